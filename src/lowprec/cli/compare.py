"""``lowprec compare CONFIG.yaml --precisions bf16,fp8 --seeds 5``: precision parity with intervals
(this parser's run: :mod:`lowprec.cli.runners.compare`).

Runs the config once per precision and seed (same seeds for every precision: same
initialisation, data order and validation split per seed), several runs at a time, writes
``compare.png`` and ``compare.json`` under ``output_dir/compare`` (or ``--compare_dir``), prints
a table with 95% intervals and exits with the verdict:

* 0: every precision below the baseline is within ``--threshold`` of it at 95% confidence;
* 1: at least one is outside (its whole interval above the threshold), or diverged;
* 2: a usage error (bad flag, key or precision name);
* 4: none outside, at least one inconclusive (the line says about how many seeds would decide).

Every flag has a key of the same name under ``compare:`` in the YAML; the flag wins. Runs that
differ in other keys than the precision (e.g. ``base_model``: a LoRA on an FP8 base against its
bf16 upcast) are ``compare.arms`` (name -> keys; see ``lowprec.train.config.compare``), judged
against the first arm or ``--baseline``.
"""

from __future__ import annotations

import argparse
from typing import Any

from lowprec.catalog import RECIPE_NAMES
from lowprec.cli.train import add_config_flags, config_command

__all__ = ["NAME", "HELP", "add_parser"]

NAME = "compare"
HELP = "run one config at several precisions and seeds and report loss parity with confidence intervals"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = config_command(
        subparsers,
        NAME,
        HELP,
        "Run one config at several precisions with the same seeds and compare the losses "
        "(95% intervals, paired gaps, a verdict). Exit codes: 0 within the threshold, 1 outside, "
        "2 usage error, 4 inconclusive.",
        "lowprec compare CONFIG.yaml [--precisions bf16,fp8] [--seeds N|LIST] [--threshold 0.005] "
        "[--workers N] [--key value ...]",
        "the YAML config",
    )

    p.add_argument(
        "--precisions",
        default=None,
        metavar="LIST",
        help="comma-separated: fp32, bf16, fp16, bf16-full, fp8 (the config's recipe), fp8-<recipe> "
        f"({', '.join('fp8-' + r for r in RECIPE_NAMES)}), fp8-torchao, "
        "fp8-torchao-<recipe> (default: compare.precisions, else fp32,bf16,fp8)",
    )
    p.add_argument(
        "--seeds",
        default=None,
        metavar="N|LIST",
        help="N seeds (seed, seed+1, ...) or a comma-separated list (default: compare.seeds, else 1)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        metavar="FRACTION",
        help="largest allowed excess of a loss over the baseline's at 95%% confidence "
        "(default: compare.threshold, else 0.02 = 2%%)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="PRECISION",
        help="the precision the others are judged against (default bf16 when listed, else the highest)",
    )
    p.add_argument(
        "--workers", default=None, metavar="N", help="runs at once (default auto: CPU cores / cpu_threads; 1 on a GPU)"
    )
    p.add_argument(
        "--tail_fraction",
        "--tail-fraction",
        type=float,
        default=None,
        metavar="FRACTION",
        help="the last part of training compared as a curve gap (default 0.2)",
    )
    p.add_argument(
        "--compare_dir",
        "--compare-dir",
        default=None,
        metavar="DIR",
        help="where runs and reports go (default: <output_dir>/compare)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        default=None,
        help="read finished runs of the identical config (same YAML, same lowprec version) from the "
        "compare directory instead of running them again: continue an interrupted comparison or add seeds",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines (each run's log is in its own file)")
    add_config_flags(p)
    return p
