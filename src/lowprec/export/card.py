"""The measured logit gap of an export, and the model card section that reports it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from lowprec.export.layers import LayerPlan
from lowprec.export.shards import atomic_write
from lowprec.fp8 import autocast

if TYPE_CHECKING:
    from lowprec.export.model import ExportReport

__all__ = ["logit_gap", "write_card", "PROBE_TOKENS"]

PROBE_TOKENS = 32


def _logits(out) -> torch.Tensor:
    return (out.logits if hasattr(out, "logits") else out[0]).float()


def logit_gap(
    model: nn.Module, plan: LayerPlan, probe_ids: torch.Tensor | None, vocab_size: int | None
) -> float | None:
    """``||logits(FP8 export) - logits(bf16 export)|| / ||logits(bf16 export)||``: one float32
    forward in high precision with every weight as the bf16 export stores it, one with the
    quantized layers' weights as the FP8 export dequantizes them (``q * scale_inv``; microscaled:
    ``q`` times its block's decode scale, times NVFP4's tensor factor)."""
    if probe_ids is None:
        if not vocab_size:
            return None
        gen = torch.Generator().manual_seed(0)
        probe_ids = torch.randint(0, int(vocab_size), (1, PROBE_TOKENS), generator=gen)
    device = next(model.parameters()).device
    bf16 = {k: p.detach().to(torch.bfloat16).float() for k, p in model.named_parameters()}
    fp8 = dict(bf16)
    fused: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for layer in plan.quantized:
        w = layer.cast.dequantize(torch.float32)
        if layer.expert is not None:  # one part of one expert of a fused 3-D Parameter
            fused.setdefault(layer.name, {})[layer.expert[:2]] = w
            continue
        fp8[f"{layer.name}.weight"] = (w.t() if layer.transposed else w).to(device)
    for name, pieces in fused.items():
        experts = 1 + max(e for e, _ in pieces)
        parts = 1 + max(p for _, p in pieces)
        rows = [torch.cat([pieces[(e, p)] for p in range(parts)]) for e in range(experts)]
        fp8[name] = torch.stack(rows).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(enabled=False):
            ref = _logits(torch.func.functional_call(model, bf16, (probe_ids.to(device),)))
            got = _logits(torch.func.functional_call(model, fp8, (probe_ids.to(device),)))
    finally:
        model.train(was_training)
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def write_card(report: "ExportReport", out_dir: str) -> str:
    """``README.md``: a model card section (appended to one already there)."""
    kept = ", ".join(sorted(report.kept)) or "none"
    gap = "not measured" if report.logit_gap is None else f"{report.logit_gap:.3e}"
    lines = [
        "## FP8 export (lowprec)",
        "",
        f"- format: `{report.format}` ({report.scheme}, {report.layout})",
        f"- training recipe: `{report.recipe or 'none (not FP8-trained)'}`",
        f"- weights: {report.how}",
        f"- quantized layers: {len(report.quantized)}; kept in bf16 (the config's ignore list): {kept}",
        f"- logit gap to the bf16 export: {gap} (relative L2 over {PROBE_TOKENS} token positions, "
        "float32 forward, measured at export)",
        *[f"- {n}" for n in report.notes],
        "",
    ]
    path = os.path.join(out_dir, "README.md")
    prior = open(path).read().rstrip() + "\n\n" if os.path.isfile(path) else ""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(prior + "\n".join(lines))

    atomic_write(path, write)
    return path
