"""An FP8 checkpoint directory as a frozen FP8 base: its FP8 Linear layers become
:class:`~lowprec.fp8.fp8_base.Float8BaseLinear` holding the file's E4M3 bytes and scales as
stored (1 byte per weight resident, no high-precision copy), the rest loads as usual. For LoRA on
an FP8 release (DeepSeek-V3-style, an llm-compressor FP8 model) or on a ``lowprec export``:
forward and input-gradient GEMMs in FP8 from the stored scales.

Two formats: ``hf-fp8`` (``quantization_config.quant_method: fp8``, ``weight_scale_inv`` per
square block) and ``compressed-tensors`` (``quant_method: compressed-tensors``, FP8
``float-quantized`` weights with a ``weight_scale`` per tensor, per output channel or per square
block; which schemes load is :mod:`lowprec.export.ct_base`'s, read with that package's own
parser; any other scheme is one line naming it).

The model is first built by transformers' own loader (its fine-grained FP8 or compressed-tensors
integration, dequantizing), so architecture, tied weights and buffers are transformers'; each FP8
layer's dequantized weight is then replaced by the stored bytes and freed. The load therefore
peaks at the high-precision size; what stays resident is the FP8 model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from lowprec.export.ct_base import CtBase, ct_layer_schemes, read_ct_config
from lowprec.fp8.conv1d import is_conv1d
from lowprec.fp8.fp8_base import Float8BaseLinear

__all__ = ["load_fp8_base", "is_fp8_base", "check_trainer_fp8_base", "BaseFormat", "read_base_format"]

BASE_ATTR = "lowprec_fp8_base"  # the loaded model's BaseFormat
METHODS = {"fp8": "hf-fp8", "compressed-tensors": "compressed-tensors"}  # quant_method -> lowprec's format name


@dataclass
class BaseFormat:
    """How an FP8 base stores its weights: ``format`` (``hf-fp8`` / ``compressed-tensors``), the
    hf-fp8 block, the compressed-tensors config, and a description for messages."""

    format: str
    describe: str
    path: str
    block: int = 128
    ct: CtBase | None = None


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, s) for s in json.load(f)["weight_map"].values()})
    return [os.path.join(path, "model.safetensors")]


def read_base_format(path: str) -> BaseFormat:
    """The directory's FP8 format, checked; a ``ValueError`` naming what it is and what to give."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(
            f"FP8 base {path}: no config.json; give a Hugging Face FP8 model directory (hf-fp8 or compressed-tensors)"
        )
    with open(cfg_path) as f:
        qc = json.load(f).get("quantization_config") or {}
    method = qc.get("quant_method", "absent")
    if method == "compressed-tensors":
        ct = read_ct_config(path, qc)
        return BaseFormat("compressed-tensors", ct.describe, path, ct=ct)
    block = qc.get("weight_block_size")
    if method != "fp8" or not (isinstance(block, list) and len(block) == 2 and block[0] == block[1]):
        raise ValueError(
            f"FP8 base {path}: quantization_config {method!r} with weight_block_size "
            f"{block!r} is not one lowprec reads (quant_method: fp8 with square blocks, e.g. [128, 128], or "
            "compressed-tensors FP8); give an hf-fp8 or compressed-tensors FP8 directory (lowprec export) or a bf16 model"
        )
    return BaseFormat("hf-fp8", f"E4M3 {block[0]}x{block[0]} blocks", path, block=int(block[0]))


def is_fp8_base(path: str) -> bool:
    """The directory's config.json declares quantized weights the FP8-base loader reads or refuses
    with its reason (``quantization_config.quant_method``: ``fp8`` or ``compressed-tensors``)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return (json.load(f).get("quantization_config") or {}).get("quant_method") in METHODS
    except (OSError, ValueError):
        return False


def check_trainer_fp8_base(path: str, adapter: str | None, sharded: bool) -> None:
    """What the YAML trainer can do with an FP8 base: LoRA adapters on one process or DDP
    (``merge_lora`` re-quantizes the merged weights in the base's format)."""
    head = f"base_model: {path} is an FP8 checkpoint whose FP8 layers load frozen, in FP8"
    if adapter != "lora":
        raise ValueError(
            f"{head}; train adapters on it: set adapter: lora (adapter: {adapter or 'none'} is not supported)"
        )
    if sharded:
        raise ValueError(f"{head}; FSDP2 / DeepSpeed / tensor parallel do not shard it yet: run on one process or DDP")


def load_fp8_base(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A transformers causal LM from an ``hf-fp8`` or FP8 ``compressed-tensors`` directory with
    its FP8 layers kept in FP8 (frozen); the other parameters in ``dtype``."""
    fmt = read_base_format(path)
    # transformers: optional, the FP8 base path needs it
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    qc = FineGrainedFP8Config(dequantize=True) if fmt.ct is None else CompressedTensorsConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, dtype=dtype, local_files_only=True)
    if fmt.ct is None:
        layers = None
        suffix = ".weight_scale_inv"
    else:
        layers = ct_layer_schemes(model, fmt.ct)
        suffix = ".weight_scale"
    found = set()
    for file in _weight_files(path):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if not key.endswith(suffix):
                    continue
                name = key[: -len(suffix)]
                granularity, block = ("block", fmt.block) if layers is None else layers.get(name, ("", 0))
                if not granularity:
                    raise ValueError(
                        f"FP8 base {path}: {key} is stored but no config group quantizes {name}; "
                        "the directory's config.json does not describe its weights"
                    )
                old = model.get_submodule(name)
                q, s = f.get_tensor(f"{name}.weight"), f.get_tensor(key)
                conv1d = is_conv1d(old)
                if conv1d:  # stored (in, out) with its block grid: the layer computes x @ W
                    q, s = q.t(), s.t()
                bias = None if old.bias is None else old.bias.detach()
                try:
                    new = Float8BaseLinear(q, s, bias, block, granularity=granularity, transposed=conv1d)
                except ValueError as exc:
                    raise ValueError(f"FP8 base {path}: {name}: {exc}") from None
                model.set_submodule(name, new)
                found.add(name)
    missing = sorted(set(layers or ()) - found)
    if missing:
        raise ValueError(
            f"FP8 base {path}: {missing[0]} (and {len(missing) - 1} more) is quantized by the config but has no "
            f"stored {suffix[1:]}; the directory is incomplete"
        )
    setattr(model, BASE_ATTR, fmt)  # the format a merge writes back (fp8_merge)
    return model
