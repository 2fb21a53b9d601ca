"""The three GEMMs of a Linear and how each operand is cast: the plan a scaling kind draws.

A :class:`LinearPlan` is built once per recipe by its scaling kind (``fp8/kinds/``) and read by
``Float8Linear`` on every call; nothing here knows a kind by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

__all__ = ["OperandCast", "GemmCast", "LinearPlan", "HIGH_PRECISION"]


@dataclass(frozen=True)
class OperandCast:
    """How one operand of one GEMM is cast. ``granularity`` is ``tensor``, ``axis`` (one
    scale per slice across the contraction dim) or ``block`` (tiles; ``block_2d`` makes them
    square, as for weights)."""

    dtype: torch.dtype
    granularity: str = "tensor"
    block_2d: bool = False


@dataclass(frozen=True)
class GemmCast:
    """Both operands of one GEMM, or ``None`` fields for a high-precision GEMM."""

    a: OperandCast | None
    b: OperandCast | None

    if TYPE_CHECKING:  # set in __post_init__, not fields; an FP8 GEMM's casts are (a, b), a high-precision one has none
        high_precision: bool = field(init=False)
        casts: tuple[OperandCast, OperandCast] = field(init=False)

    def __post_init__(self) -> None:
        # plain attributes, read on every call of a layer: no property call, and torch.compile
        # traces an attribute read without a guard on a lock (functools.cached_property holds one)
        object.__setattr__(self, "high_precision", self.a is None)
        if self.a is not None and self.b is not None:
            object.__setattr__(self, "casts", (self.a, self.b))


def _same_cast(first: GemmCast, a: OperandCast | None, second: GemmCast, b: OperandCast | None, grans: tuple) -> bool:
    """Whether an operand's cast for one FP8 GEMM is the cast another FP8 GEMM reads."""
    return (
        not first.high_precision and not second.high_precision and a is not None and a == b and a.granularity in grans
    )


@dataclass(frozen=True)
class LinearPlan:
    """The three GEMMs of a Linear: output = x W^T, grad_input = dY W, grad_weight = dY^T x.

    Derived once here, not per call: which casts one GEMM can hand to another (each holds when
    the gradient concerned is wanted at all; Float8Linear checks that per call).

    * ``x_dual``: the forward casts ``x`` in both layouts and keeps the column-major one for
      grad_weight (same dtype and scaling; axis and 1-D block scales are written for each
      orientation).
    * ``w_dual``: the forward casts ``W`` in both layouts (one tensor scale serves both).
    * ``w_reused``: grad_input reads the forward's cast of ``W`` (a tensor scale serves both
      orientations) instead of re-casting the weight in backward (rowwise, blockwise).
    * ``w_square``: both GEMMs of ``W`` use the same square blocks, so one cast could serve
      both; used for a frozen weight, whose cast is kept anyway (``frozen.py``), and for grouped
      expert weights, cast once for both GEMMs (``grouped_fn.py``).
    * ``dy_dual``: grad_input casts ``dY`` in both layouts and grad_weight reads the second.
    * ``per_tensor``: every operand of the three GEMMs is cast with one scale per tensor.
    * ``axis_fdgrad``: the output and grad_input GEMMs cast every operand with axis scales, the
      weight in one dtype for both (one pass writes both of its casts: rowwise).
    * ``axis_tensor_w``: as ``axis_fdgrad`` but grad_input's weight cast has one tensor scale
      (``dgrad_weight_tensorwise``: rowwise_with_gw_hp).
    """

    fprop: GemmCast
    dgrad: GemmCast
    wgrad: GemmCast
    save_fp8_input: bool = True
    x_dual: bool = field(init=False)
    w_dual: bool = field(init=False)
    w_reused: bool = field(init=False)
    w_square: bool = field(init=False)
    dy_dual: bool = field(init=False)
    per_tensor: bool = field(init=False)
    axis_fdgrad: bool = field(init=False)
    axis_tensor_w: bool = field(init=False)

    def __post_init__(self) -> None:
        fp, dg, wg = self.fprop, self.dgrad, self.wgrad
        axes = ("tensor", "axis", "block")  # block: 1x128 and 128x1 tiles from one pass (block_cast.py)
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        set_("x_dual", self.save_fp8_input and _same_cast(fp, fp.a, wg, wg.b, axes))
        set_("w_dual", _same_cast(fp, fp.b, dg, dg.b, ("tensor",)))
        # square blocks would serve both orientations, but blockwise re-casts W in backward: an
        # FP8 copy kept per layer costs 1 byte/param at the memory peak (same values either way)
        set_("w_reused", self.w_dual)
        set_("w_square", _same_cast(fp, fp.b, dg, dg.b, ("block",)) and dg.b is not None and dg.b.block_2d)
        set_("dy_dual", _same_cast(dg, dg.a, wg, wg.a, axes))
        casts = [o for g in (fp, dg, wg) for o in (g.a, g.b)]
        set_("per_tensor", all(o is not None and o.granularity == "tensor" for o in casts))
        fd = [o for g in (fp, dg) for o in (g.a, g.b)]
        same_w = fp.b is not None and dg.b is not None and fp.b.dtype == dg.b.dtype
        set_("axis_fdgrad", same_w and all(o is not None and o.granularity == "axis" for o in fd))
        axis_but_w = same_w and all(o is not None and o.granularity == "axis" for o in fd[:3])
        set_("axis_tensor_w", axis_but_w and dg.b is not None and dg.b.granularity == "tensor")


HIGH_PRECISION = GemmCast(None, None)  # a GEMM that casts nothing
