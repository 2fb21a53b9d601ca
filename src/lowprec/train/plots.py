"""The run's pictures, drawn from ``metrics.jsonl`` with matplotlib's Agg backend (no display).

* ``loss.png``: training loss (per logging window) and validation loss against the step;
* ``fp8_report.png``: per-layer FP8 telemetry over time (amax, scale, saturated and underflow
  fractions of each operand), one line per layer; ``fp8_guard`` warnings (dashed orange), moves to
  bf16 (solid red) and moves back to FP8 (solid green) as vertical lines, named at the top;
* ``compare.png``: ``lowprec compare``'s mean curves over seeds with 95% bands, and the paired
  gap of each precision to the baseline against the threshold.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence
from lowprec.guard_moves import gemms_text, is_move_back
from lowprec.train.stats import gap_curves, interval

__all__ = ["plot_loss", "plot_fp8_report", "plot_compare", "worst_layers", "guard_line", "guard_counts", "guard_tally"]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def guard_line(ax, ev: Mapping[str, Any]) -> None:
    """One ``fp8_guard`` event as a vertical line: a move to bf16 solid red, a move back to FP8
    solid green, a warning dashed orange."""
    color = "green" if is_move_back(ev) else "red" if ev["moved"] else "orange"
    ax.axvline(ev["step"], color=color, ls="-" if ev["moved"] else "--", lw=1)


def guard_tally(events: Sequence[Mapping[str, Any]]) -> tuple[int, int, int]:
    """(moves to bf16, moves back to FP8, warnings) among ``fp8_guard`` events."""
    back = sum(map(is_move_back, events))
    moved = sum(bool(ev["moved"]) for ev in events) - back
    return moved, back, len(events) - moved - back


def guard_counts(events: Sequence[Mapping[str, Any]]) -> str:
    """'N layer(s) moved to bf16 (solid red)[, K moved back to FP8 (solid green)], W warning(s) ...'."""
    moved, back, warned = guard_tally(events)
    text = f"{moved} layer(s) moved to bf16 (solid red)"
    if back:
        text += f", {back} moved back to FP8 (solid green)"
    return text + f", {warned} warning(s) (dashed orange)"


def _event_words(ev: Mapping[str, Any]) -> str:
    if is_move_back(ev):
        return f"step {ev['step']} {ev['layer']}{gemms_text(ev)} back to FP8"
    return f"step {ev['step']} {ev['layer']}{gemms_text(ev)} ({ev['signal']} = {ev['value']:.3g})"


def _xy(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_loss(records: Sequence[Mapping[str, Any]], path: str, title: str = "") -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x, y = _xy([r for r in records if r["kind"] == "train"], "loss")
    ax.plot(x, y, label="train", lw=1.5)
    x, y = _xy([r for r in records if r["kind"] == "eval"], "loss")
    if x:
        ax.plot(x, y, "o-", label="validation", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_fp8_report(records: Sequence[Mapping[str, Any]], path: str, top: int = 5) -> str | None:
    """A grid: rows = operand (input, weight, grad_output), columns = statistic. The ``top``
    layers with the worst saturation / underflow are drawn in colour and labelled, the rest in
    grey; a statistic that is zero everywhere is said in words, not drawn as flat lines."""
    fp8 = [r for r in records if r["kind"] == "fp8" and r["layers"]]  # torchao layers: no telemetry
    if not fp8:
        return None
    plt = _plt()
    ops = list(next(iter(fp8[0]["layers"].values())).keys())
    stats = ("amax", "scale", "saturated", "underflow")
    layers = list(fp8[0]["layers"])
    guard = [r for r in records if r["kind"] == "fp8_guard"]
    flagged = list(dict.fromkeys(ev["layer"] for ev in guard if ev["layer"] in layers))  # drawn first, in colour
    worst = (flagged + [lay for lay in worst_layers(fp8, len(layers)) if lay not in flagged])[: max(top, len(flagged))]
    fig, axes = plt.subplots(len(ops), len(stats), figsize=(4 * len(stats), 2.8 * len(ops)), squeeze=False)
    steps = [r["step"] for r in fp8]
    for i, op in enumerate(ops):
        for j, st in enumerate(stats):
            ax = axes[i][j]
            series = {lay: [r["layers"].get(lay, {}).get(op, {}).get(st, float("nan")) for r in fp8] for lay in layers}
            if st in ("saturated", "underflow") and not any(v > 0 for ys in series.values() for v in ys):
                # a flat zero line for every layer says nothing; say it in words
                ax.text(
                    0.5,
                    0.5,
                    f"no {st} values\n(all layers, all steps)",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    fontsize=9,
                    color="0.4",
                )
                ax.set_xticks([])
                ax.set_yticks([])
            else:
                for lay, ys in series.items():  # the other layers: a grey background
                    if lay not in worst:
                        ax.plot(steps, ys, lw=0.6, color="0.8")
                for k, lay in enumerate(worst):  # the layers that matter, in distinct colours
                    ax.plot(steps, series[lay], lw=1.4, color=f"C{k}", label=lay)
                if st in ("amax", "scale") and all(v > 0 for ys in series.values() for v in ys if v == v):
                    ax.set_yscale("log")
                elif st in ("saturated", "underflow"):  # 1.2 and "1e-4" above the axis, not 0.000125
                    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
                for ev in guard:  # fp8_guard: a move solid red, a move back solid green, a warning dashed orange
                    guard_line(ax, ev)
            ax.set_title(f"{op}: {st}", fontsize=9)
            ax.grid(alpha=0.3)
            if i == len(ops) - 1:
                ax.set_xlabel("step")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if guard:  # under the title: what the guard did, first events named
        named = "; ".join(_event_words(ev) for ev in guard[:2])
        fig.text(
            0.5,
            0.925,
            f"fp8_guard: {guard_counts(guard)}\n{named}" + (f"; +{len(guard) - 2} more" if len(guard) > 2 else ""),
            ha="center",
            fontsize=8,
            color="red",
        )
    if handles:
        fig.legend(
            handles,
            labels,
            loc="lower center",
            ncol=min(len(labels), 3),
            fontsize=8,
            title=(
                f"{len(worst)} of {len(layers)} layers: fp8_guard's first, then the worst by saturated + underflow "
                "fraction (others grey)"
            )
            if flagged
            else f"worst {len(worst)} of {len(layers)} layers by saturated + underflow fraction (others grey)",
        )
    fig.suptitle("FP8 telemetry per layer (saturated / underflow: fraction of values)")
    _grid_layout(fig, len(ops), len(stats), bottom=0.1, top=0.91 if guard else 0.96)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _grid_layout(fig, rows: int, cols: int, bottom: float, top: float) -> None:
    """Fixed margins in inches for a grid of small axes: room for the tick labels on the left of
    each axes, a title and the x tick labels between rows. ``tight_layout`` measured every tick
    label of the 12 axes for the same result and took 60% of the report's time (0.8 s at the end
    of every run)."""
    width, height = fig.get_size_inches()
    left, right, gap_w = 0.8, 0.15, 0.8  # inches: y tick labels (log decades, 1.25), the next axes'
    gap_h = 0.55 if rows > 1 else 0.0  # inches: an axes' title above, the x tick labels below
    line = 0.35  # inches: the top row's titles, the bottom row's x label
    axes_w = (width - left - right - gap_w * (cols - 1)) / cols
    axes_h = (height * (top - bottom) - 2 * line - gap_h * (rows - 1)) / rows
    fig.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        bottom=bottom + line / height,
        top=top - line / height,
        wspace=gap_w / axes_w,
        hspace=gap_h / axes_h,
    )


def worst_layers(fp8_records: Sequence[Mapping[str, Any]], top: int = 5) -> list[str]:
    """The ``top`` layers with the largest saturated + underflow fraction (any operand, any
    logged step), worst first; ties (all zero) keep the model's layer order."""
    score: dict[str, float] = {}
    for r in fp8_records:
        for lay, ops in r["layers"].items():
            s = max((st.get("saturated", 0.0) + st.get("underflow", 0.0) for st in ops.values()), default=0.0)
            score[lay] = max(score.get(lay, 0.0), s)
    order = sorted(score, key=lambda lay: -score[lay])  # sorted is stable: ties in layer order
    return order[:top]


def _band(per_seed: Sequence[Mapping[int, float]]) -> tuple[list, list, list, list]:
    """Steps logged by every seed; the mean and its 95% t interval at each (the mean alone for one seed)."""

    steps = sorted(set.intersection(*(set(m) for m in per_seed))) if per_seed else []
    ivs = [interval([m[s] for m in per_seed]) for s in steps]
    mean = [iv.mean for iv in ivs]
    low = [iv.low if iv.low is not None else iv.mean for iv in ivs]
    high = [iv.high if iv.high is not None else iv.mean for iv in ivs]
    return steps, mean, low, high


def plot_compare(report: Mapping[str, Any], path: str) -> str:
    """``lowprec compare``'s picture from its report: top, each precision's mean training loss
    with its 95% band over seeds (validation means as markers); bottom, the paired relative gap
    of each precision's training loss to the baseline, with its band and the threshold."""

    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    base = report["baseline"]
    base_runs = {r["seed"]: r for r in report["precisions"][base]["runs"]}
    for i, (name, row) in enumerate(report["precisions"].items()):
        color, runs = f"C{i}", row["runs"]
        if not runs:
            continue
        x, m, lo, hi = _band([{int(s): v for s, v in r["train_losses"]} for r in runs])
        top.plot(x, m, color=color, lw=1.3, label=f"{name} ({len(runs)} seeds)")
        top.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)
        x, m, lo, hi = _band([{int(s): v for s, v in r["eval_losses"]} for r in runs])
        if x:
            top.errorbar(
                x,
                m,
                yerr=[[a - b for a, b in zip(m, lo)], [b - a for a, b in zip(m, hi)]],
                fmt="o",
                color=color,
                ms=4,
                capsize=3,
            )
        paired = [r for r in runs if r["seed"] in base_runs]
        if name == base or not paired:
            continue
        gaps = gap_curves([r["train_losses"] for r in paired], [base_runs[r["seed"]]["train_losses"] for r in paired])
        x, m, lo, hi = _band([{s: 100 * g[k] for s, g in gaps.items()} for k in range(len(paired))])
        bottom.plot(x, m, color=color, lw=1.3, label=name)
        bottom.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)
    thr = 100 * report["threshold"]
    bottom.axhline(thr, color="k", ls="--", lw=1, label=f"threshold +{thr:g}%")
    bottom.axhline(0.0, color="k", lw=0.6)
    top.set_ylabel("loss (nats/token)")
    top.set_title(f"mean loss over seeds, 95% bands (validation: markers); baseline {base}")
    bottom.set_ylabel(f"training loss gap vs {base} (%)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
