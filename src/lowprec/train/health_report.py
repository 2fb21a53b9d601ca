"""``lowprec report RUN_DIR``: the FP8 health signals of a run per layer over time, worst first.

Reads ``metrics.jsonl`` (``fp8_health``, ``fp8_guard`` and ``train`` records) and writes
``health_report.png`` (training loss on top, then one row per layer, worst first: underflow and
saturated fractions (worst operand), input max-to-rms, sampled SQNR, each with its guard
threshold dashed and the guard's events as vertical lines) and ``health_report.html`` (one
self-contained page: the picture inlined as a data: URI and a table of every layer, worst first,
with the first step it crossed a threshold and what the guard did).

A layer's *severity* is its worst ratio to a threshold over the run (underflow / 0.02,
max_to_rms / 200, 15 dB / sqnr_db, ...): above 1 it crossed one.
"""

from __future__ import annotations

import base64
import html
import os
from typing import Any, Mapping, Optional, Sequence

from lowprec.fp8.observe.guard import Thresholds
from lowprec.guard_moves import gemms_text, is_move_back
from lowprec.train.metrics import FILE, read_metrics
from lowprec.train.plots import _plt, guard_line, guard_tally

__all__ = ["layer_series", "severity", "write_report"]

SIGNALS = ("underflow", "saturated", "max_to_rms", "sqnr_db")


def _worst_op(row: Mapping[str, Any], key: str) -> Optional[float]:
    vals = [
        row[op][key]
        for op in ("input", "weight", "grad_output")
        if isinstance(row.get(op), dict) and row[op].get(key) is not None
    ]
    return max(vals) if vals else None


def layer_series(health: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list]]:
    """{layer: {"step": [...], "underflow": [...], "saturated": [...], "max_to_rms": [...],
    "sqnr_db": [...]}}; None where a signal was not measured at that step."""
    out: dict[str, dict[str, list]] = {}
    for rec in health:
        for layer, row in rec["layers"].items():
            s = out.setdefault(layer, {"step": [], **{k: [] for k in SIGNALS}})
            s["step"].append(rec["step"])
            s["underflow"].append(_worst_op(row, "underflow"))
            s["saturated"].append(_worst_op(row, "saturated"))
            s["max_to_rms"].append(row.get("max_to_rms"))
            s["sqnr_db"].append(row.get("sqnr_db"))
    return out


def _ratios(s: Mapping[str, list], th: Thresholds, i: int) -> dict[str, float]:
    r = {}
    for key, limit in (("underflow", th.underflow), ("saturated", th.saturated), ("max_to_rms", th.max_to_rms)):
        v = s[key][i]
        if v is not None:
            r[key] = v / limit
    v = s["sqnr_db"][i]
    if v is not None and v > 0 and v != float("inf"):
        r["sqnr_db"] = th.sqnr_db / v
    return r


def severity(s: Mapping[str, list], th: Thresholds) -> tuple[float, str, Optional[int]]:
    """(worst ratio to a threshold, its signal, first step any threshold was crossed or None)."""
    worst, which, first = 0.0, "", None
    for i, step in enumerate(s["step"]):
        for key, ratio in _ratios(s, th, i).items():
            if ratio > worst:
                worst, which = ratio, key
            if ratio > 1 and first is None:
                first = step
    return worst, which, first


def _plot(series, order, losses, events, th: Thresholds, path: str, rows: int) -> str:
    plt = _plt()
    shown = order[:rows]
    fig = plt.figure(figsize=(16, 2.4 * (len(shown) + 1)))
    gs = fig.add_gridspec(len(shown) + 1, len(SIGNALS))
    ax = fig.add_subplot(gs[0, :])
    if losses:
        ax.plot([s for s, _ in losses], [v for _, v in losses], lw=1.3, color="k")
    ax.set_ylabel("train loss")
    ax.set_title(
        "training loss; fp8_guard moves: solid red, moves back to FP8: solid green, warnings: dashed orange", fontsize=9
    )
    limits = {"underflow": th.underflow, "saturated": th.saturated, "max_to_rms": th.max_to_rms, "sqnr_db": th.sqnr_db}
    axes = [(ax, None)]
    for r, layer in enumerate(shown, start=1):
        s = series[layer]
        for c, key in enumerate(SIGNALS):
            a = fig.add_subplot(gs[r, c])
            pts = [(x, y) for x, y in zip(s["step"], s[key]) if y is not None and y != float("inf")]
            if pts:
                a.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if key == "sqnr_db" else "-", ms=3, lw=1.3)
            else:
                a.text(0.5, 0.5, "not measured", ha="center", va="center", transform=a.transAxes, color="0.4")
            a.axhline(limits[key], color="0.3", ls=":", lw=1)
            a.set_title(f"{layer}: {key}" if c == 0 else key, fontsize=8, loc="left")
            a.grid(alpha=0.3)
            axes.append((a, layer))
    for a, layer in axes:  # the loss: every event; a layer's row: its own
        for ev in events:
            if layer is None or ev["layer"] == layer:
                guard_line(a, ev)
    fig.suptitle(f"FP8 health per layer, worst first ({len(shown)} of {len(order)} layers; dotted: guard thresholds)")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _event_cell(ev: Mapping[str, Any]) -> str:
    """What the guard did at one event, for the layer's table cell."""
    if is_move_back(ev):
        return f"step {ev['step']}: moved back to FP8{gemms_text(ev)} (after {ev.get('checks')} healthy checks)"
    what = f"moved to bf16{gemms_text(ev)}" if ev["moved"] else "warned"
    return f"step {ev['step']}: {what} ({ev['signal']} = {ev['value']:.4g})"


def _run_thresholds(run_dir: str) -> Thresholds:
    """The thresholds the run's guard used (its resolved_config.yaml), else the defaults."""
    path = os.path.join(run_dir, "resolved_config.yaml")
    if not os.path.isfile(path):
        return Thresholds()
    import yaml

    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    return Thresholds(**(cfg.get("fp8_guard_thresholds") or {}))


def write_report(run_dir: str, rows: int = 8, thresholds: Optional[Thresholds] = None) -> tuple[str, str]:
    """Write ``health_report.png`` and ``health_report.html`` into ``run_dir``; returns their paths."""
    if not os.path.isfile(os.path.join(run_dir, FILE)):
        raise ValueError(f"{run_dir}: no {FILE} here; give the output_dir of a lowprec train run")
    records = read_metrics(run_dir)
    health = [r for r in records if r.get("kind") == "fp8_health"]
    if not health:
        raise ValueError(
            f"{run_dir}: {FILE} has no fp8_health records; train with fp8_health: true "
            "(or fp8_guard: warn | act) to record them"
        )
    th = thresholds or _run_thresholds(run_dir)
    events = [r for r in records if r.get("kind") == "fp8_guard"]
    losses = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    series = layer_series(health)
    sev = {layer: severity(s, th) for layer, s in series.items()}
    flagged = list(dict.fromkeys(ev["layer"] for ev in events if ev["layer"] in series))
    order = flagged + sorted((la for la in series if la not in flagged), key=lambda la: -sev[la][0])
    png = _plot(series, order, losses, events, th, os.path.join(run_dir, "health_report.png"), rows)
    with open(png, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    by_layer: dict[str, list[str]] = {}
    for ev in events:
        by_layer.setdefault(ev["layer"], []).append(_event_cell(ev))
    trs = []
    for i, la in enumerate(order, start=1):
        worst, which, first = sev[la]
        cls = ' class="bad"' if worst > 1 else ""
        trs.append(
            f"<tr{cls}><td>{i}</td><td>{html.escape(la)}</td><td>{worst:.3g}</td><td>{html.escape(which)}</td>"
            f"<td>{'' if first is None else first}</td><td>{html.escape('; '.join(by_layer.get(la, [])))}</td></tr>"
        )
    rows_html = "\n".join(trs)
    moved, back, warned = guard_tally(events)
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>FP8 health: {html.escape(os.path.basename(os.path.abspath(run_dir)))}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
td, th {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }}
tr.bad td {{ background: #fde2e2; }}
img {{ max-width: 100%; }}
</style>
</head>
<body>
<h1>FP8 health per layer</h1>
<p>{html.escape(os.path.abspath(run_dir))}: {len(health)} checks, steps {health[0]["step"]} to {health[-1]["step"]};
{len(order)} FP8 layers; {sum(1 for la in order if sev[la][0] > 1)} crossed a guard threshold;
fp8_guard: {moved} move(s) to bf16, {back} move(s) back to FP8, {warned} warning(s).</p>
<p>Severity: a layer's worst ratio to a threshold over the run (underflow / {th.underflow:g},
saturated / {th.saturated:g}, input max-to-rms / {th.max_to_rms:g}, {th.sqnr_db:g} dB / SQNR); above 1 (red) it crossed one.</p>
<table>
<tr><th>#</th><th>layer</th><th>severity</th><th>worst signal</th><th>first step over</th><th>fp8_guard</th></tr>
{rows_html}
</table>
<h2>Signals over time, worst layers first</h2>
<img alt="FP8 health per layer over time" src="data:image/png;base64,{data}">
</body>
</html>
"""
    out = os.path.join(run_dir, "health_report.html")
    with open(out, "w") as f:
        f.write(page)
    return png, out
