"""What the CUDA dispatch believes about the device, and a way to say it for a trace.

The FP8 engine picks its CUDA path from two facts: the GPU's compute capability (which
``torch._scaled_mm`` granularities run, :func:`lowprec.fp8.gemm.dispatch.native_scaled_mm_available`)
and whether the fused Triton casts run (:func:`lowprec.fp8.kernels.available`). On a machine
without a GPU both answers are "no", so a fake-tensor trace on device ``"cuda"`` would follow
a path no GPU takes. ``trace_as`` states the answers for the duration of a block, and makes
the dispatch treat ``meta`` tensors as tensors on that GPU:

    with fp8.trace_as(sm=(9, 0), triton=True):
        x = torch.empty(m, k, device="meta", dtype=torch.bfloat16)
        ...  # the path an H100 with triton takes; nothing runs

Why ``meta`` and not fake tensors on device ``"cuda"``: forward alone would trace either way,
but autograd records each tensor's device stream when it builds the graph, and a CPU build of
torch has no CUDA device guard to ask ("PyTorch is not linked with support for cuda devices"),
so a backward pass on fake CUDA tensors aborts the process. Meta tensors carry shapes, dtypes
and strides, run every op's meta kernel (the same one FakeTensorMode runs) and go through
autograd; the custom ops' fake implementations serve the meta device too.

It changes decisions only, never numerics, and is meant for tracing (benchmarks/traffic.py,
tests/test_traffic.py); a real run under it on a different GPU would pick kernels that GPU may
not have. Process-wide (not per thread): tracing is single-threaded.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

__all__ = [
    "trace_as",
    "traced",
    "is_cuda",
    "cuda_capability",
    "triton_override",
    "triton_findable",
    "meta_out_kernel",
]


@dataclass(frozen=True)
class _Trace:
    sm: tuple[int, int]
    triton: bool


_ACTIVE: list[_Trace] = []  # a stack: nested trace_as blocks restore the outer one
_CAPABILITY: dict[int | None, tuple[int, int]] = {}


def triton_findable() -> bool:
    """Whether ``import triton`` would find the package (``find_spec``: nothing is imported;
    ``kernels.select`` caches the answer at import as ``triton_importable``)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or half-installed package
        return False


@contextmanager
def trace_as(sm: tuple[int, int] = (9, 0), triton: bool = True) -> Iterator[None]:
    """Make the CUDA dispatch decide as on a GPU of compute capability ``sm``, with (or
    without) the fused Triton casts. ``triton=True`` needs triton importable (the fused ops'
    fake implementations come from it); ``LOWPREC_DISABLE_TRITON`` is ignored inside."""
    given = tuple(int(v) for v in sm)
    if len(given) != 2:
        raise ValueError(f"trace_as(sm=...) takes (major, minor), e.g. (9, 0); got {given!r}")
    sm = (given[0], given[1])
    if triton:
        if not triton_findable():
            raise RuntimeError(
                "trace_as(triton=True) needs triton installed (pip install triton); or pass triton=False"
            )
    _ACTIVE.append(_Trace(sm, bool(triton)))
    try:
        yield
    finally:
        _ACTIVE.pop()


def traced() -> bool:
    """True inside :func:`trace_as` (the dispatch then skips anything that runs a kernel,
    such as the fused casts' first-use self-check)."""
    return bool(_ACTIVE)


def is_cuda(device: torch.device) -> bool:
    """A CUDA device, or inside :func:`trace_as` a ``meta`` one (standing for the traced GPU)."""
    return device.type == "cuda" or (device.type == "meta" and bool(_ACTIVE))


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA device: the traced one inside :func:`trace_as`, else the
    real one (asked once per device index and cached)."""
    if _ACTIVE:
        return _ACTIVE[-1].sm
    if device.index not in _CAPABILITY:
        _CAPABILITY[device.index] = torch.cuda.get_device_capability(device)
    return _CAPABILITY[device.index]


def triton_override() -> bool | None:
    """Inside :func:`trace_as`: whether the trace runs with the fused Triton casts; else None."""
    return _ACTIVE[-1].triton if _ACTIVE else None


_DEVICE_CONSTANTS: dict[tuple, torch.Tensor] = {}


def device_constant(key: tuple, device: torch.device, make: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
    """A small constant tensor (a lookup table, a transform) on ``device``, made there once per
    ``(key, device)`` by ``make(device)`` and shared (not for in-place use): made on the host in every step, its copy
    to a GPU would make the step wait. Made afresh on ``meta`` and while ``torch.compile`` traces
    (a Python-side store is no graph op)."""
    device = torch.device(device)
    if device.type == "meta" or torch.compiler.is_compiling():
        return make(device)
    full = (*key, device)
    found = _DEVICE_CONSTANTS.get(full)
    if found is None:
        found = _DEVICE_CONSTANTS[full] = make(device)
    return found


_META_OUT: dict[str, torch.library.Library] = {}  # out= overloads given a meta kernel here, and their library


def meta_out_kernel(name: str, functional: Callable) -> None:
    """Give the out= overload ``name`` (``"aten::op.out"``) a meta kernel where torch has none (2.13:
    ``_scaled_mm.out``, ``_scaled_mm_v2.out``), once: it runs ``functional``'s meta (the same
    argument checks) and returns ``out`` where it fits, so a trace on meta tensors takes the path a
    GPU takes."""
    if name in _META_OUT or torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
        return

    def meta(*args, out, **kwargs):
        res = functional(*args, **kwargs)
        torch._check(res.shape == out.shape and res.dtype == out.dtype, lambda: f"{name}: out does not fit")
        return out

    lib = torch.library.Library("aten", "IMPL")
    lib.impl(name.split("::")[1], meta, "Meta")
    _META_OUT[name] = lib
