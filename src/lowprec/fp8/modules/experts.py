"""Mixture-of-experts blocks whose experts are 3-D Parameters, in FP8.

transformers 5 stores the experts of Mixtral, Qwen2/Qwen3-MoE, gpt-oss, DeepSeek-V3, OLMoE and
most other MoE models as one module with fused 3-D weights (``MixtralExperts``: ``gate_up_proj``
(E, 2I, H), ``down_proj`` (E, H, I); gpt-oss keeps them transposed, (E, H, 2I) and (E, I, H),
with biases), decorated with ``use_experts_implementation``, which records the layout on the
instance (``has_gate``, ``has_bias``, ``is_transposed``, ``has_post_expert_norm``) and gives
every class one call: ``experts(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))``.
lowprec's built-in MoE model (``builtin:moe-tiny``) uses the same layout. torchtitan's
``GroupedExperts`` keeps three: ``w1``, ``w3`` (E, hidden, dim) and ``w2`` (E, dim, hidden), and is
called with the tokens already grouped: ``experts(x (rows, dim), num_tokens_per_expert (E,))``,
rows past the counted ones being padding (zeros out), ``silu(x w1^T) * (x w3^T)`` then ``w2``. They
are not Linear layers, so ``convert`` handles both here.

:func:`float8_experts` turns such a module into a ``Float8<Class>``: a subclass of its own
class (``isinstance`` checks, ``_apply_gate``, ``act_fn``, the config all stay) whose instance
holds the *same* Parameter objects, so optimizers built before conversion keep training them
and ``state_dict`` keys are unchanged (plus, for delayed scaling, the per-expert scaling state
under ``fp8_<projection>``; a plain checkpoint loads). Its forward:

1. route: sort the (token, expert) pairs by expert (stable), count tokens per expert (one host
   read: the per-expert GEMMs need the counts on the host, as transformers' own grouped
   fallback does);
2. gather the tokens in that order, run the grouped FP8 GEMM of ``gate_up_proj`` (or
   ``up_proj``), add the bias (gpt-oss), apply the class's own gate (``_apply_gate``: SwiGLU,
   gpt-oss's clamped GLU), run the grouped FP8 GEMM of ``down_proj`` (``fp8/modules/grouped.py``);
3. weight each row by its routing weight and sum each token's ``k`` rows (deterministic: no
   ``index_add``), as transformers' ``grouped_mm`` implementation does.

The router (``gate`` / ``router``, a ``TopKRouter`` module, not a Linear) is never converted:
its top-k choice is discrete, and FP8 noise would move tokens between experts; ``convert``
names it in the report. Outside FP8 (``fp8.autocast(enabled=False)``, eval mode) the class's own
forward runs. ``tokens_per_expert`` (a buffer, not saved) holds the last forward's routing
counts. transformers' own expert parallelism (``_is_expert_parallel``) is refused; lowprec's
(``lowprec.distributed.expert_parallel.apply_expert_parallel``: experts sharded over processes,
tokens dispatched in FP8) sets ``fp8_ep`` on the module and runs its forward, in FP8 or not.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.fp8.modules.autocast import torch_autocast_dtype
from lowprec.fp8.modules.grouped import SIDE_PROBE, Float8GroupedGemm, grouped_mm_hp
from lowprec.fp8.modules.linear import FP8Switch
from lowprec.fp8.recipes import Recipe

__all__ = [
    "ExpertsLayout",
    "experts_layout",
    "Float8Experts",
    "float8_experts",
    "route",
    "combine",
    "run_experts",
    "expert_rows",
]

GEMM_PREFIX = "fp8_"  # the Float8GroupedGemm of projection p is the child module fp8_<p>


@dataclass(frozen=True)
class ExpertsLayout:
    """Where an experts module keeps its weights: ``projections`` in call order (the first
    is gated when ``has_gate``), each a Parameter ``(E, out, in)``, or ``(E, in, out)`` when
    ``transposed``; ``bias``: a ``<projection>_bias`` (E, out) Parameter each. ``grouped``: the
    module is called with tokens already grouped by expert (torchtitan's ``GroupedExperts``:
    projections ``w1``, ``w3``, ``w2``), not with the router's choices."""

    num_experts: int
    projections: tuple[str, ...]
    transposed: bool
    bias: bool
    has_gate: bool
    post_norm: bool
    grouped: bool = False

    def weight(self, module: nn.Module, proj: str) -> torch.Tensor:
        """The (E, out, in) view of a projection's Parameter (autograd carries the layout back)."""
        w = getattr(module, proj)
        return w.transpose(-1, -2) if self.transposed else w

    def dims(self, module: nn.Module, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of one expert of ``proj``."""
        _, out, inp = self.weight(module, proj).shape
        return int(inp), int(out)


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of a fused experts module (transformers' ``use_experts_implementation``
    classes, lowprec's built-in one, torchtitan's ``GroupedExperts``), or ``None`` for anything else."""
    if not all(hasattr(module, a) for a in ("has_gate", "is_transposed", "num_experts")):
        return _grouped_layout(module)
    first = "gate_up_proj" if module.has_gate else "up_proj"
    params = dict(module.named_parameters(recurse=False))
    count: Any = module.num_experts  # a plain int attribute (nn.Module's stub says Tensor | Module)
    e = int(count)
    for name in (first, "down_proj"):
        p = params.get(name)
        if p is None or p.dim() != 3 or p.shape[0] != e:
            return None
    bias = bool(getattr(module, "has_bias", False))
    if bias and not all(f"{n}_bias" in params for n in (first, "down_proj")):
        return None
    return ExpertsLayout(
        e, (first, "down_proj"), bool(module.is_transposed), bias, bool(module.has_gate),
        bool(getattr(module, "has_post_expert_norm", False)),
    )  # fmt: skip


def _grouped_layout(module: nn.Module) -> ExpertsLayout | None:
    """torchtitan's ``GroupedExperts`` layout: ``w1``, ``w3`` (E, hidden, dim), ``w2`` (E, dim,
    hidden), a ``num_experts`` attribute, and a forward taking ``num_tokens_per_expert``."""
    params = dict(module.named_parameters(recurse=False))
    w1, w2, w3 = (params.get(n) for n in ("w1", "w2", "w3"))
    if w1 is None or w2 is None or w3 is None or not hasattr(module, "num_experts"):
        return None
    if "num_tokens_per_expert" not in inspect.signature(type(module).forward).parameters:
        return None
    e, hidden, dim = w1.shape if w1.dim() == 3 else (-1, -1, -1)
    count: Any = module.num_experts  # a plain int attribute (nn.Module's stub says Tensor | Module)
    if e != int(count) or w3.shape != w1.shape or tuple(w2.shape) != (e, dim, hidden):
        return None
    return ExpertsLayout(e, ("w1", "w3", "w2"), False, False, True, False, grouped=True)


# ------------------------------------------------------------------ routing (pure functions)
def route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor]:
    """``(perm, counts, counts_tensor)``: ``perm`` orders the flattened (token, choice) pairs
    by expert (stable: tokens keep their order within an expert), ``counts[e]`` the pairs of
    expert ``e`` (host ints, one read)."""
    ids = top_k_index.reshape(-1)
    counts_t = torch.bincount(ids, minlength=num_experts)
    counts = tuple(int(c) for c in counts_t.tolist())
    if len(counts) > num_experts or (ids.numel() and int(ids.min()) < 0):
        raise ValueError(
            f"top_k_index holds expert ids outside 0..{num_experts - 1} (expert-parallel sentinels?); "
            "lowprec's FP8 experts run every expert on this process: expert parallelism is not supported"
        )
    perm = torch.argsort(ids, stable=True)
    return perm, counts, counts_t


def combine(rows: torch.Tensor, perm: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """Each token's ``top_k`` rows (in ``perm`` order) summed back to ``(tokens, H)``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return rows[inv].view(tokens, top_k, rows.shape[-1]).sum(dim=1)


def run_experts(
    module: Any,
    layout: ExpertsLayout,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gemm: Any,
) -> torch.Tensor:
    """The experts' output for ``hidden_states`` (T, H); ``gemm(proj, x, weight, counts)`` runs
    one grouped projection (FP8 or high precision)."""
    tokens, top_k = top_k_index.shape[0], top_k_index.shape[-1]
    perm, counts, counts_t = route(top_k_index, layout.num_experts)
    if isinstance(module, Float8Experts):
        with torch.no_grad():
            module.tokens_per_expert.copy_(counts_t)
    token_of_row = perm // top_k
    x = hidden_states[token_of_row]
    expert_of_row = top_k_index.reshape(-1)[perm] if layout.bias else None
    out = expert_rows(module, layout, x, counts, expert_of_row, gemm)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    return combine(out, perm, tokens, top_k).to(hidden_states.dtype)


def expert_rows(
    module: Any,
    layout: ExpertsLayout,
    x: torch.Tensor,
    counts: tuple[int, ...],
    expert_of_row: torch.Tensor | None,
    gemm: Any,
) -> torch.Tensor:
    """The experts' output rows for ``x`` grouped by ``counts`` (one group per expert of the
    module's weights): first projection, bias (``expert_of_row``: the bias row of each row;
    ``None`` without biases), gate, down projection, bias, post-norm; not yet weighted."""
    if layout.grouped:  # torchtitan: silu(x w1^T) * (x w3^T), then w2
        gate, up, down = layout.projections
        h = F.silu(gemm(gate, x, layout.weight(module, gate), counts)) * gemm(up, x, layout.weight(module, up), counts)
        return gemm(down, h, layout.weight(module, down), counts)
    first, down = layout.projections
    h = gemm(first, x, layout.weight(module, first), counts)
    if expert_of_row is not None:
        h = h + getattr(module, f"{first}_bias")[expert_of_row].to(h.dtype)
    h = module._apply_gate(h) if layout.has_gate else module.act_fn(h)
    out = gemm(down, h, layout.weight(module, down), counts)
    if expert_of_row is not None:
        out = out + getattr(module, f"{down}_bias")[expert_of_row].to(out.dtype)
    if layout.post_norm:
        out = module.post_expert_norm(out)
    return out


# ------------------------------------------------------------------ the converted module
class Float8Experts(FP8Switch):
    """The FP8 side of a converted experts module (mixed into ``Float8<Class>``; see the
    module docstring). ``fp8_<projection>`` children run the grouped GEMMs of the projections
    converted; a projection without one (kept by a skip pattern) runs in high precision."""

    fp8_layout: ExpertsLayout
    tokens_per_expert: torch.Tensor

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None = None
    ):
        """``(hidden_states, top_k_index, top_k_weights)`` as transformers calls its experts; a
        grouped layout (torchtitan) is called ``(x, num_tokens_per_expert)``."""
        recipe = self._active_recipe()
        ep = self.__dict__.get("fp8_ep")
        if self.fp8_layout.grouped:
            if recipe is None:
                return super().forward(hidden_states, top_k_index)  # type: ignore[misc,call-arg]
            return self._grouped_forward(hidden_states, top_k_index, recipe)
        if recipe is None and ep is None:
            return super().forward(hidden_states, top_k_index, top_k_weights)  # type: ignore[misc]
        if getattr(self, "_is_expert_parallel", False):
            raise NotImplementedError(
                f"{type(self).__name__} is expert-parallel: lowprec's FP8 experts run every expert on each "
                "process (expert parallelism is not supported yet); convert without its experts "
                "(skip_patterns=['experts']) or train without expert parallelism"
            )
        gemm = self._projection_gemm(recipe, torch_autocast_dtype(hidden_states.device.type, hidden_states.dtype))
        if ep is not None:  # this rank's experts only (lowprec.distributed.expert_parallel)
            return ep.forward(self, hidden_states, top_k_index, top_k_weights, recipe, gemm)
        return run_experts(self, self.fp8_layout, hidden_states, top_k_index, top_k_weights, gemm)  # type: ignore[arg-type]

    def _grouped_forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        """torchtitan's call: ``x`` holds ``num_tokens_per_expert[e]`` rows per expert in order, then
        padding rows, whose output is zeros (as its for-loop path writes them)."""
        counts = tuple(int(c) for c in num_tokens_per_expert.tolist())  # one host read, as torchtitan's loop
        used = sum(counts)
        if len(counts) != self.fp8_layout.num_experts or used > x.shape[0]:
            raise ValueError(
                f"{type(self).__name__}: num_tokens_per_expert has {len(counts)} counts summing to {used} for "
                f"{self.fp8_layout.num_experts} experts and {x.shape[0]} rows"
            )
        with torch.no_grad():
            self.tokens_per_expert.copy_(num_tokens_per_expert.to(self.tokens_per_expert.dtype))

        gemm = self._projection_gemm(recipe, torch_autocast_dtype(x.device.type, x.dtype))
        out = expert_rows(self, self.fp8_layout, x[:used], counts, None, gemm).to(x.dtype)
        if used == x.shape[0]:
            return out
        return torch.cat([out, out.new_zeros(x.shape[0] - used, out.shape[-1])])

    def _projection_gemm(self, recipe: Recipe | None, hp: torch.dtype):
        """``gemm(proj, x, weight, counts)``: one grouped projection, in FP8 through its
        ``fp8_<proj>`` module, or in ``hp`` where it has none (kept in high precision), the FP8
        guard moved it, or FP8 is off (``recipe`` None: expert parallelism still runs)."""

        def gemm(proj: str, x: torch.Tensor, weight: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
            grouped = self._modules.get(GEMM_PREFIX + proj)  # type: ignore[attr-defined]
            if grouped is None or grouped.high_precision or recipe is None:
                out = grouped_mm_hp(x, weight, counts, hp)
                side = None if grouped is None or recipe is None else grouped.__dict__.get(SIDE_PROBE)
                if side is not None:  # the health probe measures a moved projection on the side
                    side(grouped, x, weight, counts, out)
                return out
            return grouped(x, weight, counts, recipe, hp)

        return gemm

    def fp8_gemms(self) -> dict[str, Float8GroupedGemm]:
        """The projections in FP8 and their grouped GEMM modules."""
        return {
            p: m
            for p in self.fp8_layout.projections
            if isinstance(m := self._modules.get(GEMM_PREFIX + p), Float8GroupedGemm)  # type: ignore[attr-defined]
        }

    def _check_region(self, recipe: Recipe) -> None:
        for g in self.fp8_gemms().values():
            recipe.kind.check_layer(g, recipe)  # type: ignore[arg-type]

    def reset_fp8_state(self) -> None:
        for g in self.fp8_gemms().values():
            g.reset_fp8_state()

    def to_experts(self) -> nn.Module:
        """The module as its own class again: same Parameter objects and hooks, no FP8 state."""
        if self.__dict__.get("fp8_ep") is not None:
            raise ValueError(
                f"{type(self).__name__} is expert-parallel (this process holds {self.__dict__['fp8_ep'].local} of "
                f"{self.fp8_layout.num_experts} experts): its own class cannot run it; keep it converted"
            )
        plain = copy.copy(self)
        for k, v in list(vars(plain).items()):
            if isinstance(v, (dict, set)):
                plain.__dict__[k] = copy.copy(v)
        for p in self.fp8_layout.projections:
            plain._modules.pop(GEMM_PREFIX + p, None)  # type: ignore[attr-defined]
        plain._buffers.pop("tokens_per_expert", None)  # type: ignore[attr-defined]
        plain._non_persistent_buffers_set.discard("tokens_per_expert")  # type: ignore[attr-defined]
        for k in ("recipe", "fp8_layout", "high_precision", "_fp8_forward_recipe"):
            plain.__dict__.pop(k, None)
        plain.__class__ = _base_class(type(self))
        return plain  # type: ignore[return-value]

    def extra_repr(self) -> str:
        grouped = ", ".join(self.fp8_gemms()) or "none"
        return f"experts={self.fp8_layout.num_experts}, recipe={self.recipe.name}, fp8 projections: {grouped}"

    def __reduce_ex__(self, protocol):
        # the class is made at run time: pickle and deepcopy rebuild it from the base class
        return (_rebuild, (_base_class(type(self)), self.__getstate__()))


_CLASSES: dict[type, type] = {}


def _float8_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(f"Float8{base.__name__}", (Float8Experts, base), {"__module__": __name__})
        _CLASSES[base] = cls
    return cls


def _base_class(cls: type) -> type:
    return next(b for b in cls.__bases__ if b is not Float8Experts)


def _rebuild(base: type, state: dict) -> nn.Module:
    cls = _float8_class(base)
    obj: nn.Module = object.__new__(cls)
    obj.__setstate__(state)
    return obj


def float8_experts(module: nn.Module, recipe: Recipe, projections: tuple[str, ...] | None = None) -> Float8Experts:
    """``module`` (a fused experts module, :func:`experts_layout`) as ``Float8<Class>`` holding
    the same Parameters; ``projections``: those to run in FP8 (default: both)."""
    layout = experts_layout(module)
    if layout is None:
        raise TypeError(f"{type(module).__name__} is not a fused experts module (3-D gate_up_proj/up_proj + down_proj)")
    new = copy.copy(module)  # the same Parameter objects; own dicts, so the original is untouched
    for k, v in list(vars(new).items()):
        if isinstance(v, (dict, set)):
            new.__dict__[k] = copy.copy(v)
    new.__class__ = _float8_class(type(module))
    device = getattr(module, layout.projections[0]).device
    new.__dict__["recipe"] = recipe
    new.__dict__["fp8_layout"] = layout
    new.__dict__["high_precision"] = False
    for p in layout.projections if projections is None else projections:
        new.add_module(GEMM_PREFIX + p, Float8GroupedGemm(layout.num_experts, recipe, device))
    new.register_buffer(
        "tokens_per_expert", torch.zeros(layout.num_experts, dtype=torch.int64, device=device), persistent=False
    )
    return new  # type: ignore[return-value]  # Float8<Class>: both an nn.Module and a Float8Experts
