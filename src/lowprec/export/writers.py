"""The two layouts on disk. ``hf-fp8``: safetensors with ``<layer>.weight`` (E4M3) and
``<layer>.weight_scale_inv`` (float32, one per 128x128 block) and the config's
``quantization_config`` that transformers' fine-grained FP8 integration (and vLLM / SGLang for
DeepSeek-V3-style checkpoints) reads. ``compressed-tensors``: written by the compressed-tensors
package itself (``apply_quantization_config`` + ``ModelCompressor.compress_model`` +
``update_config``), so its ``float-quantized`` layout and config are that library's own."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from lowprec.export.casts import Scheme, format_scale
from lowprec.export.layers import LayerPlan
from lowprec.fp8 import plain_state_dict, unconvert

__all__ = ["bf16_state", "write_hf_fp8", "write_compressed_tensors"]


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
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        os.path.join(out, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)


def write_hf_fp8(model: nn.Module, plan: LayerPlan, config: dict[str, Any], out: str) -> None:
    tensors = bf16_state(model)
    for layer in plan.quantized:
        q, s = layer.cast.data.cpu(), format_scale(layer.cast).cpu()
        if layer.transposed:  # Conv1D stores (in, out): the same 128x128 tiles, transposed
            q, s = q.t(), s.t()
        tensors[f"{layer.name}.weight"] = q.contiguous()
        tensors[f"{layer.name}.weight_scale_inv"] = s.contiguous()
    config = {
        **config,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [plan_block(plan), plan_block(plan)],
            "modules_to_not_convert": sorted(plan.kept),
        },
    }
    _save(tensors, config, out)


def plan_block(plan: LayerPlan) -> int:
    return plan.quantized[0].cast.block[0] if plan.quantized and plan.quantized[0].cast.block else 128


def _compressed_tensors():
    try:  # optional dependency: pip install 'lowprec[export]'
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise ValueError(
            "--format compressed-tensors needs the compressed-tensors package: "
            "pip install 'lowprec[export]' (or pip install compressed-tensors)"
        ) from None
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    return ModelCompressor, QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config


def write_compressed_tensors(
    model: nn.Module, plan: LayerPlan, scheme: Scheme, config: dict[str, Any], out: str
) -> None:
    """compressed-tensors quantizes ``weight / weight_scale`` itself; it is handed each layer's
    dequantized FP8 values and their scale, so it rounds back to exactly the FP8 values chosen
    here (a value ``q / s`` divided by ``1 / s`` lands within a float32 ulp of ``q``)."""
    if any(layer.transposed for layer in plan.quantized):
        raise ValueError(
            "--format compressed-tensors: this model has Conv1D layers (GPT-2 style, weights stored "
            "in x out), which compressed-tensors' FP8 schemes do not read; use --format hf-fp8"
        )
    ModelCompressor, QArgs, QConfig, QScheme, apply_config = _compressed_tensors()

    plain = copy.deepcopy(model).to("cpu")
    unconvert(plain)
    modules = dict(plain.named_modules())
    strategy = {"tensor": "tensor", "channel": "channel", "block": "block"}[scheme.granularity]
    args = QArgs(
        num_bits=8,
        type="float",
        strategy=strategy,
        symmetric=True,
        dynamic=False,
        block_structure=[scheme.block, scheme.block] if strategy == "block" else None,
    )
    dynamic = QArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    targets = sorted({type(modules[layer.name]).__name__ for layer in plan.quantized}) or ["Linear"]
    qconfig = QConfig(
        config_groups={
            "group_0": QScheme(targets=targets, weights=args, input_activations=dynamic, format="float-quantized")
        },
        ignore=sorted(plan.kept),
        format="float-quantized",
    )
    apply_config(plain, qconfig)
    with torch.no_grad():
        for layer in plan.quantized:
            m = modules[layer.name]
            scale = format_scale(layer.cast).cpu()
            m.weight.data = layer.cast.dequantize(torch.float32).cpu().reshape(m.weight.shape)
            m.weight_scale.data = scale.reshape(m.weight_scale.shape).to(m.weight_scale.dtype)
    compressor = ModelCompressor.from_pretrained_model(plain, quantization_format="float-quantized")
    compressor.compress_model(plain)
    tensors = bf16_state(plain)
    for name, t in plain.state_dict().items():  # the compressed weights and scales, as compressed-tensors wrote them
        if t.dtype == torch.float8_e4m3fn or name.endswith(("weight_scale", "weight_zero_point")):
            tensors[name] = t.detach().contiguous()
    _save(tensors, config, out)
    compressor.update_config(out)
