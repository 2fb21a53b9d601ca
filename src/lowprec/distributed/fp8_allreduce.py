"""FP8 gradient all-reduce as a DDP communication hook (MS-AMP O1 communication).

NCCL and gloo have no FP8 sum, so the reduction is a reduce-scatter built from an
all-to-all of FP8 shards with the sum done locally in float32, then an all-gather of the FP8
sums. Per bucket of ``N`` gradient elements over ``W`` ranks:

1. per-tensor amaxes of the bucket's gradients, all-reduced with MAX (4 bytes per tensor):
   every rank uses the same scale ``S = pow2(fp8_max / amax)`` for a given tensor;
2. each rank casts ``g * S / W`` to FP8. The pre-division by ``W`` bounds every term by
   ``fp8_max / W``, so the sum of the ``W`` terms cannot overflow FP8 (MS-AMP's rule; with a
   power-of-two ``W`` the division is exact for normal values and costs ``log2(W)`` bits of
   the subnormal range);
3. all-to-all of the FP8 payload (as uint8): rank ``k`` receives everyone's shard ``k``;
4. local float32 sum of the ``W`` shards = ``S * mean(g)`` over the shard, re-cast to FP8 with
   the same scale (it is within range by step 2): the only extra rounding;
5. all-gather of the FP8 sums; every rank divides by ``S``: the *mean* gradient, as DDP's
   default hook returns.

Bytes each rank sends (ring / pairwise algorithms): ``2 (W-1)/W N`` for the FP8 payload plus
``8 (W-1)/W T`` for ``T`` tensors' amaxes, against ``4 (W-1)/W N`` for a bf16 all-reduce and
``8 (W-1)/W N`` for fp32: half of bf16, a quarter of fp32. The hook counts them.
Cost: three collectives instead of one (latency), two FP8 roundings, and the hook runs its
collectives synchronously (no overlap of the local sum with communication).

Non-finite gradients: a NaN or inf anywhere in a tensor on any rank makes that tensor's amax
inf after the MAX; the whole tensor comes back NaN on every rank. Never finite, never hidden,
so a GradScaler or a NaN check sees it.
"""

# No ``from __future__ import annotations``: DDP inspects the hook's annotations at runtime
# and needs the real dist.GradBucket class there, not a string.

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowprec.fp8.cast.quantize import saturated_cast
from lowprec.fp8.cast.scaling import amax_to_scale

__all__ = [
    "FP8AllReduceState",
    "fp8_all_reduce_",
    "fp8_allreduce_hook",
    "register_fp8_allreduce",
    "ring_allreduce_bytes",
    "per_element",
]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class FP8AllReduceState:
    """State of the hook: which group and dtype, and what went over the wire from this rank.

    ``bytes_sent`` counts what this rank sent: FP8 payload (``payload_bytes``, half of bf16)
    plus the amax all-reduce (``amax_bytes``, 4 bytes per tensor per hop). ``bf16_bytes`` and
    ``fp32_bytes`` are what a ring all-reduce of the same buckets in bf16 / fp32 would send.
    """

    process_group: dist.ProcessGroup | None = None
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    bytes_sent: int = 0
    payload_bytes: int = 0
    amax_bytes: int = 0
    bf16_bytes: int = 0
    fp32_bytes: int = 0
    calls: int = 0
    numel: int = 0

    def __post_init__(self):
        if self.fp8_dtype not in _FP8:
            raise ValueError(
                f"fp8_dtype={self.fp8_dtype} is not an FP8 dtype; use torch.float8_e4m3fn or torch.float8_e5m2"
            )

    def reset_counters(self) -> None:
        self.bytes_sent = self.payload_bytes = self.amax_bytes = 0
        self.bf16_bytes = self.fp32_bytes = self.calls = self.numel = 0

    def counters(self) -> dict:
        return {
            "calls": self.calls,
            "numel": self.numel,
            "fp8_bytes": self.bytes_sent,
            "fp8_payload_bytes": self.payload_bytes,
            "amax_bytes": self.amax_bytes,
            "bf16_bytes": self.bf16_bytes,
            "fp32_bytes": self.fp32_bytes,
        }


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def ring_allreduce_bytes(numel: int, element_size: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce: reduce-scatter + all-gather."""
    return 2 * (world - 1) * numel * element_size // world


def per_element(values: torch.Tensor, numels: list[int]) -> torch.Tensor:
    """One value per tensor (the last dim of ``values``), repeated over that tensor's elements:
    ``(..., T) -> (..., sum(numels))``. Built with expand + cat, so no host-to-device copy of the
    counts (a blocking copy on CUDA once per bucket would stall backward) and no device-to-host
    read to size the result."""
    return torch.cat([v.unsqueeze(-1).expand(*v.shape, k) for v, k in zip(values.unbind(-1), numels)], dim=-1)


def fp8_all_reduce_(flat: torch.Tensor, numels: list[int] | None, state: FP8AllReduceState) -> torch.Tensor:
    """Average ``flat`` over the group through FP8, in place; returns ``flat``.

    ``numels`` splits ``flat`` into tensors that each get their own scale (None: one scale).
    """
    group = state.process_group
    world = dist.get_world_size(group)
    dtype = state.fp8_dtype
    n = flat.numel()
    numels = [n] if numels is None else list(numels)
    if sum(numels) != n:
        raise ValueError(f"numels sum to {sum(numels)} but the bucket has {n} elements")
    if n == 0:
        return flat
    x = flat.detach().reshape(-1).to(torch.float32)

    # 1. shared per-tensor amax; non-finite -> +inf so MAX carries it regardless of order
    amaxes = torch.stack([seg.abs().amax() if seg.numel() else seg.new_zeros(()) for seg in torch.split(x, numels)])
    amaxes = torch.where(torch.isfinite(amaxes), amaxes, torch.full_like(amaxes, float("inf")))
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    bad = torch.isinf(amaxes)
    scales = amax_to_scale(amaxes, dtype, power_of_2=True)  # S per tensor (0 where inf)
    per_elem = per_element(scales, numels)

    # 2. pre-divided cast; zero padding to a multiple of W (zeros stay zeros)
    pad = (-n) % world
    q = saturated_cast(x * (per_elem / world), dtype)
    q = torch.nn.functional.pad(q.view(torch.uint8), (0, pad))
    shard = q.numel() // world

    # 3. all-to-all: receive everyone's copy of my shard
    recv = torch.empty_like(q)
    dist.all_to_all_single(recv, q, group=group)

    # 4. local fp32 sum, re-cast with the same scale (|sum| <= fp8_max by the pre-division)
    total = recv.view(dtype).to(torch.float32).view(world, shard).sum(0)
    mine = saturated_cast(total, dtype).view(torch.uint8)

    # 5. all-gather the FP8 sums and dequantize to the mean
    gathered = torch.empty_like(q)
    _all_gather_single(gathered, mine, group=group)
    mean = gathered.view(dtype)[:n].to(torch.float32) / per_elem
    bad_elem = per_element(bad, numels)
    mean = torch.where(bad_elem, torch.full_like(mean, float("nan")), mean)
    flat.copy_(mean.view(flat.shape))

    state.calls += 1
    state.numel += n
    payload = 2 * (world - 1) * shard  # all-to-all + all-gather, (W-1) shards each
    amax_bytes = ring_allreduce_bytes(len(numels), 4, world)
    state.payload_bytes += payload
    state.amax_bytes += amax_bytes
    state.bytes_sent += payload + amax_bytes
    state.bf16_bytes += ring_allreduce_bytes(n, 2, world)
    state.fp32_bytes += ring_allreduce_bytes(n, 4, world)
    return flat


def fp8_allreduce_hook(state: FP8AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``ddp.register_comm_hook(state, fp8_allreduce_hook)``."""
    buf = bucket.buffer()
    numels = [g.numel() for g in bucket.gradients()]
    fp8_all_reduce_(buf, numels, state)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def register_fp8_allreduce(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    process_group: dist.ProcessGroup | None = None,
) -> FP8AllReduceState:
    """Register :func:`fp8_allreduce_hook` on a DDP model; returns the state (byte counters)."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"register_fp8_allreduce needs a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; wrap it with torch.nn.parallel.DistributedDataParallel first"
        )
    hooks = getattr(ddp_model, "_comm_hooks", None)  # torch keeps the registered (hook, state) pairs
    if hooks:
        name = getattr(hooks[0][0], "__name__", repr(hooks[0][0]))
        raise ValueError(
            f"FP8 gradient all-reduce (MS-AMP opt_level O1/O2) is a DDP communication hook, and this model "
            f"has one already ({name}, e.g. DistributedDataParallelKwargs(comm_hook=...)); DDP takes one: "
            "drop comm_hook, or the FP8 all-reduce (opt_level)"
        )
    group = process_group if process_group is not None else ddp_model.process_group
    state = FP8AllReduceState(process_group=group, fp8_dtype=fp8_dtype)
    ddp_model.register_comm_hook(state, fp8_allreduce_hook)
    return state
