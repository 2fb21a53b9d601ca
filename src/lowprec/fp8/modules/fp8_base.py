"""Float8BaseLinear: a frozen Linear whose weight exists only in FP8, as an FP8 checkpoint stores
it: E4M3 values and float32 dequantization scales (``w = q * scale``) at one of three
granularities: ``block`` (hf-fp8 / DeepSeek-V3 ``weight_scale_inv``, or compressed-tensors'
block strategy: one per ``b x b`` tile), ``channel`` (compressed-tensors: one per output row)
or ``tensor`` (compressed-tensors: one). 1 byte per weight plus the scales, no high-precision
copy. A base for LoRA adapters.

GEMMs (``x``: (M, K), ``W``: stored (N, K), ``dY``: (M, N)); the stored scales are used as they are:

==============  ============================================  ========================  ======
GEMM            A operand                                     B operand                 output
==============  ============================================  ========================  ======
output block    x, E4M3, 1 x b tiles (power-of-two scales)    W^T, stored b x b blocks  hp
output channel  x, E4M3, a power-of-two scale per row         W^T, stored row scales    hp
output tensor   x, E4M3, one scale                            W^T, stored scale         hp
grad_in block   dY, E4M3, 1 x b tiles (power-of-two scales)   W, stored b x b blocks    hp
grad_in chan.   dY * w_scale (per column), E4M3 per row       W's bytes, unit scale     hp
grad_in tensor  dY, E5M2, one scale                           W, stored scale           hp
grad_weight     none: the weight is frozen
==============  ============================================  ========================  ======

The activation and gradient casts are those of the training recipe with the weight's
granularity (blockwise, rowwise, tensorwise), so a lowprec export of such a run loads as a base
whose forward is the trained model's FP8 forward bit for bit (and, for blockwise, its input
gradient).

Per-channel scales lie along the input-gradient GEMM's contraction dim (N), where no scaled GEMM
takes a vector of scales, so they are folded into dY before its cast: ``dY @ diag(s) @ q`` =
``(dY * s) @ q``, then ``q`` enters with a unit scale (exact: only the cast of ``dY * s`` rounds).

hp: the ``torch.autocast`` dtype, else the input's. On CPU a block GEMM is the exact bf16 upcast
when the stored scales are powers of two too (as a lowprec blockwise export's are), the emulated
one otherwise; tensor / channel GEMMs take the exact upcast with the scales on the output. Inside
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

from lowprec.fp8.modules.autocast import fp8_enabled, torch_autocast_dtype, torch_autocast_off
from lowprec.fp8.gemm import compile_guard
from lowprec.fp8.gemm.dispatch import scaled_mm
from lowprec.fp8.cast.quantize import Float8Data, quantize

__all__ = ["Float8BaseLinear", "BASE_GRANULARITIES"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
BASE_GRANULARITIES = ("tensor", "channel", "block")


def _pow2(t: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(t)
    return bool((mantissa.abs() == 0.5).all())


def _cast(t: torch.Tensor, granularity: str, block: int, grad: bool = False) -> Float8Data:
    """An activation or output gradient (M, K) in FP8 as the training recipe of the same weight
    granularity casts it: blockwise (E4M3, 1 x b tiles, power-of-two scales), rowwise (E4M3, a
    power-of-two scale per row), tensorwise (one scale; E4M3, gradients E5M2)."""
    if granularity == "block":
        return quantize(t, E4M3, "block", block=(1, block), power_of_2=True)
    if granularity == "channel":
        return quantize(t, E4M3, "axis", dim=1, power_of_2=True)
    return quantize(t, E5M2 if grad else E4M3, "tensor")


class _BaseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w: Float8Data, granularity: str, block: int, hp: torch.dtype):
        with torch_autocast_off(x.device.type):
            out = scaled_mm(_cast(x, granularity, block), w.t(), hp)
        ctx.w, ctx.granularity, ctx.block, ctx.hp, ctx.x_dtype = w, granularity, block, hp, x.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        w = ctx.w
        with torch_autocast_off(dy.device.type):
            dy = dy.contiguous()
            if ctx.granularity == "channel":  # fold the row scales (along N, the contraction) into dY
                dy = dy.float() * torch.reciprocal(w.scale).reshape(1, -1)
                w = Float8Data(w.data, w.scale.new_ones(()), "tensor")
            grad_x = scaled_mm(_cast(dy, ctx.granularity, ctx.block, grad=True), w, ctx.hp)
        return grad_x.to(ctx.x_dtype), None, None, None, None


class Float8BaseLinear(nn.Linear):
    """A frozen ``nn.Linear`` (peft wraps it as one) holding ``weight`` as stored E4M3 bytes and
    its dequantization scales (``w = q * scale``): ``granularity`` ``block`` (``block x block``
    tiles; the grid may round up), ``channel`` ((out, 1) or (out,)) or ``tensor`` (one value).
    ``transposed``: the checkpoint stores the weight (in, out) (transformers' Conv1D); the layer
    holds it (out, in) and a writer transposes it back."""

    weight_scale_bits: torch.Tensor  # a buffer: the float32 scales' bits (int32 survives .float())
    bias: nn.Parameter | None  # type: ignore[assignment]  # nn.Linear's stub says Parameter; None is allowed

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale_inv: torch.Tensor,
        bias: torch.Tensor | None = None,
        block: int = 128,
        *,
        granularity: str = "block",
        transposed: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        if weight.dtype != E4M3 or weight.dim() != 2:
            raise ValueError(
                f"Float8BaseLinear needs a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}"
            )
        if granularity not in BASE_GRANULARITIES:
            raise ValueError(f"Float8BaseLinear: granularity {granularity!r}; choose one of {BASE_GRANULARITIES}")
        self.out_features, self.in_features = weight.shape
        scale = weight_scale_inv.to(torch.float32)
        if granularity == "block":
            want: tuple[int, ...] = (-(-self.out_features // block), -(-self.in_features // block))
            ok = tuple(scale.shape) == want
            what = f"the {block}x{block} block grid {want}"
        elif granularity == "channel":
            want, ok = (self.out_features, 1), scale.numel() == self.out_features and scale.dim() <= 2
            what = f"one scale per output row {want}"
            scale = scale.reshape(want)
        else:
            want, ok = (), scale.numel() == 1
            what = "one scale"
            scale = scale.reshape(want)
        if not ok:
            raise ValueError(
                f"weight scale {tuple(weight_scale_inv.shape)} is not {what} of a {tuple(weight.shape)} weight"
            )
        self.granularity, self.block, self.transposed = granularity, block, transposed
        self.weight = nn.Parameter(weight.contiguous().view(torch.uint8), requires_grad=False)
        self.register_buffer("weight_scale_bits", scale.contiguous().view(torch.int32))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.pow2 = _pow2(scale)

    def stored_scale(self) -> torch.Tensor:
        """The dequantization scales as stored (float32; ``()``, ``(out, 1)`` or the block grid)."""
        return self.weight_scale_bits.view(torch.float32)

    def fp8_weight(self) -> Float8Data:
        """The stored weight as the engine's ``Float8Data`` (``scale = 1 / stored scale``)."""
        inv = torch.reciprocal(self.stored_scale())
        q = self.weight.view(E4M3)
        if self.granularity == "block":
            return Float8Data(q, inv, "block", (self.block, self.block), self.pow2)
        return Float8Data(q, inv, "axis" if self.granularity == "channel" else "tensor", None, self.pow2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fp8_weight()
        if not fp8_enabled() or x.numel() == 0:
            out = F.linear(x, w.dequantize(x.dtype))
        elif torch.compiler.is_compiling() and compile_guard.keeps_eager():  # LOWPREC_COMPILE_FP8=0
            out = compile_guard.run_eagerly(self._fp8_gemm, x, w)
        else:
            out = self._fp8_gemm(x, w)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _fp8_gemm(self, x: torch.Tensor, w: Float8Data) -> torch.Tensor:
        hp = torch_autocast_dtype(x.device.type, x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        return _BaseFn.apply(flat, w, self.granularity, self.block, hp).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        how = {
            "block": f"{self.block}x{self.block} blocks",
            "channel": "a scale per output row",
            "tensor": "one scale",
        }[self.granularity]
        return f"in_features={self.in_features}, out_features={self.out_features}, E4M3 with {how}, frozen"
