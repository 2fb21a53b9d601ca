"""Whether ``tensor_parallel_size`` splits the model: read from its config before any worker
starts (no torch import). Tensor parallelism gives each process ``1 / tensor_parallel_size`` of
every block's attention heads, key/value heads and MLP units (the colwise q/k/v, gate and up
projections); a size that does not divide one of them would otherwise fail in every worker's
first forward (``shape '[4, 32, -1, 32]' is invalid``)."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from lowprec.train.hf_files import locate_pretrained
from lowprec.train.model_config import LlamaConfig

__all__ = ["model_dims", "check_tensor_parallel_dims"]


def model_dims(base_model: str) -> Optional[dict[str, int]]:
    """``{"attention heads": .., "key/value heads": .., "MLP units": ..}`` of ``base_model``
    (``builtin:<name>``, or a Hugging Face model directory / cached hub id whose config.json
    names them); None where they cannot be read here (the workers then report what fails)."""
    if base_model.startswith("builtin:"):
        try:
            mc = LlamaConfig.from_name(base_model[len("builtin:") :])
        except ValueError:
            return None  # the config check names an unknown built-in model
        return {
            "attention heads": mc.n_heads,
            "key/value heads": int(mc.n_kv_heads or mc.n_heads),
            "MLP units": mc.ffn_dim,
        }
    try:
        path = os.path.join(locate_pretrained(base_model), "config.json")
        with open(path) as f:
            conf: Any = json.load(f)
    except (OSError, ValueError):
        return None  # the trainer names a missing or broken model directory
    conf = conf.get("text_config", conf) if isinstance(conf, dict) else None
    if not isinstance(conf, dict):
        return None
    heads = conf.get("num_attention_heads")
    found = {
        "attention heads": heads,
        "key/value heads": conf.get("num_key_value_heads") or heads,
        "MLP units": conf.get("intermediate_size"),
    }
    dims = {k: v for k, v in found.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
    return dims or None


def check_tensor_parallel_dims(base_model: str, tp: int) -> None:
    """A ValueError (one line naming tensor_parallel_size and the sizes that fit) when ``tp``
    does not divide the model's attention heads, key/value heads or MLP units."""
    if tp <= 1:
        return
    dims = model_dims(base_model)
    if not dims:
        return
    bad = [f"{n} {k}" for k, n in dims.items() if n % tp]
    if not bad:
        return
    common = math.gcd(*dims.values())
    fits = [str(d) for d in range(2, common + 1) if common % d == 0]
    fix = f"set tensor_parallel_size to {' or '.join(fits)}" if fits else "set tensor_parallel_size: 1"
    have = ", ".join(f"{n} {k}" for k, n in dims.items())
    raise ValueError(
        f"tensor_parallel_size: {tp} does not divide {base_model}'s {' and '.join(bad)} (each process takes "
        f"1/{tp} of them; the model has {have}): {fix}, or shard with fsdp_version: 2 instead"
    )
