"""NVFP4 (TransformerEngine's ``NVFP4BlockScaling``): E2M1 elements with one E4M3 scale per 16
and an fp32 tensor scale, 16x16 weight tiles (so grad_input reads the forward's FP4 weight
transposed), stochastic rounding of gradients, and a random Hadamard transform on the
weight-gradient operands. ``convert`` keeps the last ``high_precision_last`` of the Linear
layers in high precision (NVIDIA keeps ~15%).

The rounding stream is seeded from ``recipe.seed``, the layer's index and its step; the step
lives in the layer's state_dict (``fp8_sr_state``), so a resumed run draws the same noise as an
uninterrupted one. The noise is counter-based (``nvfp4.sr_uniform``: a hash of the stream's seed
and each element's index on the quantized operand's layout), so the torch path and the cast
kernel round alike. The casts are in ``fp8/cast/nvfp4.py``, the Hadamard transform in ``hadamard.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lowprec.fp8 import kernels
from lowprec.fp8.modules.autocast import recomputing
from lowprec.fp8.cast.formats import E4M3, Format
from lowprec.fp8.cast.hadamard import rht, rht_sign_bits
from lowprec.fp8.kinds import base
from lowprec.fp8.kinds.mxfp8 import Microscaled
from lowprec.fp8.cast.mx import BlockScaledData
from lowprec.fp8.modules.mx_linear import Codec, mx_linear
from lowprec.fp8.cast.nvfp4 import (
    FP4X2,
    NVFP4_BLOCK,
    quantize_nvfp4,
    quantize_nvfp4_2d,
    sr_key,
    tensor_scales,
    transpose_2d,
)
from lowprec.fp8.kinds.plan import GemmCast, OperandCast
from lowprec.fp8.state_epoch import state_epoch

if TYPE_CHECKING:
    from lowprec.fp8.modules.linear import Float8Linear
    from lowprec.fp8.recipes import Recipe

__all__ = ["NVCodec", "NVFP4", "NVWeight", "SR_STATE", "cast_nvfp4"]

SR_STATE = "fp8_sr_state"  # (layer index, step) of the stochastic rounding stream


def _fused(t: torch.Tensor) -> bool:
    """Whether ``t``'s casts go to ``lowprec::cast_nvfp4``: 2-D, contiguous along either dim
    (a transposed view, such as the weight-gradient operands, is read through its strides: the
    first-use check runs both layouts), where the check passed."""
    return t.dim() == 2 and 1 in t.stride() and kernels.available(t.device, "cast_nvfp4", t)


def cast_nvfp4(t: torch.Tensor, seed: int | None = None) -> BlockScaledData:
    """``quantize_nvfp4(t, seed)`` (``seed``: stochastic rounding with that stream), bit for bit;
    on CUDA the tensor amax (``kernels.amax``, one read) and one Triton kernel for the rest
    (``kernels.cast_nvfp4``, a second read), where their first-use checks passed."""
    if not _fused(t):
        return quantize_nvfp4(t, seed)
    src = t.detach()
    s, decode = tensor_scales(kernels.amax(src))
    key = -1 if seed is None else sr_key(seed)
    q, sc, _, _ = kernels.cast_nvfp4(src, s, False, True, False, key)
    return BlockScaledData(q.view(FP4X2), sc.view(E4M3), t.shape[1], NVFP4_BLOCK, decode)


@dataclass
class NVWeight(BlockScaledData):
    """The weight's 16x16 tiles with their transpose (``transpose_2d``: grad_input's operand)
    made by the same kernel from the same read; backward keeps both layouts (0.5 + 1/16 bytes
    per weight element each) instead of unpacking and repacking the tiles."""

    t_data: torch.Tensor | None = None
    t_scale: torch.Tensor | None = None

    def nbytes(self) -> int:
        extra = 0 if self.t_data is None or self.t_scale is None else self.t_data.numel() + self.t_scale.numel()
        return super().nbytes() + extra


def cast_weight(w: torch.Tensor) -> BlockScaledData:
    """``quantize_nvfp4_2d(w)``, bit for bit; on CUDA (``kernels.cast_nvfp4``, where its check
    passed) an :class:`NVWeight` holding ``transpose_2d`` of it too, from the same read."""
    if not _fused(w):
        return quantize_nvfp4_2d(w)
    src = w.detach()
    s, decode = tensor_scales(kernels.amax(src))
    q, sc, qt, st = kernels.cast_nvfp4(src, s, True, True, True)
    return NVWeight(q.view(FP4X2), sc.view(E4M3), w.shape[1], NVFP4_BLOCK, decode, qt.view(FP4X2), st.view(E4M3))


class NVCodec(Codec):
    reuses_weight = True

    def quantize(self, t: torch.Tensor, recipe: Recipe, dtype: torch.dtype, seed: int | None = None) -> BlockScaledData:
        return cast_nvfp4(t, seed)

    def quantize_weight(self, w: torch.Tensor, recipe: Recipe, dtype: torch.dtype) -> BlockScaledData:
        return cast_weight(w)

    def transpose_weight(self, wq: BlockScaledData) -> BlockScaledData:
        if isinstance(wq, NVWeight) and wq.t_data is not None and wq.t_scale is not None:
            return BlockScaledData(wq.t_data, wq.t_scale, wq.rows, wq.block, wq.tensor_scale)
        return transpose_2d(wq)

    def wgrad_operand(self, t: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        return rht(t, recipe.seed).t()

    def quantize_wgrad(
        self, t: torch.Tensor, recipe: Recipe, dtype: torch.dtype, seed: int | None = None
    ) -> BlockScaledData:
        """``quantize(wgrad_operand(t), seed)``, bit for bit; on CUDA the random Hadamard transform
        applied inside the amax and cast kernels (``kernels.rht_amax``, ``kernels.cast_nvfp4_rht``:
        two reads of ``t``, no rotated float32 copy), where their first-use check passed."""
        if not (t.dim() == 2 and 1 in t.stride() and kernels.available(t.device, "cast_nvfp4_rht", t)):
            return super().quantize_wgrad(t, recipe, dtype, seed)
        src, bits = t.detach(), rht_sign_bits(recipe.seed)
        s, decode = tensor_scales(kernels.rht_amax(src, bits))
        q, sc = kernels.cast_nvfp4_rht(src, s, bits, -1 if seed is None else sr_key(seed))
        return _wgrad_data(q, sc, t, decode)

    def quantize_pair(
        self, t: torch.Tensor, recipe: Recipe, dtype: torch.dtype, both: bool
    ) -> tuple[BlockScaledData, BlockScaledData | None]:
        if not both:
            return self.quantize(t, recipe, dtype), None
        return self.quantize_pair_seeded(t, recipe, dtype, (None, None))

    def quantize_pair_seeded(
        self, t: torch.Tensor, recipe: Recipe, dtype: torch.dtype, seeds: tuple[int | None, int | None]
    ) -> tuple[BlockScaledData, BlockScaledData]:
        """``(quantize(t, seeds[0]), quantize_wgrad(t, seeds[1]))``, bit for bit; on CUDA from two
        reads of ``t`` instead of four: one for both tensor amaxes (``kernels.nvfp4_dual_amax``),
        one for both casts (``kernels.cast_nvfp4_dual``), where their first-use check passed."""
        if not (t.dim() == 2 and 1 in t.stride() and kernels.available(t.device, "cast_nvfp4_dual", t)):
            return self.quantize(t, recipe, dtype, seeds[0]), self.quantize_wgrad(t, recipe, dtype, seeds[1])
        src, bits = t.detach(), rht_sign_bits(recipe.seed)
        s, decode = tensor_scales(kernels.nvfp4_dual_amax(src, bits))
        keys = (-1 if seed is None else sr_key(seed) for seed in seeds)
        q, sc, qt, st = kernels.cast_nvfp4_dual(src, s, bits, *keys)
        plain = BlockScaledData(q.view(FP4X2), sc.view(E4M3), t.shape[1], NVFP4_BLOCK, decode[0])
        return plain, _wgrad_data(qt, st, t, decode[1])


def _wgrad_data(q: torch.Tensor, sc: torch.Tensor, t: torch.Tensor, decode: torch.Tensor) -> BlockScaledData:
    """The weight-gradient operand of ``t`` (M, C) from a kernel's bytes: (C, M padded to 16)."""
    return BlockScaledData(
        q.view(FP4X2), sc.view(E4M3), -(-t.shape[0] // NVFP4_BLOCK) * NVFP4_BLOCK, NVFP4_BLOCK, decode
    )


# The seeds are host integers; the state lives in a buffer (checkpoints, device moves). The
# buffer is read once (a device sync) and then mirrored on the host, so a training step never
# waits for the GPU. The mirror holds the state epoch it was read in: every write of scaling
# state from outside a step (a load, a reset, a skipped step's restore) moves the epoch on.
_HOST_COPY = "_nvfp4_sr_host"


def _host_state(layer, state: torch.Tensor) -> tuple[int, int]:
    copy = layer.__dict__.get(_HOST_COPY)
    if copy is None or copy[0] != state_epoch():
        # a trace on meta tensors (fp8.trace_as) has no values to read: stream (0, 0)
        values = (0, 0) if state.device.type == "meta" else (int(v) for v in state.tolist())
        copy = layer.__dict__[_HOST_COPY] = (state_epoch(), *values)
    return copy[1], copy[2]


def _stream_seed(recipe: Recipe, layer: int, step: int, which: int) -> int:
    """A 63-bit seed per (recipe seed, layer, step, GEMM): distinct streams, reproducible."""
    h = (recipe.seed * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB + which) & (
        2**63 - 1
    )
    return h


class NVFP4(Microscaled):
    name = "nvfp4"
    packed_dtype = "torch.float4_e2m1fn_x2"
    codec = NVCodec()
    cpu_scales = "block scales folded in, tensor scales on the output"
    state_buffers = (SR_STATE,)
    state_what = "stochastic-rounding state"

    def check(self, recipe: Recipe) -> None:
        if recipe.fp8_format is not Format.E4M3:
            raise ValueError(
                "fp8_format applies to FP8 elements; nvfp4 holds E2M1 elements with E4M3 scales: set fp8_format='E4M3'"
            )
        if not recipe.save_fp8_activations:
            raise ValueError(
                "nvfp4 keeps the FP4 input for the weight-gradient GEMM; save_fp8_activations=False "
                "is not supported with it"
            )

    def gemms(self, recipe: Recipe) -> tuple[GemmCast, GemmCast, GemmCast]:
        fwd = recipe.fp8_format.forward_dtype  # E4M3 names the block scales' format
        nv = OperandCast(fwd, "nv16")
        w2d = OperandCast(fwd, "nv16", block_2d=True)
        return GemmCast(nv, w2d), GemmCast(nv, w2d), GemmCast(nv, nv)

    def describe_operand(self, o: OperandCast) -> str:
        return "e2m1/16x16" if o.block_2d else "e2m1/1x16"

    def init_state(self, layer: Float8Linear) -> None:
        layer.register_buffer(SR_STATE, torch.zeros(2, dtype=torch.int64, device=layer.weight.device))

    def number_layer(self, layer: Float8Linear, index: int) -> None:
        getattr(layer, SR_STATE)[0] = index  # a distinct, reproducible rounding stream per layer
        layer.__dict__.pop(_HOST_COPY, None)

    def forward(self, layer: Float8Linear, x2: torch.Tensor, recipe: Recipe, hp: torch.dtype) -> torch.Tensor:
        return mx_linear(layer, x2, recipe, hp, self.codec, self._seeds(layer, recipe))

    def _seeds(self, layer: Float8Linear, recipe: Recipe) -> tuple[int, int] | None:
        """This call's stochastic-rounding seeds (dgrad's and wgrad's dY), advancing the layer's
        stream; None without grad (nothing to round)."""
        if not torch.is_grad_enabled():
            return None
        state = getattr(layer, SR_STATE)
        index, step = _host_state(layer, state)
        # a recompute replays the stream of the forward that advanced it; a reentrant
        # checkpoint's first forward runs without grad and advanced nothing, so its recompute
        # is the call that takes this step's stream (as the uncheckpointed run would)
        if recomputing() and layer.__dict__.get("_nvfp4_advanced", False):
            step -= 1
        else:
            state[1] += 1  # the buffer (saved in checkpoints) and its host copy advance together
            layer.__dict__[_HOST_COPY] = (state_epoch(), index, step + 1)
        layer.__dict__["_nvfp4_advanced"] = not recomputing()
        return _stream_seed(recipe, index, step, 0), _stream_seed(recipe, index, step, 1)

    def grouped_seeds(self, call: base.GroupedCall) -> list[tuple[int, int] | None] | None:
        """Each expert holding tokens advances its own stream, in expert order, as the per-expert
        loop's ``forward`` calls do."""
        gemm, weight = call.gemm, call.weight
        return [self._seeds(gemm.slot(e, weight[e]), call.recipe) if n else None for e, n in enumerate(call.counts)]


base.register(NVFP4())
