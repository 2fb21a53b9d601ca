"""Pick the FP8 backend, once: explicit handler > ``ACCELERATE_FP8_BACKEND`` > auto (native).

A TE, MS-AMP or torchao recipe asked for where that library is missing runs the same recipe on
lowprec's native engine, and the choice is logged once with its reason.
"""

from __future__ import annotations

from typing import Optional

from lowprec.backends.availability import is_available
from lowprec.backends.base import Backend, log_once
from lowprec.kwargs import (
    FP8_PREFIX,
    AORecipeKwargs,
    FP8RecipeKwargs,
    MSAMPRecipeKwargs,
    NativeRecipeKwargs,
    RecipeKwargs,
    TERecipeKwargs,
    env_get,
    environ,
    normalize_backend,
)

__all__ = ["select_backend", "default_handler", "native_recipe_for", "warn_unread_env"]

_DEFAULT_HANDLERS = {
    "native": NativeRecipeKwargs,
    "torchao": AORecipeKwargs,
    "te": TERecipeKwargs,
    "msamp": MSAMPRecipeKwargs,
}
_LIBRARY = {"torchao": "torchao", "te": "transformer_engine", "msamp": "msamp"}


def default_handler(handler: Optional[RecipeKwargs]) -> tuple[RecipeKwargs, str]:
    """The handler to use and why: the user's, or one built for the env-named backend."""
    if isinstance(handler, FP8RecipeKwargs):
        return handler.to_handler(), f"FP8RecipeKwargs(backend={handler.backend!r}) (deprecated spelling)"
    if handler is not None:
        return handler, f"{type(handler).__name__} passed in kwargs_handlers"
    raw = env_get("ACCELERATE_FP8_BACKEND")
    name = normalize_backend(raw, "ACCELERATE_FP8_BACKEND")
    if name is not None:
        return _DEFAULT_HANDLERS[name](), f"env ACCELERATE_FP8_BACKEND={raw}"
    return NativeRecipeKwargs(), "auto: no FP8 backend asked for; the native engine is always available"


def native_recipe_for(handler: RecipeKwargs):
    """The native engine's recipe equivalent to a handler (the fallback's 'same recipe')."""
    from lowprec.fp8.recipes import Recipe

    if isinstance(handler, NativeRecipeKwargs):
        return handler.to_recipe()
    if isinstance(handler, TERecipeKwargs):
        if handler.fp8_format == "E5M2":
            raise ValueError(
                "fp8_format='E5M2' needs TransformerEngine; the native engine runs HYBRID or E4M3"
            )
        if handler.use_mxfp8_block_scaling:
            # MXFP8: E4M3 everywhere, power-of-two scales per 32-element block
            return Recipe.from_name("blockwise", block_size=32, use_during_eval=handler.use_autocast_during_eval)
        return Recipe.from_name(
            "delayed",
            fp8_format=handler.fp8_format,
            margin=handler.margin,
            interval=handler.interval,
            amax_history_len=handler.amax_history_len,
            amax_compute_algo=handler.amax_compute_algo,
            override_linear_precision=tuple(handler.override_linear_precision),
            use_during_eval=handler.use_autocast_during_eval,
        )
    if isinstance(handler, MSAMPRecipeKwargs):
        return Recipe.from_name("delayed")
    if isinstance(handler, AORecipeKwargs):
        ignored = [k for k, v in (("config", handler.config is not None), ("pad_inner_dim", handler.pad_inner_dim is False)) if v]
        if ignored:
            log_once(f"lowprec: AORecipeKwargs {', '.join(ignored)} configure torchao only and have no "
                     "effect on lowprec's native engine (torchao is not installed)")
        return Recipe.from_name(handler.recipe or "tensorwise", use_during_eval=handler.use_autocast_during_eval)
    raise TypeError(f"not an FP8 recipe handler: {type(handler).__name__}")


_OVERRIDES = ("OVERRIDE_FPROP", "OVERRIDE_DGRAD", "OVERRIDE_WGRAD")
_SCALING = ("FORMAT", "AMAX_HISTORY_LEN", "AMAX_COMPUTE_ALGO", "MARGIN", "INTERVAL") + _OVERRIDES
# the FP8 variables each handler reads (ACCELERATE_FP8_ prefix unless spelled out); every
# backend reads ACCELERATE_FP8_BACKEND through the selection itself
_ENV_READ = {
    TERecipeKwargs: _SCALING + ("USE_AUTOCAST_DURING_EVAL", "USE_MXFP8_BLOCK_SCALING"),
    MSAMPRecipeKwargs: ("OPT_LEVEL",),
    AORecipeKwargs: ("PAD_INNER_DIM", "ENABLE_FSDP_FLOAT8_ALL_GATHER", "USE_AUTOCAST_DURING_EVAL"),
    NativeRecipeKwargs: _SCALING + ("USE_AUTOCAST_DURING_EVAL", "LOWPREC_FP8_RECIPE"),
}
_HINT = {
    "LOWPREC_FP8_RECIPE": "it picks a recipe for the native backend only (ACCELERATE_FP8_BACKEND=NATIVE)",
    FP8_PREFIX + "OPT_LEVEL": "O1/O2 come with the msamp backend only (ACCELERATE_FP8_BACKEND=MSAMP)",
}


def warn_unread_env(handler: RecipeKwargs) -> list[str]:
    """Log once per variable each ``ACCELERATE_FP8_*`` / ``LOWPREC_FP8_RECIPE`` that is set but
    that the chosen backend's handler never reads (so the user does not believe it took effect).
    Returns the names."""
    reads = {name if name.startswith("LOWPREC_") else FP8_PREFIX + name
             for name in _ENV_READ.get(type(handler), ())}
    reads.add(FP8_PREFIX + "BACKEND")
    unread = sorted(
        name for name, value in environ().items()
        if value != "" and (name.startswith(FP8_PREFIX) or name == "LOWPREC_FP8_RECIPE") and name not in reads
    )
    for name in unread:
        hint = _HINT.get(name, "it has no effect there")
        log_once(f"lowprec: {name} is set but the {handler.backend} FP8 backend ({type(handler).__name__}) "
                 f"does not read it; {hint}")
    return unread


def select_backend(handler: Optional[RecipeKwargs]) -> Backend:
    handler, why = default_handler(handler)
    warn_unread_env(handler)
    name = handler.backend
    library = _LIBRARY.get(name)
    if library is not None and is_available(name):
        if name == "torchao":
            from lowprec.backends.torchao import TorchAOBackend

            return TorchAOBackend(handler, reason=f"{why}; torchao installed")
        if name == "te":
            from lowprec.backends.te import TEBackend

            return TEBackend(handler, reason=f"{why}; transformer_engine installed")
        from lowprec.backends.msamp import MSAMPBackend

        return MSAMPBackend(handler.opt_level, reason=f"{why}; msamp installed")

    from lowprec.backends.native import NativeBackend

    recipe = native_recipe_for(handler)
    if library is None:
        return NativeBackend(
            recipe,
            reason=why,
            module_filter=handler.module_filter_func,
            skip_first_last=handler.skip_first_last,
            skip_patterns=handler.skip_patterns,
        )
    reason = f"{why}; {library} is not installed, so lowprec's native engine runs the same recipe ({recipe.name})"
    log_once(f"lowprec: FP8 backend {name!r}: {reason}")
    if name == "msamp":
        from lowprec.backends.msamp import NativeOptLevelBackend

        return NativeOptLevelBackend(recipe, handler.opt_level, reason)
    if name == "te":  # TE converts every eligible Linear, the first and last included
        return NativeBackend(recipe, name="te", reason=reason, skip_first_last=False, skip_patterns=())
    return NativeBackend(recipe, name="torchao", reason=reason, module_filter=handler.module_filter_func)
