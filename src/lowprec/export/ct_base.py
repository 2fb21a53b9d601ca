"""A compressed-tensors directory as a frozen FP8 base: which of its schemes lowprec loads, read
with the compressed-tensors package's own parser (``QuantizationConfig``) and module matching
(``match_named_modules``), and the one-line refusal of every other scheme.

Loaded: ``float-quantized`` groups with 8-bit float (E4M3) symmetric static weights per tensor,
per channel or in square blocks (compressed-tensors' ``FP8_DYNAMIC`` / ``FP8_BLOCK`` presets,
W8A16 FP8, and what ``lowprec export --format compressed-tensors`` writes), with dynamic FP8
activations or none: lowprec casts activations dynamically itself. Refused, naming the scheme:
anything else (NVFP4, MXFP8 / MXFP4, int weights, W8A8 INT8, non-square blocks, groups), and
calibrated scales that a frozen base would silently drop (static activation scales, as in the
``FP8`` preset; a quantized KV cache; sparsity or transforms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["CtBase", "read_ct_config", "ct_layer_schemes"]

_DO = (
    "give an FP8 compressed-tensors directory (float-quantized E4M3 weights per tensor, channel or "
    "square block, dynamic or no activation quantization; e.g. lowprec export --format "
    "compressed-tensors), an hf-fp8 directory, or the model dequantized to bf16"
)


@dataclass
class CtBase:
    """The parsed ``quantization_config`` (compressed-tensors' ``QuantizationConfig``) of an FP8 base."""

    config: Any
    describe: str


def _args(a: Any) -> tuple[Any, ...] | None:
    return (
        None
        if a is None
        else (a.num_bits, str(a.type), str(a.strategy), a.group_size, a.block_structure, a.dynamic, a.symmetric)
    )


def _scheme_name(scheme: Any, fmt: str) -> str:
    """The compressed-tensors preset the scheme is (weights and activations as the preset's), or
    a description of it, with its on-disk format."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    for name, preset in PRESET_SCHEMES.items():
        if preset and (
            _args(preset.get("weights")),
            _args(preset.get("input_activations")),
        ) == (_args(scheme.weights), _args(scheme.input_activations)):
            return f"preset {name}, format {fmt}"
    w, a = scheme.weights, scheme.input_activations
    weights = "no weights" if w is None else f"{w.type} {w.num_bits}-bit weights per {w.strategy}"
    if w is not None and w.block_structure:
        weights += f" {w.block_structure}"
    acts = (
        "no activation quantization"
        if a is None
        else f"{'dynamic' if a.dynamic else 'static'} {a.type} {a.num_bits}-bit activations per {a.strategy}"
    )
    return f"{weights}, {acts}, format {fmt}"


def _why_not(scheme: Any, fmt: str) -> str | None:
    """Why lowprec cannot hold the group as a frozen FP8 base, or None."""
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType

    w, a = scheme.weights, scheme.input_activations
    if fmt != CompressionFormat.float_quantized.value:
        return f"its format {fmt} is not float-quantized (FP8 bytes with float32 scales)"
    if w is None or w.type != QuantizationType.FLOAT or w.num_bits != 8:
        return "its weights are not 8-bit float (E4M3)"
    if w.strategy not in (QuantizationStrategy.TENSOR, QuantizationStrategy.CHANNEL, QuantizationStrategy.BLOCK):
        return f"its weight strategy {w.strategy} is not tensor, channel or block"
    if w.strategy == QuantizationStrategy.BLOCK and not (
        w.block_structure and len(w.block_structure) == 2 and w.block_structure[0] == w.block_structure[1]
    ):
        return f"its weight blocks {w.block_structure} are not square"
    if not w.symmetric or w.dynamic or w.actorder is not None:
        return "its weights are asymmetric, dynamic or reordered"
    if a is not None and not (a.dynamic is True and a.type == QuantizationType.FLOAT and a.num_bits == 8):
        return "its activations are not dynamic FP8 (static scales were calibrated for the frozen weights)"
    if scheme.output_activations is not None:
        return "it quantizes output activations"
    return None


def read_ct_config(path: str, qc: dict[str, Any]) -> CtBase:
    """compressed-tensors' parse of ``qc``, checked: every group one lowprec loads, else one line."""
    head = f"FP8 base {path}: a compressed-tensors checkpoint"
    try:  # optional dependency: pip install 'lowprec[export]'
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise ValueError(
            f"{head}; reading it needs the compressed-tensors package: pip install 'lowprec[export]' "
            "(or pip install compressed-tensors)"
        ) from None
    from compressed_tensors.quantization import QuantizationConfig

    try:
        config = QuantizationConfig.model_validate(qc)
    except Exception as exc:  # pydantic's ValidationError, or a preset name it does not know
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{head} whose quantization_config compressed-tensors cannot read ({first}); {_DO}") from None
    extras = [k for k in ("sparsity_config", "transform_config") if qc.get(k)]
    if config.kv_cache_scheme is not None or extras:
        what = "a quantized KV cache (kv_cache_scheme)" if config.kv_cache_scheme is not None else extras[0]
        raise ValueError(f"{head} with {what}, which lowprec's FP8 base does not hold; {_DO}")
    names = []
    for group, scheme in config.config_groups.items():
        fmt = str(getattr(scheme.format, "value", scheme.format) or config.format)
        name = _scheme_name(scheme, fmt)
        why = _why_not(scheme, fmt)
        if why is not None:
            raise ValueError(f"{head} whose {group} ({name}) lowprec cannot load as an FP8 base: {why}; {_DO}")
        names.append(name)
    if not names:
        raise ValueError(f"{head} without config groups (nothing quantized); {_DO}")
    return CtBase(config, "; ".join(sorted(set(names))))


def ct_layer_schemes(model: nn.Module, base: CtBase) -> dict[str, tuple[str, int]]:
    """Each quantized module's (granularity, block) as compressed-tensors matches the config's
    targets and ignore list on ``model`` (a later group does not re-claim a module)."""
    from compressed_tensors.utils import match_named_modules

    out: dict[str, tuple[str, int]] = {}
    for scheme in base.config.config_groups.values():
        w = scheme.weights
        granularity = str(getattr(w.strategy, "value", w.strategy))
        block = int(w.block_structure[0]) if granularity == "block" else 128
        for name, _ in match_named_modules(model, scheme.targets, base.config.ignore):
            out.setdefault(name, (granularity, block))
    return out
