"""The questions of ``lowprec config`` (interactive). Reads answers with ``input()``, so tests
feed them on stdin; an empty answer takes the default shown in brackets. A wrong answer is
explained and asked again; the end of stdin before all answers is a usage error.

Each answer goes through the same parser as the flag and the YAML key, so the wizard cannot
write a value that ``launch`` rejects (Accelerate's wizard wrote keys its launcher ignored,
reference §3.4 bug 2, and a boolean where three were needed, issue #3489).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from lowprec.config import values as V
from lowprec.config.env import LaunchSettings
from lowprec.errors import UsageError
from lowprec.backends.spec import spec_or_native
from lowprec.catalog import FIELD_DEFAULTS, RECIPE_OPTIONS, Granularity, kind_info, recipe_info, SCALING_FIELDS
from lowprec.config.env import _parse_zero_stage

__all__ = ["ask", "run_wizard"]


def ask(question: str, default: Any, parse: Callable[[Any], Any], choices: tuple[str, ...] = ()) -> Any:
    shown = "yes" if default is True else "no" if default is False else default
    options = f" ({'/'.join(choices)})" if choices else ""
    while True:
        try:
            answer = input(f"{question}{options} [{shown}]: ").strip()
        except EOFError:
            raise UsageError(f"no answer to {question!r}: stdin ended (use flags or --default instead)") from None
        if not answer:
            return parse(default) if default is not None else None
        try:
            return parse(answer)
        except ValueError as exc:
            print(f"  {exc}", file=sys.stderr)


def _int(minimum: int) -> Callable[[Any], int]:
    return lambda v: V.parse_int(v, minimum=minimum)


def _optional_str(value: Any) -> str | None:
    text = str(value).strip()
    return None if text.lower() in ("", "none") else text


def run_wizard() -> LaunchSettings:
    s: dict[str, Any] = {}
    s["num_machines"] = ask("How many machines?", 1, _int(1))
    if s["num_machines"] > 1:
        s["machine_rank"] = ask("Rank of this machine?", 0, _int(0))
        s["main_process_ip"] = ask("IP address of the machine with rank 0?", None, _optional_str)
        s["main_process_port"] = ask("Port on that machine?", 29500, _int(0))
    s["num_processes"] = ask("How many processes in total (all machines together)?", s["num_machines"], _int(1))
    s["use_cpu"] = ask("Train on CPU only?", False, V.parse_bool)
    if s["num_processes"] > 1 or s["num_machines"] > 1:
        mode = ask(
            "Data parallelism", "ddp", lambda v: V.choice(v, ("ddp", "fsdp", "deepspeed")), ("ddp", "fsdp", "deepspeed")
        )
        s["use_fsdp"], s["use_deepspeed"] = mode == "fsdp", mode == "deepspeed"
        if mode == "fsdp":
            s["fsdp_reshard_after_forward"] = ask("Reshard parameters after forward (FULL_SHARD)?", True, V.parse_bool)
            s["fsdp_transformer_layer_cls_to_wrap"] = ask(
                "Layer class(es) to wrap, comma-separated (none: wrap the whole model)", "none", _optional_str
            )
            if s["fsdp_transformer_layer_cls_to_wrap"]:
                s["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        if mode == "deepspeed":
            s["zero_stage"] = ask("ZeRO stage?", 2, _zero_stage, ("0", "1", "2", "3"))
        else:
            tp = ask(
                "Tensor parallel size (processes splitting each Linear of the model's _tp_plan; 1: none)?",
                1,
                _tp_size(s["num_processes"], mode == "fsdp"),
            )
            s["tp_size"] = tp if tp > 1 else None
    s["mixed_precision"] = ask("Mixed precision?", "bf16", V.parse_mixed_precision, V.MIXED_PRECISIONS)
    if s["mixed_precision"] == "fp8":
        _fp8_questions(s)
    return LaunchSettings(**{k: v for k, v in s.items() if v is not None})


def _tp_size(processes: int, fsdp: bool) -> Callable[[Any], int]:
    """A tensor-parallel size that divides the processes; without FSDP2 nothing holds the other
    dimension, so it must be all of them."""

    def parse(value: Any) -> int:
        tp = V.parse_int(value, minimum=1)
        if processes % tp:
            raise ValueError(f"{tp} does not divide the {processes} processes")
        if not fsdp and tp not in (1, processes):
            raise ValueError(f"with ddp, 1 or {processes} (all processes); other sizes shard the rest with fsdp")
        return tp

    return parse


def _zero_stage(value: Any) -> int:
    return _parse_zero_stage(value)


def _fp8_questions(s: dict[str, Any]) -> None:
    """Only what the chosen backend and recipe read (their declarations decide, no names here)."""

    backend = s["fp8_backend"] = ask("FP8 backend?", "native", V.parse_fp8_backend, V.FP8_BACKENDS)
    spec = spec_or_native(backend)
    reads = set(spec.reads)
    recipe = None
    if "fp8_recipe" in reads:
        s["fp8_recipe"] = ask("FP8 recipe?", "tensorwise", V.parse_fp8_recipe, V.FP8_RECIPES)
        recipe = recipe_info(s["fp8_recipe"])
    if spec.library is None:  # lowprec's engine runs it: say what to do where FP8 GEMMs are missing
        s["fp8_fallback"] = ask(
            "Where the device has no FP8 GEMMs: train in bf16, or emulate FP8?",
            "emulate",
            V.parse_fp8_fallback,
            V.FP8_FALLBACKS,
        )
    recipe_reads = set(spec_reads_of(recipe))
    if "fp8_format" in reads and (recipe is None or recipe.granularity is Granularity.TENSOR):
        s["fp8_format"] = ask("FP8 format?", FIELD_DEFAULTS["fp8_format"], V.parse_fp8_format, spec.fp8_formats)
    for option in RECIPE_OPTIONS.values():  # the catalog's recipe options this backend and recipe read
        if option.setting in reads and option.name in recipe_reads:
            s[option.setting] = ask(option.question, option.default, V.parse_recipe_option(option.name), option.choices)
    if "fp8_override_linear_precision" in reads and ask(
        "Run some GEMMs of Linear layers in high precision?", False, V.parse_bool
    ):
        s["fp8_override_linear_precision"] = (
            ask("  forward GEMM (fprop) in high precision?", False, V.parse_bool),
            ask("  grad-input GEMM (dgrad) in high precision?", False, V.parse_bool),
            ask("  grad-weight GEMM (wgrad) in high precision?", False, V.parse_bool),
        )
    if "fp8_opt_level" in reads:
        s["fp8_opt_level"] = ask("MS-AMP optimization level?", "O2", V.parse_opt_level, V.OPT_LEVELS)
    if "fp8_use_autocast_during_eval" in reads:
        s["fp8_use_autocast_during_eval"] = ask("Keep FP8 on in eval mode?", False, V.parse_bool)
    # the native engine all-gathers in FP8 where a shard can compute its scales (every recipe but nvfp4)
    if (
        s.get("use_fsdp")
        and "fp8_enable_fsdp_float8_all_gather" in reads
        and (recipe is None or kind_info(recipe.scaling).fp8_all_gather)
    ):
        s["fp8_enable_fsdp_float8_all_gather"] = ask("All-gather FSDP weights in FP8?", True, V.parse_bool)


def spec_reads_of(recipe: Any) -> tuple[str, ...]:
    """The scaling fields a recipe reads; a backend without recipe names (TE: DelayedScaling)
    reads them all."""

    return SCALING_FIELDS if recipe is None else recipe.reads
