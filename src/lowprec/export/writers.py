"""The two layouts on disk. ``hf-fp8``: safetensors with ``<layer>.weight`` (E4M3) and
``<layer>.weight_scale_inv`` (float32, one per 128x128 block) and the config's
``quantization_config`` that transformers' fine-grained FP8 integration (and vLLM / SGLang for
DeepSeek-V3-style checkpoints) reads. ``compressed-tensors``: written by the compressed-tensors
package itself (``apply_quantization_config`` + ``ModelCompressor.compress_model`` +
``update_config``), so its layouts and config are that library's own: ``float-quantized`` (FP8
per tensor, channel or block), ``mxfp8-quantized`` (its ``MXFP8`` preset: E4M3 weights, uint8 E8M0
scales per 1x32, dynamic MXFP8 activations) and ``nvfp4-pack-quantized`` (its ``NVFP4A16`` preset:
``weight_packed`` two E2M1 values per byte, E4M3 ``weight_scale`` per 1x16, float32
``weight_global_scale``)."""

from __future__ import annotations

import copy
import os
import typing
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file

from lowprec.export.shards import atomic_write, remove_stale_layout, write_json
from torch import nn

from lowprec.export.casts import Scheme, format_global_scale
from lowprec.export.experts import checkpoint_names
from lowprec.export.layers import LayerPlan, QuantizedLayer
from lowprec.fp8.cast.mx import BlockScaledData
from lowprec.fp8.cast.quantize import Float8Data
from lowprec.fp8 import plain_state_dict, unconvert

__all__ = ["bf16_state", "write_hf_fp8", "write_compressed_tensors", "hf_fp8_quantization_config"]


def bf16_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's tensors (no FP8 scaling state), floats in bf16, a tied LM head stored once
    (under the embedding's key: transformers re-ties it from ``tie_word_embeddings``)."""
    seen: dict[int, str] = {}
    out = {}
    for k, t in plain_state_dict(model.state_dict(keep_vars=True)).items():
        if t.data_ptr() in seen and t.numel() > 0:  # tied: keep the first key (the embedding)
            continue
        seen[t.data_ptr()] = k
        t = t.detach().to("cpu")
        out[k] = (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous().clone()
    return out


def _save(tensors: dict[str, torch.Tensor], config: dict[str, Any], out: str) -> None:
    """The weights, then the config, each written to a temporary file and renamed: an interrupted
    export leaves no truncated file under either name (an earlier export's, if any, stays whole).
    A sharded model's index and shards already in ``out`` are removed once the new file is in place
    (loaders that follow the index, vLLM and SGLang among them, would read those instead)."""
    atomic_write(
        os.path.join(out, "model.safetensors"),
        lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"}),
    )
    remove_stale_layout(out, ["model.safetensors"])
    write_json(os.path.join(out, "config.json"), config, indent=1, sort_keys=True)


def _expert_pieces(plan: LayerPlan) -> dict[str, tuple[int, int]]:
    """Each fused experts projection the plan quantizes: its key -> (experts, parts)."""
    fused: dict[str, tuple[int, int]] = {}
    for q in plan.quantized:
        if q.expert is not None:
            e, _, parts = q.expert
            fused[q.name] = (max(e + 1, fused.get(q.name, (0, 0))[0]), parts)
    return fused


def _per_expert(
    tensors: dict[str, torch.Tensor],
    plan: LayerPlan,
    config: dict[str, Any],
    write: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``tensors`` under the checkpoint names transformers writes, with each fused experts
    projection's bf16 3-D tensor replaced by its experts' parts as Linear layers: ``write(prefix,
    layer)`` gives the tensors of one part (``prefix``: its Linear's name); and each kept layer's
    checkpoint name (what an ignore list names, as compressed-tensors maps its own)."""
    fused = _expert_pieces(plan)
    if not fused:
        return tensors, {k: k for k in plan.kept}
    plain = {k: v for k, v in tensors.items() if k not in fused}
    names = checkpoint_names(config, list(plain), fused)
    out = {names[k]: v for k, v in plain.items()}
    for layer in plan.quantized:
        if layer.expert is not None:
            fused_key = (layer.name, *layer.expert[:2])
            key = names[fused_key]
            out.update(write(key.removesuffix(".weight"), layer))
    kept = {k: names.get(f"{k}.weight", f"{k}.weight").removesuffix(".weight") for k in plan.kept}
    return out, kept


def write_hf_fp8(model: nn.Module, plan: LayerPlan, config: dict[str, Any], out: str) -> None:
    tensors = bf16_state(model)
    for layer in plan.quantized:
        if layer.expert is not None:
            continue
        q, s = layer.cast.data.cpu(), layer.format_scale().cpu()
        if layer.transposed:  # Conv1D stores (in, out): the same 128x128 tiles, transposed
            q, s = q.t(), s.t()
        tensors[f"{layer.name}.weight"] = q.contiguous()
        tensors[f"{layer.name}.weight_scale_inv"] = s.contiguous()

    def expert(prefix: str, layer: QuantizedLayer) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.weight": layer.cast.data.cpu().contiguous(),
            f"{prefix}.weight_scale_inv": layer.format_scale().cpu().contiguous(),
        }

    tensors, kept = _per_expert(tensors, plan, config, expert)
    _save(tensors, hf_fp8_quantization_config(config, plan, list(kept.values())), out)


def hf_fp8_quantization_config(
    config: dict[str, Any], plan: LayerPlan, kept: list[str] | None = None
) -> dict[str, Any]:
    """``config`` with hf-fp8's ``quantization_config`` (the plan's block, its kept layers not
    converted; ``kept``: their names in the checkpoint, where transformers renames them on load)."""
    return {
        **config,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [plan_block(plan), plan_block(plan)],
            "modules_to_not_convert": sorted(plan.kept if kept is None else kept),
        },
    }


def plan_block(plan: LayerPlan) -> int:
    if not plan.quantized:
        return 128
    # hf-fp8's casts are Float8Data (scheme_for refuses microscaled weights for it)
    block = typing.cast(Float8Data, plan.quantized[0].cast).block
    return block[0] if block else 128


def _compressed_tensors() -> SimpleNamespace:
    try:  # optional dependency: pip install 'lowprec[export]'
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise ValueError(
            "--format compressed-tensors needs the compressed-tensors package: "
            "pip install 'lowprec[export]' (or pip install compressed-tensors)"
        ) from None
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    return SimpleNamespace(
        ModelCompressor=ModelCompressor,
        CompressionFormat=CompressionFormat,
        QArgs=QuantizationArgs,
        QConfig=QuantizationConfig,
        QScheme=QuantizationScheme,
        apply_config=apply_quantization_config,
        preset=preset_name_to_scheme,
    )


# compressed-tensors' preset and on-disk format of each microscaled scheme (casts.MICRO)
_PRESETS = {"mxfp8": ("MXFP8", "mxfp8_quantized"), "nvfp4": ("NVFP4A16", "nvfp4_pack_quantized")}
_STORED = ("weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point")  # kept as written


def _ct_scheme(ct: SimpleNamespace, scheme: Scheme, targets: list[str]) -> tuple[Any, str]:
    """compressed-tensors' QuantizationScheme for ``scheme`` and its compression format: its own
    preset for MXFP8 / NVFP4, FP8 weights with dynamic per-token activations otherwise."""
    if scheme.microscaled:
        preset, fmt = _PRESETS[scheme.granularity]
        fmt = getattr(ct.CompressionFormat, fmt).value
        return ct.preset(preset, targets).model_copy(update={"format": fmt}), fmt
    fmt = ct.CompressionFormat.float_quantized.value
    strategy = {"tensor": "tensor", "channel": "channel", "block": "block"}[scheme.granularity]
    args = ct.QArgs(
        num_bits=8,
        type="float",
        strategy=strategy,
        symmetric=True,
        dynamic=False,
        block_structure=[scheme.block, scheme.block] if strategy == "block" else None,
    )
    dynamic = ct.QArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    return ct.QScheme(targets=targets, weights=args, input_activations=dynamic, format=fmt), fmt


def _refuse_unheld(plan: LayerPlan, scheme: Scheme) -> None:
    """Layers compressed-tensors' schemes do not read: Conv1D (in x out) weights, and microscaled
    casts whose input dim is not whole blocks (lowprec pads the last block; the schemes do not)."""
    if any(layer.transposed for layer in plan.quantized):
        raise ValueError(
            "--format compressed-tensors: this model has Conv1D layers (GPT-2 style, weights stored "
            "in x out), which compressed-tensors' FP8 schemes do not read; use --format hf-fp8"
        )
    # a microscaled scheme's casts are the trained BlockScaledData (--requantize: FP8 per channel)
    ragged = [
        q.name
        for q in plan.quantized
        if scheme.microscaled and typing.cast(BlockScaledData, q.cast).cols % scheme.block
    ]
    if ragged:
        raise ValueError(
            f"--format compressed-tensors: {ragged[0]} has an input dim that is not a multiple of "
            f"{scheme.granularity}'s block of {scheme.block}, which its {scheme.granularity.upper()} scheme does not hold; "
            "pass --requantize (export_model: requantize=True; FP8 per channel) or serve the bf16 weights"
        )


def _set_cast(m: nn.Module, layer: QuantizedLayer) -> None:
    """The layer's weight as the cast's dequantized values and its scales in compressed-tensors'
    convention, from which that package's compressor rounds back to exactly the cast's values (a
    value ``q * s`` divided by ``s`` lands within a float32 ulp of ``q``)."""
    cast = layer.cast
    # the layer's Parameters (weight_scale, weight_global_scale: registered by compressed-tensors)
    weight = typing.cast(torch.Tensor, m.weight)
    weight.data = cast.dequantize(torch.float32).cpu().reshape(weight.shape)
    weight_scale = typing.cast(torch.Tensor, m.weight_scale)
    weight_scale.data = layer.format_scale().cpu().reshape(weight_scale.shape).to(weight_scale.dtype)
    if hasattr(m, "weight_global_scale"):  # NVFP4: its casts are BlockScaledData
        global_scale = typing.cast(torch.Tensor, m.weight_global_scale)
        global_scale.data = format_global_scale(typing.cast(BlockScaledData, cast)).cpu().reshape(global_scale.shape)


def write_compressed_tensors(
    model: nn.Module, plan: LayerPlan, scheme: Scheme, config: dict[str, Any], out: str, base: Any = None
) -> None:
    """compressed-tensors quantizes (and packs) ``weight / weight_scale`` itself; it is handed each
    layer's dequantized cast and its scales (:func:`_set_cast`), so it writes the cast's values.
    ``base``: a compressed-tensors ``QuantizationConfig`` whose groups, targets, ignore list and
    format are written instead of ``scheme``'s (a merge onto an FP8 base keeps the base's)."""
    _refuse_unheld(plan, scheme)
    ct = _compressed_tensors()
    plain = copy.deepcopy(model).to("cpu")
    unconvert(plain)
    modules = dict(plain.named_modules())
    if base is None:
        targets = sorted(
            {"Linear" if layer.expert is not None else type(modules[layer.name]).__name__ for layer in plan.quantized}
        )
        qscheme, fmt = _ct_scheme(ct, scheme, targets)
        qconfig = ct.QConfig(config_groups={"group_0": qscheme}, ignore=sorted(plan.kept), format=fmt)
    else:
        fmt = ct.CompressionFormat.float_quantized.value
        groups = {k: v.model_copy(deep=True) for k, v in base.config_groups.items()}
        qconfig = ct.QConfig(config_groups=groups, ignore=list(base.ignore or []), format=base.format)
    # each expert's parts as Linear layers of a scratch module, compressed by the same config
    parts = [layer for layer in plan.quantized if layer.expert is not None]
    bank = nn.ModuleList(nn.Linear(q.cast.data.shape[1], q.cast.data.shape[0], bias=False) for q in parts)
    ct.apply_config(plain, qconfig)
    ct.apply_config(bank, qconfig)
    with torch.no_grad():
        for layer in plan.quantized:
            if layer.expert is None:
                _set_cast(modules[layer.name], layer)
        for linear, layer in zip(bank, parts):
            _set_cast(linear, layer)
    compressor = ct.ModelCompressor.from_pretrained_model(plain, quantization_format=fmt)
    compressor.compress_model(plain)
    if parts:
        ct.ModelCompressor.from_pretrained_model(bank, quantization_format=fmt).compress_model(bank)
    tensors = bf16_state(plain)
    for name, t in plain.state_dict().items():  # the compressed weights and scales, as compressed-tensors wrote them
        if t.dtype == torch.float8_e4m3fn or name.endswith(_STORED):
            tensors[name] = t.detach().contiguous()
    index = {id(layer): i for i, layer in enumerate(parts)}

    def expert(prefix: str, layer: QuantizedLayer) -> dict[str, torch.Tensor]:
        own = f"{index[id(layer)]}."
        return {
            prefix + "." + k[len(own) :]: t.detach().contiguous()
            for k, t in bank.state_dict().items()
            if k.startswith(own) and (t.dtype == torch.float8_e4m3fn or k.endswith(_STORED))
        }

    tensors, kept = _per_expert(tensors, plan, config, expert)
    _save(tensors, config, out)
    written = compressor.quantization_config
    if written is not None and written.ignore:  # the checkpoint's names (compressed-tensors maps them
        written.ignore = [kept.get(n, n) for n in written.ignore]  # only for a model transformers loaded)
    compressor.update_config(out)
