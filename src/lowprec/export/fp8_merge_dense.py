"""The merge of :mod:`lowprec.export.fp8_merge` as it was first written, through a dense model:
every FP8 layer replaced by an ``nn.Linear`` holding its dequantized float32 weight, then the
export writers (``write_hf_fp8``; ``write_compressed_tensors``, which deep-copies the model) or
``save_pretrained`` in bf16. It peaks at about 4 bytes per FP8 weight plus the copies. Kept as the
reference the streaming merge is checked against, bit for bit (``merge_lora_fp8_base(...,
stream=False)``), and as the "before" of ``benchmarks/fp8_merge_peak.py``.
"""

from __future__ import annotations

import os
import typing
from typing import Any

import torch
from torch import nn

from lowprec.export.casts import Scheme, format_cast
from lowprec.export.fp8_base import BASE_ATTR, BaseFormat
from lowprec.export.hf_config import hf_config_of
from lowprec.export.layers import LayerPlan, QuantizedLayer
from lowprec.export.writers import write_compressed_tensors, write_hf_fp8
from lowprec.fp8.cast.quantize import Float8Data
from lowprec.fp8.modules.conv1d import is_conv1d
from lowprec.fp8.modules.fp8_base import Float8BaseLinear

__all__ = ["merge_dense", "lora_delta", "dense_layer"]


def lora_delta(layer: Any) -> torch.Tensor:
    """The layer's active LoRA adapters' delta (out, in), float32 (peft's ``get_delta_weight``)."""
    delta = None
    for name in layer.active_adapters:
        if name in layer.lora_A:
            d = layer.get_delta_weight(name).float()
            delta = d if delta is None else delta + d
    return delta if delta is not None else torch.zeros(layer.get_base_layer().weight.shape)


def dense_layer(m: Float8BaseLinear, weight: torch.Tensor, own_layout: bool = False) -> nn.Module:
    """A plain layer holding ``weight`` (out, in) and ``m``'s bias: an ``nn.Linear`` (what the FP8
    writers read; they transpose a ``transposed`` layer themselves), or with ``own_layout`` a
    base layer stored transposed (transformers' ``Conv1D``) as a ``Conv1D`` (in, out), so
    ``save_pretrained`` writes what transformers loads."""
    if own_layout and m.transposed:
        # transformers: the model holding a Conv1D is a transformers model
        from transformers.pytorch_utils import Conv1D

        layer: nn.Module = Conv1D(m.out_features, m.in_features)
        layer.weight = nn.Parameter(weight.t().contiguous(), requires_grad=False)
    else:
        layer = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
    if m.bias is not None:
        layer.bias = nn.Parameter(m.bias.detach().clone(), requires_grad=False)
    return layer


def _merged_weights(inner: nn.Module) -> list[tuple[str, Float8BaseLinear, torch.Tensor]]:
    """Each LoRA layer on an FP8 base layer: its name, the base layer, and the merged weight
    (out, in) in float32: the dequantized stored weight plus the adapters' delta."""
    # peft: optional; a model with adapters has it
    from peft.tuners.lora import LoraLayer

    out: list[tuple[str, Float8BaseLinear, torch.Tensor]] = []
    for name, m in list(inner.named_modules()):
        if isinstance(m, LoraLayer) and isinstance(base := m.get_base_layer(), Float8BaseLinear):
            out.append((name, base, base.fp8_weight().dequantize(torch.float32) + lora_delta(m).to(base.weight.device)))
    return out


def merge_dense(peft_model: nn.Module, fmt: BaseFormat, out: str, format: str) -> tuple[list[str], list[str]]:
    """Write the merge to ``out`` through the dense model: (merged layers, unchanged FP8 layers)."""
    peft: Any = peft_model  # a peft PeftModel: get_base_model / merge_and_unload are peft's
    inner = peft.get_base_model()
    if format == "bf16":
        return _merge_to_bf16(peft_model, inner, out)
    merged: dict[str, Float8BaseLinear] = {}
    for name, base, w in _merged_weights(inner):
        cast = format_cast(w, Scheme(base.granularity, base.block))
        new = Float8BaseLinear(
            cast.data,
            torch.reciprocal(cast.scale),
            base.bias,
            base.block,
            granularity=base.granularity,
            transposed=base.transposed,
        )
        inner.set_submodule(name, new)  # the adapter is merged: peft's merge below skips it
        merged[name] = new
    plain = peft.merge_and_unload()  # adapters on high-precision layers, modules_to_save
    plan = LayerPlan(how="re-quantized once with the base's format rule after the merge (not trained scales)")
    unchanged = []
    for name, m in list(plain.named_modules()):
        if isinstance(m, Float8BaseLinear):
            cast = m.fp8_weight()
            stored = m.stored_scale().clone()  # the scales the layer holds, written exactly
            plan.quantized.append(QuantizedLayer(name, cast, m.transposed, False, stored))
            if name not in merged:
                unchanged.append(name)
            plain.set_submodule(name, dense_layer(m, cast.dequantize(torch.float32)))
    for name, m in plain.named_modules():
        if (isinstance(m, nn.Linear) or is_conv1d(m)) and name not in {q.name for q in plan.quantized}:
            plan.kept[name] = "high precision in the FP8 base"
    os.makedirs(out, exist_ok=True)
    config = hf_config_of(plain)
    if fmt.format == "hf-fp8":
        write_hf_fp8(plain, plan, config, out)
    else:
        first = typing.cast(Float8Data, plan.quantized[0].cast)  # FP8 base layers' casts (fp8_weight)
        scheme = Scheme({"axis": "channel"}.get(first.granularity, first.granularity), fmt.block)
        write_compressed_tensors(plain, plan, scheme, config, out, base=fmt.ct.config if fmt.ct else None)
    return sorted(merged), sorted(unchanged)


def _merge_to_bf16(peft_model: Any, inner: nn.Module, out: str) -> tuple[list[str], list[str]]:
    """``merge_lora_fp8_base(format="bf16")``: every layer dense, the model in bf16,
    ``save_pretrained`` (a config without ``quantization_config``)."""
    merged = []
    for name, base, w in _merged_weights(inner):
        inner.set_submodule(
            name, dense_layer(base, w, own_layout=True)
        )  # the adapter is merged: peft's merge below skips it
        merged.append(name)
    plain = peft_model.merge_and_unload()  # adapters on high-precision layers, modules_to_save
    unchanged = []
    for name, m in list(plain.named_modules()):
        if isinstance(m, Float8BaseLinear):
            plain.set_submodule(name, dense_layer(m, m.fp8_weight().dequantize(torch.float32), own_layout=True))
            unchanged.append(name)
    if getattr(plain.config, "quantization_config", None) is not None:
        del plain.config.quantization_config
    plain.to(torch.bfloat16)
    plain.config.dtype = torch.bfloat16
    if hasattr(plain, BASE_ATTR):
        delattr(plain, BASE_ATTR)  # no longer an FP8 model
    os.makedirs(out, exist_ok=True)
    plain.save_pretrained(out)
    return sorted(merged), sorted(unchanged)
