"""Model conversion: swap ``nn.Linear`` for ``Float8Linear`` in place, and back.

The default filter keeps in high precision, each with its reason in the report:

* the first and the last Linear of the model (in module order), for stability (as Accelerate's
  ``AORecipeKwargs`` and TransformerEngine users do: the embedding-side projection and the
  output head are the most sensitive);
* Linear layers whose ``in_features`` or ``out_features`` is not a multiple of 16 (FP8 GEMM
  kernels need it; padding would cost more than FP8 saves);
* layers whose name has a component equal to one of ``skip_patterns`` (default ``lm_head``,
  ``router``, ``gate``: output heads and MoE routers). Components are matched exactly, so a
  SwiGLU ``gate_proj`` is converted; a pattern with ``*`` or ``?`` is a glob on the full name;
* peft adapter layers (a name component ``lora_A``, ``lora_B``, ...): rank-r GEMMs are too small
  for FP8 to pay, and adapter quality is what fine-tuning optimises (the frozen base layer inside
  the peft wrapper is converted as usual).

``transformers``' ``Conv1D`` (GPT-2: a Linear whose weight is stored in x out) converts to
:class:`~lowprec.fp8.modules.conv1d.Float8Conv1D` under the same rules, keeping its parameter layout
and state_dict (Accelerate + torchao leave it in high precision without a word). Every other
layer type with parameters that stays in high precision is counted in the report by type, with
the reason (embeddings are lookups, norms are elementwise, Linear subclasses such as 4-bit
layers have their own forward).

A recipe with ``high_precision_last > 0`` (nvfp4: 0.15, as NVIDIA keeps about 15% of the Linear
layers, mostly the last ones, in BF16) then keeps that fraction of the layers that would convert,
the last ones in module order (rounded up), in high precision, each with the reason.

With ``Recipe(fp8_activations=True)`` the non-Linear ops that support it (the built-in model's
RMSNorm and SwiGLU MLP, Hugging Face ``LlamaRMSNorm`` / ``LlamaMLP``) also keep E4M3 copies for
backward (:mod:`lowprec.fp8.modules.activations`); the report lists them.

Mixture-of-experts blocks: experts stored as 3-D Parameters (transformers 5's fused experts:
``MixtralExperts``, ``Qwen3MoeExperts``, ``GptOssExperts``, ``DeepseekV3Experts``, ...; the
built-in ``moe-tiny``) convert to ``Float8<Class>`` (:mod:`lowprec.fp8.modules.experts`): the same
Parameters, grouped FP8 GEMMs per expert. Each projection is judged on its own name
(``...experts.gate_up_proj``, ``...experts.down_proj``): a skip pattern (``experts``,
``down_proj``, a glob) keeps it in high precision, as do dims that are not multiples of 16; a
custom ``module_filter`` is asked once, with the experts module. Experts kept as separate
``nn.Linear`` layers (older checkpoints, shared experts) are Linear layers like any other.
Routers (a module named ``router``, ``gate`` or ``shared_expert_gate``, a layer inside one such
as SwitchTransformers' ``router.classifier``, or a ``*Router`` class) are listed in the report.
In a model with experts they stay in high precision whatever ``skip_patterns`` say, and a
``module_filter`` that asks for one in FP8 is a ``ValueError`` naming it. Expert weights in any
other layout (a module with a 2-D/3-D Parameter of its own and ``expert`` in its class or name:
Llama 4's batched experts, DBRX's, JetMoE's, Inkling's shared experts) stay in high precision: the
report lists each as ``experts kept``, the summary counts them and one warning says so.

A custom ``module_filter(module, fqn) -> bool`` replaces the default rules. A skipped layer
never stops its siblings from converting (Accelerate's ``convert_model`` returns early).
"""

from __future__ import annotations

import fnmatch
import math
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from lowprec.fp8 import kinds
from lowprec.fp8.modules import activations
from lowprec.fp8.modules.conv1d import Float8Conv1D, gemm_dims, is_conv1d
from lowprec.fp8.modules.experts import Float8Experts, experts_layout, float8_experts
from lowprec.fp8.modules.fp8_base import Float8BaseLinear
from lowprec.fp8.modules.linear import Float8Linear
from lowprec.fp8.recipes import Recipe, as_recipe

__all__ = [
    "ConversionReport",
    "DEFAULT_SKIP_PATTERNS",
    "ADAPTER_PATTERNS",
    "convert",
    "unconvert",
    "has_fp8_layers",
    "plain_state_dict",
    "default_module_filter",
]

DEFAULT_SKIP_PATTERNS = ("lm_head", "router", "gate")
# name components of MoE routers / shared-expert gates (besides classes named *Router)
ROUTER_NAMES = ("router", "gate", "shared_expert_gate")
ADAPTER_PATTERNS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
logger = logging.getLogger("lowprec.fp8")
ModuleFilter = Callable[[nn.Module, str], bool]


@dataclass
class ConversionReport:
    """What ``convert`` did: converted layers, skipped layers with reasons, GEMM path."""

    recipe: Recipe
    converted: list[tuple[str, int, int]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    gemm: str = ""
    # type name -> (count, reasons): every parameterised layer type left in high precision
    kept_types: dict[str, tuple[int, list[str]]] = field(default_factory=dict)
    # modules whose non-Linear activations backward keeps in E4M3 (recipe.fp8_activations)
    fp8_activations: list[str] = field(default_factory=list)
    # MoE: (experts module, experts, [(projection, in, out) in FP8]) and (router, its class)
    experts: list[tuple[str, int, list[tuple[str, int, int]]]] = field(default_factory=list)
    # layers an earlier convert() made FP8 with this recipe: left as they are (neither converted
    # by this call nor kept in high precision)
    already: list[str] = field(default_factory=list)
    routers: list[tuple[str, str]] = field(default_factory=list)
    grouped_gemm: str = ""
    # expert weights in a layout the grouped GEMMs do not run: (module, its class), high precision
    experts_kept: list[tuple[str, str]] = field(default_factory=list)
    expert_projections_kept: int = 0  # projections of fused experts modules kept in high precision

    @property
    def num_converted(self) -> int:
        return len(self.converted)

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe.to_dict(),
            "converted": [{"name": n, "in_features": i, "out_features": o} for n, i, o in self.converted],
            "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
            "already_fp8": list(self.already),
            "gemm": self.gemm,
            "kept_in_high_precision_by_type": {t: {"count": n, "reasons": r} for t, (n, r) in self.kept_types.items()},
            "fp8_activations": list(self.fp8_activations),
            "experts": [
                {
                    "name": n,
                    "num_experts": e,
                    "fp8": [{"projection": p, "in_features": i, "out_features": o} for p, i, o in ps],
                }
                for n, e, ps in self.experts
            ],
            "routers": [{"name": n, "type": t} for n, t in self.routers],
            "experts_kept": [{"name": n, "type": t} for n, t in self.experts_kept],
            "grouped_gemm": self.grouped_gemm,
            "switch": self.switch(),
        }

    def summary(self) -> str:
        """One line for the console; ``str(report)`` is the full table (one line per layer)."""
        gemm_kept = {
            t: n
            for t, (n, why) in self.kept_types.items()
            if "Linear" in t or "Conv1D" in t or any("Linear subclass" in w for w in why)
        }
        if self.expert_projections_kept:
            gemm_kept["expert projections"] = self.expert_projections_kept
        by_type = f" ({', '.join(f'{t} {n}' for t, n in gemm_kept.items())})" if gemm_kept else ""
        acts = (
            f"; E4M3 activations saved in {len(self.fp8_activations)} module(s)" if self.recipe.fp8_activations else ""
        )
        moe = ""
        if self.experts or self.routers or self.experts_kept:
            kept = ""
            if self.experts_kept:
                kinds = sorted({t for _, t in self.experts_kept})
                kept = f", {len(self.experts_kept)} experts module(s) in high precision ({', '.join(kinds)})"
            moe = (
                f"; MoE: {len(self.experts)} experts module(s) with grouped FP8 GEMMs{kept}, "
                f"{len(self.routers)} router(s) kept in high precision"
            )
        already = f", {len(self.already)} already FP8" if self.already else ""
        return (
            f"FP8 conversion: {len(self.converted)} Linear layer(s) converted{already}, {len(self.skipped)} kept in high "
            f"precision{by_type}; recipe {self.recipe.name}; GEMMs: {self.gemm}{acts}{moe}; {self.switch()}"
        )

    def switch(self) -> str:
        """How FP8 is switched on: conversion is the switch (fp8/modules/autocast.py)."""
        when = "training and eval" if self.recipe.use_during_eval else "training mode (eval: high precision)"
        return f"FP8 on in the converted layers wherever they run, in {when}; off inside fp8.autocast(enabled=False)"

    def __str__(self) -> str:
        lines = [
            f"FP8 conversion: recipe {self.recipe.name} ({self.recipe.describe()})",
            f"  GEMMs: {self.gemm}",
            f"  {self.switch()}",
            f"  {len(self.converted)} Linear layer(s) converted, {len(self.skipped)} kept in high precision",
        ]
        if self.already:
            lines.append(
                f"  {len(self.already)} layer(s) already FP8 with this recipe (an earlier convert), left as they are"
            )
        if self.kept_types:
            kept = "; ".join(f"{t} x{n} ({', '.join(r)})" for t, (n, r) in self.kept_types.items())
            lines.append(f"  high precision by layer type: {kept}")
        if self.recipe.fp8_activations:
            lines.append(
                f"  backward keeps E4M3 activations (fp8_activations) in {len(self.fp8_activations)} "
                "non-Linear module(s) (RMSNorm inputs; SwiGLU gate and up)"
            )
        for name, i, o in self.converted:
            lines.append(f"    fp8   {name}  ({i} -> {o})")
        for name, reason in self.skipped:
            lines.append(f"    skip  {name}  ({reason})")
        if self.experts:
            lines.append(f"  experts (grouped GEMMs: {self.grouped_gemm})")
            for name, e, ps in self.experts:
                projs = ", ".join(f"{p} ({i} -> {o})" for p, i, o in ps) or "none"
                lines.append(f"    fp8   {name}  ({e} experts; FP8: {projs})")
        for name, kind in self.experts_kept:
            lines.append(f"    experts kept {name}  ({kind}: {_OTHER_EXPERTS_WHY})")
        for name, kind in self.routers:
            lines.append(f"    router {name}  ({kind}: kept in high precision)")
        return "\n".join(lines)


def _matches(fqn: str, patterns: Iterable[str]) -> str | None:
    parts = fqn.split(".")
    for p in patterns:
        if any(ch in p for ch in "*?[") and fnmatch.fnmatchcase(fqn, p):
            return p
        if p in parts:
            return p
    return None


def default_module_filter(
    model: nn.Module,
    *,
    skip_first_last: bool = True,
    skip_patterns: Iterable[str] = DEFAULT_SKIP_PATTERNS,
    skip_adapters: bool = True,
) -> Callable[[nn.Module, str], str | None]:
    """Build the default rule: returns ``None`` to convert, or the reason to skip."""
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear or is_conv1d(m)]
    edges = {linears[0], linears[-1]} if (skip_first_last and linears) else set()
    patterns = tuple(skip_patterns)

    def rule(module: nn.Module, fqn: str) -> str | None:
        if fqn in edges:
            return "first Linear" if fqn == linears[0] else "last Linear"
        adapter = _matches(fqn, ADAPTER_PATTERNS) if skip_adapters else None
        if adapter is not None:
            return f"peft adapter layer ({adapter}): rank-r GEMM too small for FP8"
        n_in, n_out = gemm_dims(module)
        if n_in % 16 or n_out % 16:
            return f"dims {n_in}x{n_out} not multiples of 16"
        hit = _matches(fqn, patterns)
        if hit is not None:
            return f"name matches {hit!r}"
        return None

    return rule


def _gemm_note(recipe: Recipe, device: torch.device) -> str:
    if device.type == "meta":
        return "chosen at run time on the device the model is materialised on"
    if recipe.gemm == "emulate":
        return "emulated (dequantize + float32 matmul), as asked"
    return recipe.kind.gemm_note(recipe, device)


_KEPT_WHY = {
    nn.Embedding: "lookups, not GEMMs",
    nn.EmbeddingBag: "lookups, not GEMMs",
    nn.LayerNorm: "normalisation: elementwise",
    nn.modules.conv._ConvNd: "convolutions: FP8 covers Linear GEMMs",
}


def _count_kept(report: ConversionReport, module: nn.Module, reason: str | None = None) -> None:
    """Count a parameterised layer left in high precision under its type, with the reason;
    containers (whose parameters live in children) are not layers."""
    if reason is None:
        if not any(True for _ in module.parameters(recurse=False)):
            return
        reason = next((why for cls, why in _KEPT_WHY.items() if isinstance(module, cls)), None)
        if reason is None:
            reason = "normalisation: elementwise" if "norm" in type(module).__name__.lower() else "not a Linear layer"
    if reason.startswith("dims "):
        reason = "dims not multiples of 16"
    name = "peft adapter Linear" if reason.startswith("peft adapter") else type(module).__name__
    count, reasons = report.kept_types.get(name, (0, []))
    if reason.startswith("peft adapter"):
        reason = "rank-r GEMMs too small for FP8; adapter quality"
    report.kept_types[name] = (count + 1, reasons if reason in reasons else reasons + [reason])


_ROUTER_WHY = "MoE router: its top-k choice is discrete, FP8 noise would move tokens between experts"
_OTHER_EXPERTS_WHY = (
    "expert weights in a layout the grouped FP8 GEMMs do not run (they run transformers' "
    "use_experts_implementation experts and torchtitan's GroupedExperts): high precision"
)


def _other_experts(fqn: str, module: nn.Module) -> bool:
    """A module holding expert weights of its own (a 2-D or 3-D Parameter; ``expert`` in its
    class name or its own name) that :func:`experts_layout` does not take: Llama 4's batched
    ``Llama4TextExperts``, DBRX's ``DbrxExpertGLU``, JetMoE's ``JetMoeParallelExperts``."""
    if not any(p.dim() >= 2 for p in module.parameters(recurse=False)):
        return False
    return "expert" in type(module).__name__.lower() or "expert" in fqn.rpartition(".")[2].lower()


def _is_router(fqn: str, module: nn.Module) -> bool:
    """A mixture-of-experts router or shared-expert gate (holds its own parameters); a peft
    adapter on one (``...shared_expert_gate.lora_A.default``) is an adapter layer, not a router."""
    if not any(True for _ in module.parameters(recurse=False)):
        return False
    parts = fqn.split(".")
    if any(p in ADAPTER_PATTERNS for p in parts):
        return False
    return any(p in ROUTER_NAMES for p in parts) or type(module).__name__.endswith("Router")


def _check_router_kept(module: nn.Module, fqn: str, module_filter: ModuleFilter | None) -> None:
    """A router asked for in FP8 by a ``module_filter``: one line, not a silent conversion."""
    if module_filter is not None and module_filter(module, fqn):
        raise ValueError(
            f"module_filter asks for the mixture-of-experts router {fqn!r} in FP8: its top-k choice is "
            "discrete and FP8 noise would move tokens between experts, so routers stay in high precision; "
            "return False for it in module_filter"
        )


def _experts_projections(
    report: ConversionReport,
    module: nn.Module,
    fqn: str,
    layout,
    module_filter: ModuleFilter | None,
    patterns: tuple[str, ...],
) -> tuple[str, ...]:
    """The projections of an experts module to run in FP8; the others go to ``report.skipped``
    with their reason (a custom filter is asked once, for the whole module)."""
    if fqn == "":
        raise ValueError("convert() got a bare experts module; wrap it in a module (its parent MoE block)")
    if module_filter is not None and not module_filter(module, fqn):
        report.skipped.append((fqn, "module_filter returned False"))
        report.expert_projections_kept += 1
        return ()
    keep = []
    for p in layout.projections:
        n_in, n_out = layout.dims(module, p)
        hit = _matches(f"{fqn}.{p}", patterns) if module_filter is None else None
        if n_in % 16 or n_out % 16:
            report.skipped.append((f"{fqn}.{p}", f"dims {n_in}x{n_out} not multiples of 16"))
        elif hit is not None:
            report.skipped.append((f"{fqn}.{p}", f"name matches {hit!r}"))
        else:
            keep.append(p)
    report.expert_projections_kept += len(layout.projections) - len(keep)
    return tuple(keep)


def _set_submodule(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def convert(
    model: nn.Module,
    recipe: Recipe | str | None = None,
    module_filter: ModuleFilter | None = None,
    *,
    skip_first_last: bool = True,
    skip_patterns: Iterable[str] = DEFAULT_SKIP_PATTERNS,
    warn_if_none: bool = True,
) -> ConversionReport:
    """Swap eligible ``nn.Linear`` layers of ``model`` for ``Float8Linear``, in place.

    Args:
        recipe: a :class:`Recipe` or a recipe name (default ``tensorwise``).
        module_filter: ``fn(module, fqn) -> bool``; True converts. Replaces the default rules.
        skip_first_last, skip_patterns: knobs of the default rules (see module docstring).
        warn_if_none: log a warning, with the reasons, when no layer converts (the model would
            run in high precision); False for callers that say so themselves.
    """
    recipe = as_recipe(recipe, "convert()")
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() needs an nn.Module, got {type(model).__name__}")
    report = ConversionReport(recipe)
    rule = default_module_filter(model, skip_first_last=skip_first_last, skip_patterns=skip_patterns)
    moe = any("experts" in fqn.split(".") for fqn, _ in model.named_modules())
    device = None
    chosen: list[tuple[str, nn.Linear]] = []
    experts: list[tuple[str, nn.Module, tuple[str, ...]]] = []
    for fqn, module in list(model.named_modules()):
        router = _is_router(fqn, module)
        if router:
            report.routers.append((fqn, type(module).__name__))
        if isinstance(module, (Float8Linear, Float8Experts)):
            if module.recipe != recipe:  # silently keeping the old recipe would contradict the report
                raise ValueError(
                    f"convert(recipe={recipe.name}): {fqn or 'the model'} is already FP8 with the "
                    f"{module.recipe.name} recipe; to change recipes, fp8.unconvert(model) first"
                )
            report.already.append(fqn)
            continue
        layout = experts_layout(module)
        if layout is not None:
            projections = _experts_projections(report, module, fqn, layout, module_filter, tuple(skip_patterns))
            if projections:
                experts.append((fqn, module, projections))
            else:
                _count_kept(report, module, report.skipped[-1][1])
            continue
        conv1d = is_conv1d(module)
        if not isinstance(module, nn.Linear) and not conv1d:
            other = not router and _other_experts(fqn, module)
            if other:
                report.experts_kept.append((fqn, type(module).__name__))
            _count_kept(report, module, _ROUTER_WHY if router else (_OTHER_EXPERTS_WHY if other else None))
            continue
        if type(module) is not nn.Linear and not conv1d:
            reason = f"{type(module).__name__} is a Linear subclass with its own forward"
            if type(module).__name__ == "Linear4bit":  # bitsandbytes' NF4 weights under adapter: qlora
                reason = "4-bit base weights: QLoRA; bitsandbytes runs their GEMMs"
            elif isinstance(module, Float8BaseLinear):
                reason = "FP8 base weights (stored E4M3, frozen): already FP8 GEMMs"
            report.skipped.append((fqn, reason))
            _count_kept(report, module, reason)
            continue
        if router and moe:
            _check_router_kept(module, fqn, module_filter)
            why: str | None = _ROUTER_WHY  # whatever skip_patterns say
        else:
            why = (
                rule(module, fqn)
                if module_filter is None
                else (None if module_filter(module, fqn) else "module_filter returned False")
            )
        if why is not None:
            report.skipped.append((fqn, why))
            _count_kept(report, module, why)
            continue
        if fqn == "":
            raise ValueError("convert() got a bare nn.Linear; wrap it in a module or use Float8Linear.from_linear")
        chosen.append((fqn, module))
    keep = math.ceil(recipe.high_precision_last * len(chosen) - 1e-9)  # rounded up; 0 keeps none
    for fqn, module in chosen[len(chosen) - keep :] if keep else ():
        reason = (
            f"the {recipe.name} recipe keeps the last {recipe.high_precision_last:.0%} "
            "of its Linear layers in high precision (high_precision_last)"
        )
        report.skipped.append((fqn, reason))
        _count_kept(report, module, reason)
    for index, (fqn, module) in enumerate(chosen[: len(chosen) - keep]):
        conv1d = is_conv1d(module)
        new = Float8Conv1D.from_conv1d(module, recipe) if conv1d else Float8Linear.from_linear(module, recipe)
        recipe.kind.number_layer(new, index)  # nvfp4: a distinct, reproducible rounding stream per layer
        _set_submodule(model, fqn, new)
        report.converted.append((fqn, *gemm_dims(module)))
        device = device or module.weight.device
    index = len(chosen) - keep
    for fqn, module, projections in experts:
        layout = experts_layout(module)
        assert layout is not None  # checked above
        fp8_experts = float8_experts(module, recipe, projections)
        for g in fp8_experts.fp8_gemms().values():
            g.number_experts(index)  # nvfp4: a distinct, reproducible rounding stream per expert
            index += layout.num_experts
        _set_submodule(model, fqn, fp8_experts)  # type: ignore[arg-type]
        report.experts.append((fqn, layout.num_experts, [(p, *layout.dims(module, p)) for p in projections]))
        device = device or getattr(module, layout.projections[0]).device
    report.gemm = _gemm_note(recipe, device or torch.device("cpu"))
    if experts:
        d = device or torch.device("cpu")
        report.grouped_gemm = _gemm_note(recipe, d) if d.type == "meta" else recipe.kind.grouped_note(recipe, d)
    if recipe.fp8_activations:
        report.fp8_activations = activations.enable(model)
        if not report.fp8_activations:  # never a silent no-op
            logger.warning(
                "lowprec.fp8: fp8_activations is on but no module supports it (the built-in model's "
                "RMSNorm/LlamaMLP, Hugging Face LlamaRMSNorm/LlamaMLP); activations stay in high precision"
            )
    if warn_if_none and not (report.converted or report.experts or report.already):  # never a silent no-op
        reasons = sorted({why for _, why in report.skipped})
        logger.warning(
            "lowprec.fp8: convert(recipe=%s) converted no layer, so the model runs in high precision (%s); "
            "print the returned report for each layer's reason",
            recipe.name,
            "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "") if reasons else "it has no Linear layer",
        )
    if report.experts_kept:  # the experts hold most of an MoE model's GEMMs: never silently in bf16
        kinds = sorted({t for _, t in report.experts_kept})
        logger.warning(
            "lowprec.fp8: %d experts module(s) stay in high precision (%s, e.g. %s): %s",
            len(report.experts_kept),
            ", ".join(kinds),
            report.experts_kept[0][0],
            _OTHER_EXPERTS_WHY.replace(": high precision", ""),
        )
    if (report.converted or report.experts) and report.gemm.startswith("emulated") and recipe.gemm != "emulate":
        # a fallback is never silent: emulation is correct but slower than bf16
        logger.warning("lowprec.fp8: FP8 GEMMs will be %s", report.gemm)
    return report


def unconvert(model: nn.Module) -> int:
    """Swap every ``Float8Linear`` back to ``nn.Linear`` and every FP8 experts module back to its
    class (same Parameter objects); returns how many modules were swapped. The FP8 scaling
    state is dropped."""
    count = 0
    for fqn, module in list(model.named_modules()):
        if isinstance(module, Float8Linear):
            _set_submodule(model, fqn, module.to_linear())
            count += 1
        elif isinstance(module, Float8Experts):
            _set_submodule(model, fqn, module.to_experts())
            count += 1
    activations.disable(model)  # fp8_activations: back to the plain forward
    return count


def has_fp8_layers(model: nn.Module) -> bool:
    """True if any submodule is a ``Float8Linear`` or FP8 experts module."""
    return any(isinstance(m, (Float8Linear, Float8Experts)) for m in model.modules())


def plain_state_dict(state_dict_or_model) -> dict[str, torch.Tensor]:
    """A state dict without FP8 scaling state, loadable by the unconverted model.

    Accepts a model or a state dict. The reverse direction needs no helper: a converted model
    loads a plain state dict as is (its layers keep fresh scaling state).
    """
    sd = state_dict_or_model.state_dict() if isinstance(state_dict_or_model, nn.Module) else state_dict_or_model
    names = set(kinds.state_buffers())
    return {k: v for k, v in sd.items() if k.rpartition(".")[2] not in names}
