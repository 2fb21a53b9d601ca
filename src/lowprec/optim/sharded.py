"""FP8AdamW on DTensor parameters (FSDP2 shards): the state of one process's shard, laid out
exactly as the single-process state of the whole parameter.

Choice: scales are **reduced, not per shard**. FSDP2 shards a parameter along dim 0, so each
process holds one contiguous range ``[start, start + n)`` of the flattened parameter. FP8AdamW's
first-moment blocks are counted on the *global* flat index (block ``k`` = elements ``[k*B,
(k+1)*B)``, as in one process), and the second moment's per-tensor scale is of the whole tensor.
The blocks a shard boundary cuts, and the per-tensor amax, need the other processes' values:
per parameter, every process contributes 3 floats (amax of its first and last block, amax of
``sqrt(v)``) to one ``all_gather`` (12 x world bytes per parameter per step, on the shard
group). Why not per-shard scales, which are numerically as valid (each shard's state is
independent)? Because then the state would depend on the world size: a checkpoint could not be
resharded without dequantizing and requantizing (lossy wherever a new block mixes values of old
blocks with different scales), and a 2-process run could not be compared bitwise with one
process. With reduced scales the state of a shard *is* that slice of the one-process state:

* the optimizer math on a shard equals the one-process math on the same gradient bitwise
  (tests/test_fsdp2_o2.py: identical payloads, scales and weights after several steps);
* a checkpoint holds the one-process state: payloads (and fp32 masters) as DTensors with the
  parameter's placement, which DCP reshards like the weight itself; the block scales as one
  plain ``(ceil(numel / B),)`` tensor (replicated: DCP writes it once), assembled at
  ``state_dict()`` by one MAX all-reduce per parameter; each process slices its blocks on load.
  Resuming on 4, 2 or 1 processes restores the same optimizer state, nothing is requantized.

Stochastic rounding needs noise that does not depend on how the tensor is cut either:
:func:`chunked_uniform` seeds each fixed stretch of 2**18 elements of the flat tensor on its
own, so element ``i`` gets the same noise whichever process holds it, and a shard draws only
the stretches it overlaps.

Supported placements: ``Shard(0)`` on any number of mesh dimensions (FSDP2, also nested) and
``Replicate`` (HSDP replicas hold the same range). Tensor parallel shards along other dims are
not one contiguous range of the flat tensor: refused with the fix in the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lowprec.fp8.formats import is_fp8_dtype
from lowprec.fp8.quantize import saturated_cast
from lowprec.fp8.scaling import amax, amax_to_scale, block_amax
from lowprec.optim.moments import dither, encode_exp_avg, encode_root

__all__ = ["ShardRange", "shard_range", "chunked_uniform", "NOISE_CHUNK", "gather_boundary_amaxes", "encode_moments_shard",
           "decode_exp_avg_shard", "full_block_scales", "as_state_dtensor", "local_state"]


@dataclass(frozen=True)
class ShardRange:
    """Where a DTensor parameter's local shard sits in its flattened global tensor."""

    start: int  # global flat index of the first local element
    numel: int  # local elements
    total: int  # global elements
    ranges: tuple[tuple[int, int], ...]  # (start, numel) of every process in ``group``
    group: Optional[dist.ProcessGroup]
    param: torch.Tensor  # the DTensor (its mesh, placements, shape)


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        return None
    return DTensor


def shard_range(p: torch.Tensor) -> Optional[ShardRange]:
    """The :class:`ShardRange` of a DTensor parameter; None for a plain tensor."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(p, dtensor):
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = p.device_mesh, p.placements
    for pl in placements:
        if not (type(pl) is Replicate or (type(pl) is Shard and pl.dim == 0)):
            raise ValueError(
                f"FP8AdamW (opt_level O2) steps DTensor parameters sharded along dim 0 (FSDP2) or "
                f"replicated; this one is placed {tuple(placements)} (tensor parallel?): use a torch "
                "optimizer (opt_level O1 or none) with tensor parallelism"
            )
    row = 1
    for s in p.shape[1:]:
        row *= s
    local = p.to_local()
    shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, placements)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"DTensor local shard {tuple(local.shape)} is not the expected {tuple(shape)}")
    start = (offset[0] if len(offset) else 0) * row
    group = _mesh_group(mesh)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    mine = torch.tensor([start, local.numel()], dtype=torch.int64, device=local.device)  # NCCL: on the GPU
    everyone = [torch.empty_like(mine) for _ in range(world)]
    if world > 1:  # once per parameter, at its first step: the layout never changes
        dist.all_gather(everyone, mine, group=group)
    else:
        everyone = [mine]
    return ShardRange(start, local.numel(), p.numel(), tuple(tuple(int(v) for v in t) for t in everyone), group, p)


def _mesh_group(mesh) -> Optional[dist.ProcessGroup]:
    # one process group spanning the whole mesh: its own group for a 1-D mesh (FSDP2), the
    # default group when a multi-dimensional mesh covers every process
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() != dist.get_world_size():
        raise ValueError("FP8AdamW on DTensors needs a 1-D mesh or a mesh over all processes")
    return None


# ------------------------------------------------------------------ split-independent noise
NOISE_CHUNK = 1 << 18  # elements per independently seeded stretch of the noise


def chunked_uniform(key: int, start: int, n: int, total: int, device=None) -> torch.Tensor:
    """Uniform [0, 1) float32 noise for elements ``start .. start + n - 1`` of a ``total``-element
    stream ``key``: the stream is cut into fixed stretches of :data:`NOISE_CHUNK` elements, each
    drawn from a generator seeded with ``(key, stretch)``, so an element's noise does not depend
    on which range a process asks for. A shard draws its own stretches only (at most two partly
    used), at ``torch.rand``'s speed; a hash of the index per element (counter-based, as Philox)
    gave the same property but ran ~40x slower than ``torch.rand`` on CPU (measured, 1M elements)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device if device is not None else "cpu")
    parts = []
    for c in range(start // NOISE_CHUNK, (start + n - 1) // NOISE_CHUNK + 1):
        gen.manual_seed((key * 0x94D049BB133111EB + c * 0xD6E8FEB86659FD93 + c) % (1 << 63))
        lo = c * NOISE_CHUNK
        draw = torch.rand(min(NOISE_CHUNK, total - lo), generator=gen, device=device, dtype=torch.float32)
        parts.append(draw[max(start - lo, 0):start + n - lo])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# ------------------------------------------------------------------------ scale agreement
def _blocks(start: int, numel: int, block: int) -> tuple[int, int]:
    """First and last global block index of ``[start, start + numel)`` (-1, -1 when empty)."""
    return (start // block, (start + numel - 1) // block) if numel else (-1, -1)


def gather_boundary_amaxes(sr: ShardRange, block: int, first: torch.Tensor, last: torch.Tensor,
                           tensor_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Agree on the amaxes a shard cannot compute alone: of its first and last block (which
    other shards may share) and of the whole tensor. One ``all_gather`` of 3 floats per process;
    blocks inside a shard need nothing. NaN propagates (``torch.maximum``)."""
    mine = torch.stack([first, last, tensor_amax]).to(torch.float32).reshape(3)
    world = len(sr.ranges)
    if world == 1:
        return mine[0], mine[1], mine[2]
    everyone = torch.empty(world * 3, dtype=torch.float32, device=mine.device)
    dist.all_gather_into_tensor(everyone, mine, group=sr.group)
    everyone = everyone.view(world, 3)
    if block >= sr.total:  # one block: the whole tensor (also on a process with an empty shard)
        whole = everyone[:, 0].max()
        return whole, whole, everyone[:, 2].max()
    k0, k1 = _blocks(sr.start, sr.numel, block)
    out_first, out_last = first.reshape(()).float(), last.reshape(()).float()
    for r, (s, n) in enumerate(sr.ranges):
        b0, b1 = _blocks(s, n, block)
        for b, theirs in ((b0, everyone[r, 0]), (b1, everyone[r, 1])):
            if b == k0:
                out_first = torch.maximum(out_first, theirs)
            if b == k1:
                out_last = torch.maximum(out_last, theirs)
    return out_first, out_last, everyone[:, 2].max()


def _block(sr: ShardRange, block_size: Optional[int]) -> int:
    # as moments.encode_exp_avg: one scale for the whole tensor when it fits in one block
    return block_size if block_size is not None and sr.total > block_size else max(sr.total, 1)


def encode_moments_shard(sr: ShardRange, m: torch.Tensor, v: torch.Tensor, m_dtype, v_dtype,
                         block_size: Optional[int], m_noise=None, v_noise=None):
    """``moments.encode_exp_avg`` / ``encode_exp_avg_sq`` of a shard with the one-process scales.
    Returns ``(exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale)``; the scale of ``m`` has
    shape ``()`` per tensor or one entry per global block this shard touches."""
    root = v.sqrt()
    zero = torch.zeros((), dtype=torch.float32, device=m.device)
    root_amax = amax(root) if root.numel() else zero
    if not is_fp8_dtype(m_dtype):  # FP16/BF16/FP32 first moment: unscaled, elementwise
        *_, t = gather_boundary_amaxes(sr, 1, zero, zero, root_amax)
        return (*encode_exp_avg(m, m_dtype, None, m_noise), *encode_root(root, v_dtype, v_noise, t))
    b = _block(sr, block_size)
    flat = m.reshape(-1)
    off = sr.start % b
    if not flat.numel():
        local = torch.zeros(0, dtype=torch.float32, device=m.device)
    elif b == sr.total:
        local = amax(flat).reshape(1)
    else:  # zero padding to whole global blocks: zeros never raise an amax
        padded = torch.nn.functional.pad(flat, (off, (-(off + flat.numel())) % b))
        local = block_amax(padded.view(1, -1), (1, b)).reshape(-1)
    first, last, t = gather_boundary_amaxes(sr, b, local[0] if local.numel() else zero,
                                            local[-1] if local.numel() else zero, root_amax)
    if local.numel():
        local = local.clone()
        local[0], local[-1] = first, last
    scale = amax_to_scale(local if b != sr.total else first, m_dtype, power_of_2=True)
    full = scale if scale.dim() == 0 else scale.repeat_interleave(b)[off:off + flat.numel()]
    scaled = flat * full
    if m_noise is not None:
        scaled = dither(scaled, m_dtype, m_noise.reshape(-1))
    data = saturated_cast(scaled, m_dtype).view(m.shape)
    return (data, scale, *encode_root(root, v_dtype, v_noise, t))


def decode_exp_avg_shard(sr: ShardRange, data: torch.Tensor, scale: torch.Tensor,
                         block_size: Optional[int]) -> torch.Tensor:
    """Inverse of :func:`encode_moments_shard`'s first moment, in float32 (exact: scales are
    powers of two, so ``* (1 / scale)`` equals the one-process ``dequantize``)."""
    if scale.dim() == 0:
        return data.to(torch.float32) / scale
    b = _block(sr, block_size)
    off = sr.start % b
    inv = scale.reciprocal().repeat_interleave(b)[off:off + data.numel()]
    return (data.reshape(-1).to(torch.float32) * inv).view(data.shape)


# ------------------------------------------------------------------------- checkpoint form
def full_block_scales(sr: ShardRange, local_scales: torch.Tensor, block_size: Optional[int]) -> torch.Tensor:
    """The ``(ceil(total / block),)`` scales of the whole parameter, on every process (one MAX
    all-reduce; scales are > 0 and shared blocks hold the same value on both sides)."""
    if local_scales.dim() == 0:  # one scale per tensor: the same on every process already
        return local_scales
    block = _block(sr, block_size)
    n_blocks = -(-sr.total // block)
    full = torch.zeros(n_blocks, dtype=torch.float32, device=local_scales.device)
    k0, k1 = _blocks(sr.start, sr.numel, block)
    if k0 >= 0:
        full[k0:k1 + 1] = local_scales
    if len(sr.ranges) > 1:
        dist.all_reduce(full, op=dist.ReduceOp.MAX, group=sr.group)
    return full


def as_state_dtensor(sr: ShardRange, local: torch.Tensor) -> torch.Tensor:
    """A state tensor of ``sr.param``'s shape and placement around this process's ``local``."""
    from torch.distributed.tensor import DTensor

    p = sr.param
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def local_state(sr: ShardRange, key: str, value: torch.Tensor, block_size: Optional[int]) -> torch.Tensor:
    """The inverse of the checkpoint form: this shard's part of a loaded state tensor."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        return value.to_local()
    if key == "exp_avg_scale" and value.dim() == 1:
        k0, k1 = _blocks(sr.start, sr.numel, _block(sr, block_size))
        return value[k0:k1 + 1] if k0 >= 0 else value[:0]
    if value.dim() > 0 and value.numel() == sr.total:  # a whole tensor (e.g. a one-process checkpoint)
        return value.reshape(-1)[sr.start:sr.start + sr.numel].view(sr.param.to_local().shape)
    return value
