"""Float8BaseLinear: a frozen Linear whose weight exists only in FP8, as an FP8 checkpoint stores
it (hf-fp8 / DeepSeek-V3 layout: E4M3 values, one float32 ``weight_scale_inv`` per block): 1 byte
per weight plus 4 bytes per block, no high-precision copy. A base for LoRA adapters.

GEMMs (``x``: (M, K), ``W``: stored (N, K), ``dY``: (M, N)); the stored scales are used as they are:

==============  ==========================  ===========================  =========
GEMM            A operand                   B operand                    output
==============  ==========================  ===========================  =========
output          x, E4M3, 1 x b tiles        W^T, stored b x b blocks     hp
grad_input      dY, E4M3, 1 x b tiles       W, stored b x b blocks       hp
grad_weight     none: the weight is frozen
==============  ==========================  ===========================  =========

hp: the ``torch.autocast`` dtype, else the input's. The activation casts are the blockwise
recipe's (power-of-two scales), so on CPU the GEMM is the exact bf16 upcast when the stored
scales are powers of two too (a lowprec blockwise export), the emulated one otherwise. Inside
``fp8.autocast(enabled=False)`` the weight is dequantized for that call and the GEMM runs in
high precision.

Storage survives ``model.float()`` / ``.to(bfloat16)``: the E4M3 bytes are a ``uint8``
Parameter (``requires_grad=False``) and the scales their float32 bits in an ``int32`` buffer,
dtypes those casts leave alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.fp8.autocast import fp8_enabled, torch_autocast_dtype, torch_autocast_off
from lowprec.fp8.gemm import scaled_mm
from lowprec.fp8.quantize import Float8Data, quantize

__all__ = ["Float8BaseLinear"]

E4M3 = torch.float8_e4m3fn


def _pow2(t: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(t)
    return bool((mantissa.abs() == 0.5).all())


class _BaseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w: Float8Data, block: int, hp: torch.dtype):
        with torch_autocast_off(x.device.type):
            xq = quantize(x, E4M3, "block", block=(1, block), power_of_2=True)
            out = scaled_mm(xq, w.t(), hp)
        ctx.w, ctx.block, ctx.hp, ctx.x_dtype = w, block, hp, x.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        with torch_autocast_off(dy.device.type):
            dyq = quantize(dy.contiguous(), E4M3, "block", block=(1, ctx.block), power_of_2=True)
            grad_x = scaled_mm(dyq, ctx.w, ctx.hp)
        return grad_x.to(ctx.x_dtype), None, None, None


class Float8BaseLinear(nn.Linear):
    """A frozen ``nn.Linear`` (peft wraps it as one) holding ``weight`` as stored E4M3 bytes and
    ``weight_scale_inv`` (``w = q * scale_inv`` per ``block x block`` tile; the grid may round up)."""

    weight_scale_bits: torch.Tensor  # a buffer: the float32 scale_inv's bits (int32 survives .float())
    bias: nn.Parameter | None  # type: ignore[assignment]  # nn.Linear's stub says Parameter; None is allowed

    def __init__(
        self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None, block: int = 128
    ) -> None:
        nn.Module.__init__(self)
        if weight.dtype != E4M3 or weight.dim() != 2:
            raise ValueError(
                f"Float8BaseLinear needs a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        grid = (-(-self.out_features // block), -(-self.in_features // block))
        if tuple(weight_scale_inv.shape) != grid:
            raise ValueError(
                f"weight_scale_inv {tuple(weight_scale_inv.shape)} is not the {block}x{block} block grid "
                f"{grid} of a {tuple(weight.shape)} weight"
            )
        self.block = block
        self.weight = nn.Parameter(weight.contiguous().view(torch.uint8), requires_grad=False)
        self.register_buffer("weight_scale_bits", weight_scale_inv.to(torch.float32).contiguous().view(torch.int32))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.pow2 = _pow2(weight_scale_inv.float())

    def fp8_weight(self) -> Float8Data:
        """The stored weight as the engine's ``Float8Data`` (``scale = 1 / scale_inv``)."""
        scale_inv = self.weight_scale_bits.view(torch.float32)
        return Float8Data(
            self.weight.view(E4M3), torch.reciprocal(scale_inv), "block", (self.block, self.block), self.pow2
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fp8_weight()
        if not fp8_enabled() or x.numel() == 0:
            out = F.linear(x, w.dequantize(x.dtype))
        else:
            hp = torch_autocast_dtype(x.device.type, x.dtype)
            out = _BaseFn.apply(x.reshape(-1, x.shape[-1]), w, self.block, hp).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, E4M3 {self.block}x{self.block} blocks, frozen"
