"""lowprec.optim: low-precision optimizer state and MS-AMP style opt levels (torch only)."""

from lowprec.optim.fp8_adamw import FP8Adam, FP8AdamW
from lowprec.optim.opt_level import OPT_LEVELS, apply_opt_level, to_fp8_adamw
from lowprec.optim.fp8_grads import (
    clip_grad_norm_,
    fp8_grad,
    hold_grads_in_fp8,
    materialize_grads,
)

__all__ = [
    "FP8AdamW",
    "FP8Adam",
    "apply_opt_level",
    "to_fp8_adamw",
    "OPT_LEVELS",
    "hold_grads_in_fp8",
    "fp8_grad",
    "materialize_grads",
    "clip_grad_norm_",
]
