"""Weights that a big-model dispatch left off the model, read back for ``save_model``.

Accelerate's ``load_checkpoint_and_dispatch(model, ..., device_map={"layer": "disk"})`` leaves
offloaded parameters on the meta device and keeps their values in the ``weights_map`` of a hook
on the module (``module._hf_hook``; a ``SequentialHook`` holds several). ``save_model`` must
write the real values, as Accelerate's does; lowprec has no dispatch of its own, so this only
reads what such a hook holds. A meta tensor that no hook holds is an error naming it (saving
it would write garbage).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["fill_offloaded"]


def _weights_maps(module: nn.Module) -> list[Any]:
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    return [h.weights_map for h in hooks if getattr(h, "weights_map", None) is not None]


def fill_offloaded(model: nn.Module, state_dict: dict) -> dict:
    """``state_dict`` with every meta tensor replaced by its offloaded value (on the CPU)."""
    if not any(isinstance(t, torch.Tensor) and t.is_meta for t in state_dict.values()):
        return state_dict
    out = dict(state_dict)
    for prefix, module in model.named_modules():
        maps = _weights_maps(module)
        if not maps:
            continue
        local = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for name, _ in local:
            key = f"{prefix}.{name}" if prefix else name
            held = next((m[name] for m in maps if name in m), None)
            if key in out and out[key].is_meta and held is not None:
                out[key] = held.detach().to("cpu")
    missing = [k for k, t in out.items() if isinstance(t, torch.Tensor) and t.is_meta]
    if missing:
        raise ValueError(
            f"save_model: {missing[0]} is on the meta device and no offload hook holds its value "
            f"({len(missing)} such tensors); load the weights (or dispatch with an offload folder) first"
        )
    return out
