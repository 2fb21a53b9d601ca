"""The linter is part of the test command: `ruff check src tests benchmarks examples` with pyproject.toml's rules."""

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
    proc = subprocess.run([*_ruff(), "check", "src", "tests", "benchmarks", "examples", "--output-format", "concise", "--no-cache"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
