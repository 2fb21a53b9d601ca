"""``lowprec compare CONFIG.yaml --precisions bf16,fp8 --seeds 5``: precision parity with intervals.

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
from typing import Any, Union
from lowprec.catalog import RECIPE_NAMES
from lowprec.cli.train import add_config_flags, config_command, overrides_from_args

__all__ = ["NAME", "HELP", "add_parser", "run", "parse_seeds", "compare_settings"]

NAME = "compare"
HELP = "run one config at several precisions and seeds and report loss parity with confidence intervals"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = config_command(
        subparsers,
        NAME,
        HELP,
        "Run one config at several precisions with the same seeds and compare the losses "
        "(95%% intervals, paired gaps, a verdict). Exit codes: 0 within the threshold, 1 outside, "
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


def parse_seeds(text: str) -> Union[int, list[int]]:
    """``5`` -> 5 seeds; ``1,2,3`` -> those seeds."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values:
        raise ValueError(f"--seeds {text}: give a number of seeds (5) or a comma-separated list (1,2,3)")
    return values[0] if "," not in text else values


def compare_settings(args: argparse.Namespace, cfg: Any):
    """The YAML's ``compare:`` with the flags given on the command line applied (validated)."""
    from lowprec.train.config import CompareSpec

    spec = cfg.compare or CompareSpec()
    flags: dict[str, Any] = {}
    if args.precisions is not None and spec.arms is not None:
        raise ValueError(
            "--precisions with compare.arms in the config: each arm is a run; drop --precisions "
            "(an arm may set precision: <name>)"
        )
    if args.precisions is not None:
        flags["precisions"] = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if args.seeds is not None:
        flags["seeds"] = parse_seeds(args.seeds)
    for key in ("threshold", "baseline", "tail_fraction", "reuse"):
        if getattr(args, key) is not None:
            flags[key] = getattr(args, key)
    if args.workers is not None:
        flags["workers"] = args.workers if args.workers == "auto" else _int_flag("--workers", args.workers)
    try:
        return CompareSpec.model_validate({**spec.model_dump(exclude_unset=True), **flags})
    except Exception as exc:  # pydantic's ValidationError: name the flag, not the model
        errs = getattr(exc, "errors", lambda **_: [])(include_url=False)
        if not errs:
            raise
        e = errs[0]
        key = str(e["loc"][0]) if e["loc"] else "compare"
        where = f"--{key}" if key in flags else f"compare.{key}"
        raise ValueError(f"{where}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})") from None


def _int_flag(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} {text}: give a whole number or auto") from None


def run(args: argparse.Namespace) -> int:
    from lowprec.train.compare import compare
    from lowprec.train.compare_report import format_report
    from lowprec.train.config import load_config

    cfg = load_config(args.config, overrides_from_args(args))
    spec = compare_settings(args, cfg)
    report, out = compare(
        cfg,
        spec.precisions,
        spec.seed_list(cfg.seed),
        spec.threshold,
        args.compare_dir,
        workers=spec.workers,
        baseline=spec.baseline,
        tail_fraction=spec.tail_fraction,
        quiet=args.quiet,
        reuse=spec.reuse,
        arms=spec.arms,
    )
    print(format_report(report))
    print(f"lowprec compare: wrote {out}/compare.png and {out}/compare.json")
    return int(report["exit_code"])
