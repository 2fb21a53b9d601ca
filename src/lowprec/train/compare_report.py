"""``lowprec compare``'s report: from every run's ``summary.json`` to intervals, verdicts and a table.

Pure data in, data out (no torch, no files), so the statistics are tested on synthetic runs.

Per precision, over its seeds: the mean and 95% t interval of the final train and validation
losses; per precision below the baseline, the *paired* relative gap to the baseline (same seed
on both sides) of the final validation loss (train loss when there is no validation set), of the
training loss averaged over the last ``tail_fraction`` of the run, and the first logged step where
the curve leaves the baseline's band; the verdict (:func:`lowprec.train.stats.verdict`). The
baseline's own seed-to-seed spread is reported as the noise floor: what a one-seed comparison
would be up against.

Exit codes (:data:`EXIT_CODES`): 0 every verdict within the threshold, 1 at least one outside
(or a run diverged), 4 none outside but at least one inconclusive.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from lowprec.train.precisions import precision_rank
from lowprec.train.stats import (
    INCONCLUSIVE,
    OUTSIDE,
    WITHIN,
    first_departure,
    interval,
    relative_gaps,
    tail_gaps,
    verdict,
)

__all__ = ["EXIT_CODES", "choose_baseline", "build_report", "format_report"]

EXIT_CODES = {WITHIN: 0, OUTSIDE: 1, INCONCLUSIVE: 4}
LEVEL = 0.95


def choose_baseline(precisions: Sequence[str], requested: Optional[str] = None) -> str:
    """``requested`` if given (it must be among the precisions), else bf16, else the highest."""
    if requested is not None:
        if requested not in precisions:
            raise ValueError(
                f"--baseline {requested}: not among --precisions {','.join(precisions)}; add it or pick one of them"
            )
        return requested
    if "bf16" in precisions:
        return "bf16"
    return min(precisions, key=precision_rank)


def _iv(values: Sequence[Optional[float]]) -> Optional[dict]:
    xs = [v for v in values if v is not None]
    return interval(xs, LEVEL).to_dict() if xs and len(xs) == len(values) else None


def _judged(p: str, baseline: str) -> bool:
    """Precisions below the baseline get a verdict; those above it (fp32 vs bf16) only gaps."""
    return p != baseline and precision_rank(p) >= precision_rank(baseline)


def build_report(
    runs: Mapping[str, Mapping[int, Mapping[str, Any]]],
    baseline: str,
    threshold: float,
    tail_fraction: float = 0.2,
    failed: Optional[Mapping[str, Mapping[int, str]]] = None,
    skipped: Optional[Mapping[str, str]] = None,
) -> dict[str, Any]:
    """``runs[precision][seed]`` is that run's summary (``RunResult`` as a dict); ``failed``
    names runs that diverged (``precision -> seed -> reason``); ``skipped`` precisions that did
    not run, with the reason. Returns the JSON-ready report (every run included)."""
    failed = {p: dict(v) for p, v in (failed or {}).items() if v}
    seeds = sorted({s for by_seed in runs.values() for s in by_seed} | {s for v in failed.values() for s in v})
    base = runs.get(baseline, {})
    metric = (
        "final_eval_loss"
        if base and all(r.get("final_eval_loss") is not None for r in base.values())
        else "final_train_loss"
    )
    out: dict[str, Any] = {
        "baseline": baseline,
        "threshold": threshold,
        "level": LEVEL,
        "metric": metric,
        "tail_fraction": tail_fraction,
        "seeds": seeds,
        "precisions": {},
        "skipped": dict(skipped or {}),
    }
    if baseline in failed:
        raise ValueError(
            f"the baseline {baseline} diverged (seeds {sorted(failed[baseline])}): nothing to compare "
            "with; lower learning_rate or pick another --baseline"
        )
    ordered = sorted(set(runs) | set(failed), key=lambda p: (precision_rank(p), p))
    for p in ordered:
        by_seed = runs.get(p, {})
        common = [s for s in sorted(by_seed) if s in base]
        row: dict[str, Any] = {
            "runs": [{"seed": s, **dict(by_seed[s])} for s in sorted(by_seed)],
            "failed": {str(s): why for s, why in sorted(failed.get(p, {}).items())},
            "final_train_loss": _iv([by_seed[s].get("final_train_loss") for s in sorted(by_seed)]) if by_seed else None,
            "final_eval_loss": _iv([by_seed[s].get("final_eval_loss") for s in sorted(by_seed)]) if by_seed else None,
            "tokens_per_s": _mean([by_seed[s].get("tokens_per_s") for s in by_seed]),
            "peak_mem_mb": max((by_seed[s].get("peak_mem_mb") or 0.0 for s in by_seed), default=None),
            "wall_s": _mean([by_seed[s].get("wall_s") for s in by_seed]),
        }
        if p != baseline and common:
            gaps = relative_gaps([by_seed[s][metric] for s in common], [base[s][metric] for s in common])
            curves = [by_seed[s]["train_losses"] for s in common]
            refs = [base[s]["train_losses"] for s in common]
            tail = tail_gaps(curves, refs, tail_fraction)
            row["gap"] = {
                "seeds": common,
                "per_seed": gaps,
                metric: interval(gaps, LEVEL).to_dict(),
                "tail_train_loss": interval(tail, LEVEL).to_dict() if tail else None,
                "tail_per_seed": tail,
            }
            row["first_departure_step"] = first_departure(curves, refs, threshold, LEVEL)
        if _judged(p, baseline):
            if p in failed:
                row["verdict"] = {
                    "outcome": OUTSIDE,
                    "threshold": threshold,
                    "gap": None,
                    "seeds_needed": None,
                    "reason": f"diverged (seed {', '.join(map(str, sorted(failed[p])))}): {next(iter(failed[p].values()))}",
                }
            elif common:
                row["verdict"] = verdict(row["gap"]["per_seed"], threshold, LEVEL).to_dict()
        out["precisions"][p] = row
    values = [base[s][metric] for s in sorted(base)]
    floor = interval(values, LEVEL) if values else None
    out["noise_floor"] = (
        None
        if floor is None
        else {
            "precision": baseline,
            "metric": metric,
            "values": values,
            "mean": floor.mean,
            "sd": floor.sd,
            "relative_sd": None if floor.sd is None else floor.sd / abs(floor.mean),
        }
    )
    outcomes = [row["verdict"]["outcome"] for row in out["precisions"].values() if "verdict" in row]
    out["outcome"] = OUTSIDE if OUTSIDE in outcomes else INCONCLUSIVE if INCONCLUSIVE in outcomes else WITHIN
    out["exit_code"] = EXIT_CODES[out["outcome"]]
    return out


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


# ------------------------------------------------------------------ the printed table
def _loss(iv: Optional[dict]) -> str:
    if iv is None:
        return "-"
    return f"{iv['mean']:.4f}" + ("" if iv["high"] is None else f" ± {iv['high'] - iv['mean']:.4f}")


def _pct(iv: Optional[dict]) -> str:
    if iv is None:
        return "-"
    if iv["low"] is None:
        return f"{100 * iv['mean']:+.2f}%"
    return f"{100 * iv['mean']:+.2f}% [{100 * iv['low']:+.2f}, {100 * iv['high']:+.2f}]"


def format_report(report: Mapping[str, Any]) -> str:
    metric = report["metric"]
    short = "val" if metric == "final_eval_loss" else "train"
    base = report["baseline"]
    head = (
        "precision",
        "seeds",
        "val loss (95% CI)",
        "train loss (95% CI)",
        f"{short} gap vs {base} [95% CI]",
        "tail train gap [95% CI]",
        "leaves band",
        "verdict",
        "tokens/s",
    )
    rows = []
    for p, r in report["precisions"].items():
        gap = r.get("gap")
        v = r.get("verdict")
        verdict_txt = "reference" if p == base else ("-" if v is None else v["outcome"])
        if v is not None and v["outcome"] == INCONCLUSIVE and v.get("seeds_needed"):
            verdict_txt += f" (~{v['seeds_needed']} seeds)"
        dep = r.get("first_departure_step")
        rows.append(
            (
                p,
                str(len(r["runs"])) + (f" +{len(r['failed'])} failed" if r["failed"] else ""),
                _loss(r["final_eval_loss"]),
                _loss(r["final_train_loss"]),
                "-" if gap is None else _pct(gap[metric]),
                "-" if gap is None else _pct(gap["tail_train_loss"]),
                "-" if p == base or gap is None else (f"step {dep}" if dep is not None else "never"),
                verdict_txt,
                "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}",
            )
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    floor = report.get("noise_floor")
    if floor and floor["relative_sd"] is not None:
        out.append(
            f"noise floor: {base}'s {metric.replace('_', ' ')} varies {100 * floor['relative_sd']:.2f}% (sd) "
            f"from seed to seed over {len(floor['values'])} seeds; the gaps above are paired per seed"
        )
    for p, why in report.get("skipped", {}).items():
        out.append(f"skipped {p}: {why}")
    thr = 100 * report["threshold"]
    for p, r in report["precisions"].items():
        v = r.get("verdict")
        if v is not None and v["outcome"] != WITHIN and v.get("reason"):
            out.append(f"{p}: {v['outcome']}: {v['reason']}")
    code = report["exit_code"]
    out.append(
        f"verdict: {report['outcome']} (a {short} loss at most +{thr:.2f}% above {base} at "
        f"{100 * report['level']:.0f}% confidence) -> exit code {code}"
    )
    return "\n".join(out)
