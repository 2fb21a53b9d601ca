"""``lowprec compare CONFIG.yaml --precisions fp32,bf16,fp8``: precision parity of one config.

Runs the config once per precision (same seed, same data order), writes ``compare.png`` and
``compare.json`` under ``output_dir/compare`` (or ``--compare_dir``), prints a table, and exits
1 when FP8's final validation loss is more than ``--threshold`` above BF16's.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["NAME", "HELP", "add_parser", "run"]

NAME = "compare"
HELP = "run one config at several precisions and report loss parity"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from lowprec.cli.train import add_config_flags, config_command

    p = config_command(
        subparsers, NAME, HELP, "Run one config at several precisions (same seed and data order) and compare the losses.",
        "lowprec compare CONFIG.yaml [--precisions fp32,bf16,fp8] [--threshold 0.02] [--key value ...]",
        "the YAML config",
    )
    p.add_argument("--precisions", default="fp32,bf16,fp8", metavar="LIST",
                   help="comma-separated: fp32, bf16, fp16, bf16-full, fp8, fp8:<recipe> (fp8 with that "
                        "fp8_recipe, e.g. fp8:mxfp8,fp8:nvfp4) (default fp32,bf16,fp8)")
    p.add_argument("--threshold", type=float, default=0.02, metavar="FRACTION",
                   help="largest allowed excess of FP8's final validation loss over BF16's (default 0.02 = 2%%)")
    p.add_argument("--compare_dir", "--compare-dir", default=None, metavar="DIR",
                   help="where runs and reports go (default: <output_dir>/compare)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or info logs from the runs")
    add_config_flags(p)
    return p


def run(args: argparse.Namespace) -> int:
    from lowprec.cli.train import overrides_from_args
    from lowprec.train.compare import compare, format_table
    from lowprec.train.config import load_config

    if not 0 <= args.threshold < 1:
        raise ValueError(f"--threshold {args.threshold}: use a fraction in [0, 1), e.g. 0.02 for 2%")
    cfg = load_config(args.config, overrides_from_args(args))
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    result = compare(cfg, precisions, args.threshold, args.compare_dir, quiet=args.quiet)
    print(format_table(result))
    out = os.path.dirname(result.rows[0].output_dir)
    print(f"lowprec compare: wrote {os.path.join(out, 'compare.png')} and {os.path.join(out, 'compare.json')}")
    return 0 if result.passed else 1
