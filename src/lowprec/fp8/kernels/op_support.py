"""What the ``torch.library`` operators around the Triton kernels share (:mod:`.ops`,
:mod:`.ops_nvfp4`; imports triton: load lazily): the operator decorator (opaque custom ops whose
fake runs the body without launching, or ``triton_op`` with ``LOWPREC_INDUCTOR_KERNELS=1``: see
:mod:`.ops`), whether the kernels run in Triton's interpreter, the (input class, op) pairs
that run as two passes after a device self-check, and the launch arguments the cast kernels share.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from torch.library import triton_op, wrap_triton

from lowprec.fp8.cast.formats import fp8_max
from lowprec.fp8.kernels.classes import INPUT_DTYPES, input_class
from lowprec.fp8.kernels.triton_cast import cast_transpose_amax_kernel

__all__ = ["TRACED", "INDUCTOR_KERNELS_ENV", "interpreting", "set_two_pass", "two_pass"]

# Inductor traces into the operators and compiles the kernels itself only when asked (see above)
INDUCTOR_KERNELS_ENV = "LOWPREC_INDUCTOR_KERNELS"
TRACED = os.environ.get(INDUCTOR_KERNELS_ENV, "").strip().lower() in ("1", "true", "yes", "on")
_FAKE = [False]  # True while an operator's fake implementation runs its body: no launches


@contextlib.contextmanager
def _no_launch() -> Iterator[None]:
    _FAKE[0] = True
    try:
        yield
    finally:
        _FAKE[0] = False


def _skip(t: torch.Tensor) -> bool:
    """No launch: a trace (``fp8.trace_as``: meta tensors carry shapes only) or a fake run."""
    return _FAKE[0] or t.device.type == "meta"


def _kernel(k):
    """What to launch ``k`` through: ``wrap_triton`` (so a trace records it) in the traced form,
    else the kernel itself (the operator is opaque; its own launch is the checked binary)."""
    return wrap_triton(k) if TRACED else k


def _operator(name: str, mutates_args, opaque: bool = False) -> Callable:
    """``triton_op`` (traced form) or an opaque ``custom_op`` whose fake runs the same body
    without launching (outputs get their shapes, dtypes and strides from the body). ``opaque``:
    a custom op in the traced form too (a body that reads its tensors' addresses, which a trace's
    fake tensors have none of)."""

    def wrap(fn: Callable):
        if TRACED and not opaque:
            return triton_op(name, mutates_args=mutates_args)(fn)
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)

        def fake(*args, **kwargs):
            with _no_launch():
                return fn(*args, **kwargs)

        op.register_fake(fake)
        return op

    return wrap


# Decided once, from the kernel objects themselves: under ``TRITON_INTERPRET=1`` at import
# ``triton.jit`` returns an InterpretedFunction, whatever the variable says later.
_INTERPRETED = type(cast_transpose_amax_kernel).__name__ == "InterpretedFunction"


# (input class, op) pairs that run as two launches, one store each (the plain layout, then the
# transposed one), because their one-pass kernel failed the device self-check for that class
# (selfcheck.TWO_PASS_OPS). Process-wide: one GPU model per process is assumed.
_TWO_PASS: set[tuple] = set()


def set_two_pass(cls: tuple, name: str, on: bool) -> None:
    """Inputs of class ``cls`` (``classes.input_class``): run the op ``name`` as two passes, or not."""
    (_TWO_PASS.add if on else _TWO_PASS.discard)((cls, name))


def two_pass(name: str, x: torch.Tensor) -> bool:
    return (input_class(x), name) in _TWO_PASS


def interpreting() -> bool:
    """True when the kernels run in Triton's CPU interpreter (tests): use the software FP8
    convert, since the interpreter's own is not round-to-nearest-even."""
    return _INTERPRETED


def _dims(x: torch.Tensor) -> tuple[int, ...]:
    """``(rows, cols, row stride, column stride)`` of a 2-D ``x``: the ``M, N, stride_xm, stride_xn``
    every cast kernel takes after its pointers."""
    return (*x.shape, *x.stride())


def _fp8_args(fp8_dtype: torch.dtype, soft_cast: bool | None = None) -> dict:
    """The format constants of the FP8 cast kernels: ``FP8_MAX``, ``E4M3`` and ``SOFT_CAST`` (the
    software convert, by default under the interpreter)."""
    return dict(
        FP8_MAX=fp8_max(fp8_dtype),
        E4M3=fp8_dtype == torch.float8_e4m3fn,
        SOFT_CAST=interpreting() if soft_cast is None else soft_cast,
    )


def _filled(*outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``outputs`` with each None replaced by the first given one (all None where none is): a
    kernel takes a pointer for every output, and writes only those its flags ask for."""
    first = next((t for t in outputs if t is not None), None)
    return tuple(first if t is None else t for t in outputs)


def _row_col_outputs(q, s, qt, st) -> tuple[torch.Tensor, ...]:
    """``(q, s, qt, st)``, the row outputs (data, scales) and the column ones, with the pair left
    out (its data None) filled with the other pair: what the MX and NVFP4 cast kernels take."""
    rows = (q, s) if q is not None else (qt, st)
    cols = (qt, st) if qt is not None else (q, s)
    return (*rows, *cols)


def _check(x: torch.Tensor, fp8_dtype: torch.dtype) -> None:
    if x.dim() != 2:
        raise ValueError(
            f"the fused FP8 cast takes a 2-D tensor, got shape {tuple(x.shape)}; reshape to (-1, last_dim)"
        )
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"the fused FP8 cast takes bfloat16/float16/float32 input, got {x.dtype}")
    fp8_max(fp8_dtype)  # raises a clear ValueError for a non-FP8 dtype
