"""Grouped expert GEMMs in FP8: one 3-D weight ``(E, N, K)``, tokens grouped by expert.

A mixture-of-experts layer multiplies each token by the weights of the experts its router
chose. With the tokens sorted by expert (``counts[e]`` consecutive rows for expert ``e``), that
is one GEMM per expert, ``out[rows of e] = x[rows of e] @ W[e]^T``, and their backward:

==============  ================================  =================================  ========
GEMM, expert e  A operand                         B operand                          output
==============  ================================  =================================  ========
output          x_e   (c_e, K), contract K        W_e^T (K, N), contract K           hp
grad_input      dY_e  (c_e, N), contract N        W_e   (N, K), contract N           hp
grad_weight     dY_e^T (N, c_e), contract c_e     x_e   (c_e, K), contract c_e       float32
==============  ================================  =================================  ========

Every cast is per expert: a token group never shares a scale with another expert's tokens
(per-tensor recipes: one scale per expert's token group, one per expert weight, one per
expert's dY; rowwise / blockwise / MX: rows and tiles never cross a group), so one expert's
outlier token cannot flatten the others' FP8 values. An expert without tokens runs nothing
and its weight gradient is zero.

:class:`Float8GroupedGemm` holds what one such weight needs across steps (the state its scaling
kind keeps, per expert: delayed scaling's amax histories, NVFP4's rounding streams; telemetry
rows) and asks the kind to run the GEMMs (:meth:`~lowprec.fp8.kinds.base.Kind.grouped_forward`).
Every kind can: by default each expert runs the GEMMs of a Float8Linear of its kind on an
:class:`ExpertSlot` (the expert's weight and its row of each state buffer), so the casts, the
FP8 copies backward keeps (1 byte per input element, as for a Linear), the GEMM path (on CPU
the exact bf16 upcast) and the numerics are a Linear's: with every token on one expert the
result is a Float8Linear's bit for bit. Where a one-call grouped FP8 kernel runs (torch's, or
lowprec's Triton one), the tensorwise, delayed, rowwise and blockwise kinds run all experts in
one call per GEMM instead (``grouped_fn.py``), with the same per-expert scales and state:
delayed scaling reads and updates each expert's row of its amax histories as the per-expert
loop does, bit for bit (``tests/test_fp8_grouped.py``).

The experts module that calls this (routing, gating, combining) is ``fp8/modules/experts.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lowprec.fp8.modules.state_dtype import Float32State
from lowprec.fp8.gemm import compile_guard
from lowprec.fp8.modules.autocast import torch_autocast_off
from lowprec.fp8.kinds.base import GroupedCall
from lowprec.fp8.modules.linear import bump_state_epoch
from lowprec.guard_moves import GEMMS as GEMM_NAMES

if TYPE_CHECKING:
    from lowprec.fp8.modules.linear import Float8Linear
    from lowprec.fp8.recipes import Recipe

__all__ = ["Float8GroupedGemm", "ExpertSlot", "grouped_mm_hp", "SIDE_PROBE"]

# where the health probe (``fp8/observe/health.py``) puts its callback on a grouped GEMM it measures
# on the side: ``probe(gemm, x, weight, counts, out)`` after a moved projection's high-precision run
SIDE_PROBE = "_lowprec_side_probe"


class ExpertSlot:
    """Expert ``index`` of a :class:`Float8GroupedGemm`, as its scaling kind sees a Linear
    layer: ``weight`` (N, K), row ``index`` of every buffer of the module (``fp8_stats``, the
    kind's state), and the module's ``recipe`` / ``fp8_telemetry``. Kept for the module's life,
    so what a kind stores on a layer's ``__dict__`` (NVFP4's recompute mark, the recipe of the
    last forward) is kept per expert too."""

    weight: torch.Tensor

    def __init__(self, owner: Float8GroupedGemm, index: int) -> None:
        self.__dict__["_owner"] = owner
        self.__dict__["_index"] = index

    def __getattr__(self, name: str) -> Any:  # only for names not set on the slot itself
        owner = self.__dict__["_owner"]
        buf = owner._buffers.get(name)
        if buf is not None:
            return buf[self.__dict__["_index"]]
        if name in ("recipe", "fp8_telemetry", "high_precision", "training"):
            return getattr(owner, name)
        raise AttributeError(name)

    def gemm_weight(self) -> torch.Tensor:
        return self.weight

    def __reduce_ex__(self, protocol):  # a slot is a view of its owner: rebuilt, never pickled apart
        return (ExpertSlot, (self.__dict__["_owner"], self.__dict__["_index"]))


class _Template(nn.Module):
    """What a kind's ``init_state`` reads from a layer (its recipe, its weight's device), to
    learn the buffers one layer of that kind keeps; the grouped module keeps them per expert."""

    def __init__(self, recipe: Recipe, device: torch.device) -> None:
        super().__init__()
        self.recipe = recipe
        self.weight = torch.empty(0, device=device)


class Float8GroupedGemm(Float32State, nn.Module):
    """The FP8 state and dispatch of one grouped weight ``(E, N, K)`` (see module docstring).

    It holds no parameter: the weight stays where the model keeps it (a 3-D Parameter of the
    experts module) and is passed in. Buffers: the scaling kind's per-layer state with a
    leading expert dim (delayed: ``fp8_amax_history_input`` (E, L), ...; saved in the
    state_dict under this module's name, and a plain checkpoint without them loads, as for
    Float8Linear) and ``fp8_stats`` (E, 3, 4), the telemetry rows (not saved)."""

    fp8_stats: torch.Tensor
    # the FP8 guard moves a grouped projection whole (``high_precision``: all three GEMMs of every
    # expert in the autocast dtype), never one of its GEMMs: its GEMMs share the experts' routing
    per_gemm_moves = False

    def __init__(self, num_experts: int, recipe: Recipe, device: torch.device | None = None) -> None:
        super().__init__()
        self.num_experts = int(num_experts)
        self.recipe = recipe
        self.fp8_telemetry = False
        self.high_precision = False
        device = device or torch.device("cpu")
        template = _Template(recipe, device)
        recipe.kind.init_state(cast("Float8Linear", template))
        for name, buf in template._buffers.items():
            if buf is None:
                continue
            persistent = name not in template._non_persistent_buffers_set
            stacked = buf.unsqueeze(0).repeat(self.num_experts, *([1] * buf.dim())).contiguous()
            self.register_buffer(name, stacked, persistent=persistent)
        self.register_buffer("fp8_stats", torch.zeros(self.num_experts, 3, 4, device=device), persistent=False)
        self._slots = [ExpertSlot(self, e) for e in range(self.num_experts)]

    def slot(self, e: int, weight: torch.Tensor) -> Float8Linear:
        """Expert ``e`` as a layer of this module's kind, holding ``weight`` (N, K)."""
        s = self._slots[e]
        s.__dict__["weight"] = weight
        return cast("Float8Linear", s)

    def number_experts(self, first_index: int) -> None:
        """``convert`` numbers every converted GEMM; each expert gets its own index (NVFP4: a
        distinct, reproducible rounding stream per expert)."""
        for e in range(self.num_experts):
            self.recipe.kind.number_layer(self.slot(e, torch.empty(0)), first_index + e)

    @property
    def high_precision_gemms(self) -> tuple[str, ...]:
        """The GEMMs in high precision by a move: all three or none (see ``per_gemm_moves``)."""
        return GEMM_NAMES if self.high_precision else ()

    def set_high_precision_gemms(self, gemms: Iterable[str] = ()) -> None:
        """Any GEMM named moves the whole projection; ``()`` moves it back to FP8."""
        names = set(gemms)
        if names - set(GEMM_NAMES):
            raise ValueError(f"unknown GEMM(s) {sorted(names - set(GEMM_NAMES))}; use {', '.join(GEMM_NAMES)}")
        self.high_precision = bool(names)

    def gemm_precision(self) -> dict[str, bool]:
        """Each GEMM's precision in training: True = high precision (moved), False = FP8."""
        return dict.fromkeys(GEMM_NAMES, self.high_precision)

    def reset_fp8_state(self) -> None:
        bump_state_epoch()
        with torch.no_grad():
            self.fp8_stats.zero_()
            for e in range(self.num_experts):
                self.recipe.kind.reset_state(self.slot(e, torch.empty(0)))

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, counts: tuple[int, ...], recipe: Recipe, hp: torch.dtype
    ) -> torch.Tensor:
        """``(S, N)`` for ``x`` (S, K) grouped by ``counts`` and ``weight`` (E, N, K)."""
        if len(counts) != self.num_experts or weight.shape[0] != self.num_experts:
            raise ValueError(
                f"grouped GEMM for {self.num_experts} experts got {len(counts)} group counts and a "
                f"{tuple(weight.shape)} weight"
            )
        if torch.compiler.is_compiling():  # LOWPREC_COMPILE_FP8=0, or a kind that cannot compile here
            why = compile_guard.eager_reason(recipe.kind.compile_break(x.device))
            if why is not None:
                # outside the try block below: Dynamo cannot resume after a graph break inside one,
                # so it ran this whole frame eagerly, where is_compiling() is False, and then traced
                # the kind's grouped_forward as a frame of its own (mxfp8 / nvfp4 on CPU: an
                # InductorError on their float8_e8m0fnu / float4_e2m1fn_x2 tensors)
                return compile_guard.run_eagerly(self._run, x, weight, counts, recipe, hp, why=why)
        return self._run(x, weight, counts, recipe, hp)

    def _run(
        self, x: torch.Tensor, weight: torch.Tensor, counts: tuple[int, ...], recipe: Recipe, hp: torch.dtype
    ) -> torch.Tensor:
        try:
            return recipe.kind.grouped_forward(GroupedCall(self, x, weight, counts, recipe, hp))
        finally:  # the slots held views of this call's weight: let them go with the call
            for s in self._slots:
                # set to None, not popped: under torch.compile(dynamic=True) the routing's graph
                # break made Dynamo replay "set, then pop" as a delattr of a key it never set
                # (KeyError: 'weight' inside Dynamo's generated code)
                s.__dict__["weight"] = None

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, recipe={self.recipe.name}"

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        bump_state_epoch()
        # a plain checkpoint has no scaling state: keep this module's fresh state (as Float8Linear)
        ours = {prefix + n for n in self.recipe.kind.state_buffers if n in self._buffers}
        missing_ours = [k for k in missing_keys if k in ours]
        if missing_ours and len(missing_ours) == len(ours):
            for k in missing_ours:
                missing_keys.remove(k)


def grouped_mm_hp(x: torch.Tensor, weight: torch.Tensor, counts: tuple[int, ...], hp: torch.dtype) -> torch.Tensor:
    """The same grouped product in high precision (``hp``), for a projection kept out of FP8
    or FP8 switched off: one ``torch.matmul`` per expert holding tokens."""
    outs = []
    start = 0
    with torch_autocast_off(x.device.type):
        for e, n in enumerate(counts):
            if n:
                outs.append(torch.matmul(x[start : start + n].to(hp), weight[e].to(hp).t()))
            start += n
    if not outs:
        return x.new_zeros((0, weight.shape[1]), dtype=hp)
    return outs[0] if len(outs) == 1 else torch.cat(outs)
