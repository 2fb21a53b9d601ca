"""``merge_lora`` onto a frozen FP8 base: the LoRA delta merged into each FP8 layer's
dequantized base weight in float32, re-quantized once with the base's own format rule (its
granularity and block size: ``amax / 448`` per tensor, output channel or block, as
:func:`~lowprec.export.casts.format_cast`), written in the base's format (hf-fp8 ->
hf-fp8, compressed-tensors -> compressed-tensors with the base's groups, targets and ignore list),
so the merged directory loads again as an FP8 base and in transformers / vLLM. Or, with
``format="bf16"``, a plain bf16 transformers model: the merged weights from the same float32 sums,
every other FP8 layer dequantized (``q * scale``), one bf16 rounding and no FP8 at all.

The merged weights' scales are new (made from the merged weights), not trained ones: no forward
read them. FP8 layers no adapter touched keep their stored bytes and scales exactly; adapters on
high-precision layers (and ``modules_to_save``) merge as peft merges them. The write builds the
dequantized model once, so it peaks at the high-precision size (the load no longer does).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lowprec.export.casts import Scheme, format_cast
from lowprec.export.fp8_base import BASE_ATTR, BaseFormat, read_base_format
from lowprec.export.hf_config import hf_config_of
from lowprec.export.layers import LayerPlan, QuantizedLayer
from lowprec.export.writers import write_compressed_tensors, write_hf_fp8
from lowprec.fp8.modules.conv1d import is_conv1d
from lowprec.fp8.modules.fp8_base import Float8BaseLinear

__all__ = ["MergeReport", "merge_lora_fp8_base", "MERGE_FORMATS"]

MERGE_FORMATS = ("fp8", "bf16")  # what merge_lora writes from an FP8 base

logger = logging.getLogger("lowprec")


@dataclass
class MergeReport:
    """What the merge wrote (also ``lowprec_merge.json`` in the directory)."""

    out_dir: str
    format: str
    base: str
    how: str
    merged: list[str] = field(default_factory=list)  # FP8 layers re-quantized after the merge
    unchanged: list[str] = field(default_factory=list)  # FP8 layers written with their stored bytes

    def __str__(self) -> str:
        return (
            f"lowprec: merge_lora onto the FP8 base {self.base}: {self.format} in {self.out_dir}; "
            f"{len(self.merged)} FP8 layer(s) merged and {self.how}; {len(self.unchanged)} kept their stored bytes"
        )


def _delta(layer: Any) -> torch.Tensor:
    """The layer's active LoRA adapters' delta (out, in), float32 (peft's ``get_delta_weight``)."""
    delta = None
    for name in layer.active_adapters:
        if name in layer.lora_A:
            d = layer.get_delta_weight(name).float()
            delta = d if delta is None else delta + d
    return delta if delta is not None else torch.zeros(layer.get_base_layer().weight.shape)


def _dense(m: Float8BaseLinear, weight: torch.Tensor, own_layout: bool = False) -> nn.Module:
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

    out = []
    for name, m in list(inner.named_modules()):
        if isinstance(m, LoraLayer) and isinstance(m.get_base_layer(), Float8BaseLinear):
            base = m.get_base_layer()
            out.append((name, base, base.fp8_weight().dequantize(torch.float32) + _delta(m).to(base.weight.device)))
    return out


def merge_lora_fp8_base(peft_model: nn.Module, out: str, format: str = "fp8") -> MergeReport:
    """Merge ``peft_model``'s LoRA adapters into its FP8 base (loaded by ``load_fp8_base``) and
    write the merged model to ``out``: ``format`` ``fp8`` (the default) in the base's FP8 format,
    the merged layers re-quantized once; ``bf16`` as a plain bf16 transformers model (every FP8
    layer dequantized, the merged ones from their float32 sum, one bf16 rounding, no FP8). Changes
    the model in place (its adapters are unloaded): run it last."""
    if format not in MERGE_FORMATS:
        raise ValueError(
            f"merge_lora_fp8_base(format={format!r}): choose one of {', '.join(MERGE_FORMATS)} "
            "(fp8: the base's FP8 format, re-quantized; bf16: a plain bf16 model)"
        )
    inner = peft_model.get_base_model()
    fmt: BaseFormat = getattr(inner, BASE_ATTR, None) or read_base_format(str(inner.name_or_path))
    if format == "bf16":
        return _merge_to_bf16(peft_model, inner, fmt, out)
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
    plain = peft_model.merge_and_unload()  # adapters on high-precision layers, modules_to_save
    plan = LayerPlan(how="re-quantized once with the base's format rule after the merge (not trained scales)")
    unchanged = []
    for name, m in list(plain.named_modules()):
        if isinstance(m, Float8BaseLinear):
            cast = m.fp8_weight()
            stored = m.stored_scale().clone()  # the scales the layer holds, written exactly
            plan.quantized.append(QuantizedLayer(name, cast, m.transposed, False, stored))
            if name not in merged:
                unchanged.append(name)
            plain.set_submodule(name, _dense(m, cast.dequantize(torch.float32)))
    for name, m in plain.named_modules():
        if (isinstance(m, nn.Linear) or is_conv1d(m)) and name not in {q.name for q in plan.quantized}:
            plan.kept[name] = "high precision in the FP8 base"
    os.makedirs(out, exist_ok=True)
    config = hf_config_of(plain)
    if fmt.format == "hf-fp8":
        write_hf_fp8(plain, plan, config, out)
    else:
        first = plan.quantized[0].cast
        scheme = Scheme({"axis": "channel"}.get(first.granularity, first.granularity), fmt.block)
        write_compressed_tensors(plain, plan, scheme, config, out, base=fmt.ct.config if fmt.ct else None)
    how = (
        "the LoRA delta merged into the dequantized base weight in float32, then re-quantized once with the "
        f"base's format rule ({fmt.describe}): new scales, not trained ones"
    )
    return _report(MergeReport(os.path.abspath(out), fmt.format, fmt.path, how, sorted(merged), sorted(unchanged)))


def _report(report: MergeReport) -> MergeReport:
    """Write ``lowprec_merge.json`` beside the merged model and log the report."""
    with open(os.path.join(report.out_dir, "lowprec_merge.json"), "w") as f:
        json.dump(asdict(report), f, indent=1)
    logger.info("%s", report)
    return report


def _merge_to_bf16(peft_model: nn.Module, inner: nn.Module, fmt: BaseFormat, out: str) -> MergeReport:
    """``merge_lora_fp8_base(format="bf16")``: every layer dense, the model in bf16,
    ``save_pretrained`` (a config without ``quantization_config``)."""
    merged = []
    for name, base, w in _merged_weights(inner):
        inner.set_submodule(
            name, _dense(base, w, own_layout=True)
        )  # the adapter is merged: peft's merge below skips it
        merged.append(name)
    plain = peft_model.merge_and_unload()  # adapters on high-precision layers, modules_to_save
    unchanged = []
    for name, m in list(plain.named_modules()):
        if isinstance(m, Float8BaseLinear):
            plain.set_submodule(name, _dense(m, m.fp8_weight().dequantize(torch.float32), own_layout=True))
            unchanged.append(name)
    if getattr(plain.config, "quantization_config", None) is not None:
        del plain.config.quantization_config
    plain.to(torch.bfloat16)
    plain.config.dtype = torch.bfloat16
    if hasattr(plain, BASE_ATTR):
        delattr(plain, BASE_ATTR)  # no longer an FP8 model
    os.makedirs(out, exist_ok=True)
    plain.save_pretrained(out)
    how = (
        "the LoRA delta merged into the dequantized base weight in float32, written in bf16 (one bf16 "
        f"rounding; the base was {fmt.describe}); the unchanged FP8 layers written dequantized (q * scale) in bf16"
    )
    return _report(MergeReport(os.path.abspath(out), "bf16", fmt.path, how, sorted(merged), sorted(unchanged)))
