"""lowprec.fp8: the FP8 engine. Needs nothing but torch.

import lowprec.fp8 as fp8
report = fp8.convert(model, recipe=fp8.Recipe.from_name("delayed"))
print(report)
loss = model(x).loss            # conversion is the switch: FP8 GEMMs in training mode
loss.backward()
with fp8.autocast(enabled=False):
    ref = model(x).loss         # an override: high precision for this region
"""

from lowprec.fp8.modules.autocast import autocast, fp8_enabled
from lowprec.fp8.gemm.capability import trace_as
from lowprec.fp8.modules.recompute import checkpoint
from lowprec.fp8.convert import (
    DEFAULT_SKIP_PATTERNS,
    ConversionReport,
    convert,
    default_module_filter,
    has_fp8_layers,
    plain_state_dict,
    unconvert,
)
from lowprec.fp8.observe.cost_model import DeviceProfile, auto_module_filter, predict_speedup
from lowprec.fp8.cast.formats import E4M3, E5M2, Format, fp8_max
from lowprec.fp8.gemm.dispatch import native_scaled_mm_available, scaled_mm
from lowprec.fp8.modules.linear import Float8Linear, delayed_scale_step
from lowprec.fp8.modules.conv1d import Float8Conv1D
from lowprec.fp8.modules.fp8_base import Float8BaseLinear
from lowprec.fp8.cast.quantize import Float8Data, dequantize, quantize, saturated_cast
from lowprec.fp8.recipes import RECIPE_NAMES, Recipe
from lowprec.fp8.cast.scaling import amax_to_scale
from lowprec.fp8.observe.telemetry import disable as disable_telemetry
from lowprec.fp8.observe.telemetry import enable as enable_telemetry
from lowprec.fp8.observe.telemetry import expert_telemetry, telemetry
from lowprec.fp8.modules.experts import Float8Experts
from lowprec.fp8.modules.grouped import Float8GroupedGemm

__all__ = [
    "E4M3",
    "E5M2",
    "Format",
    "fp8_max",
    "Recipe",
    "RECIPE_NAMES",
    "Float8Data",
    "quantize",
    "dequantize",
    "saturated_cast",
    "amax_to_scale",
    "scaled_mm",
    "native_scaled_mm_available",
    "Float8Linear",
    "Float8Conv1D",
    "Float8BaseLinear",
    "delayed_scale_step",
    "convert",
    "unconvert",
    "has_fp8_layers",
    "plain_state_dict",
    "default_module_filter",
    "DEFAULT_SKIP_PATTERNS",
    "ConversionReport",
    "autocast",
    "checkpoint",
    "fp8_enabled",
    "telemetry",
    "expert_telemetry",
    "Float8Experts",
    "Float8GroupedGemm",
    "enable_telemetry",
    "disable_telemetry",
    "DeviceProfile",
    "predict_speedup",
    "auto_module_filter",
    "trace_as",
]
