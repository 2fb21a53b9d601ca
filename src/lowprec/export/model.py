"""``export_model``: a (converted) model to an FP8 directory that inference engines load."""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lowprec.export.card import logit_gap, write_card
from lowprec.export.casts import FORMATS, scheme_for
from lowprec.export.hf_config import hf_config_of
from lowprec.export.shards import write_json
from lowprec.export.layers import model_recipe, plan_layers
from lowprec.export.writers import write_compressed_tensors, write_hf_fp8
from lowprec.fp8.cast.quantize import Float8Data

__all__ = ["ExportReport", "export_model"]


@dataclass
class ExportReport:
    """What an export wrote: format, scheme, how the weights were quantized and why, which layers
    stayed bf16 and why, and the measured relative logit gap to the bf16 export."""

    out_dir: str
    format: str
    scheme: str
    layout: str  # the weights' and activations' number formats
    recipe: str | None
    how: str
    quantized: list[str]
    trained_scales: bool
    kept: dict[str, str]
    logit_gap: float | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        gap = "not measured" if self.logit_gap is None else f"{self.logit_gap:.2e}"
        return (
            f"lowprec export: {self.format} ({self.scheme}) in {self.out_dir}: {len(self.quantized)} layer(s) quantized, "
            f"{len(self.kept)} kept bf16; {self.how}; logit gap to the bf16 export {gap} (relative)"
        )


def export_model(
    model: nn.Module,
    out_dir: str,
    format: str = "hf-fp8",
    *,
    requantize: bool = False,
    config: dict[str, Any] | None = None,
    probe_ids: torch.Tensor | None = None,
    notes: list[str] | None = None,
    adapter_merged: bool = False,
) -> ExportReport:
    """Write ``model`` to ``out_dir`` as ``format`` (``hf-fp8`` or ``compressed-tensors``).

    A model converted with ``lowprec.fp8.convert`` exports its FP8 layers with the trained
    scales where its recipe casts the weight as the format stores it (blockwise 128 -> hf-fp8;
    tensorwise -> per tensor, rowwise -> per channel, blockwise -> block, mxfp8 -> MXFP8, nvfp4 ->
    NVFP4 in compressed-tensors; mxfp8 / nvfp4 -> hf-fp8 is refused unless ``requantize``),
    otherwise quantized once with the format's rule; its high-precision layers stay bf16 and are
    in the config's ignore list. An unconverted model quantizes the layers ``fp8.convert``'s
    default rules would convert. ``config``: the Hugging Face config dict (default: the model's
    own, or the built-in model's as a transformers Llama). ``probe_ids``: token ids for the
    measured logit gap (default: 64 ids drawn with seed 0). ``adapter_merged``: the weights have
    an adapter merged into them after training (as a peft model's are), so no training forward
    cast them and the report does not call their scales trained."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not an export format; choose one of {', '.join(FORMATS)}")
    model, merged = _adapters_merged(model)
    recipe = model_recipe(model)
    scheme = scheme_for(format, None if requantize else recipe)
    config = dict(config) if config is not None else hf_config_of(model)
    plan = plan_layers(model, scheme, recipe, requantize)
    if merged or adapter_merged:
        _untrained(plan, recipe, scheme)
    if not plan.quantized:
        raise ValueError(
            "the model has no Linear layer to quantize (every one is kept in high precision); nothing to export in FP8"
        )
    os.makedirs(out_dir, exist_ok=True)
    if format == "hf-fp8":
        write_hf_fp8(model, plan, config, out_dir)
    else:
        write_compressed_tensors(model, plan, scheme, config, out_dir)
    gap = logit_gap(model, plan, probe_ids, config.get("vocab_size"))
    notes = list(notes or []) + merged + plan.notes + _ragged_note(plan) + _block_experts_note(plan, format, scheme)
    report = ExportReport(
        out_dir=os.path.abspath(out_dir),
        format=format,
        scheme=scheme.describe(),
        layout=scheme.layout(),
        recipe=None if recipe is None else (recipe.name or recipe.scaling),
        how=plan.how,
        quantized=list(dict.fromkeys(q.name for q in plan.quantized)),  # a fused experts projection once
        trained_scales=all(q.trained for q in plan.quantized),
        kept=dict(plan.kept),
        logit_gap=gap,
        notes=notes,
    )
    write_json(os.path.join(out_dir, "lowprec_export.json"), report.to_dict(), indent=1)
    write_card(report, out_dir)
    return report


def _adapters_merged(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """A peft model is exported as its base with the adapters merged (what inference engines
    load: transformers' names, no adapter tensors), merged by peft in a copy, so the model
    passed in keeps training; any other model as it is."""
    if not (hasattr(model, "merge_and_unload") and hasattr(model, "get_base_model")):
        return model, []
    try:
        peft_copy: Any = copy.deepcopy(model)  # a peft PeftModel: merge_and_unload is peft's
        merged = peft_copy.merge_and_unload()
    except Exception as exc:  # noqa: BLE001 - peft's own reason, in one line
        raise ValueError(
            f"export_model: a peft model whose adapters peft cannot merge ({type(exc).__name__}: {exc}); "
            "merge them first (model.merge_and_unload()) and export the merged model"
        ) from None
    return merged, [
        "source: a peft model; its adapters merged into the base by peft (merge_and_unload, in a copy), "
        "so the FP8 casts are of the merged weights"
    ]


def _untrained(plan, recipe, scheme) -> None:
    """Weights an adapter was merged into: the recipe's cast of them (where the format holds it)
    is made at export, not read by any training forward."""
    if not any(q.trained for q in plan.quantized):
        return  # quantized once with the format's rule, and said so
    for q in plan.quantized:
        q.trained = False
    plan.how = (
        "an adapter merged into the weights after training, so no training forward cast them: quantized once "
        f"at export with the {recipe.scaling} recipe's weight cast ({scheme.describe()})"
    )


def _block_experts_note(plan, format: str, scheme) -> list[str]:
    """compressed-tensors' block-scaled FP8 experts are written as its spec lays them out, but
    transformers' loader folds an expert's scale into its weight by a plain broadcast product, which
    holds for one block per expert weight only (measured: transformers 5.24 fails to load more)."""
    if format != "compressed-tensors" or not scheme.block_scaled:
        return []
    many = [q.name for q in plan.quantized if q.expert is not None and q.cast.scale.numel() > 1]
    if not many:
        return []
    note = (
        f"experts: {many[0]} (and others) have several 128x128 scale blocks per expert weight; transformers "
        "cannot load compressed-tensors FP8 experts with block scales (its loader multiplies each expert's "
        "weight by its scale without expanding the blocks); other compressed-tensors loaders were not tested "
        "here. For transformers, export --format hf-fp8 (block scales, loads: tested)"
    )
    logging.getLogger("lowprec").warning("lowprec export: %s", note)
    return [note]


def _ragged_note(plan) -> list[str]:
    """Blocks that do not tile a dim: the partial last block has its own scale (GPU loaders read
    the grid rounded up), but transformers' ``dequantize=True`` path divides the dim by the grid."""
    ragged = [
        q.name
        for q in plan.quantized
        if isinstance(q.cast, Float8Data)
        and q.cast.block is not None
        and any(d > b and d % b for d, b in zip(q.cast.data.shape, q.cast.block))
    ]
    if not ragged:
        return []
    return [
        f"{len(ragged)} layer(s) ({ragged[0]}, ...) have a dim above the block size that is not a multiple of it: "
        "each partial last block has its own scale; transformers' dequantize=True (CPU) path refuses such shapes"
    ]
