"""The type checker is part of the test command: `mypy` over the whole package, with
pyproject.toml's [tool.mypy] settings."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_passes(tmp_path):
    try:
        import mypy  # noqa: F401 - the dev extra installs it
    except ImportError:
        pytest.fail("mypy is not installed: pip install -e '.[dev]' (the dev extra has it)")
    # a private cache: no state shared with a developer's own runs, and a run that cannot pass
    # on a warm cache alone
    cmd = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout
