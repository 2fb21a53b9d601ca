"""FP8AdamW on DTensor parameters (FSDP2 shards): the state of one process's shard, laid out
exactly as the single-process state of the whole parameter.

Choice: scales are **reduced, not per shard**. FSDP2 shards a parameter along dim 0, so each
process holds one contiguous range ``[start, start + n)`` of the flattened parameter. FP8AdamW's
first-moment blocks are counted on the *global* flat index (block ``k`` = elements ``[k*B,
(k+1)*B)``, as in one process), and the second moment's per-tensor scale is of the whole tensor.
The blocks a shard boundary cuts, and the per-tensor amax, need the other processes' values:
per parameter, every process contributes 3 floats (amax of its first and last block, amax of
``sqrt(v)``); the step gathers those of all parameters in **one** ``all_gather`` per process
group (12 x parameters x world bytes per step; :func:`agree_amaxes`), so it holds every
parameter's new fp32 moments until then (8 bytes per local element, transient). The shard
layout is computed from the mesh, without communication. Why not per-shard scales, which are numerically as valid (each shard's state is
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
from typing import Any, Optional, cast

import torch
import torch.distributed as dist

from lowprec.fp8.cast.formats import is_fp8_dtype
from lowprec.fp8.cast.quantize import saturated_cast
from lowprec.fp8.cast.scaling import amax, amax_to_scale, block_amax
from lowprec.optim.moments import dither, encode_exp_avg, encode_root

__all__ = [
    "ShardRange",
    "shard_range",
    "chunked_uniform",
    "NOISE_CHUNK",
    "PendingMoments",
    "prepare_moments_shard",
    "agree_amaxes",
    "finish_moments_shard",
    "encode_moments_shard",
    "decode_exp_avg_shard",
    "full_block_scales",
    "as_state_dtensor",
    "local_state",
]


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
    ranges = _all_ranges(p, group, world, row) if world > 1 else ((start, local.numel()),)
    if ranges[dist.get_rank(group) if world > 1 else 0] != (start, local.numel()):
        raise ValueError(f"DTensor shard layout {ranges} does not hold this process's ({start}, {local.numel()})")
    return ShardRange(start, local.numel(), p.numel(), ranges, group, p)


def _all_ranges(p, group, world: int, row: int) -> tuple[tuple[int, int], ...]:
    """(start, numel) of every process of ``group``, computed from the mesh (no communication:
    the optimizer's step then has exactly one collective)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = p.device_mesh
    out = []
    for r in range(world):
        g = dist.get_global_rank(group, r) if group is not None else r
        coord = (mesh.mesh == g).nonzero()[0].tolist()
        shape, offset = _compute_local_shape_and_global_offset(p.shape, mesh.shape, coord, p.placements)
        n = 1
        for s in shape:
            n *= s
        out.append(((offset[0] if len(offset) else 0) * row, n))
    return tuple(out)


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
        parts.append(draw[max(start - lo, 0) : start + n - lo])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# ------------------------------------------------------------------------ scale agreement
def _blocks(start: int, numel: int, block: int) -> tuple[int, int]:
    """First and last global block index of ``[start, start + numel)`` (-1, -1 when empty)."""
    return (start // block, (start + numel - 1) // block) if numel else (-1, -1)


def _resolve_boundary(
    sr: ShardRange,
    block: int,
    first: torch.Tensor,
    last: torch.Tensor,
    mine: torch.Tensor,
    everyone: Optional[torch.Tensor],
):
    """The amaxes a shard cannot compute alone: of its first and last block (which other shards
    may share) and of the whole tensor, from every process's 3 floats (``everyone``, ``(world,
    3)``; None: one process). Blocks inside a shard need nothing. NaN propagates
    (``torch.maximum``)."""
    if everyone is None:
        return mine[0], mine[1], mine[2]
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


@dataclass
class PendingMoments:
    """A shard's new moments waiting for the agreed amaxes (:func:`prepare_moments_shard`):
    ``mine`` is what this process contributes to the one all_gather of the step."""

    sr: ShardRange
    m: torch.Tensor
    root: torch.Tensor  # sqrt(v)
    m_dtype: torch.dtype
    v_dtype: torch.dtype
    block: int  # elements per first-moment scale (1: FP16/BF16/FP32 first moment, unscaled)
    local: torch.Tensor  # amax of each global block this shard touches (FP8 first moment)
    mine: torch.Tensor  # (3,) float32: first block amax, last block amax, amax of sqrt(v)


def prepare_moments_shard(
    sr: ShardRange, m: torch.Tensor, v: torch.Tensor, m_dtype, v_dtype, block_size: Optional[int]
) -> PendingMoments:
    """The local half of encoding a shard's moments: block and tensor amaxes of this shard."""
    root = v.sqrt()
    zero = torch.zeros((), dtype=torch.float32, device=m.device)
    root_amax = amax(root) if root.numel() else zero
    empty = torch.zeros(0, dtype=torch.float32, device=m.device)
    if not is_fp8_dtype(m_dtype):  # FP16/BF16/FP32 first moment: unscaled, elementwise
        return PendingMoments(sr, m, root, m_dtype, v_dtype, 1, empty, torch.stack([zero, zero, root_amax]))
    b = _block(sr, block_size)
    flat = m.reshape(-1)
    off = sr.start % b
    if not flat.numel():
        local = empty
    elif b == sr.total:
        local = amax(flat).reshape(1)
    else:  # zero padding to whole global blocks: zeros never raise an amax
        padded = torch.nn.functional.pad(flat, (off, (-(off + flat.numel())) % b))
        local = block_amax(padded.view(1, -1), (1, b)).reshape(-1)
    first, last = (local[0], local[-1]) if local.numel() else (zero, zero)
    mine = torch.stack([first, last, root_amax]).to(torch.float32).reshape(3)
    return PendingMoments(sr, m, root, m_dtype, v_dtype, b, local, mine)


def agree_amaxes(pending: list[PendingMoments]) -> list[Optional[torch.Tensor]]:
    """Every process's 3 floats of each pending shard: **one** ``all_gather`` per process group
    for all of them (12 x parameters x world bytes), split back into one ``(world, 3)`` tensor per
    entry (None where the group has one process). Every process must pass its shards of the same
    parameters in the same order (the optimizer's parameter order)."""
    out: list[Optional[torch.Tensor]] = [None] * len(pending)
    by_group: list[tuple[Optional[dist.ProcessGroup], int, list[int]]] = []  # in first-seen order
    for i, pm in enumerate(pending):
        world = len(pm.sr.ranges)
        if world == 1:
            continue
        for grp, _world, idx in by_group:
            if grp is pm.sr.group:
                idx.append(i)
                break
        else:
            by_group.append((pm.sr.group, world, [i]))
    for grp, world, idx in by_group:
        mine = torch.cat([pending[i].mine for i in idx])
        everyone = torch.empty(world * mine.numel(), dtype=torch.float32, device=mine.device)
        dist.all_gather_into_tensor(everyone, mine, group=grp)
        everyone = everyone.view(world, len(idx), 3)
        for j, i in enumerate(idx):
            out[i] = everyone[:, j]
    return out


def finish_moments_shard(pm: PendingMoments, everyone: Optional[torch.Tensor], m_noise=None, v_noise=None):
    """The second half: ``moments.encode_exp_avg`` / ``encode_exp_avg_sq`` of the shard with the
    one-process scales. Returns ``(exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale)``; the
    scale of ``m`` has shape ``()`` per tensor or one entry per global block this shard touches."""
    sr, m, b = pm.sr, pm.m, pm.block
    first, last, t = _resolve_boundary(sr, b, pm.mine[0], pm.mine[1], pm.mine, everyone)
    if not is_fp8_dtype(pm.m_dtype):
        return (*encode_exp_avg(m, pm.m_dtype, None, m_noise), *encode_root(pm.root, pm.v_dtype, v_noise, t))
    flat = m.reshape(-1)
    off = sr.start % b
    local = pm.local
    if local.numel():
        local = local.clone()
        local[0], local[-1] = first, last
    scale = amax_to_scale(local if b != sr.total else first, pm.m_dtype, power_of_2=True)
    full = scale if scale.dim() == 0 else scale.repeat_interleave(b)[off : off + flat.numel()]
    scaled = flat * full
    if m_noise is not None:
        scaled = dither(scaled, pm.m_dtype, m_noise.reshape(-1))
    data = saturated_cast(scaled, pm.m_dtype).view(m.shape)
    return (data, scale, *encode_root(pm.root, pm.v_dtype, v_noise, t))


def encode_moments_shard(
    sr: ShardRange,
    m: torch.Tensor,
    v: torch.Tensor,
    m_dtype,
    v_dtype,
    block_size: Optional[int],
    m_noise=None,
    v_noise=None,
    *,
    collective: bool = True,
):
    """Prepare, agree (one all_gather for this one shard) and finish. ``collective=False`` when
    every process is known to hold the same amaxes (the zero state of a new parameter): no
    communication, each process stands in for all."""
    pm = prepare_moments_shard(sr, m, v, m_dtype, v_dtype, block_size)
    if collective:
        everyone = agree_amaxes([pm])[0]
    else:
        everyone = None if len(sr.ranges) == 1 else pm.mine.expand(len(sr.ranges), 3)
    return finish_moments_shard(pm, everyone, m_noise, v_noise)


def decode_exp_avg_shard(
    sr: ShardRange, data: torch.Tensor, scale: torch.Tensor, block_size: Optional[int]
) -> torch.Tensor:
    """Inverse of :func:`encode_moments_shard`'s first moment, in float32 (exact: scales are
    powers of two, so ``* (1 / scale)`` equals the one-process ``dequantize``)."""
    if scale.dim() == 0:
        return data.to(torch.float32) / scale
    b = _block(sr, block_size)
    off = sr.start % b
    inv = scale.reciprocal().repeat_interleave(b)[off : off + data.numel()]
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
        full[k0 : k1 + 1] = local_scales
    if len(sr.ranges) > 1:
        dist.all_reduce(full, op=dist.ReduceOp.MAX, group=sr.group)
    return full


def as_state_dtensor(sr: ShardRange, local: torch.Tensor) -> torch.Tensor:
    """A state tensor of ``sr.param``'s shape and placement around this process's ``local``."""
    from torch.distributed.tensor import DTensor

    p = cast(DTensor, sr.param)  # a shard range is made for DTensor parameters only
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def local_state(sr: ShardRange, key: str, value: torch.Tensor, block_size: Optional[int]) -> torch.Tensor:
    """The inverse of the checkpoint form: this shard's part of a loaded state tensor."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        return value.to_local()
    if key == "exp_avg_scale" and value.dim() == 1:
        k0, k1 = _blocks(sr.start, sr.numel, _block(sr, block_size))
        return value[k0 : k1 + 1] if k0 >= 0 else value[:0]
    if value.dim() > 0 and value.numel() == sr.total:  # a whole tensor (e.g. a one-process checkpoint)
        return value.reshape(-1)[sr.start : sr.start + sr.numel].view(cast(Any, sr.param).to_local().shape)
    return value
