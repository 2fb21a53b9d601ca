"""FP8 gradient reduce-scatter for FSDP2 (MS-AMP O1's gradient communication, FSDP2's half).

FSDP2 reduce-scatters each unit's gradients in ``reduce_dtype`` through a replaceable
communication object (``FSDPModule.set_custom_reduce_scatter``, torch >= 2.8). NCCL and gloo
have no FP8 sum, so :class:`FP8ReduceScatter` builds it from one all-to-all of FP8 chunks and a
local float32 sum (the first half of lowprec's DDP FP8 all-reduce, ``fp8_allreduce.py``):

FSDP2 hands over one flat buffer of ``W x S`` elements, chunk ``r`` (``S`` elements) destined for
rank ``r``, each chunk the concatenation of every parameter's padded shard. Per chunk and per
parameter the sender computes an amax, casts ``g * scale`` to FP8 (power-of-two scales) and
appends its float32 scales to the chunk's bytes; **one** ``all_to_all_single`` delivers chunk
``r`` of every sender to rank ``r``, which dequantizes each sender's chunk with that sender's
scales and sums the ``W`` chunks in float32. The sum is never re-quantized (the output stays in
``reduce_dtype``), so the only rounding is each rank's FP8 cast of its own gradient: the same
rounding as O1's "gradients through FP8" in one process, with scales per shard instead of per
tensor (a shard's amax <= the tensor's, so never coarser). No pre-division is needed (the sum is
float32). FSDP2 is told to send SUM (``set_force_sum_reduction_for_comms``) and divides the
result by the world size itself.

Bytes each rank sends: ``(W-1) x (S + 4 x T)`` for ``T`` parameters in the unit, against
``(W-1) x 2 S`` for a bf16 reduce-scatter and ``(W-1) x 4 S`` for fp32: half of bf16 plus the
scales. Counted in :attr:`FP8ReduceScatter.counters`.

Non-finite gradients: an inf or NaN in a sender's shard of a parameter makes that shard's
scale 0 or NaN, and the receiver's whole shard of that parameter NaN: never finite, never hidden.
One process (``W = 1``): FSDP2 does not communicate and does not call this; gradients stay in
full precision. HSDP (a replicate dimension): only the reduce-scatter over the shard group is
FP8; FSDP2's all-reduce across replicas that follows stays in ``reduce_dtype``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lowprec.distributed.fp8_allreduce import per_element
from lowprec.fp8.cast.quantize import saturated_cast
from lowprec.fp8.cast.scaling import amax_to_scale

__all__ = ["FP8ReduceScatter", "install_fp8_reduce_scatter", "CountingReduceScatter", "install_counting_reduce_scatter"]

logger = logging.getLogger("lowprec")


def _reduce_scatter_base():
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:  # torch < 2.8: no custom reduce-scatter
        return object
    return ReduceScatter


class _Counting(_reduce_scatter_base()):  # type: ignore[misc]
    def __init__(self) -> None:
        self.calls = 0
        self.numel = 0
        self.sent_bytes = 0  # what this rank put on the wire
        self.bf16_bytes = 0  # what a bf16 reduce-scatter of the same gradients sends
        self.fp32_bytes = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _count(self, n: int, world: int, sent: int) -> None:
        self.calls += 1
        self.numel += n
        self.sent_bytes += sent
        self.bf16_bytes += (world - 1) * n * 2 // world
        self.fp32_bytes += (world - 1) * n * 4 // world

    @property
    def counters(self) -> dict:
        return {
            "calls": self.calls,
            "numel": self.numel,
            "sent_bytes": self.sent_bytes,
            "bf16_bytes": self.bf16_bytes,
            "fp32_bytes": self.fp32_bytes,
        }


class CountingReduceScatter(_Counting):
    """FSDP2's own reduce-scatter, counted: ``(W-1)/W x input bytes`` per call (ring)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        world = dist.get_world_size(group)
        n = input_tensor.numel()
        self._count(n, world, (world - 1) * n * input_tensor.element_size() // world)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class FP8ReduceScatter(_Counting):
    """An FSDP2 custom reduce-scatter in FP8 (module doc). ``segments``: the padded shard numel
    of each parameter of the unit, in FSDP2's order (one scale each per chunk)."""

    def __init__(self, segments: list[int], fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        super().__init__()
        self.segments = [int(s) for s in segments]
        self.fp8_dtype = fp8_dtype

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"FP8ReduceScatter sums (FSDP2 divides afterwards); got op {op}")
        world = dist.get_world_size(group)
        size = output_tensor.numel()
        segs = self.segments if sum(self.segments) == size else [size]
        dtype = self.fp8_dtype
        x = input_tensor.detach().reshape(world, size).to(torch.float32)
        parts = torch.split(x, segs, dim=1)
        # per destination chunk and parameter: amax -> power-of-two scale (NaN stays NaN)
        amaxes = torch.stack([p.abs().amax(dim=1) if p.numel() else p.new_zeros(world) for p in parts], dim=1)
        scales = amax_to_scale(amaxes, dtype, power_of_2=True)  # (W, T)
        per_elem = per_element(scales, segs)
        q = saturated_cast(x * per_elem, dtype).view(torch.uint8)
        packed = torch.cat([q, scales.view(torch.uint8)], dim=1)  # chunk bytes, then its scales
        recv = torch.empty_like(packed)
        dist.all_to_all_single(recv, packed.reshape(-1), group=group)  # row i: sender i's chunk for me
        data = recv[:, :size].contiguous().view(dtype).to(torch.float32)
        their = recv[:, size:].contiguous().view(torch.float32)  # (W, T)
        inv = per_element(their, segs)
        output_tensor.copy_((data / inv).sum(0).to(output_tensor.dtype))
        self._count(world * size, world, (world - 1) * packed.shape[1])
        return None


def _unit_segments(module: Any) -> Optional[list[int]]:
    groups = module._get_fsdp_state()._fsdp_param_groups  # FSDP2 internals: checked below
    if len(groups) != 1:
        return None
    return [fp.padded_sharded_param_size.numel() for fp in groups[0].fsdp_params]


def _install(model: nn.Module, make) -> list:
    from torch.distributed.fsdp import FSDPModule

    comms = []
    for m in model.modules():
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups:
            comm = make(m)
            m.set_custom_reduce_scatter(comm)
            comms.append(comm)
    return comms


def install_fp8_reduce_scatter(
    model: nn.Module, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> list[FP8ReduceScatter]:
    """An :class:`FP8ReduceScatter` on every FSDP2 unit of ``model`` (after ``fully_shard``)."""
    if _reduce_scatter_base() is object:
        raise ValueError("FP8 reduce-scatter needs torch >= 2.8 (FSDPModule.set_custom_reduce_scatter)")

    def make(m):
        segs = _unit_segments(m)
        if segs is None:
            raise ValueError(
                "FP8 reduce-scatter needs one FSDP2 parameter group per unit (no shard_placement_fn "
                "with several meshes)"
            )
        m.set_force_sum_reduction_for_comms(True)
        return FP8ReduceScatter(segs, fp8_dtype)

    return _install(model, make)


def install_counting_reduce_scatter(model: nn.Module) -> list[CountingReduceScatter]:
    """A :class:`CountingReduceScatter` on every FSDP2 unit of ``model``."""
    return _install(model, lambda m: CountingReduceScatter())
