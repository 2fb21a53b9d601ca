"""The TransformerEngine backend's declaration: TE's DelayedScaling, MXFP8BlockScaling and
NVFP4BlockScaling where TE is installed, else the same recipe on lowprec's engine. The
implementation (and the fixes over Accelerate) is in ``lowprec/backends/engines/te.py``."""

from __future__ import annotations

from lowprec.backends.spec import RECIPE_SETTINGS, BackendSpec, Implementation, moved_to_engine
from lowprec.kwargs import TERecipeKwargs

__all__ = ["SPEC"]

# the implementation's names, importable from here as before (loaded when asked for)
__getattr__ = moved_to_engine("te", ("TEBackend", "te_convert", "build_te_recipe", "native_recipe"), __name__)


SPEC = BackendSpec(
    env_value="TE",
    aliases=("transformer_engine", "transformerengine", "transformer-engine"),
    summary="NVIDIA TransformerEngine (DelayedScaling, MXFP8BlockScaling, NVFP4BlockScaling); else the same recipe natively",
    kwargs_class=TERecipeKwargs,
    reads=RECIPE_SETTINGS,
    reads_env=("ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING", "ACCELERATE_FP8_USE_NVFP4_BLOCK_SCALING"),
    fp8_formats=("HYBRID", "E4M3", "E5M2"),
    library="transformer_engine",
    distributions=("transformer_engine", "transformer-engine", "transformer_engine_torch"),
    create=Implementation("te:create"),
    native_recipe=Implementation("te:native_recipe"),
    fallback=Implementation("te:fallback"),
)
