"""The end products of a run: ``model.safetensors`` (bf16, plain model), ``config.json`` and the
resolved training config.

``model.safetensors`` holds the weights in bfloat16 under the plain model's names: FP8 scaling
state is dropped (``lowprec.fp8.plain_state_dict``) and tied tensors are stored once per key,
so ``build_model(...).load_state_dict(safetensors.torch.load_file(path))`` works with nothing
but torch and safetensors.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
import yaml
from lowprec.fp8 import plain_state_dict
from lowprec.guard_moves import is_move_back, moved_gemms, moved_layers
from lowprec.train.model import LlamaConfig, LlamaForCausalLM
from lowprec.utils.parallelism import describe_ep

__all__ = ["export_model", "write_resolved_config", "load_exported_model", "write_conversion_report"]


def export_model(state_dict: dict[str, torch.Tensor], model_config: dict[str, Any], output_dir: str) -> str:
    from safetensors.torch import save_file

    sd = plain_state_dict(state_dict)
    out = {}
    for k, t in sd.items():
        t = t.detach().to("cpu")
        out[k] = (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous().clone()
    path = os.path.join(output_dir, "model.safetensors")
    tmp = path + ".tmp"
    save_file(out, tmp, metadata={"format": "pt", "dtype": "bfloat16"})
    os.replace(tmp, path)
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(model_config, f, indent=1)
    return path


def load_exported_model(output_dir: str, dtype: torch.dtype = torch.float32):
    """The plain built-in model with the exported weights (for tests and users)."""
    from safetensors.torch import load_file

    with open(os.path.join(output_dir, "config.json")) as f:
        cfg = LlamaConfig(**json.load(f))
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(load_file(os.path.join(output_dir, "model.safetensors")))
    return model.to(dtype)


def write_resolved_config(config: dict[str, Any], decisions: dict[str, Any], output_dir: str) -> str:
    """``resolved_config.yaml``: the full config (defaults filled in) plus every decision made."""
    path = os.path.join(output_dir, "resolved_config.yaml")
    body = dict(config)
    body["_resolved"] = {k: {"value": _plain(d.value), "reason": d.reason} for k, d in decisions.items()}
    with open(path, "w") as f:
        yaml.safe_dump(body, f, sort_keys=False)
    return path


def _plain(v: Any) -> Any:
    return v if isinstance(v, (bool, int, float, str, type(None))) else str(v)


def moves_text(moves: list[dict[str, Any]]) -> str:
    """The conversion report's section on the guard's moves and moves back, in order ('' when none)."""
    if not moves:
        return ""
    back = sum(map(is_move_back, moves))
    head = f"fp8_guard: {len(moves) - back} layer(s) moved to high precision (bf16) during training"
    if back:
        head += f", {back} moved back to FP8 ({len(moved_layers(moves))} in bf16 at the end)"
    if any(m.get("gemms") for m in moves):  # fp8_guard_scope: gemm
        now = moved_gemms(moves)
        head += "; per GEMM, in bf16 at the end: " + (
            "; ".join(f"{layer} {', '.join(g)}" for layer, g in now.items()) or "none"
        )
    lines = ["", head + ":"]
    lines += [f"  step {m['step']}: {m['layer']}  {_move_words(m)}" for m in moves]
    return "\n".join(lines)


def _move_words(m: dict[str, Any]) -> str:
    which = f"{', '.join(m['gemms'])} " if m.get("gemms") else ""
    if is_move_back(m):
        return f"moved back to FP8 {which}after {m.get('checks')} healthy checks (it moved for {m['signal']})"
    return f"{which}({m['signal']} = {m['value']:.4g})"


def write_conversion_report(acc, output_dir: str, moves: tuple = ()) -> Optional[str]:
    """The full per-layer FP8 conversion table, next to the metrics (the console has one line),
    and the layers fp8_guard: act moved to high precision since (rewritten at each move)."""
    report = getattr(getattr(acc, "backend", None), "report", None)
    if report is None:
        return None
    ep = describe_ep(getattr(acc, "parallelism_config", None), acc.num_processes)
    path = os.path.join(output_dir, "fp8_conversion.txt")
    with open(path, "w") as f:
        f.write(str(report) + "\n" + (ep + "\n" if ep else "") + (moves_text(list(moves)) + "\n" if moves else ""))
    return path
