"""Helpers for tests of the launch settings: a clean environment and what `lowprec launch
--dry_run` would export."""

from __future__ import annotations

import os
import shlex

from lowprec.cli.main import main


def clear_launch_env(monkeypatch) -> None:
    """No ACCELERATE_*, LOWPREC_FP8* or FSDP_* variable from the calling shell or another test."""
    for name in [n for n in os.environ if n.startswith(("ACCELERATE_", "LOWPREC_FP8", "FSDP_"))]:
        monkeypatch.delenv(name)


def exported(argv, capsys) -> dict[str, str]:
    """The variables `lowprec launch --dry_run ARGV` exports, as {name: value}."""
    assert main(["launch", "--dry_run", *argv]) == 0
    out = capsys.readouterr().out
    return {
        k: shlex.split(v)[0]
        for k, _, v in (ln[7:].partition("=") for ln in out.splitlines() if ln.startswith("export "))
    }
