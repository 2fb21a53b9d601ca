"""O1 weight gradients held in FP8 between backward and the optimizer step.

A post-accumulate-grad hook on each parameter quantizes the freshly accumulated ``.grad`` to
FP8 (per-tensor scale, from ``lowprec.fp8.cast.quantize``) and sets ``.grad = None``, so the
high-precision gradient of a parameter lives only from its own accumulation to its hook. At the
end of backward the model's gradients occupy 1 byte per element (plus 4 bytes of scale per
tensor) instead of 2 (bf16) or 4 (fp32). Gradient accumulation over micro-batches works: the
hook adds the held FP8 gradient to the new one and re-quantizes (one extra rounding per
micro-batch).

Who reads the FP8 gradients:

* :class:`lowprec.optim.FP8AdamW` reads them directly (:func:`held_grad`);
* any other optimizer gets them back as ``.grad`` through a step pre-hook
  (:func:`materialize_grads`), and the FP8 copies are dropped after its step;
* :func:`clip_grad_norm_` clips them in place by scaling the *scales* (no dequantize pass).
  ``torch.nn.utils.clip_grad_norm_`` does not see them (``.grad`` is None): call
  ``materialize_grads`` first or use ours.

Not for DDP: DDP owns its gradient buckets, so under DDP the FP8 part of O1 is the FP8
all-reduce hook (``lowprec.distributed``) instead.

``hold=False`` rounds ``.grad`` through FP8 in place instead (same numerics, no memory saved):
for code that must see ``.grad`` between backward and step, such as ``GradScaler.unscale_``
or a plain ``torch.nn.utils.clip_grad_norm_``, which would otherwise see no gradients.
"""

from __future__ import annotations

from typing import Iterable

import torch

from lowprec.fp8.cast.quantize import Float8Data, dequantize, quantize_tensorwise

__all__ = [
    "FP8_GRAD_ATTR",
    "GRAD_DTYPES",
    "FP8GradHandles",
    "hold_grads_in_fp8",
    "fp8_grad",
    "held_grad",
    "materialize_grads",
    "clear_fp8_grads",
    "clip_grad_norm_",
]

FP8_GRAD_ATTR = "_lowprec_fp8_grad"
GRAD_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_grad(p: torch.Tensor) -> Float8Data | None:
    """The FP8 gradient held for ``p`` (None when there is none)."""
    return getattr(p, FP8_GRAD_ATTR, None)


def held_grad(p: torch.Tensor) -> Float8Data | None:
    """The held FP8 gradient of ``p``, checking that ``.grad`` was not set behind our back.

    Both at once means something wrote ``.grad`` after our hook ran. In practice that is
    DistributedDataParallel applied *after* ``apply_opt_level``: DDP writes the all-reduced
    gradient into ``.grad`` while we hold the local, un-reduced one. Adding the two would be
    silently wrong, so this is an error.
    """
    held = fp8_grad(p)
    if held is not None and p.grad is not None:
        raise ValueError(
            "a parameter has both .grad and an FP8 gradient held by apply_opt_level: the model "
            "was most likely wrapped in DistributedDataParallel after apply_opt_level (or "
            "apply_opt_level was given ddp.module). Call apply_opt_level on the DDP-wrapped "
            "model, which then uses the FP8 all-reduce hook instead of holding gradients"
        )
    return held


def _make_hook(dtype: torch.dtype, hold: bool):
    def hook(p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if not hold:
            g.copy_(dequantize(quantize_tensorwise(g, dtype), g.dtype))
            return
        held = fp8_grad(p)
        if held is not None:  # accumulation over micro-batches
            g = g.to(torch.float32) + dequantize(held)
        setattr(p, FP8_GRAD_ATTR, quantize_tensorwise(g, dtype))
        p.grad = None

    return hook


class FP8GradHandles:
    """Hook handles returned by :func:`hold_grads_in_fp8`; ``remove()`` undoes it."""

    def __init__(self, params: list[torch.nn.Parameter], handles: list, dtype: torch.dtype):
        self.params = params
        self.handles = handles
        self.dtype = dtype

    def remove(self) -> None:
        materialize_grads(self.params)
        for h in self.handles:
            h.remove()
        self.handles = []


def hold_grads_in_fp8(
    params: Iterable[torch.nn.Parameter],
    dtype: torch.dtype = torch.float8_e4m3fn,
    hold: bool = True,
) -> FP8GradHandles:
    """Register the FP8 gradient hooks on every parameter that requires grad (``hold=False``:
    round ``.grad`` through FP8 in place instead of holding it)."""
    if dtype not in GRAD_DTYPES:
        raise ValueError(f"grad dtype {dtype} is not an FP8 dtype; use torch.float8_e4m3fn or torch.float8_e5m2")
    params = [p for p in params if p.requires_grad]
    handles = [p.register_post_accumulate_grad_hook(_make_hook(dtype, hold)) for p in params]
    return FP8GradHandles(params, handles, dtype)


def materialize_grads(params: Iterable[torch.Tensor]) -> None:
    """Move held FP8 gradients back into ``.grad`` (in the parameter's dtype)."""
    for p in params:
        held = held_grad(p)
        if held is None:
            continue
        p.grad = dequantize(held, p.dtype)
        setattr(p, FP8_GRAD_ATTR, None)


def clear_fp8_grads(params: Iterable[torch.Tensor]) -> None:
    for p in params:
        if fp8_grad(p) is not None:
            setattr(p, FP8_GRAD_ATTR, None)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over both ``.grad`` and held FP8 gradients.

    FP8 gradients are clipped by dividing their scale by the clip factor, which is exact and
    touches 4 bytes per tensor. Returns the total norm (float32).
    """
    params = [p for p in params]
    norms = []
    for p in params:
        held = held_grad(p)
        if p.grad is not None:
            norms.append(torch.linalg.vector_norm(p.grad.float(), norm_type))
        if held is not None:
            norms.append(torch.linalg.vector_norm(dequantize(held), norm_type))
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
        held = fp8_grad(p)
        if held is not None:
            setattr(p, FP8_GRAD_ATTR, Float8Data(held.data, held.scale / coef, "tensor"))
    return total
