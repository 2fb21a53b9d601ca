"""Hugging Face Accelerate's own configuration objects, converted to lowprec's.

Code that builds Accelerate objects and hands them to an Accelerator (``transformers.Trainer``
builds ``DistributedDataParallelKwargs``, ``GradientAccumulationPlugin``,
``DataLoaderConfiguration``, and ``TorchDynamoPlugin`` / ``FullyShardedDataParallelPlugin`` /
``DeepSpeedPlugin`` when asked) can hand them to ``lowprec.Accelerator``: each one is converted
here, field by field, to lowprec's class of the same name.

The rule, so nothing is dropped silently:

* a field at Accelerate's declared default is left to lowprec's default (Accelerate's own
  ``to_kwargs()`` rule: ``InitProcessGroupKwargs()``'s ``backend="nccl"`` means "the default");
* any other field lowprec's class also has is passed on (an Enum as its value, ``None`` left to
  lowprec's default, which reads the same environment variable as Accelerate's);
* a field lowprec has no equivalent for is accepted only while it is inert (``None``, ``False``,
  empty, Accelerate's own default, or an enum meaning "no"); any other value is refused with one
  line naming the class, the field and the fix;
* an Accelerate class with no lowprec equivalent (``MegatronLMPlugin``, ...) is refused with one
  line.

accelerate itself is never imported here: an object is Accelerate's when its class was defined
in an ``accelerate.*`` module.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any, Callable, Optional

from lowprec import kwargs as K
from lowprec.errors import UsageError
from lowprec.parallelism_config import ParallelismConfig
from lowprec.utils import dataclasses as D
from lowprec.utils.parallelism import TorchTensorParallelPlugin

__all__ = ["is_accelerate_object", "from_accelerate"]


def is_accelerate_object(obj: Any) -> bool:
    """True when ``obj``'s class comes from the ``accelerate`` package."""
    return type(obj).__module__.split(".")[0] == "accelerate"


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def _inert(value: Any, field: dataclasses.Field) -> bool:
    """A value that asks for nothing (so accepting it without an equivalent changes nothing)."""
    value = _plain(value)
    if value is None or value is False or (isinstance(value, (dict, list, tuple, set, str)) and not value):
        return True
    if isinstance(value, str) and value.lower() in ("no", "none", "auto"):
        return True
    default = field.default
    return default is not dataclasses.MISSING and _plain(default) == value


def _refuse(where: str, cls_name: str, field: str, value: Any, fix: str) -> UsageError:
    return UsageError(f"{where}: Accelerate's {cls_name}({field}={_plain(value)!r}) has no lowprec equivalent; {fix}")


def _lowprec_class(name: str) -> Optional[type]:
    """lowprec's class for an Accelerate class name (None: none)."""
    table = {
        "ParallelismConfig": ParallelismConfig,
        "TorchTensorParallelPlugin": TorchTensorParallelPlugin,
    }
    for module in (K, D):
        table.update({n: getattr(module, n) for n in module.__all__ if isinstance(getattr(module, n, None), type)})
    return table.get(name)


# per class: Accelerate field -> how to read it (a converter of the value, or the lowprec field
# name); fields not listed go through the general rule above
def _ds_config(value: Any) -> Any:
    return getattr(value, "config", value)  # HfDeepSpeedConfig -> its dict


def _auto_none(value: Any) -> Any:
    return None if value == "auto" else value


def _offload(value: Any) -> bool:
    # FSDP2 takes an OffloadPolicy; CPUOffloadPolicy (or True) puts parameters on CPU
    return bool(value) if isinstance(value, bool) else type(value).__name__ == "CPUOffloadPolicy"


def _enum_name(value: Any) -> Any:
    return value.name if isinstance(value, Enum) else value


def _wrap_policy(value: Any) -> Any:
    """Accelerate's plugin turns its policy name into torch's function in ``__post_init__``
    (transformers' Trainer always names one); lowprec's plugin takes the name back. Any other
    callable (a user's own policy, a ``functools.partial``) has no lowprec equivalent."""
    if value is None or isinstance(value, str):
        return value
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    names = {transformer_auto_wrap_policy: "TRANSFORMER_BASED_WRAP", size_based_auto_wrap_policy: "SIZE_BASED_WRAP"}
    if value in names:
        return names[value]
    raise _refuse(
        "fsdp_plugin",
        "FullyShardedDataParallelPlugin",
        "auto_wrap_policy",
        value,
        "name the policy (TRANSFORMER_BASED_WRAP with transformer_cls_names_to_wrap, SIZE_BASED_WRAP with "
        "min_num_params, or NO_WRAP)",
    )


SPECIAL: dict[str, dict[str, Callable[[Any], Any]]] = {
    "DeepSpeedPlugin": {"hf_ds_config": _ds_config, "gradient_clipping": _auto_none},
    "FullyShardedDataParallelPlugin": {
        "cpu_offload": _offload,
        "state_dict_type": _enum_name,
        "auto_wrap_policy": _wrap_policy,
    },
}
RENAMED = {"FullyShardedDataParallelPlugin": {"cpu_offload": "offload_params"}}
# fields Accelerate derives from others lowprec converts (never set by hand to mean more)
DERIVED = {
    "FullyShardedDataParallelPlugin": ("state_dict_config", "optim_state_dict_config", "limit_all_gathers"),
    # zero3_init_flag acts where the model is built (transformers' from_pretrained reads the
    # HfDeepSpeedConfig Accelerate's plugin registered), not in the Accelerator
    "DeepSpeedPlugin": ("is_train_batch_min", "msamp_opt_level", "zero3_init_flag"),
    # the backends of context/sequence parallelism, which lowprec refuses by their sizes
    "ParallelismConfig": ("cp_backend", "sp_backend", "tp_handler", "cp_handler", "sp_handler"),
}
# values that ask for nothing beyond the general rule (DeepSpeed's accumulation of one step)
INERT = {"DeepSpeedPlugin": {"gradient_accumulation_steps": (1,)}, "ParallelismConfig": {"sp_size": (1,)}}
FIXES = {
    "TorchDynamoPlugin": "compile the whole model (drop use_regional_compilation)",
    "FullyShardedDataParallelPlugin": "lowprec runs FSDP2 (fully_shard) with its own mixed precision and wrapping; drop it",
    "DeepSpeedPlugin": "set it in the DeepSpeed config dict (hf_ds_config), pass gradient_accumulation_steps to the "
    "Accelerator, or use MSAMPRecipeKwargs for MS-AMP",
    "ProfileKwargs": "drop it",
    "ParallelismConfig": "lowprec runs tensor parallelism and data-parallel sharding only; drop it",
}


def from_accelerate(obj: Any, where: str = "") -> Any:
    """lowprec's equivalent of an Accelerate kwargs handler, plugin or configuration object;
    any other object is returned unchanged. ``where``: the argument it came in (for errors)."""
    where = where or "Accelerator"
    if not is_accelerate_object(obj) or not dataclasses.is_dataclass(obj):
        if is_accelerate_object(obj) and not isinstance(obj, type):
            raise UsageError(f"{where}: Accelerate's {type(obj).__name__} has no lowprec equivalent; remove it")
        return obj
    name = type(obj).__name__
    target = _lowprec_class(name)
    if target is None:
        raise UsageError(
            f"{where}: Accelerate's {name} has no lowprec equivalent "
            "(lowprec runs DDP, FSDP2, DeepSpeed ZeRO and tensor parallelism); remove it"
        )
    ours = {f.name for f in dataclasses.fields(target) if f.init}
    special, renamed, derived, inert = (
        SPECIAL.get(name, {}),
        RENAMED.get(name, {}),
        DERIVED.get(name, ()),
        INERT.get(name, {}),
    )
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        dest = renamed.get(f.name, f.name)
        if f.default is not dataclasses.MISSING and _plain(value) == _plain(f.default) and f.name not in special:
            continue  # Accelerate's default: lowprec's default applies (Accelerate's to_kwargs() rule)
        if dest in ours:
            value = special.get(f.name, _plain)(value)
            if value is not None:
                kw[dest] = list(value) if isinstance(value, set) else value
        elif f.name not in derived and not _inert(value, f) and _plain(value) not in inert.get(f.name, ()):
            raise _refuse(where, name, f.name, value, FIXES.get(name, "drop it"))
    if name == "DeepSpeedPlugin" and getattr(obj, "enable_msamp", False):
        raise _refuse(where, name, "enable_msamp", True, "pass MSAMPRecipeKwargs(opt_level=...) in kwargs_handlers")
    try:
        return target(**kw)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{where}: Accelerate's {name} could not be converted: {err}") from None
