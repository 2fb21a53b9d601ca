"""One input, several Linears: q/k/v (and gate/up) read the same tensor, so cast it once.

A Llama block feeds one normalised hidden state to ``q_proj``, ``k_proj`` and ``v_proj``, and
another to ``gate_proj`` and ``up_proj``. With the same recipe and scale those casts are the
same computation on the same values, so the second and third layers take the first one's
result: the FP8 tensor(s), and on the CPU path its exact bf16 upcast. Backward gains too: the
layers save *one* FP8 copy of the input between them instead of one each, and on CPU the
weight-gradient GEMMs upcast that copy once (:func:`shared_upcast`).

What makes two casts "the same" (:func:`cast_key`): the same tensor object at the root of the
view (``x.reshape(-1, K)`` is a fresh view per layer), the same geometry and dtype, an unchanged
version counter (no in-place write in between), and the same cast: FP8 dtype, granularity,
recipe fields the cast reads, the scale handed in (delayed scaling: each layer's own, compared
by value on the host) and whether the second layout is wanted. Anything else is a miss and the
layer casts as before, so results are bit-identical with and without sharing
(``tests/test_fp8_shared_cast.py``).

Lifetime: one slot per thread holds the last cast (a weak reference to its input, never keeping
it alive). It is replaced by the next Linear that reads another tensor and dropped when its
input dies, so at most one cast (and one bf16 upcast) is held beyond what autograd saves.
Skipped under ``torch.compile`` (the graph is traced once; host reads would break it), for
tensors made under ``torch.inference_mode()`` (they keep no version counter) and when
``LOWPREC_SHARE_CASTS=0``.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import torch

__all__ = ["cast_key", "lookup", "store", "amax", "shared_upcast", "enabled"]

_LOCAL = threading.local()
# saved FP8 inputs read by more than one Linear: id(data) -> (weakref to data, [bf16 upcast])
_SHARED_SAVED: dict[int, tuple[weakref.ref, list]] = {}


def enabled() -> bool:
    return os.environ.get("LOWPREC_SHARE_CASTS", "1") != "0" and not torch.compiler.is_compiling()


def _root(x: torch.Tensor) -> torch.Tensor:
    return x._base if x._base is not None else x


def _identity(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device, x._version)


def cast_key(spec: Any, recipe: Any, scale: torch.Tensor | None, dual: bool) -> tuple | None:
    """What the cast depends on besides the values; ``None`` where it cannot be keyed cheaply
    (a scale tensor off the CPU would need a device sync to compare) or sharing is off."""
    if not enabled():
        return None
    if scale is None:
        scale_value = None
    elif scale.device.type == "cpu" and scale.dim() == 0:
        scale_value = scale.item()
    else:
        return None
    return (spec, recipe.margin, recipe.power_of_2_scales, recipe.block_size, scale_value, dual)


class _Slot:
    """The last cast: a weak reference to its input's root, that input's geometry and version,
    and ``box`` = [key, (row-major cast, column-major cast), host amax]. The box is emptied when
    the input dies (the weakref's callback holds the box, not the slot: no reference cycle, so
    a replaced slot frees its tensors at once)."""

    __slots__ = ("ref", "identity", "box")

    def __init__(self, x: torch.Tensor) -> None:
        box: list = [None, None, None]
        self.box = box
        self.ref = weakref.ref(_root(x), lambda _r: box.__setitem__(slice(None), [None, None, None]))
        self.identity = _identity(x)

    def matches(self, x: torch.Tensor) -> bool:
        return self.ref() is _root(x) and self.identity == _identity(x)


def _trackable(x: torch.Tensor) -> bool:
    """Whether an in-place write to ``x`` would show in its version counter: not for a tensor
    made under ``torch.inference_mode()``, which keeps none, so its casts are not shared."""
    return not x.is_inference()


def _slot(x: torch.Tensor) -> _Slot | None:
    slot = getattr(_LOCAL, "slot", None)
    return slot if slot is not None and slot.matches(x) else None


def _slot_for(x: torch.Tensor) -> _Slot:
    slot = _slot(x)
    if slot is None:
        slot = _LOCAL.slot = _Slot(x)
    return slot


def lookup(x: torch.Tensor, key: tuple | None) -> Any:
    """The cast stored for ``x`` under ``key``: (row-major cast, column-major cast or None), or
    ``None``. A hit marks the column-major cast, the one saved for the weight gradient, as
    shared, so that backward upcasts it once (:func:`shared_upcast`)."""
    if key is None or not _trackable(x):
        return None
    slot = _slot(x)
    if slot is None or slot.box[0] != key:
        return None
    value = slot.box[1]
    if value[1] is not None:
        _mark_shared(value[1].data)
    return value


def store(x: torch.Tensor, key: tuple | None, value: Any) -> None:
    if key is None or not _trackable(x):
        return
    box = _slot_for(x).box
    box[0], box[1] = key, value


def amax(x: torch.Tensor, compute) -> float:
    """``compute(x)`` (a host amax), once per tensor while it is the slot's input."""
    if not enabled() or not _trackable(x):
        return compute(x)
    box = _slot_for(x).box
    if box[2] is None:
        box[2] = compute(x)
    return box[2]


def _mark_shared(data: torch.Tensor) -> None:
    key = id(data)
    if key not in _SHARED_SAVED:

        def forget(_ref: weakref.ref, key: int = key) -> None:
            _SHARED_SAVED.pop(key, None)

        _SHARED_SAVED[key] = (weakref.ref(data, forget), [None])


def shared_upcast(q: Any, upcast) -> None:
    """Give ``q`` (a saved FP8 operand about to feed a CPU GEMM) the bf16 upcast made by an
    earlier backward that read the same saved tensor, or make it and keep it for the next one.
    The upcast lives until the saved tensor does: until the last of those backwards ran."""
    if q.bf16_cache is not None or torch.compiler.is_compiling():
        return
    entry = _SHARED_SAVED.get(id(q.data))
    if entry is None or entry[0]() is not q.data:
        return
    if entry[1][0] is None:
        entry[1][0] = upcast(q.data)
    q.bf16_cache = entry[1][0]
