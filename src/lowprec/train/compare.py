"""``lowprec compare``: one config, several precisions, N seeds each; a parity report with intervals.

Each (precision, seed) runs as its own ``lowprec train`` process in
``<compare dir>/<precision>/seed<N>/``, with only the precision keys and the seed changed, so the
runs of one seed share initialisation, data order and validation split across precisions.
Up to ``workers`` processes run at once. Then (:mod:`lowprec.train.compare_report`):

* ``compare.json``: every run's summary, per precision the mean and 95% interval of the final
  losses, the paired gaps to the baseline, the curve gaps, the verdicts, the noise floor;
* ``compare.png``: mean curves with 95% bands, and the paired gap curves against the threshold;
* a printed table; the exit code says within (0), outside (1) or inconclusive (4).

A precision that cannot run here (``fp8-torchao`` without torchao) is skipped with the reason,
logged and in the report; it never disappears silently.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, Any, Mapping, Optional, Sequence

import yaml

from lowprec.decision import Decision
from lowprec.train.compare_report import build_report, choose_baseline
from lowprec.train.config import TrainConfig
from lowprec.train.precisions import library_backend, precision_overrides
from lowprec import __version__
from lowprec.errors import EXIT_NONFINITE, did_you_mean
from lowprec.train.plots import plot_compare
from lowprec.train.run_lock import make_output_dir

__all__ = ["CompareRun", "plan_runs", "arm_overrides", "resolve_workers", "skip_reason", "compare"]

logger = logging.getLogger("lowprec")


@dataclass(frozen=True)
class CompareRun:
    precision: str
    seed: int
    config: TrainConfig
    config_path: str
    log_path: str

    @property
    def output_dir(self) -> str:
        return self.config.output_dir


def skip_reason(precision: str) -> Optional[str]:
    """Why ``precision`` cannot run here (``fp8-torchao`` without torchao), or None when it can."""
    spec = library_backend(precision)
    if spec is None or spec.available():
        return None
    return (
        f"{spec.library} is not installed (pip install {' '.join(spec.distributions) or spec.library}), "
        f"so fp8_backend: {spec.name} cannot run"
    )


def plan_runs(
    cfg: TrainConfig,
    precisions: Sequence[str],
    seeds: Sequence[int],
    out: str,
    arms: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> list[CompareRun]:
    """Every run's validated config, seed-major (a partial result still has whole seeds);
    a bad precision, arm or combination fails here, before anything runs. With ``arms``
    (``compare.arms``: name -> keys) the runs are the arms, ``precisions`` unused."""
    names = list(arms) if arms is not None else list(precisions)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--precisions {','.join(names)}: list each precision once, e.g. fp32,bf16,fp8")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {seeds}: list each seed once")
    keys = {n: arm_overrides(n, arms[n], cfg) if arms is not None else precision_overrides(n, cfg) for n in names}
    runs = []
    for seed in seeds:
        for p in names:
            where = os.path.join(out, p, f"seed{seed}")
            fixed = dict(
                seed=seed,
                output_dir=where,
                compare=None,
                resume_from_checkpoint=None,
                save_steps=None,
                saves_per_epoch=None,
                progress_bar=False,
            )
            try:
                c = cfg.replace(**keys[p], **fixed)
            except ValueError as exc:
                if arms is None:
                    raise
                raise ValueError(f"compare.arms.{p}: {exc}") from None
            runs.append(CompareRun(p, seed, c, where + ".yaml", where + ".log"))
    return runs


def arm_overrides(name: str, arm: Mapping[str, Any], cfg: TrainConfig) -> dict[str, Any]:
    """The config keys of arm ``name``: its precision's keys (``precision: <name>``), then its own
    (each a trainer key; a ``ValueError`` naming ``compare.arms.<name>.<key>`` otherwise)."""
    keys = dict(arm)
    precision = keys.pop("precision", None)
    fields = set(TrainConfig.model_fields)
    for key in keys:
        if key.split(".")[0] not in fields:
            raise ValueError(
                f"compare.arms.{name}.{key}: not a trainer key{did_you_mean(key, fields)}; an arm sets trainer keys "
                "(base_model, learning_rate, ...) and precision: <name>"
            )
    if precision is None:
        return keys
    try:
        return {**precision_overrides(precision, cfg), **keys}
    except ValueError as exc:
        raise ValueError(f"compare.arms.{name}.precision: {str(exc).removeprefix('--precisions: ')}") from None


def arm_precision(name: str, arms: Optional[Mapping[str, Mapping[str, Any]]]) -> Optional[str]:
    """The precision a run is: the arm's ``precision:`` key, or the name itself without arms."""
    return name if arms is None else arms[name].get("precision")


def resolve_workers(requested: Any, cfg: TrainConfig, n_runs: int, device: str) -> tuple[Decision, Optional[int]]:
    """(workers with the reason, cpu_threads per run or None to keep the config's): resolved once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested not in (None, "auto"):
        workers = Decision(min(int(requested), n_runs), f"--workers {requested}")
    elif device != "cpu":
        workers = Decision(1, f"one {device} device: parallel runs would share it and distort memory and speed")
    else:
        per_run = cfg.cpu_threads or 1
        workers = Decision(
            max(1, min(n_runs, cores // per_run)),
            f"{cores} CPU cores / cpu_threads {per_run} per run, at most {n_runs} runs",
        )
    threads = None
    if device == "cpu" and cfg.cpu_threads is None and workers.value > 1:
        # torch's default is every core in every process: N processes would oversubscribe N-fold
        threads = max(1, cores // workers.value)
    return workers, threads


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _config_text(run: CompareRun) -> str:
    return yaml.safe_dump(run.config.to_yaml_dict(), sort_keys=False)


def finished_summary(run: CompareRun) -> Optional[dict]:
    """The summary of an earlier, finished run of exactly this config (``--reuse``), else None.

    A run counts as finished when its ``summary.json`` exists and was written by this lowprec
    version, and its YAML (written before it started) is identical to the one planned now: any
    other key, seed or precision re-runs it. Code changes within one version are not detected,
    so reuse runs made by the code you are comparing."""

    try:
        with open(run.config_path) as f:
            same = f.read() == _config_text(run)
        with open(os.path.join(run.output_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    return summary if same and summary.get("lowprec_version") == __version__ else None


class _Launched(subprocess.Popen):
    """A run's process with its log file and start time."""

    log_file: IO[str]
    started: float


def _launch(run: CompareRun) -> _Launched:
    os.makedirs(os.path.dirname(run.config_path), exist_ok=True)
    with open(run.config_path, "w") as f:
        f.write(_config_text(run))
    cmd = [sys.executable, "-m", "lowprec.cli.main", "train", run.config_path]
    log = open(run.log_path, "w")  # noqa: SIM115 - closed when the process is reaped
    proc = _Launched(cmd, stdout=log, stderr=subprocess.STDOUT)
    proc.log_file = log
    proc.started = time.perf_counter()
    return proc


def _run_all(runs: list[CompareRun], workers: int, quiet: bool, reuse: bool = False) -> tuple[dict, dict]:
    """Run with up to ``workers`` processes; returns (summaries, failures) keyed precision -> seed.
    A run that stopped on non-finite values (exit 3) is a failure of its precision; any other
    failure stops the comparison with the run's log named. With ``reuse``, finished runs of the
    same config are read, not run again (:func:`finished_summary`)."""

    pending: list[CompareRun] = []
    active: list[tuple[CompareRun, _Launched]] = []
    summaries: dict[str, dict[int, dict]] = {}
    failed: dict[str, dict[int, str]] = {}
    done = 0
    for run in runs:
        old = finished_summary(run) if reuse else None
        if old is None:
            pending.append(run)
            continue
        summaries.setdefault(run.precision, {})[run.seed] = old
        done += 1
        if not quiet:
            print(
                f"lowprec compare: [{done}/{len(runs)}] {run.precision} seed {run.seed}: reused "
                f"({run.output_dir}/summary.json)",
                file=sys.stderr,
                flush=True,
            )
    try:
        while pending or active:
            while pending and len(active) < workers:
                run = pending.pop(0)
                active.append((run, _launch(run)))
            time.sleep(0.2)
            for item in [a for a in active if a[1].poll() is not None]:
                active.remove(item)
                run, proc = item
                proc.log_file.close()
                done += 1
                secs = time.perf_counter() - proc.started
                if proc.returncode == EXIT_NONFINITE:
                    failed.setdefault(run.precision, {})[run.seed] = _last_line(run.log_path)
                    status = "diverged (non-finite)"
                elif proc.returncode != 0:
                    raise ValueError(
                        f"the {run.precision} run, seed {run.seed}, failed with exit code "
                        f"{proc.returncode}: {_last_line(run.log_path)} (log {run.log_path})"
                    )
                else:
                    with open(os.path.join(run.output_dir, "summary.json")) as f:
                        summaries.setdefault(run.precision, {})[run.seed] = json.load(f)
                    s = summaries[run.precision][run.seed]
                    loss = s["final_eval_loss"] if s["final_eval_loss"] is not None else s["final_train_loss"]
                    status = f"loss {loss:.4f}"
                if not quiet:
                    print(
                        f"lowprec compare: [{done}/{len(runs)}] {run.precision} seed {run.seed}: {status} "
                        f"in {secs:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for _, proc in active:  # Ctrl-C or a failed run: stop the others (only ours, by handle)
            proc.terminate()
            proc.wait()
            proc.log_file.close()
    return summaries, failed


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return "?"
    return lines[-1][:300] if lines else "(no output)"


def compare(
    cfg: TrainConfig,
    precisions: Sequence[str],
    seeds: Sequence[int],
    threshold: float = 0.02,
    output_dir: Optional[str] = None,
    *,
    workers: Any = "auto",
    baseline: Optional[str] = None,
    tail_fraction: float = 0.2,
    quiet: bool = False,
    reuse: bool = False,
    arms: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> tuple[dict[str, Any], str]:
    """Run every precision (or every arm of ``arms``: name -> keys, ``compare.arms``) with every
    seed; returns (the report, the compare directory)."""
    for note in cfg.notes:  # said here once: the runs train from dumped configs without those keys
        logger.warning("lowprec compare: note: %s", note)
    out = os.path.abspath(output_dir or os.path.join(cfg.output_dir, "compare"))
    names = list(arms) if arms is not None else list(precisions)
    base = choose_baseline(names, baseline) if arms is None else (baseline or names[0])
    if base not in names:
        raise ValueError(f"--baseline {base}: not among compare.arms ({', '.join(names)}); pick one of them")
    skipped: dict[str, str] = {}
    for p in names:
        precision = arm_precision(p, arms)
        why = skip_reason(precision) if precision else None
        if why:
            skipped[p] = why
            logger.warning("lowprec compare: skipping %s: %s", p, why)
    if base in skipped:
        raise ValueError(f"the baseline {base} cannot run: {skipped[base]}")
    kept = [p for p in names if p not in skipped]
    runs = plan_runs(cfg, kept, seeds, out, None if arms is None else {p: arms[p] for p in kept})
    high = sorted({r.precision for r in runs if not r.config.fp8})
    if high and (cfg.fp8_guard != "off" or cfg.fp8_health):
        logger.info(
            "lowprec compare: fp8_guard / fp8_health apply to the FP8 runs only (%s have no FP8 layers)",
            ", ".join(high),
        )
    decision, threads = resolve_workers(workers, cfg, len(runs), _device())
    logger.info("lowprec compare: workers = %s (%s)", decision.value, decision.reason)
    if threads is not None:
        logger.info(
            "lowprec compare: cpu_threads = %d per run (%d runs in parallel; cpu_threads unset)",
            threads,
            decision.value,
        )
        runs = [
            CompareRun(r.precision, r.seed, r.config.replace(cpu_threads=threads), r.config_path, r.log_path)
            for r in runs
        ]
    make_output_dir(out, "--compare_dir" if output_dir else "output_dir")
    if not quiet:
        print(
            f"lowprec compare: {len(runs)} runs ({len(kept)} {'arms' if arms else 'precisions'} x {len(seeds)} seeds), "
            f"{decision.value} at a time, in {out}",
            file=sys.stderr,
            flush=True,
        )
    summaries, failed = _run_all(runs, decision.value, quiet, reuse)
    report = build_report(summaries, base, threshold, tail_fraction, failed, skipped)
    report["workers"] = {"value": decision.value, "reason": decision.reason}
    if arms is not None:
        report["arms"] = {p: dict(arms[p]) for p in names}

    report["plot"] = plot_compare(report, os.path.join(out, "compare.png"))
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report, out
