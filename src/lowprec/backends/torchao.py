"""The torchao backend's declaration: ``torchao.float8.convert_to_float8_training`` (real
torchao, optional), else the same recipe on lowprec's engine. The implementation (and the fixes
over Accelerate) is in ``lowprec/backends/engines/torchao.py``."""

from __future__ import annotations

from lowprec.backends.spec import BackendSpec, Implementation, moved_to_engine
from lowprec.kwargs import AORecipeKwargs

__all__ = ["SPEC"]

# the implementation's names, importable from here as before (loaded when asked for)
__getattr__ = moved_to_engine("torchao", ("TorchAOBackend", "first_last_linear_filter", "native_recipe"), __name__)


SPEC = BackendSpec(
    env_value="AO",
    summary="PyTorch torchao Float8Linear (tensorwise/rowwise, FSDP2 FP8 all-gather); else the same recipe natively",
    kwargs_class=AORecipeKwargs,
    reads=(
        "fp8_pad_inner_dim",
        "fp8_enable_fsdp_float8_all_gather",
        "fp8_use_autocast_during_eval",
        "fp8_force_recompute_fp8_weight_in_bwd",
    ),
    library="torchao",
    distributions=("torchao",),
    create=Implementation("torchao:create"),
    native_recipe=Implementation("torchao:native_recipe"),
    fallback=Implementation("torchao:fallback"),
    trainer_recipes=("tensorwise", "rowwise", "rowwise_with_gw_hp"),  # torchao's Float8LinearRecipeName
    trainer_handler=lambda recipe: AORecipeKwargs(recipe=recipe),
)
