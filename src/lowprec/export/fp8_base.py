"""An ``hf-fp8`` directory as a frozen FP8 base: its FP8 Linear layers become
:class:`~lowprec.fp8.fp8_base.Float8BaseLinear` holding the file's E4M3 bytes and block scales
(1 byte per weight resident, no high-precision copy), the rest loads as usual. For LoRA on an FP8
release (DeepSeek-V3-style) or on a ``lowprec export``: forward and input-gradient GEMMs in FP8
from the stored scales.

The model is first built by transformers' own loader (its fine-grained FP8 integration with
``dequantize=True``), so architecture, tied weights and buffers are transformers'; each FP8
layer's dequantized weight is then replaced by the stored bytes and freed. The load therefore
peaks at the high-precision size; what stays resident is the FP8 model.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn

from lowprec.fp8.conv1d import is_conv1d
from lowprec.fp8.fp8_base import Float8BaseLinear

__all__ = ["load_fp8_base", "is_fp8_base", "check_trainer_fp8_base"]


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, s) for s in json.load(f)["weight_map"].values()})
    return [os.path.join(path, "model.safetensors")]


def _check(path: str) -> int:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"FP8 base {path}: no config.json; give a Hugging Face FP8 model directory (hf-fp8)")
    with open(cfg_path) as f:
        qc = json.load(f).get("quantization_config") or {}
    block = qc.get("weight_block_size")
    if qc.get("quant_method") != "fp8" or not (isinstance(block, list) and len(block) == 2 and block[0] == block[1]):
        raise ValueError(
            f"FP8 base {path}: quantization_config {qc.get('quant_method', 'absent')!r} with weight_block_size "
            f"{block!r} is not one lowprec reads (quant_method: fp8 with square blocks, e.g. [128, 128]); "
            "give an hf-fp8 directory (lowprec export --format hf-fp8) or a bf16 model"
        )
    return int(block[0])


def is_fp8_base(path: str) -> bool:
    """The directory's config.json declares FP8 weights (``quantization_config.quant_method: fp8``)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return (json.load(f).get("quantization_config") or {}).get("quant_method") == "fp8"
    except (OSError, ValueError):
        return False


def check_trainer_fp8_base(path: str, adapter: str | None, merge_lora: bool, sharded: bool) -> None:
    """What the YAML trainer can do with an FP8 base: LoRA adapters on one process or DDP."""
    head = f"base_model: {path} is an FP8 checkpoint whose FP8 layers load frozen, in FP8"
    if adapter != "lora":
        raise ValueError(
            f"{head}; train adapters on it: set adapter: lora (adapter: {adapter or 'none'} is not supported)"
        )
    if merge_lora:
        raise ValueError(
            f"{head}; merging adapters into FP8 weights is not supported yet: drop merge_lora "
            "(the adapter is saved on its own)"
        )
    if sharded:
        raise ValueError(f"{head}; FSDP2 / DeepSpeed / tensor parallel do not shard it yet: run on one process or DDP")


def load_fp8_base(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A transformers causal LM from an ``hf-fp8`` directory with its FP8 layers kept in FP8
    (frozen); the other parameters in ``dtype``."""
    block = _check(path)
    # transformers: optional, the FP8 base path needs it
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=dtype, local_files_only=True
    )
    for file in _weight_files(path):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if not key.endswith(".weight_scale_inv"):
                    continue
                name = key[: -len(".weight_scale_inv")]
                old = model.get_submodule(name)
                q, s = f.get_tensor(f"{name}.weight"), f.get_tensor(key)
                if is_conv1d(old):  # stored (in, out) with its block grid: the layer computes x @ W
                    q, s = q.t(), s.t()
                bias = None if old.bias is None else old.bias.detach()
                model.set_submodule(name, Float8BaseLinear(q, s, bias, block))
    return model
