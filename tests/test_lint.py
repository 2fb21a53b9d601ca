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


def test_nothing_points_outside_the_repository():
    """The project's own notes live outside the repository: no file in it may refer to them."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.fail(f"git ls-files failed: {tracked.stderr}")
    # spelled in two halves so that this file does not name them
    needles = tuple("shar" + "ed/" + tail for tail in ("seeds", "reference", "DESIGN", "STYLE")) + ("../" + "shared",)
    hits = []
    for rel in tracked.stdout.split():
        if not rel.endswith((".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".sh")):
            continue
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        hits += [f"{rel}: {n}" for n in needles if n in text]
    assert not hits, hits


def test_the_docs_name_only_files_that_exist():
    """Every repository path the README and the guide quote (`src/...`, `examples/...`,
    `benchmarks/...`, `tests/...`) exists: the guide sent readers to a table in a file that
    had moved (src/lowprec/train/inert_keys.py)."""
    import re

    missing = []
    for doc in ("README.md", os.path.join("docs", "guide.md")):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        for path in sorted(set(re.findall(r"`((?:src|examples|benchmarks|tests)/[\w/.\-]*)`", text))):
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{doc}: {path}")
    assert not missing, missing
