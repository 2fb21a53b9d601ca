"""A weight that arrives already in FP8: the output of an FSDP2 FP8 all-gather.

:class:`Float8GatheredWeight` is what FSDP2's ``fsdp_post_all_gather`` hands the layer as its
unsharded weight (``lowprec.distributed.fsdp_float8``): the FP8 bytes that went over the wire
and the one per-tensor scale every rank cast its shard with. It reports the high-precision
dtype (FSDP2's ``param_dtype``), so autograd gives its gradient in that dtype and FSDP2
reduce-scatters it as usual.

* :func:`as_float8_data` lets the FP8 GEMM take the bytes as they are (no second cast): the
  weight's per-tensor cast *is* this data, so a layer computes exactly what it would have
  computed from the high-precision weight cast with the same scale.
* Any other op (a high-precision GEMM under ``override_linear_precision``, telemetry, a plain
  ``F.linear`` outside the FP8 region, ``state_dict``) sees the dequantized weight
  ``data / scale``: the FP8-rounded values, never garbage.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from lowprec.fp8.cast.mx import E8M0, MX_BLOCK, BlockScaledData, dequantize_blocks
from lowprec.fp8.cast.quantize import Float8Data

logger = logging.getLogger("lowprec")
_RECAST_LOGGED: set[str] = set()

__all__ = ["Float8GatheredWeight", "as_float8_data", "as_mx_weight", "gathered_scale_and_amax"]

# ops that keep the FP8 payload (views FSDP2 takes of the unsharded parameter, detach for
# nn.Parameter); every other op runs on the dequantized tensor
_VIEW_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.view.default,
}


class Float8GatheredWeight(torch.Tensor):
    """FP8 ``data`` (the gathered bytes, viewed as FP8) and a 0-d float32 ``scale``
    (``weight ~= data / scale``), presenting as a ``dtype`` tensor."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *args: Any, **kwargs: Any):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            device=data.device,
            requires_grad=False,
        )

    def __init__(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        pow2: bool = False,
        amax: torch.Tensor | None = None,
        granularity: str = "tensor",
        contract: int | None = None,
        block: tuple[int, int] | None = None,
    ):
        self._data = data
        self._scale = scale
        self._pow2 = pow2
        # "tensor": one scale; "axis": one per slice across dim ``contract`` (rowwise: (N, 1) for
        # the forward GEMM, contract 1; (1, K) for grad_input, contract 0); "mx": MXFP8, 32-element
        # blocks along K (contract 1) or along N (contract 0: the cast of W^T, kept in W's layout,
        # ``_scale`` the E8M0 bytes as gathered; see :func:`as_mx_weight`)
        self._granularity = granularity
        self._contract = contract
        self._block = block  # "block": the square tiles, which serve both GEMMs that read the weight
        # the whole high-precision weight's amax, where the gather carries it (delayed scaling
        # records it in the weight's history: the payload's own amax would be the FP8-rounded one)
        self._amax = amax

    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]  # torch's stub
        return f"Float8GatheredWeight(shape={tuple(self.shape)}, fp8={self._data.dtype}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.dtype, self._pow2, None, self._granularity, self._contract, self._block)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8GatheredWeight(inner["_data"], inner["_scale"], *meta)

    def dequantize(self) -> torch.Tensor:
        if self._granularity == "mx":
            q = as_mx_weight(self, self._contract)
            assert q is not None
            full = dequantize_blocks(q)
            return (full if self._contract == 1 else full.t()).to(self.dtype)
        return (self._data.to(torch.float32) / self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEW_OPS:
            src = args[0]
            data = func(src._data, *args[1:], **kwargs)
            return Float8GatheredWeight(
                data, src._scale, src.dtype, src._pow2, src._amax, src._granularity, src._contract, src._block
            )
        args, kwargs = tree_map_only(Float8GatheredWeight, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


def as_float8_data(
    t: torch.Tensor, dtype: torch.dtype, granularity: str, contract: int | None = None
) -> Float8Data | None:
    """The FP8 cast a GEMM operand already carries, when it is a :class:`Float8GatheredWeight`
    of the asked-for dtype and granularity (for ``axis``: across the asked-for ``contract`` dim);
    else ``None`` (cast as usual: a gathered weight then reads as its dequantized values)."""
    if not isinstance(t, Float8GatheredWeight) or t._data.dtype != dtype or t._granularity != granularity:
        return None
    if granularity == "tensor":
        return Float8Data(t._data, t._scale, "tensor", None, t._pow2)
    if granularity == "block":  # square tiles: the same cast for either contracted dim
        return Float8Data(t._data, t._scale, "block", t._block, t._pow2)
    if granularity == "axis" and contract is not None and t._contract == contract:
        return Float8Data(t._data, t._scale, "axis", None, t._pow2)
    if granularity == "axis" and contract is not None and "axis" not in _RECAST_LOGGED:
        _RECAST_LOGGED.add("axis")
        logger.info(
            "lowprec: FSDP2 FP8 all-gather (rowwise): a GEMM contracting dim %d reads a weight gathered "
            "for dim %d (FSDP2 kept the forward's: reshard_after_forward=False), so it is re-cast from "
            "those FP8 values, one rounding more than without the FP8 all-gather",
            contract,
            t._contract,
        )
    return None


def gathered_scale_and_amax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(scale, whole-weight amax)`` of a gathered FP8 weight that carries its amax (the FSDP2 FP8
    all-gather of a delayed-scaling layer); ``None`` for anything else."""
    if isinstance(t, Float8GatheredWeight) and t._amax is not None:
        return t._scale, t._amax
    return None


def as_mx_weight(t: torch.Tensor, contract: int | None) -> BlockScaledData | None:
    """The MXFP8 operand a gathered weight carries for the GEMM contracting its dim ``contract``
    (1: the forward's ``W`` along K; 0: grad_input's ``W^T`` along N), as views of the gathered
    buffers (no copy kept past the GEMM); ``None`` for anything else."""
    if not isinstance(t, Float8GatheredWeight) or t._granularity != "mx" or t._contract != contract:
        return None
    n, k = t._data.shape
    scale = t._scale.view(E8M0)
    if contract == 1:
        return BlockScaledData(t._data, scale, k, MX_BLOCK)
    return BlockScaledData(t._data.t(), scale.reshape(n // MX_BLOCK, k).t(), n, MX_BLOCK)
