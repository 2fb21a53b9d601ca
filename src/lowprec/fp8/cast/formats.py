"""FP8 formats: the two dtypes, their ranges, and the named format pairs.

E4M3 (``float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, max 448, no inf, has NaN.
E5M2 (``float8_e5m2``):   5 exponent bits, 2 mantissa bits, max 57344, has inf and NaN.

``Format.HYBRID`` casts forward operands (activations, weights) to E4M3 and gradients to
E5M2 (TransformerEngine's default); ``Format.E4M3`` uses E4M3 everywhere (DeepSeek-V3,
torchao rowwise).
"""

from __future__ import annotations

from enum import Enum

import torch

__all__ = ["E4M3", "E5M2", "Format", "fp8_max", "is_fp8_dtype", "saturation_threshold"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

_MAX = {E4M3: 448.0, E5M2: 57344.0}
# Half the spacing between the largest finite value and the one below it: values up to
# max + this would round to max anyway (E4M3: 448 +- 16, E5M2: 57344 + 4096).
_HALF_TOP_ULP = {E4M3: 16.0, E5M2: 4096.0}


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2).

    Literals, not a read of ``_MAX``: under ``torch.compile(dynamic=True)`` Dynamo makes a float
    read from a module global a graph input, which it then cannot lift out of a traced
    autograd.Function (an AssertionError inside Dynamo at the second FP8 layer); a literal in
    the code stays a constant. ``tests/test_fp8_compile.py`` compiles with it.
    """
    if dtype == E4M3:
        return 448.0
    if dtype == E5M2:
        return 57344.0
    raise ValueError(f"{dtype} is not an FP8 dtype; use lowprec.fp8.E4M3 or E5M2")


def saturation_threshold(dtype: torch.dtype) -> float:
    """Magnitude above which a scaled value is *clipped* rather than rounded to ``fp8_max``.

    A value in (fp8_max, threshold] would round to fp8_max under round-to-nearest anyway; only
    beyond it does saturation lose information. Telemetry counts those.
    """
    return fp8_max(dtype) + _HALF_TOP_ULP[dtype]


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in _MAX


class Format(str, Enum):
    """Named pair (forward dtype, gradient dtype), spelled as TransformerEngine spells it."""

    E4M3 = "E4M3"
    HYBRID = "HYBRID"

    @classmethod
    def parse(cls, value: "Format | str") -> "Format":
        if isinstance(value, Format):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            raise ValueError(
                f"fp8_format={value!r} is not known; use 'HYBRID' (E4M3 forward, E5M2 gradients) "
                "or 'E4M3' (E4M3 everywhere)"
            ) from None

    @property
    def forward_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        return E5M2 if self is Format.HYBRID else E4M3
