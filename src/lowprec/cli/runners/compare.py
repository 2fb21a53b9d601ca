"""``lowprec compare``'s run (its parser: :mod:`lowprec.cli.compare`): the flags over the YAML's
``compare:``, the runs (:mod:`lowprec.train.compare`), the printed report and the verdict's exit
code."""

from __future__ import annotations

import argparse
from typing import Any, Union

from lowprec.cli.runners.train import overrides_from_args
from lowprec.train.compare import compare
from lowprec.train.compare_report import format_report
from lowprec.train.config import CompareSpec, load_config

__all__ = ["run", "parse_seeds", "compare_settings"]


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
        errs: list[dict[str, Any]] = getattr(exc, "errors", lambda **_: [])(include_url=False)
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


def check_one_process(cfg: Any) -> None:
    """compare runs every arm as one process (in parallel workers); a config that needs several
    processes per run is refused here, not inside each run with a flag compare does not take."""
    needs = [
        f"{key}: {value}"
        for key, value, several in (
            ("deepspeed", "set", cfg.deepspeed is not None),
            ("tensor_parallel_size", cfg.tensor_parallel_size, cfg.tensor_parallel_size > 1),
            ("ep_size", cfg.ep_size, cfg.ep_size > 1),
        )
        if several
    ]
    if needs:
        raise ValueError(
            f"{', '.join(needs)}: that needs several processes per run, and lowprec compare runs each run "
            "as one process; compare without it (e.g. --ep_size 1), or train each precision with "
            "lowprec train --num_processes N and compare their metrics"
        )


def run(args: argparse.Namespace) -> int:
    if not args.config:  # on defaults alone it would start fp32, bf16 and fp8 runs of a whole epoch each
        raise ValueError(
            "a YAML config comes first: lowprec compare CONFIG.yaml [--precisions ...] (e.g. examples/tiny.yaml); "
            "it sets the model, data and steps of every run"
        )
    cfg = load_config(args.config, overrides_from_args(args))
    check_one_process(cfg)
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
