"""Collectives over nested tensors (gather, reduce, pad) and device moves, Accelerate-named."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from lowprec.state.partial import PartialState

__all__ = [
    "CannotPadNestedTensorWarning",
    "DistributedOperationException",
    "is_torch_tensor",
    "recursively_apply",
    "send_to_device",
    "gather",
    "reduce",
    "pad_across_processes",
    "to_fp32",
    "has_tensor",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
]


class CannotPadNestedTensorWarning(UserWarning):
    """``pad_across_processes`` was given a nested tensor (ragged: no single size to pad); it is returned as is."""


class DistributedOperationException(Exception):
    """In debug mode (``PartialState().debug``, ``ACCELERATE_DEBUG_MODE=1``), a collective given
    tensors whose shapes differ between processes: said on every process, naming each one's
    shapes, instead of the hang or the transport error the collective itself would end in."""


def _debug() -> bool:
    # the state's flag as set, without building a state (PartialState() would initialise one)
    return bool(PartialState._shared_state.get("debug")) and _distributed()


def _shapes(data: Any) -> list[tuple[int, ...]]:
    found: list[tuple[int, ...]] = []
    recursively_apply(lambda t: found.append(tuple(t.shape)), data)
    return found


def _verify(operation: str, shapes: list) -> None:
    """Debug mode: every process passed the same ``shapes``, or one exception on every process."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, shapes)
    if any(s != every[0] for s in every):
        per = "; ".join(f"process {i}: {s}" for i, s in enumerate(every))
        raise DistributedOperationException(
            f"{operation}: the tensors' shapes differ between processes ({per}); every process must pass "
            "tensors of one shape (pad_across_processes pads them along one dimension)"
        )


def is_torch_tensor(data: Any) -> bool:
    return isinstance(data, torch.Tensor)


def recursively_apply(
    fn: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """``fn(leaf, *args, **kwargs)`` on every leaf of nested lists/tuples/dicts for which
    ``test_type`` holds; other leaves are kept, or with ``error_on_other_type`` refused (TypeError)."""
    if isinstance(data, (list, tuple)):
        out = [
            recursively_apply(fn, d, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs)
            for d in data
        ]
        return type(data)(*out) if hasattr(data, "_fields") else type(data)(out)
    if isinstance(data, dict):
        return type(data)(
            {
                k: recursively_apply(
                    fn, v, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
                )
                for k, v in data.items()
            }
        )
    if test_type(data):
        return fn(data, *args, **kwargs)
    if error_on_other_type:
        # Accelerate's wording, which its users and tests match
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{getattr(fn, '__name__', fn)}`. Only nested list/tuple/dicts "
            f"of objects that are valid for `{getattr(test_type, '__name__', test_type)}` should be passed."
        )
    return data


def send_to_device(data: Any, device: torch.device, non_blocking: bool = True, skip_keys: Any = None) -> Any:
    """Every tensor in ``data`` to ``device``; entries of a mapping named in ``skip_keys`` (a key
    or a list of keys, Accelerate's argument) stay where they are."""
    if skip_keys is not None and isinstance(data, dict):
        skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys)
        return type(data)(
            {k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys) for k, v in data.items()}
        )
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)


def to_fp32(data: Any) -> Any:
    """fp16/bf16 outputs to float32 (the model's interior stays low precision)."""
    return recursively_apply(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, data)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gather_one(t: torch.Tensor) -> torch.Tensor:
    if not _distributed():
        return t
    t = t.contiguous()
    if t.ndim == 0:
        t = t[None]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out, dim=0)


def gather(data: Any) -> Any:
    """Concatenate each tensor across processes along dim 0 (scalars become shape [world])."""
    if _debug():
        _verify("gather", _shapes(data))
    return recursively_apply(_gather_one, data)


def reduce(data: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Every tensor of ``data`` reduced across processes: ``"sum"``, ``"mean"`` (the default, as
    Accelerate's ``utils.reduce``; ``Accelerator.reduce``'s is ``"sum"``), ``"max"``, or ``"none"``
    (this process's copy), then times ``scale``."""
    if reduction not in ("sum", "mean", "max", "none"):
        raise ValueError(f"reduction={reduction!r}; use 'sum', 'mean', 'max' or 'none'")
    if _debug():
        _verify("reduce", _shapes(data))

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if _distributed() and reduction != "none":
            dist.all_reduce(t, op=dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM)
            if reduction == "mean":
                t = t / dist.get_world_size()
        return t * scale if scale != 1.0 else t

    return recursively_apply(one, data)


def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along ``dim`` to the largest size across processes (so it can be gathered)."""
    if _debug():  # the sizes along dim may differ; the number of dimensions may not
        _verify("pad_across_processes", [(len(s),) for s in _shapes(data)])

    def one(t: torch.Tensor, dim: int = dim) -> torch.Tensor:
        if t.is_nested:
            warnings.warn(
                "pad_across_processes: a nested tensor has no single size to pad along; returned unpadded",
                CannotPadNestedTensorWarning,
                stacklevel=3,
            )
            return t
        if not _distributed() or not -t.ndim <= dim < t.ndim:
            return t
        dim %= t.ndim
        size = torch.tensor([t.shape[dim]], device=t.device)
        sizes = _gather_one(size)
        longest = int(sizes.max())
        if longest == t.shape[dim]:
            return t
        shape = list(t.shape)
        shape[dim] = longest
        out = t.new_full(shape, pad_index)
        idx = [slice(None)] * t.ndim
        idx[dim] = slice(longest - t.shape[dim], longest) if pad_first else slice(0, t.shape[dim])
        out[tuple(idx)] = t
        return out

    return recursively_apply(one, data)


def has_tensor(data: Any) -> bool:
    """Whether a (nested list / tuple / dict) structure holds any tensor."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return any(has_tensor(d) for d in data)
    if isinstance(data, dict):
        return any(has_tensor(v) for v in data.values())
    return False


def gather_object(obj: Any) -> list:
    """All processes' picklable objects, flattened one level (lists are concatenated)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(obj) if isinstance(obj, (list, tuple)) else [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    flat: list = []
    for part in out:
        flat.extend(part if isinstance(part, (list, tuple)) else [part])
    return flat


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Every tensor (nested) takes process ``from_process``'s value, in place; returned too."""
    if _debug():
        _verify("broadcast", _shapes(data))

    def one(t: torch.Tensor) -> torch.Tensor:
        if _distributed():
            dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(one, data)


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Picklable objects from process ``from_process``, into ``object_list`` in place."""
    if _distributed():
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list
