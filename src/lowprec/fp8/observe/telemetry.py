"""FP8 telemetry: per-layer amax, scale, and saturation / underflow fractions.

``enable(model)`` turns the extra statistics on (two more elementwise passes per cast, so it is
off by default); ``telemetry(model)`` reads the last step's values of every Float8Linear as a
plain dict (one host synchronisation, at read time only):

    {"layers.0.mlp.up_proj": {"input": {"amax": .., "scale": .., "saturated": .., "underflow": ..},
                              "weight": {...}, "grad_output": {...}}, ...}

``saturated`` is the fraction of values whose scaled magnitude went beyond what rounding to the
format's max would cover (they were clipped: E4M3 > 464, E5M2 > 61440); ``underflow`` the fraction of non-zero values that became 0. For rowwise and
blockwise casts ``scale`` is the smallest scale of the tensor. An operand that has not been
cast in FP8 yet reports zeros; one whose GEMM ran in high precision since keeps the values of
the last step in which it was cast. Under the Accelerator (or ``lowprec train``) a delayed-scaling
operand also reports ``amax_spikes``: the accepted steps whose amax was more than 1024 times its
history's previous maximum (``step_stage.py``); reading them logs any spike not logged yet.

Mixture-of-experts modules converted by ``fp8.convert`` report per expert
(:func:`expert_telemetry`): the tokens routed to each expert in the last forward (always
recorded: the counts are the routing's own) and, while telemetry is on, each FP8 projection's
statistics per expert, as lists indexed by expert (an expert that ran no token keeps the values
of the last step in which it ran)::

    {"model.layers.0.mlp.experts": {"tokens": [12, 0, 31, ...],
                                    "gate_up_proj": {"input": {"amax": [..E..], ...}, ...}, ...}}
"""

from __future__ import annotations

import torch
from torch import nn

from lowprec.fp8.modules.experts import GEMM_PREFIX, Float8Experts
from lowprec.fp8.modules.grouped import Float8GroupedGemm
from lowprec.fp8.modules.linear import OPERANDS, Float8Linear
from lowprec.fp8.step_stage import spike_counts, warn_counted

__all__ = ["enable", "disable", "telemetry", "expert_telemetry", "grouped_telemetry", "worst_expert", "STAT_FIELDS"]

STAT_FIELDS = ("amax", "scale", "saturated", "underflow")  # the columns of a telemetry row


def _set(model: nn.Module, on: bool) -> int:
    n = 0
    for m in model.modules():
        if isinstance(m, (Float8Linear, Float8GroupedGemm)):
            m.fp8_telemetry = on
            n += 1
    return n


def enable(model: nn.Module) -> int:
    """Turn statistics on for every Float8Linear and grouped expert GEMM; returns how many."""
    return _set(model, True)


def disable(model: nn.Module) -> int:
    return _set(model, False)


def telemetry(model: nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Float8Linear):
            rows = m.fp8_stats.detach().cpu().tolist()
            out[name] = {op: dict(zip(STAT_FIELDS, row)) for op, row in zip(OPERANDS, rows)}
            spikes = spike_counts(m)
            if spikes is not None and m.recipe.kind.keeps_history:
                for op, n in zip(OPERANDS, spikes):
                    out[name][op]["amax_spikes"] = n
    warn_counted(model)
    return out


def expert_telemetry(model: nn.Module) -> dict[str, dict]:
    """Per-expert routing counts and FP8 statistics of every converted experts module (see the
    module docstring); one host read per module."""
    out: dict[str, dict] = {}
    for name, m in model.named_modules():
        if isinstance(m, Float8Experts):
            entry: dict = {"tokens": [int(t) for t in m.tokens_per_expert.tolist()]}
            for proj, g in m.fp8_gemms().items():
                rows = g.fp8_stats.detach().cpu()  # (E, 3, 4)
                entry[proj] = {
                    op: {f: rows[:, i, j].tolist() for j, f in enumerate(STAT_FIELDS)} for i, op in enumerate(OPERANDS)
                }
            out[name] = entry
    return out


def grouped_telemetry(model: nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    """Each FP8 expert projection as one telemetry row, keyed by its grouped GEMM module's name
    (``...experts.fp8_gate_up_proj``), over the experts that ran tokens in the last forward:
    the largest saturated and underflow fractions, and the amax and scale of the expert with
    the least headroom (largest ``amax * scale``). What the FP8 guard judges an expert
    projection by: one expert in trouble flags it. Projections whose experts ran nothing yet are
    left out."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, m in model.named_modules():
        if not isinstance(m, Float8Experts):
            continue
        ran = m.tokens_per_expert.detach().cpu() > 0
        for proj, g in m.fp8_gemms().items():
            rows = g.fp8_stats.detach().cpu()[ran]  # (experts that ran, 3, 4)
            if rows.numel() == 0:
                continue
            out[f"{name}.{GEMM_PREFIX}{proj}"] = {op: worst_expert(rows[:, i]) for i, op in enumerate(OPERANDS)}
    return out


def worst_expert(st: torch.Tensor) -> dict[str, float]:
    """One operand's telemetry over the experts that ran, ``st`` (experts, 4) in ``STAT_FIELDS``
    order, as one row: the largest saturated and underflow fractions, the amax and scale of the
    expert with the least headroom (largest ``amax * scale``)."""
    worst = int(torch.argmax(st[:, 0] * st[:, 1]))
    return {
        "amax": float(st[worst, 0]),
        "scale": float(st[worst, 1]),
        "saturated": float(st[:, 2].max()),
        "underflow": float(st[:, 3].max()),
    }
