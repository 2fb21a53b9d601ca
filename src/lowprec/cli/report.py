"""``lowprec report RUN_DIR``: the FP8 health signals of a ``lowprec train`` run, per layer over
time, worst layers first: ``health_report.png`` and one self-contained ``health_report.html``
in RUN_DIR (``lowprec.train.health_report``). The run must have recorded them (``fp8_health:
true`` or ``fp8_guard: warn | act``)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["NAME", "HELP", "add_parser"]  # the run: lowprec.cli.runners.report

NAME = "report"
HELP = "draw a run's FP8 health signals per layer (PNG + one HTML page), worst layers first"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help=HELP, description=__doc__)
    p.add_argument("run_dir", help="a lowprec train output_dir (holds metrics.jsonl)")
    p.add_argument("--layers", type=int, default=8, help="layers drawn in the picture (the table lists all)")
    return p
