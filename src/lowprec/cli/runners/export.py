"""``lowprec export``'s run (its parser: :mod:`lowprec.cli.export`)."""

from __future__ import annotations

import argparse

from lowprec.export import export_run
from lowprec.train.run_lock import make_output_dir

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    out = make_output_dir(args.out, key="--out")
    print(export_run(args.path, out, args.format, requantize=args.requantize))
    return 0
