"""lowprec.fp8: the FP8 engine (torch only)."""

from lowprec.fp8.formats import E4M3, E5M2, Format, fp8_max
from lowprec.fp8.quantize import Float8Data, dequantize, quantize, saturated_cast
from lowprec.fp8.scaling import amax_to_scale

__all__ = [
    "E4M3",
    "E5M2",
    "Format",
    "fp8_max",
    "Float8Data",
    "quantize",
    "dequantize",
    "saturated_cast",
    "amax_to_scale",
]
