"""``lowprec compare``: one config, several precisions, same seed and data order; a parity report.

Each precision runs as its own ``lowprec train`` process (so peak memory and tokens/s are that
run's alone) in ``output_dir/compare/<precision>/``, with only the precision keys changed. Then:

* ``compare.png``: the training and validation curves overlaid;
* ``compare.json``: per precision the final train / validation loss, the largest relative gap
  of its training curve to the reference (the highest precision run), tokens/s, peak memory,
  plus the parity verdict;
* a printed table, and exit code 1 when FP8's final validation loss is more than ``threshold``
  (default 2%) above BF16's (above the reference run's when bf16 is not among the precisions).

``fp8:<recipe>`` (e.g. ``fp8:mxfp8``, ``fp8:nvfp4``) is the fp8 precision with that
``fp8_recipe``, so that several recipes run beside bf16 in one comparison; each gets its
parity line, and the verdict needs all of them to pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import yaml

from lowprec.train.config import TrainConfig

__all__ = ["PRECISIONS", "precision_overrides", "CompareRow", "CompareResult", "compare", "summarize", "format_table"]

# precision -> config keys; listed from highest to lowest precision (the first present is the reference)
PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": {"fp8": False, "fp16": None, "bf16": False},
    "bf16": {"fp8": False, "fp16": None, "bf16": True},
    "fp16": {"fp8": False, "fp16": True, "bf16": False},
    "bf16-full": {"fp8": False, "fp16": None, "bf16": "full"},
    "fp8": {"fp8": True, "fp16": None},
}


def precision_overrides(name: str, cfg: TrainConfig) -> dict[str, Any]:
    if name.startswith("fp8:"):  # the fp8 precision with another recipe
        from lowprec.catalog import recipe_info

        try:
            recipe = recipe_info(name[4:]).name
        except ValueError as err:
            raise ValueError(f"--precisions {name}: {err}") from None
        return {**precision_overrides("fp8", cfg), "fp8_recipe": recipe}
    if name not in PRECISIONS:
        from lowprec.errors import did_you_mean

        raise ValueError(f"--precisions: unknown precision {name!r}{did_you_mean(name, PRECISIONS)}; use {', '.join(PRECISIONS)}")
    keys = dict(PRECISIONS[name])
    if name == "fp8":  # FP8 keeps the config's bf16 choice for the non-FP8 ops (auto by default)
        keys["bf16"] = cfg.bf16 if cfg.bf16 is not False else "auto"
    return keys


@dataclass
class CompareRow:
    precision: str
    final_train_loss: Optional[float]
    final_eval_loss: Optional[float]
    max_rel_gap: Optional[float]  # max over steps of |loss - ref| / ref, training curve
    tokens_per_s: float
    peak_mem_mb: float
    wall_s: float
    output_dir: str


@dataclass
class CompareResult:
    reference: str
    rows: list = field(default_factory=list)
    threshold: float = 0.02
    parity: Optional[dict] = None  # {"fp8": .., "baseline": .., "rel_diff": .., "passed": ..}
    parities: dict = field(default_factory=dict)  # per fp8 variant ("fp8", "fp8:mxfp8", ...)

    @property
    def passed(self) -> bool:
        return all(bool(p["passed"]) for p in self.parities.values()) if self.parities else (
            self.parity is None or bool(self.parity["passed"]))


def _rel_gap(curve: Sequence[Sequence[float]], ref: Sequence[Sequence[float]]) -> Optional[float]:
    ref_at = {int(s): v for s, v in ref}
    gaps = [abs(v - ref_at[int(s)]) / abs(ref_at[int(s)]) for s, v in curve if int(s) in ref_at and ref_at[int(s)]]
    return max(gaps) if gaps else None


def summarize(summaries: dict[str, dict[str, Any]], threshold: float = 0.02) -> CompareResult:
    """Rows and verdict from each run's ``summary.json`` (a RunResult as a dict)."""
    order = [p for p in PRECISIONS if p in summaries] + sorted(p for p in summaries if p.startswith("fp8:"))
    reference = order[0]
    ref_curve = summaries[reference]["train_losses"]
    result = CompareResult(reference=reference, threshold=threshold)
    for p in order:
        s = summaries[p]
        result.rows.append(
            CompareRow(
                precision=p,
                final_train_loss=s["final_train_loss"],
                final_eval_loss=s["final_eval_loss"],
                max_rel_gap=0.0 if p == reference else _rel_gap(s["train_losses"], ref_curve),
                tokens_per_s=s["tokens_per_s"],
                peak_mem_mb=s["peak_mem_mb"],
                wall_s=s["wall_s"],
                output_dir=s["output_dir"],
            )
        )
    baseline = "bf16" if "bf16" in summaries else reference
    for variant in (p for p in order if p == "fp8" or p.startswith("fp8:")):
        if len(order) > 1 and baseline != variant:
            key = "final_eval_loss" if summaries[variant]["final_eval_loss"] is not None else "final_train_loss"
            f, b = summaries[variant][key], summaries[baseline][key]
            rel = (f - b) / abs(b)
            result.parities[variant] = {
                "fp8": f, "variant": variant, "baseline": baseline, "baseline_loss": b, "metric": key,
                "rel_diff": rel, "threshold": threshold, "passed": rel <= threshold,
            }
    result.parity = next(iter(result.parities.values()), None)
    return result


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(result: CompareResult) -> str:
    head = ("precision", "train loss", "val loss", f"max gap vs {result.reference}", "tokens/s", "peak mem MB")
    rows = [
        (r.precision, _fmt(r.final_train_loss, ".4f"), _fmt(r.final_eval_loss, ".4f"),
         "reference" if r.precision == result.reference else _fmt(None if r.max_rel_gap is None else 100 * r.max_rel_gap, ".2f") + "%",
         _fmt(r.tokens_per_s, ".0f"), _fmt(r.peak_mem_mb, ".0f"))
        for r in result.rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    for p in result.parities.values() or ([result.parity] if result.parity else []):
        what = "validation" if p["metric"] == "final_eval_loss" else "train (no validation set)"
        verdict = "PASS" if p["passed"] else "FAIL"
        out.append(
            f"parity: {p.get('variant', 'fp8')} final {what} loss {p['fp8']:.4f} vs {p['baseline']} "
            f"{p['baseline_loss']:.4f}: {100 * p['rel_diff']:+.2f}% (threshold +{100 * p['threshold']:.1f}%) {verdict}"
        )
    return "\n".join(out)


def compare(
    cfg: TrainConfig,
    precisions: Sequence[str],
    threshold: float = 0.02,
    output_dir: Optional[str] = None,
    quiet: bool = False,
) -> CompareResult:
    if len(set(precisions)) != len(precisions) or not precisions:
        raise ValueError(f"--precisions {','.join(precisions)}: list each precision once, e.g. fp32,bf16,fp8")
    out = os.path.abspath(output_dir or os.path.join(cfg.output_dir, "compare"))
    configs = {}
    for p in precisions:  # validate every variant before running any
        configs[p] = cfg.replace(
            **precision_overrides(p, cfg), output_dir=os.path.join(out, p), resume_from_checkpoint=None, save_steps=None
        )
    from lowprec.train.outputs import make_output_dir

    make_output_dir(out, "--output_dir" if output_dir else "output_dir")
    summaries: dict[str, dict[str, Any]] = {}
    for p, c in configs.items():
        path = os.path.join(out, f"{p}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(c.to_yaml_dict(), f, sort_keys=False)
        cmd = [sys.executable, "-m", "lowprec.cli.main", "train", path] + (["--quiet"] if quiet else [])
        if not quiet:
            print(f"lowprec compare: {p}: {' '.join(cmd[1:])}", file=sys.stderr)
        proc = subprocess.run(cmd, check=False)
        if proc.returncode != 0:
            raise ValueError(f"the {p} run failed with exit code {proc.returncode} (config {path})")
        with open(os.path.join(c.output_dir, "summary.json")) as f:
            summaries[p] = json.load(f)
    result = summarize(summaries, threshold)
    from lowprec.train.metrics import read_metrics
    from lowprec.train.plots import plot_compare

    plot_compare({p: read_metrics(s["output_dir"]) for p, s in summaries.items()}, os.path.join(out, "compare.png"))
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump({"reference": result.reference, "threshold": threshold, "parity": result.parity,
                   "parities": result.parities,
                   "rows": [asdict(r) for r in result.rows]}, f, indent=1)
    return result
