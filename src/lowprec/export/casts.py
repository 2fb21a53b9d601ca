"""Which quantized weights an export writes, and their scales in the format's convention.

A format stores each quantized weight as E4M3 values plus a *dequantization* multiplier
(``w ~= q * s_fmt``: transformers' ``weight_scale_inv``, compressed-tensors' ``weight_scale``);
the engine's :class:`~lowprec.fp8.cast.quantize.Float8Data` keeps the *quantization* multiplier
(``q = saturate(w * s)``), so ``s_fmt = 1 / s``. Where the training recipe's weight cast has the
format's granularity, the export writes that cast's own values (trained scales, bit-identical to
what the forward GEMM read); otherwise it quantizes once with the format's rule (``amax / 448``
per tensor, channel or block) and says so.

MXFP8 and NVFP4 runs keep their microscaled weight casts (:class:`~lowprec.fp8.cast.mx.BlockScaledData`,
decode scales already) in compressed-tensors' MXFP8 and NVFP4 schemes, whose layouts are the
casts': MXFP8 E4M3 values with an E8M0 scale per 1x32 along the input dim; NVFP4 E2M1 values with
an E4M3 scale per 1x16 and a float32 global scale. lowprec's NVFP4 weights are cast in 16x16
tiles, stored with the tile's scale repeated on each of its 16 rows: 16 equal 1x16 scales, still
exactly the trained numbers. compressed-tensors' global scale is the encode factor
``448 * 6 / amax``; lowprec keeps its reciprocal (the decode factor). hf-fp8 holds neither
(refused: use compressed-tensors or ``--requantize``). All functions here are pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from lowprec.catalog import export_holds
from lowprec.fp8.cast.mx import BlockScaledData, e8m0_decode
from lowprec.fp8.cast.quantize import Float8Data, quantize
from lowprec.fp8.recipes import Recipe

__all__ = [
    "FORMATS",
    "Scheme",
    "scheme_for",
    "trained_matches",
    "format_cast",
    "format_scale",
    "format_global_scale",
]

FORMATS = ("hf-fp8", "compressed-tensors")
BLOCK = 128  # hf-fp8's weight_block_size, and the block of compressed-tensors' FP8_BLOCK preset
# compressed-tensors' microscaled weight schemes (the recipes' export_scheme): 1 x block along the
# input dim, the elements' width, and what the model card says of the weights and activations
MICRO = {
    "mxfp8": (32, "FP8", "E4M3 weights with an E8M0 scale per 1x32, dynamic MXFP8 activations"),
    "nvfp4": (
        16,
        "FP4",
        "E2M1 weights with an E4M3 scale per 1x16 and a float32 global scale; activations not quantized "
        "(NVFP4A16: the W4A4 scheme needs an input global scale calibrated on data, which training does not keep)",
    ),
}


@dataclass(frozen=True)
class Scheme:
    """One weight quantization of a format: ``tensor``, ``channel`` (one scale per output row),
    ``block`` (``block x block`` tiles), or compressed-tensors' ``mxfp8`` / ``nvfp4`` (``1 x block``)."""

    granularity: str
    block: int = BLOCK

    @property
    def microscaled(self) -> bool:
        return self.granularity in MICRO

    @property
    def block_scaled(self) -> bool:
        """``block x block`` tiles (hf-fp8's layout; compressed-tensors' block strategy)."""
        return self.granularity == "block"

    def describe(self) -> str:
        if self.microscaled:
            return f"{self.granularity}, 1x{self.block} blocks"
        return f"{self.block}x{self.block} blocks" if self.granularity == "block" else f"per {self.granularity}"

    def layout(self) -> str:
        """The weights' and activations' number formats, for the model card."""
        return MICRO[self.granularity][2] if self.microscaled else "E4M3 weights, dynamic activation scales"

    def elements(self) -> str:
        return MICRO[self.granularity][1] if self.microscaled else "FP8"


def scheme_for(fmt: str, recipe: Recipe | None) -> Scheme:
    """The scheme ``fmt`` writes for a model trained with ``recipe`` (None: not FP8-trained).

    Raises ``ValueError`` for a format that cannot hold the recipe's weights: MXFP8 / NVFP4 train
    with 1x32 / 1x16 microscales that only compressed-tensors' MXFP8 / NVFP4 schemes hold."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not an export format; choose one of {', '.join(FORMATS)}")
    # the compressed-tensors scheme that holds the recipe's weight cast as trained (its kind's row)
    trained = None if recipe is None else recipe.kind.info.export_scheme
    if recipe is not None and not export_holds(fmt, recipe.kind.info):
        held = f"use --format compressed-tensors (its {trained.upper()} scheme keeps them), " if trained else ""
        raise ValueError(
            f"--format {fmt}: a {recipe.scaling} run trained with microscaled weights that {fmt}'s FP8 layout "
            f"cannot hold; {held}pass --requantize (export_model: requantize=True) to quantize it once with the format's "
            "rule, or serve the bf16 weights"
        )
    if fmt == "hf-fp8":
        return Scheme("block", BLOCK)
    if recipe is None:
        return Scheme("channel")
    if trained in MICRO:
        return Scheme(trained, MICRO[trained][0])
    # export_holds passed above only for a kind with an export_scheme: ``trained`` is a str here
    return Scheme(cast(str, trained), recipe.block_size if trained == "block" else BLOCK)


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
        return (
            True,
            f"trained scales: the {recipe.scaling} forward's own {scheme.elements()} weights ({scheme.describe()})",
        )
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


def format_scale(q: Float8Data | BlockScaledData) -> torch.Tensor:
    """The format's dequantization multiplier (float32), in the cast's scale shape: ``1 / scale``,
    ``()`` per tensor, ``(out, 1)`` per channel, ``(ceil(out/b), ceil(in/b))`` per block (exact for
    power-of-two scales; otherwise rounded once, the FP8 values unchanged); a microscaled cast's
    own block decode scales, ``(out, in / block)``, exactly (NVFP4's without its tensor factor)."""
    if isinstance(q, BlockScaledData):
        return e8m0_decode(q.scale) if q.tensor_scale is None else q.scale.to(torch.float32)
    return torch.reciprocal(q.scale.to(torch.float32))


def format_global_scale(q: BlockScaledData) -> torch.Tensor:
    """compressed-tensors' NVFP4 global scale (the encode factor ``448 * 6 / amax``, float32) of an
    NVFP4 cast, which keeps the decode factor: its reciprocal, rounded once."""
    # an NVFP4 cast (the only kind passed here) always holds its tensor scale
    return torch.reciprocal(cast(torch.Tensor, q.tensor_scale).to(torch.float32))
