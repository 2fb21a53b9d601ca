"""Fused 3-D experts (Mixtral, Qwen3-MoE, ``builtin:moe-tiny``) in an FP8 export.

transformers 5 holds a MoE layer's experts as one module with ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I), but the checkpoints it writes (``save_pretrained``) and that it, vLLM and
SGLang read are per-expert 2-D Linear weights (Mixtral: ``block_sparse_moe.experts.{e}.w1/w3/w2``;
Qwen2/Qwen3-MoE, DeepSeek-V3: ``mlp.experts.{e}.gate_proj/up_proj/down_proj``), which its
conversion mapping fuses at load, together with their ``weight_scale_inv`` (fine-grained FP8) or
``weight_scale`` (compressed-tensors; with ``dequantize`` both are dequantized per expert first).
So the export writes each expert's gate, up and down projections as Linear weights with their
own scales, named by transformers' own reverse conversion (``revert_weight_conversion``, what
``save_pretrained`` runs), never by a table of lowprec's.

Per expert, the trained cast is the grouped GEMM's: ``kind.forward_weight_cast`` of the expert's
slot, the function the forward calls. ``gate_up_proj``'s cast is split at row ``I`` into gate and
up: exact where no scale spans both (per tensor: the one scale, written to both; per channel;
blocks when ``I`` is a multiple of the block); otherwise each half is quantized once with the
format's rule and the report says so. The router (``gate`` / ``router``) is never quantized: it
is in the ignore list. gpt-oss-style experts (transposed, with biases) are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowprec.export.casts import Scheme, format_cast
from lowprec.fp8.modules.experts import Float8Experts, experts_layout
from lowprec.fp8.cast.quantize import Float8Data
from lowprec.fp8.recipes import Recipe

__all__ = ["plan_experts", "split_rows", "checkpoint_names", "ROUTER"]

ROUTER = "router: its top-k choice is discrete, kept in high precision (never quantized)"


def split_rows(cast: Float8Data, parts: int) -> list[Float8Data] | None:
    """``cast`` (out, in) as ``parts`` equal row ranges, each with exactly its scales; None where a
    scale spans two ranges (blocks taller than a range's rows, or not aligned to them)."""
    rows = cast.data.shape[0]
    if rows % parts:
        return None
    n = rows // parts
    if cast.granularity == "tensor":
        scales = [cast.scale] * parts
    elif cast.granularity == "axis" and cast.scale.dim() == 2 and cast.scale.shape[0] == rows:
        scales = list(cast.scale.split(n, dim=0))
    elif cast.granularity == "block" and cast.block is not None and n % cast.block[0] == 0:
        scales = list(cast.scale.split(n // cast.block[0], dim=0))
    else:
        return None
    return [
        Float8Data(d, s, cast.granularity, cast.block)
        for d, s in zip(cast.data.split(n, dim=0), scales)  # fmt: skip
    ]


def _refuse(name: str, why: str) -> ValueError:
    return ValueError(
        f"export: {name} {why}; convert without its experts (skip_patterns=['experts']) to export it "
        "with the experts in bf16, or export the bf16 model.safetensors"
    )


def plan_experts(
    model: nn.Module, scheme: Scheme, recipe: Recipe | None, trained: bool, plan: Any, quantized_layer: type
) -> None:
    """Add each fused experts module's per-expert, per-part casts to ``plan`` (``quantized_layer``:
    layers.QuantizedLayer), its router to ``plan.kept``, and a note where a part is quantized once."""
    once: list[str] = []
    modules: list[str] = []
    for name, m in model.named_modules():
        layout = experts_layout(m)
        if layout is None:
            continue
        converted = isinstance(m, Float8Experts)
        if recipe is not None and not converted:
            plan.kept[name] = "high precision in training (fp8_filter / skip pattern)"
            continue
        if layout.grouped:
            raise _refuse(
                name, "is a torchtitan-style GroupedExperts (w1/w2/w3), which has no transformers layout to export to"
            )
        if layout.transposed or layout.bias:
            raise _refuse(name, "has transposed experts with biases (gpt-oss style), which the export does not write")
        if scheme.microscaled:
            raise _refuse(
                name,
                f"is a fused experts module; the {scheme.granularity.upper()} export of experts is not written yet "
                "(use --requantize for FP8 per channel)",
            )
        modules.append(f"{name} ({layout.num_experts} experts)")
        gemms = m.fp8_gemms() if converted else {}
        if converted and set(gemms) != set(layout.projections):
            raise _refuse(
                name,
                "keeps one projection in high precision (a skip pattern); a checkpoint's experts are FP8 in "
                "every projection or in none",
            )
        parent = name.rpartition(".")[0]
        for router in ("gate", "router"):
            full = f"{parent}.{router}" if parent else router
            if _has(model, full):
                plan.kept[full] = ROUTER
        for i, proj in enumerate(layout.projections):
            parts = 2 if (i == 0 and layout.has_gate) else 1
            weights = layout.weight(m, proj).detach()
            for e in range(layout.num_experts):
                pieces = None
                if trained:
                    slot = gemms[proj].slot(e, weights[e])
                    try:
                        pieces = split_rows(m.recipe.kind.forward_weight_cast(slot, m.recipe), parts)
                    finally:
                        slot.__dict__.pop("weight", None)
                    if pieces is None and f"{name}.{proj}" not in once:
                        once.append(f"{name}.{proj}")
                exact = pieces is not None
                if pieces is None:
                    pieces = [format_cast(w, scheme) for w in weights[e].chunk(parts, dim=0)]
                for p, cast in enumerate(pieces):
                    plan.quantized.append(quantized_layer(f"{name}.{proj}", cast, False, exact, expert=(e, p, parts)))
    if modules:
        routers = sum(1 for why in plan.kept.values() if why == ROUTER)
        plan.notes.append(
            f"experts: {len(modules)} fused experts module(s) ({modules[0]}, ...) written as per-expert Linear "
            "weights (gate, up, down projections, each with its own scales), named as transformers' save_pretrained "
            f"writes them; {routers} router(s) kept bf16 (in the ignore list)"
        )
    if once:
        plan.notes.append(
            f"{len(once)} fused expert projection(s) ({once[0]}, ...) have a scale block spanning gate and up rows "
            "(the intermediate size is not a multiple of the block): their gate and up halves are quantized once "
            "with the format's rule; the other experts keep their trained scales"
        )


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def checkpoint_names(config: dict[str, Any], keys: list[str], fused: dict[str, tuple[int, int]]) -> dict[Any, str]:
    """The checkpoint names transformers' ``save_pretrained`` gives: ``key -> name`` for each plain
    key, ``(fused key, expert, part) -> name`` (a ``...weight`` name) for each fused experts
    projection ``fused[key] = (experts, parts)``; from its reverse conversion of the model type."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # optional: only a MoE export needs it, to name the experts as transformers does
        raise ValueError(
            "export: writing fused experts as per-expert weights needs transformers (its conversion mapping names "
            "them): pip install transformers"
        ) from None
    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise ValueError("export: the config has no model_type, so the experts' checkpoint names are unknown")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    dummy: dict[str, torch.Tensor] = {}
    code = 0
    origin: dict[int, Any] = {}
    for k in keys:
        dummy[k] = torch.tensor([[float(code)]])
        origin[code] = k
        code += 1
    for k, (experts, parts) in fused.items():
        dummy[k] = torch.arange(code, code + experts * parts, dtype=torch.float32).reshape(experts, parts, 1)
        for e in range(experts):
            for p in range(parts):
                origin[code + e * parts + p] = (k, e, p)
        code += experts * parts
    names: dict[Any, str] = {}
    for new, t in revert_weight_conversion(meta, dummy).items():
        if t.numel() != 1:
            raise ValueError(
                f"export: transformers' {model_type} conversion mapping writes {new} from several tensors, "
                "which the export does not handle"
            )
        names[origin[int(t.reshape(-1)[0])]] = new
    missing = [k for k in fused if (k, 0, 0) not in names or names[(k, 0, 0)] == k]
    if missing or len(names) != len(origin):
        raise ValueError(
            f"export: transformers has no per-expert checkpoint layout for model_type {model_type!r} "
            f"({(missing or ['its keys'])[0]} is not split per expert); its fused experts cannot be written in FP8"
        )
    return names
