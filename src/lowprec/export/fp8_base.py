"""An FP8 checkpoint directory as a frozen FP8 base: its FP8 Linear layers become
:class:`~lowprec.fp8.modules.fp8_base.Float8BaseLinear` holding the file's E4M3 bytes and scales as
stored (1 byte per weight resident, no high-precision copy), the rest loads as usual. For LoRA on
an FP8 release (DeepSeek-V3-style, an llm-compressor FP8 model) or on a ``lowprec export``:
forward and input-gradient GEMMs in FP8 from the stored scales.

Two formats: ``hf-fp8`` (``quantization_config.quant_method: fp8``, ``weight_scale_inv`` per
square block) and ``compressed-tensors`` (``quant_method: compressed-tensors``, FP8
``float-quantized`` weights with a ``weight_scale`` per tensor, per output channel or per square
block; which schemes load is :mod:`lowprec.export.ct_base`'s, read with that package's own
parser; any other scheme is one line naming it).

The load (``load_fp8_base``) builds the model from its config with every parameter on the meta
device (buffers real: the model's own constructor computes them), then reads each stored tensor
once with safetensors' ``safe_open``: an FP8 layer's E4M3 bytes and scales go into its
``Float8BaseLinear`` as stored, never upcast; the other tensors are materialised in the
requested dtype; tied weights are tied again. The load therefore peaks near the resident size of
the FP8 model, not at the high-precision size of the whole model. A checkpoint whose tensor
names are not the model's (transformers renames or fuses some while loading) goes through
transformers' own dequantizing loader instead (``direct=False``: architecture, ties and buffers
are transformers', each FP8 layer's dequantized weight then replaced by the stored bytes), logged,
peaking at the high-precision size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
from safetensors import safe_open
from torch import nn

from lowprec.export.ct_base import CtBase, ct_layer_schemes, read_ct_config
from lowprec.fp8.modules.conv1d import is_conv1d
from lowprec.fp8.modules.fp8_base import Float8BaseLinear

__all__ = ["load_fp8_base", "is_fp8_base", "check_trainer_fp8_base", "BaseFormat", "read_base_format"]

logger = logging.getLogger("lowprec")

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
    (``merge_lora`` re-quantizes the merged weights in the base's format, or writes bf16)."""
    head = f"base_model: {path} is an FP8 checkpoint whose FP8 layers load frozen, in FP8"
    if adapter != "lora":
        raise ValueError(
            f"{head}; train adapters on it: set adapter: lora (adapter: {adapter or 'none'} is not supported)"
        )
    if sharded:
        raise ValueError(f"{head}; FSDP2 / DeepSpeed / tensor parallel do not shard it yet: run on one process or DDP")


def load_fp8_base(path: str, dtype: torch.dtype = torch.float32, *, direct: bool = True) -> nn.Module:
    """A transformers causal LM from an ``hf-fp8`` or FP8 ``compressed-tensors`` directory with
    its FP8 layers kept in FP8 (frozen); the other parameters in ``dtype``.

    ``direct`` (the default): the model is built with its parameters on the meta device and
    each tensor read from the safetensors files once; FP8 weights and scales go into
    ``Float8BaseLinear`` as stored and are never upcast, so the load peaks at the resident size.
    A checkpoint whose tensor names are not the model's (transformers renames or fuses some on
    load) is loaded through transformers, logged. ``direct=False``: through transformers'
    dequantizing loader, then each FP8 layer swapped for its stored bytes (peaks at the
    ``dtype`` size of the whole model)."""
    fmt = read_base_format(path)
    model = _load_direct(path, fmt, dtype) if direct else None
    if model is None:
        model = _load_dequantized(path, fmt, dtype)
    setattr(model, BASE_ATTR, fmt)  # the format a merge writes back (fp8_merge)
    return model


def _tensor_files(path: str) -> dict[str, str]:
    """Each stored tensor's name -> the safetensors file holding it."""
    out: dict[str, str] = {}
    for file in _weight_files(path):
        with safe_open(file, "pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def _fp8_layers(path: str, fmt: BaseFormat, model: nn.Module, stored: Iterable[str]) -> dict[str, tuple[str, int]]:
    """The FP8 layers of ``model`` (name -> granularity, block): hf-fp8's are those with a stored
    ``weight_scale_inv``; compressed-tensors' those its config's groups match, each of which
    must have a stored ``weight_scale`` and no other layer one (a ``ValueError`` otherwise)."""
    suffix = ".weight_scale_inv" if fmt.ct is None else ".weight_scale"
    scaled = {k[: -len(suffix)] for k in stored if k.endswith(suffix)}
    modules = dict(model.named_modules())
    absent = sorted(n for n in scaled if n not in modules)
    if absent:  # e.g. per-expert Linear weights of a model that fuses its experts on load
        fused = " (it fuses each layer's experts into 3-D parameters)" if ".experts." in absent[0] else ""
        raise ValueError(
            f"FP8 base {path}: {absent[0]} (and {len(absent) - 1} more) holds FP8 weights but is not a layer of "
            f"transformers' {type(model).__name__}{fused}; a frozen FP8 base loads FP8 Linear layers stored under "
            "the model's own names, not FP8 experts: train on the bf16 model instead"
        )
    if fmt.ct is None:
        return dict.fromkeys(sorted(scaled), ("block", fmt.block))
    layers = ct_layer_schemes(model, fmt.ct)
    extra = sorted(scaled - set(layers))
    if extra:
        raise ValueError(
            f"FP8 base {path}: {extra[0]}{suffix} is stored but no config group quantizes {extra[0]}; "
            "the directory's config.json does not describe its weights"
        )
    missing = sorted(set(layers) - scaled)
    if missing:
        raise ValueError(
            f"FP8 base {path}: {missing[0]} (and {len(missing) - 1} more) is quantized by the config but has no "
            f"stored {suffix[1:]}; the directory is incomplete"
        )
    return layers


def _base_layer(
    path: str, name: str, old: nn.Module, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None, how: tuple
) -> Float8BaseLinear:
    """The stored E4M3 ``q`` and scales ``s`` of layer ``name`` (replacing ``old``) as a frozen layer."""
    conv1d = is_conv1d(old)
    if conv1d:  # stored (in, out) with its block grid: the layer computes x @ W
        q, s = q.t(), s.t()
    granularity, block = how
    try:
        return Float8BaseLinear(q, s, bias, block, granularity=granularity, transposed=conv1d)
    except ValueError as exc:
        raise ValueError(f"FP8 base {path}: {name}: {exc}") from None


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no storage, initialisation a
    no-op) and their buffers real: rotary frequencies and masks are computed by the model's own
    constructor, as accelerate's ``init_empty_weights(include_buffers=False)``. A parameter's
    ``torch.empty`` is moved to meta as it is registered, before anything writes to it."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _load_direct(path: str, fmt: BaseFormat, dtype: torch.dtype) -> nn.Module | None:
    """The model with each stored tensor read once: FP8 layers as stored, the rest in ``dtype``
    (as the meta skeleton declares it); None when the stored names are not the model's."""
    # transformers: optional, the FP8 base path needs it
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    del config.quantization_config  # the model holds plain layers until the FP8 ones are set (as transformers' load)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    files = _tensor_files(path)
    layers = _fp8_layers(path, fmt, model, files)
    suffix = ".weight_scale_inv" if fmt.ct is None else ".weight_scale"
    fp8_keys = {f"{n}{s}" for n in layers for s in (".weight", ".bias", suffix)}
    params = {k: p for k, p in model.named_parameters() if k not in fp8_keys}
    buffers = dict(model.state_dict(keep_vars=True))  # persistent buffers too; tied parameters under each name
    modules = dict(model.named_modules())
    missing = sorted(set(params) - set(files))
    unexpected = sorted(set(files) - set(buffers) - fp8_keys) + [f"{n}.weight" for n in layers if n not in modules]
    if missing or unexpected:
        why = (
            f"stored tensor {unexpected[0]} is not the model's"
            if unexpected
            else f"the model's {missing[0]} is not stored"
        )
        logger.info(
            "lowprec: FP8 base %s: %s; loading through transformers' dequantizing loader (peaks at the %s size "
            "of the model)",
            path,
            why,
            dtype,
        )
        return None
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if key not in fp8_keys:
                    t, want = f.get_tensor(key), buffers[key]
                    state[key] = t.to(want.dtype) if t.is_floating_point() and want.is_floating_point() else t
            for name in sorted(n for n in layers if files.get(f"{n}.weight") == file):
                bias = f"{name}.bias"
                b = None if bias not in files else _read(files[bias], bias).to(buffers[bias].dtype)
                scale = _read(files[f"{name}{suffix}"], f"{name}{suffix}")
                new = _base_layer(path, name, modules[name], f.get_tensor(f"{name}.weight"), scale, b, layers[name])
                model.set_submodule(name, new)  # the meta Linear goes; the stored bytes stay as they are
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still = [k for k, p in model.named_parameters() if p.is_meta]
    if still:
        raise ValueError(
            f"FP8 base {path}: {still[0]} was not loaded (not stored, not tied); the directory is incomplete"
        )
    model.eval()
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    return model


def _read(file: str, key: str) -> torch.Tensor:
    """One stored tensor, as stored."""
    with safe_open(file, "pt") as f:
        return f.get_tensor(key)


def _load_dequantized(path: str, fmt: BaseFormat, dtype: torch.dtype) -> nn.Module:
    """transformers' dequantizing load, then each FP8 layer's weight swapped for the stored bytes."""
    # transformers: optional, the FP8 base path needs it
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    qc = FineGrainedFP8Config(dequantize=True) if fmt.ct is None else CompressedTensorsConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, dtype=dtype, local_files_only=True)
    files = _tensor_files(path)
    layers = _fp8_layers(path, fmt, model, files)
    suffix = ".weight_scale_inv" if fmt.ct is None else ".weight_scale"
    for name, how in layers.items():
        old = model.get_submodule(name)
        q, s = _read(files[f"{name}.weight"], f"{name}.weight"), _read(files[f"{name}{suffix}"], f"{name}{suffix}")
        bias = None if old.bias is None else cast(torch.Tensor, old.bias).detach()  # Linear / Conv1D: a Parameter
        model.set_submodule(name, _base_layer(path, name, old, q, s, bias, how))
    return model
