"""The FP8 guard's settings and their rules, shared by ``lowprec train``'s schema
(``train/config/fp8.py``: ``fp8_guard``, ``fp8_guard_*``, ``fp8_health*``) and the Accelerator's
:class:`~lowprec.fp8_kwargs.NativeRecipeKwargs` (the same names): torch-free and pydantic-free,
so the schema stays free of torch and the engine free of pydantic.

Each rule raises ``ValueError`` with one line naming the key. ``spell(key, value)`` renders a
setting as its user wrote it: ``fp8_guard: act`` in YAML, ``fp8_guard='act'`` in Python.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

from lowprec.errors import did_you_mean
from lowprec.guard_moves import GUARD_SCOPES

__all__ = [
    "GUARD_MODES",
    "THRESHOLD_NAMES",
    "Spell",
    "python_spelling",
    "guard_mode",
    "guard_scope",
    "GUARD_SCOPES",
    "GUARD_FIELDS",
    "check_count",
    "check_thresholds",
    "check_recover_needs_act",
    "check_scope_needs_act",
    "check_health_for_guard",
    "health_on",
]

GUARD_MODES = ("off", "warn", "act")
THRESHOLD_NAMES = ("saturated", "underflow", "max_to_rms", "sqnr_db")

# the settings' names, in lowprec train's YAML and on NativeRecipeKwargs (fp8_health_every: the
# Accelerator's check cadence, where the trainer checks at its logging steps)
GUARD_FIELDS = (
    "fp8_guard",
    "fp8_guard_patience",
    "fp8_guard_recover_after",
    "fp8_guard_scope",
    "fp8_guard_thresholds",
    "fp8_health",
    "fp8_health_sqnr_every",
    "fp8_health_every",
)

Spell = Callable[[str, Any], str]


def python_spelling(key: str, value: Any) -> str:
    """``key=value`` as a Python call writes it."""
    return f"{key}={value!r}"


def guard_mode(value: Any, spell: Spell, key: str = "fp8_guard") -> str:
    """``off | warn | act``; ``False`` is off (YAML 1.1 reads a bare ``off`` as false); ``True``
    says neither warn nor act, so it is refused with both spelled out."""
    if value is False:
        return "off"
    if value is True:
        raise ValueError(
            f"{spell(key, True)} is ambiguous; use {spell(key, 'warn')} (log) or {spell(key, 'act')} "
            "(move the layer to bf16)"
        )
    if not isinstance(value, str) or value not in GUARD_MODES:
        raise ValueError(f"{spell(key, value)} is not a guard mode; use {', '.join(GUARD_MODES)}")
    return value


def guard_scope(value: Any, spell: Spell, key: str = "fp8_guard_scope") -> str:
    """``layer | gemm``: what ``act`` moves, the layer or only the GEMMs that read the unhealthy
    operand (docs/guide.md, "FP8 health and the guard")."""
    if not isinstance(value, str) or value not in GUARD_SCOPES:
        raise ValueError(
            f"{spell(key, value)} is not a guard scope; use {spell(key, 'layer')} (move the whole layer) "
            f"or {spell(key, 'gemm')} (move only the GEMMs that read the unhealthy operand)"
        )
    return value


def check_count(key: str, value: Any, spell: Spell) -> int:
    """A count of checks or steps: an integer >= 1 (``True`` is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{spell(key, value)} is not an integer >= 1 (a count of steps or checks)")
    return value


def check_thresholds(
    value: Optional[Mapping[str, Any]], key: str = "fp8_guard_thresholds"
) -> Optional[dict[str, float]]:
    """Overrides of the guard's thresholds: known signal names, finite numbers."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}: expected a mapping of signal names to numbers, got {type(value).__name__}")
    out: dict[str, float] = {}
    for k, v in value.items():
        if k not in THRESHOLD_NAMES:
            raise ValueError(
                f"{key}.{k}: unknown signal{did_you_mean(k, THRESHOLD_NAMES)}; use {', '.join(THRESHOLD_NAMES)}"
            )
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{key}.{k}: expected a finite number, got {v!r}")
        out[k] = float(v)
    return out


def check_recover_needs_act(recover_after: Optional[int], guard: str, spell: Spell) -> None:
    """``fp8_guard_recover_after`` moves layers back, which only ``act`` moves."""
    if recover_after is not None and guard != "act":
        raise ValueError(
            f"{spell('fp8_guard_recover_after', recover_after)} moves layers back to FP8, but "
            f"{spell('fp8_guard', guard)} moves none; set {spell('fp8_guard', 'act')} or drop fp8_guard_recover_after"
        )


def check_scope_needs_act(scope: str, guard: str, spell: Spell) -> None:
    """``fp8_guard_scope: gemm`` says what ``act`` moves; no other mode moves anything."""
    if scope != "layer" and guard != "act":
        raise ValueError(
            f"{spell('fp8_guard_scope', scope)} says which GEMMs act moves, but {spell('fp8_guard', guard)} "
            f"moves none; set {spell('fp8_guard', 'act')} or drop fp8_guard_scope"
        )


def check_health_for_guard(guard: str, health: Optional[bool], spell: Spell) -> None:
    """A guard reads the health signals: ``fp8_health`` false with a guard is a contradiction."""
    if guard != "off" and health is False:
        raise ValueError(
            f"{spell('fp8_guard', guard)} reads the health signals that {spell('fp8_health', False)} turns off; "
            f"drop fp8_health (a guard turns it on) or set {spell('fp8_guard', 'off')}"
        )


def check_act_with_fp8_all_gather(
    guard: str, all_gather: Optional[bool], spell: Spell, key: str = "fp8_enable_fsdp_float8_all_gather"
) -> None:
    """``act`` moves layers to bf16, but FSDP2's FP8 all-gather hands every layer its weight
    already cast to FP8: a moved layer would compute with FP8-rounded weights while reported in
    bf16. (``warn`` moves nothing; tensor/sequence parallelism gathers a moved layer's input in
    high precision and is fine.)"""
    if guard == "act" and all_gather:
        raise ValueError(
            f"{spell('fp8_guard', 'act')} moves layers to bf16, but {spell(key, True)} "
            "gives every layer its weight all-gathered in FP8, so a moved layer would still compute with FP8-rounded "
            f"weights; set {spell('fp8_guard', 'warn')} or drop {key}"
        )


def health_on(guard: str, health: Optional[bool]) -> bool:
    """Health signals are recorded: ``fp8_health`` true, or by default with a guard."""
    return health if health is not None else guard != "off"
