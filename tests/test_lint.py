"""The linter and the formatter are part of the test command: `ruff check` and `ruff format --check` over
src, tests, benchmarks and examples with pyproject.toml's settings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff() -> list[str]:
    try:
        import ruff  # noqa: F401 - the dev extra installs it
    except ImportError:
        if shutil.which("ruff") is None:
            pytest.fail("ruff is not installed: pip install -e '.[dev]' (the dev extra has it)")
        return ["ruff"]
    return [sys.executable, "-m", "ruff"]


def test_ruff_check_passes():
    proc = subprocess.run(
        [*_ruff(), "check", "src", "tests", "benchmarks", "examples", "--output-format", "concise", "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_check_passes():
    proc = subprocess.run(
        [*_ruff(), "format", "--check", "src", "tests", "benchmarks", "examples", "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, "run `ruff format src tests benchmarks examples`:\n" + proc.stdout + proc.stderr
