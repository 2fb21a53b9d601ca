"""Count the bytes each process hands to collectives, at the collective itself.

:class:`CommBytes` is a ``TorchDispatchMode``: every collective op that runs inside it (the
``c10d`` ops behind ``torch.distributed.all_reduce`` & co., the functional ``_c10d_functional``
ops DTensor redistributes with, in forward and backward alike) adds the bytes of its input
tensor(s) to a counter keyed by ``(kind, dtype)``. No wrapper of ours has to be on the path, so
what DTensor, FSDP2 or a parallel style sends on its own is counted too.

The count is the payload one process contributes: an all-gather's local shard, a
reduce-scatter's or all-reduce's whole input; :meth:`CommBytes.ring_bytes` converts it to the
bytes a ring algorithm sends per process, comparable across kinds.
FP8 payloads travel as ``uint8`` on gloo (no FP8 dtype), and are counted as such.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CommBytes"]

# op name (without namespace and overload) -> (kind, index of the input argument)
_OPS = {
    "allreduce_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 1),
    "allgather_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "all_gather_into_tensor_out": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "alltoall_base_": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast_": ("broadcast", 0),
}
_NAMESPACES = ("c10d", "_c10d_functional")


def _tensor_bytes(arg: Any) -> int:
    leaves, _ = tree_flatten(arg)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class CommBytes(TorchDispatchMode):
    """``with CommBytes() as c: ...``; then ``c.bytes`` maps ``(kind, dtype name)`` to bytes and
    ``c.calls`` to the number of collectives. ``c.total(kind)`` sums one kind over dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _NAMESPACES and func._opname in _OPS:  # noqa: SLF001 - torch's op name
            kind, index = _OPS[func._opname]  # noqa: SLF001
            payload = args[index] if index < len(args) else None
            leaves = [t for t in tree_flatten(payload)[0] if isinstance(t, torch.Tensor)]
            key = (kind, str(leaves[0].dtype).removeprefix("torch.") if leaves else "none")
            self.bytes[key] += _tensor_bytes(payload)
            self.calls[key] += 1
        return func(*args, **kwargs)

    def total(self, kind: str) -> int:
        return sum(b for (k, _), b in self.bytes.items() if k == kind)

    def ring_bytes(self, world: int) -> int:
        """Bytes one process sends under ring algorithms over ``world`` processes: an all-gather
        ``(W-1)`` shards, a reduce-scatter ``(W-1)/W`` of its input, an all-reduce twice that
        (reduce-scatter + all-gather), a broadcast or all-to-all its input once."""
        factor = {"all_gather": world - 1, "reduce_scatter": (world - 1) / world, "all_reduce": 2 * (world - 1) / world}
        return round(sum(b * factor.get(kind, 1) for (kind, _), b in self.bytes.items()))

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{"all_gather": {"uint8": bytes, ...}, ...}`` (JSON-ready)."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for (kind, dtype), b in sorted(self.bytes.items()):
            out[kind][dtype] = b
        return dict(out)
