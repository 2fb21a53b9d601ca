"""Which FP8 weights an export writes, and their scales in the format's convention.

A format stores each quantized weight as E4M3 values plus a *dequantization* multiplier
(``w ~= q * s_fmt``: transformers' ``weight_scale_inv``, compressed-tensors' ``weight_scale``);
the engine's :class:`~lowprec.fp8.quantize.Float8Data` keeps the *quantization* multiplier
(``q = saturate(w * s)``), so ``s_fmt = 1 / s``. Where the training recipe's weight cast has the
format's granularity, the export writes that cast's own values (trained scales, bit-identical to
what the forward GEMM read); otherwise it quantizes once with the format's rule (``amax / 448``
per tensor, channel or block) and says so. All functions here are pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowprec.fp8.quantize import Float8Data, quantize
from lowprec.fp8.recipes import Recipe

__all__ = ["FORMATS", "Scheme", "scheme_for", "trained_matches", "format_cast", "format_scale"]

FORMATS = ("hf-fp8", "compressed-tensors")
BLOCK = 128  # hf-fp8's weight_block_size, and the block of compressed-tensors' FP8_BLOCK preset


@dataclass(frozen=True)
class Scheme:
    """One weight quantization of a format: ``tensor``, ``channel`` (one scale per output row)
    or ``block`` (``block x block`` tiles)."""

    granularity: str
    block: int = BLOCK

    def describe(self) -> str:
        return f"{self.block}x{self.block} blocks" if self.granularity == "block" else f"per {self.granularity}"


def scheme_for(fmt: str, recipe: Recipe | None) -> Scheme:
    """The scheme ``fmt`` writes for a model trained with ``recipe`` (None: not FP8-trained).

    Raises ``ValueError`` for a format the recipe cannot produce: MXFP8 / NVFP4 train with 1x32 /
    1x16 microscales that neither FP8 layout holds."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not an export format; choose one of {', '.join(FORMATS)}")
    # the compressed-tensors scheme that holds the recipe's weight cast as trained (its kind's row)
    trained = None if recipe is None else recipe.kind.info.export_scheme
    if recipe is not None and trained is None:
        raise ValueError(
            f"--format {fmt}: a {recipe.scaling} run trained with microscaled weights that {fmt}'s FP8 layout "
            "cannot hold; pass --requantize to quantize it once with the format's rule, or use the bf16 model.safetensors"
        )
    if fmt == "hf-fp8":
        return Scheme("block", BLOCK)
    if recipe is None:
        return Scheme("channel")
    return Scheme(trained, recipe.block_size if trained == "block" else BLOCK)


def trained_matches(recipe: Recipe | None, scheme: Scheme) -> tuple[bool, str]:
    """Whether the forward's weight cast under ``recipe`` is already ``scheme`` (then its values
    and scales are exported as they are), and the reason either way."""
    if recipe is None:
        return False, "not trained in FP8: quantized once with the format's rule"
    if recipe.kind.keeps_history:
        return False, (
            "delayed scaling keeps its weight scale in an amax history that the checkpoint does not pin to the "
            "last forward: quantized once per tensor with the format's rule"
        )
    if recipe.kind.info.export_scheme == scheme.granularity and (
        scheme.granularity != "block" or recipe.block_size == scheme.block
    ):
        return True, f"trained scales: the {recipe.scaling} forward's own FP8 weights ({scheme.describe()})"
    return False, f"{recipe.scaling} weights are not {scheme.describe()}: quantized once with the format's rule"


def format_cast(weight: torch.Tensor, scheme: Scheme) -> Float8Data:
    """Quantize a 2-D (out, in) weight once with the format's rule: scale = 448 / amax per
    tensor, output row or block, not rounded to a power of two."""
    e4m3 = torch.float8_e4m3fn
    if scheme.granularity == "tensor":
        return quantize(weight, e4m3, "tensor")
    if scheme.granularity == "channel":
        return quantize(weight, e4m3, "axis", dim=1, power_of_2=False)
    return quantize(weight, e4m3, "block", block=(scheme.block, scheme.block), power_of_2=False)


def format_scale(q: Float8Data) -> torch.Tensor:
    """The format's dequantization multiplier (``1 / scale``, float32), in the cast's scale shape:
    ``()`` per tensor, ``(out, 1)`` per channel, ``(ceil(out/b), ceil(in/b))`` per block. Exact for
    power-of-two scales; otherwise rounded once, the FP8 values unchanged."""
    return torch.reciprocal(q.scale.to(torch.float32))
