"""The protocol every scaling kind follows, and the registry that finds a kind by its name.

A scaling kind says where a scale comes from and how many elements share it; its module
(``fp8/kinds/<name>.py``) owns everything that depends on that: the recipe fields it accepts,
the casts of each GEMM's operands (:meth:`Kind.gemms`, from which the recipe builds its
:class:`~lowprec.fp8.kinds.plan.LinearPlan`), the state a layer keeps across steps, what a forward
runs, and how the GEMMs are described in the conversion report. ``Float8Linear`` and the rest
of lowprec ask the kind (``recipe.kind``) and never compare its name.

Adding a kind is one module here, registered with :func:`register`, plus one row in
:data:`lowprec.catalog.RECIPES` (its name, meaning, the fields it reads and the torch-free
capabilities the launcher and the trainer check); ``tests/test_fp8_kinds.py`` adds a test-only
kind that way and trains with it.

Operand casts are shared between kinds and keyed by granularity (``fp8/modules/linear_fn.py``); a kind
module registers the casts of the granularity it introduced.

Grouped expert GEMMs (a mixture of experts' 3-D weight ``(E, N, K)``, tokens grouped by expert;
``fp8/modules/grouped.py``) are a kind's too: :meth:`Kind.grouped_forward` runs them. The default, which
every kind inherits, runs each non-empty expert's three GEMMs exactly as the kind runs a Linear's
(:meth:`Kind.forward` on that expert's slot: its weight, its rows of the state buffers), so a new
kind has grouped GEMMs with per-expert scales and state without writing anything; a kind with a
single-call grouped kernel overrides it (``ScaledGemmKind``: ``torch._scaled_grouped_mm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import importlib

import torch

from lowprec.catalog import RECIPES, RecipeInfo, kind_info
from lowprec.fp8.kinds.plan import GemmCast, OperandCast

if TYPE_CHECKING:
    from lowprec.fp8.modules.grouped import Float8GroupedGemm
    from lowprec.fp8.modules.linear import Float8Linear
    from lowprec.fp8.cast.mx import BlockScaledData
    from lowprec.fp8.cast.quantize import Float8Data
    from lowprec.fp8.recipes import Recipe

__all__ = [
    "Kind",
    "GroupedCall",
    "register",
    "unregister",
    "get",
    "names",
    "state_buffers",
]


@dataclass(frozen=True)
class GroupedCall:
    """One call of a grouped expert GEMM module (``fp8/modules/grouped.py``): ``x`` (S, K) holds
    ``counts[e]`` consecutive rows per expert ``e``, each group multiplied by ``weight[e].t()``
    (``weight``: (E, N, K)), output in ``hp``; ``gemm`` holds the experts' state rows."""

    gemm: Float8GroupedGemm
    x: torch.Tensor
    weight: torch.Tensor
    counts: tuple[int, ...]
    recipe: Recipe
    hp: torch.dtype


class Kind:
    """One scaling kind (see the module docstring). Subclasses set ``name`` and override what
    differs; the defaults are those of a kind with no state whose three GEMMs run in
    ``_Float8LinearFn`` (``fp8/modules/linear_fn.py``)."""

    name: ClassVar[str] = ""
    # one scale per tensor: the FP8 all-gather, tensor parallelism and ``margin`` need it
    per_tensor: ClassVar[bool] = False
    # scales come from an amax history kept in the layer (re-cast each step with another scale:
    # a frozen weight's cast cannot be kept; histories are reduced across data-parallel ranks)
    keeps_history: ClassVar[bool] = False
    # buffers a layer of this kind keeps in its state_dict (resumed runs continue them)
    state_buffers: ClassVar[tuple[str, ...]] = ()
    # what those buffers are, for the message when a region asks for this kind on a layer without them
    state_what: ClassVar[str] = ""
    # the recipe fields only this kind reads (anything else set is rejected by ``check``)
    own_flags: ClassVar[tuple[str, ...]] = ()

    @property
    def info(self) -> RecipeInfo:
        """This kind's catalog row: what the torch-free layers may do with it (FP8 all-gather,
        tensor parallelism, export), in one place for both sides."""
        return kind_info(self.name)

    # ------------------------------------------------------------------ the recipe
    def check(self, recipe: Recipe) -> None:
        """This kind's rules on the recipe's fields (``ValueError`` naming the field)."""

    def gemms(self, recipe: Recipe) -> tuple[GemmCast, GemmCast, GemmCast]:
        """(fprop, dgrad, wgrad) casts, before ``override_linear_precision`` is applied."""
        raise NotImplementedError

    def describe_operand(self, o: OperandCast) -> str:
        return f"{str(o.dtype).replace('torch.float8_', '')}/{o.granularity}"

    # ------------------------------------------------------------------ the layer
    def init_state(self, layer: Float8Linear) -> None:
        """Register this kind's buffers on a freshly converted layer."""

    def reset_state(self, layer: Float8Linear) -> None:
        """Put this kind's buffers back to their initial values."""

    def number_layer(self, layer: Float8Linear, index: int) -> None:
        """``convert`` hands each converted layer its index in module order."""

    def check_layer(self, layer: Float8Linear, recipe: Recipe) -> None:
        """A region's recipe (``fp8.autocast(recipe=...)``) of this kind on ``layer``: refuse
        when the layer lacks the state this kind keeps."""
        if any(not hasattr(layer, b) for b in self.state_buffers):
            raise ValueError(
                f"fp8.autocast(recipe={recipe.name!r}) asks for {self.name} scaling, but this layer was "
                f"converted with {layer.recipe.name!r} and has no {self.state_what}; convert the model "
                f"with a {self.name} recipe instead"
            )

    def forward(self, layer: Float8Linear, x2: torch.Tensor, recipe: Recipe, hp: torch.dtype) -> torch.Tensor:
        """The output of ``layer`` for 2-D ``x2`` (bias not added)."""
        raise NotImplementedError

    def forward_weight_cast(self, layer: Float8Linear, recipe: Recipe) -> Float8Data | BlockScaledData:
        """The FP8 weight, (out, in), that the forward GEMM reads (what ``lowprec.export`` writes
        as trained scales); ``ValueError`` where it is not a function of the weight alone."""
        raise ValueError(
            f"recipe {recipe.name!r}: its forward weight cast is not a function of the weight "
            "alone; quantize the weight with a format's rule instead"
        )

    def compile_break(self, device: torch.device) -> str | None:
        """Why this kind's GEMMs on ``device`` must run outside a ``torch.compile`` graph (a graph
        break, logged once: ``fp8/gemm/compile_guard.py``), or None: they are traced."""
        return None

    def gemm_note(self, recipe: Recipe, device: torch.device) -> str:
        """How this recipe's GEMMs run on ``device``, for the conversion report."""
        raise NotImplementedError

    # ------------------------------------------------------------------ grouped expert GEMMs
    def grouped_forward(self, call: GroupedCall) -> torch.Tensor:
        """``(S, N)``, the experts' outputs (see :class:`GroupedCall`). By default each
        non-empty expert runs :meth:`forward` on its slot (``gemm.slot(e, weight[e])``): the
        Linear's casts with scales of its own (a token group never shares one with another
        expert's tokens), its state row, the FP8 copies it keeps for backward, its GEMM path;
        an empty expert runs nothing."""
        gemm, x, weight, counts, recipe, hp = call.gemm, call.x, call.weight, call.counts, call.recipe, call.hp
        outs = []
        # unbind / split, not weight[e] / x[a:b]: their backward stacks (concatenates) the experts'
        # gradients once; a select / slice per expert would make each expert's gradient a zero
        # tensor of the whole weight (input) and add them up: E full-size passes
        if any(counts):
            experts, groups = weight.unbind(0), x.split(list(counts))
            for e, n in enumerate(counts):
                if n:
                    outs.append(self.forward(gemm.slot(e, experts[e]), groups[e], recipe, hp))
        if not outs:  # no token routed anywhere: nothing to multiply
            return x.new_zeros((0, weight.shape[1]), dtype=hp)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def grouped_note(self, recipe: Recipe, device: torch.device) -> str:
        """How the grouped expert GEMMs of this recipe run on ``device``, for the report."""
        return f"one GEMM set per expert that holds tokens, each as a Linear's: {self.gemm_note(recipe, device)}"


_KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Make ``kind`` known under ``kind.name`` (``ValueError`` if that name is taken)."""
    if not kind.name or kind.name in _KINDS:
        raise ValueError(f"scaling kind {kind.name!r} is empty or already registered")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


def names() -> tuple[str, ...]:
    """The kinds the catalog names (each loaded on first use) and any registered besides."""
    return tuple(dict.fromkeys([*(r.scaling for r in RECIPES.values()), *_KINDS]))


def get(name: str) -> Kind:
    """The kind called ``name``; ``ValueError`` listing the known ones. A kind the catalog names
    is loaded from its module, ``lowprec.fp8.kinds.<name>``, on first use (the module registers
    it), so that importing the engine loads no kind it does not run."""
    kind = _KINDS.get(name)
    if kind is None and name in names():
        importlib.import_module(f"{__package__}.{name}")
        kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"scaling={name!r} is not known; use one of {names()}")
    return kind


def state_buffers() -> tuple[str, ...]:
    """Every buffer name any known kind keeps (what a plain state dict leaves out)."""
    seen: dict[str, None] = {}
    for kind in map(get, names()):
        seen.update(dict.fromkeys(kind.state_buffers))
    return tuple(seen)
