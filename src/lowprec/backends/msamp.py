"""MS-AMP's declaration: the real library (O1/O2 via ``msamp.initialize``) where it is
installed, else lowprec's own O1/O2 on the delayed recipe. The implementation (and how each
composes with DDP, FSDP2 and DeepSpeed) is in ``lowprec/backends/engines/msamp.py``."""

from __future__ import annotations

from lowprec.backends.spec import BackendSpec, Implementation, moved_to_engine
from lowprec.kwargs import MSAMPRecipeKwargs

__all__ = ["SPEC"]

# the implementation's names, importable from here as before (loaded when asked for)
__getattr__ = moved_to_engine("msamp", ("MSAMPBackend", "NativeOptLevelBackend", "native_recipe"), __name__)


SPEC = BackendSpec(
    env_value="MSAMP",
    aliases=("ms-amp", "ms_amp"),
    summary="Microsoft MS-AMP O1/O2 (FP8 gradients and all-reduce; O2 also FP8/FP16 Adam state); else lowprec's O1/O2",
    kwargs_class=MSAMPRecipeKwargs,
    reads=("fp8_opt_level",),
    library="msamp",
    distributions=("msamp", "ms-amp"),
    create=Implementation("msamp:create"),
    native_recipe=Implementation("msamp:native_recipe"),
    fallback=Implementation("msamp:fallback"),
)
