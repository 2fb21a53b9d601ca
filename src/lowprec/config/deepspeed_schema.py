"""DeepSpeed's own schema check of a config, before any worker starts, as one line naming the key
(torch-free: ``lowprec train`` runs it in the process that launches the workers; DeepSpeed itself
is imported only when the check runs)."""

from __future__ import annotations

import copy
from typing import Any, Optional

__all__ = ["check_deepspeed_config", "deepspeed_config_error"]


def _key_path(node: Any, loc: tuple, value: Any, path: tuple = ()) -> Optional[tuple]:
    """The path in the user's config whose tail is ``loc`` and whose value is ``value``:
    DeepSpeed validates each section with its own pydantic model, whose error locations start
    at the section (``stage``), not at the config (``zero_optimization.stage``)."""
    if path[-len(loc) :] == tuple(str(p) for p in loc) and node == value:
        return path
    if isinstance(node, dict):
        for k, v in node.items():
            found = _key_path(v, loc, value, (*path, str(k)))
            if found:
                return found
    return None


def deepspeed_config_error(exc: BaseException, config: dict, source: str) -> Optional[str]:
    """One line for DeepSpeed's pydantic ``ValidationError`` (a multi-line dump naming its
    model class, not the key), naming the key's full path and ``source``; None for others."""
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ != "ValidationError" or not callable(errors):
        return None
    parts = []
    for err in errors(include_url=False)[:3]:
        loc = tuple(err.get("loc", ()))
        path = _key_path(config, loc, err.get("input")) if loc else None
        key = ".".join(path) if path else ".".join(str(p) for p in loc) or getattr(exc, "title", "config")
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        parts.append(f"{key}: {err['msg'].removeprefix('Value error, ')}{got}")
    return f"{source}: " + "; ".join(parts) + "; fix it (DeepSpeed's config reference lists the values)"


def check_deepspeed_config(config: dict, source: str, micro_batch_size: int, accumulation_steps: int) -> None:
    """DeepSpeed's own schema check of ``config``, before any worker starts (a worker would
    fail with DeepSpeed's raw pydantic dump). Only field errors are reported here: batch-size
    arithmetic depends on the world size, which the launched run checks."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        return  # the run reports the missing package with the install line
    body = copy.deepcopy(config)
    body.setdefault("train_micro_batch_size_per_gpu", micro_batch_size)
    body.setdefault("gradient_accumulation_steps", accumulation_steps)
    try:
        DeepSpeedConfig(body)
    except Exception as exc:  # noqa: BLE001 - only DeepSpeed's schema errors are ours to report
        line = deepspeed_config_error(exc, config, source)
        if line is not None:
            raise ValueError(line) from None
