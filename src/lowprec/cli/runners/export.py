"""``lowprec export``'s run (its parser: :mod:`lowprec.cli.export`)."""

from __future__ import annotations

import argparse
import contextlib
import os

from lowprec.export import export_run
from lowprec.train.run_lock import make_output_dir

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    created = not os.path.exists(args.out)
    out = make_output_dir(args.out, key="--out")
    try:
        print(export_run(args.path, out, args.format, requantize=args.requantize))
    except BaseException:
        if created:  # a refused export leaves no empty --out behind (rmdir: only if nothing was written)
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise
    return 0
