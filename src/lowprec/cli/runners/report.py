"""``lowprec report``'s run (its parser: :mod:`lowprec.cli.report`)."""

from __future__ import annotations

import argparse

from lowprec.train.health_report import write_report

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    if args.layers < 1:
        raise ValueError(f"--layers {args.layers}: draw at least 1 layer")
    png, page = write_report(args.run_dir, rows=args.layers)
    print(f"lowprec report: {page} (picture: {png})")
    return 0
