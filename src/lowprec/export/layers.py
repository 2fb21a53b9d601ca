"""Which layers of a model an export quantizes, with which cast, and which stay bf16 and why."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lowprec.export.casts import Scheme, format_cast, format_scale, trained_matches
from lowprec.export.experts import plan_experts
from lowprec.fp8.modules.conv1d import is_conv1d
from lowprec.fp8.convert import default_module_filter
from lowprec.fp8.modules.linear import Float8Linear
from lowprec.fp8.cast.mx import BlockScaledData
from lowprec.fp8.cast.quantize import Float8Data
from lowprec.fp8.recipes import Recipe

__all__ = ["QuantizedLayer", "LayerPlan", "plan_layers", "model_recipe"]


@dataclass
class QuantizedLayer:
    name: str
    cast: Float8Data | BlockScaledData  # (out, in), whatever the layer's storage layout; MXFP8 / NVFP4: along in
    transposed: bool  # stored (in, out): transformers' Conv1D
    trained: bool
    # the format's scale exactly as a checkpoint stored it (an FP8 base's unmerged layer), written
    # as it is; None: format_scale(cast)
    stored_scale: torch.Tensor | None = None
    # a fused experts projection (``name``: its 3-D Parameter's key): (expert, part, parts), the
    # part of the expert's rows (gate_up_proj: gate 0, up 1) this cast holds; None: a Linear
    expert: tuple[int, int, int] | None = None

    def format_scale(self) -> torch.Tensor:
        return format_scale(self.cast) if self.stored_scale is None else self.stored_scale


@dataclass
class LayerPlan:
    quantized: list[QuantizedLayer] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # layer name -> why it stays bf16
    how: str = ""  # trained scales or quantized once, and why
    notes: list[str] = field(default_factory=list)


def model_recipe(model: nn.Module) -> Recipe | None:
    """The recipe of the model's FP8 layers (one per model: ``fp8.convert`` gives every layer the
    same), or None for a model that was not converted."""
    for m in model.modules():
        if isinstance(m, Float8Linear):
            return m.recipe
    return None


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def _tied(model: nn.Module, weight: torch.Tensor) -> bool:
    """The weight is also another module's parameter (an LM head tied to the embedding)."""
    owners = sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is weight)
    return owners > 1


def plan_layers(model: nn.Module, scheme: Scheme, recipe: Recipe | None, requantize: bool = False) -> LayerPlan:
    """Quantize the Linear layers that trained in FP8 (a model never converted: those
    ``fp8.convert``'s default rules pick), with the forward's own cast where ``recipe`` casts
    the weight as ``scheme`` does; every other Linear stays bf16 with its reason. Fused experts
    modules: each expert's projections (``export.experts``); their routers stay bf16."""
    plan = LayerPlan()
    trained, plan.how = trained_matches(None if requantize else recipe, scheme)
    if requantize and recipe is not None:
        plan.how = f"--requantize: {recipe.scaling} weights quantized once with the format's rule ({scheme.describe()})"
    converted = recipe is not None
    rule = None if converted else default_module_filter(model)
    for name, m in model.named_modules():
        if not _is_linear(m):
            continue
        if converted and not isinstance(m, Float8Linear):
            plan.kept[name] = "high precision in training (first/last Linear, lm_head, router, gate or fp8_filter)"
            continue
        if rule is not None:  # not converted
            why = rule(m, name)
            if why is not None:
                plan.kept[name] = why
                continue
        if _tied(model, m.weight):
            plan.kept[name] = "tied to the embedding, which stays bf16"
            continue
        conv1d = is_conv1d(m) or getattr(m, "_conv1d_cls", None) is not None
        weight = m.gemm_weight() if isinstance(m, Float8Linear) else (m.weight.t() if conv1d else m.weight)
        cast = m.forward_weight_cast() if trained else format_cast(weight.detach(), scheme)
        plan.quantized.append(QuantizedLayer(name, cast, conv1d, trained))
    plan_experts(model, scheme, recipe, trained, plan, QuantizedLayer)
    return plan
