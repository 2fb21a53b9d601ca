"""The settings flags shared by ``lowprec launch`` and ``lowprec config``.

Every flag's ``dest`` is a :class:`~lowprec.config.env.LaunchSettings` field and its default is
``argparse.SUPPRESS``: a flag the user did not type is absent from the namespace, so "given on
the command line" is exact and a flag can never override the YAML with its own default
(Accelerate tracked this by hand, reference §3.2). Each flag also has a dash spelling
(``--fp8-backend``), as in Accelerate.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, Callable

from lowprec.catalog import RECIPE_OPTIONS
from lowprec.config import values as V
from lowprec.config.env import FP8_FIELDS, UNREAD_FIELDS, LaunchSettings, check_fp8_fields
from lowprec.errors import UsageError, did_you_mean

__all__ = [
    "LowprecArgumentParser",
    "add_settings_flags",
    "settings_from_args",
    "check_cli_flags_apply",
    "fp8_backend_chosen",
]


# short spellings users type for a long flag, which no string distance finds
_FLAG_ALIASES = {"--lr": "--learning_rate", "--bs": "--micro_batch_size", "--steps": "--max_steps"}


class LowprecArgumentParser(argparse.ArgumentParser):
    """argparse with a "did you mean" for unknown flags, one line on stderr, exit code 2.

    Prefix matching is off (``allow_abbrev=False``, also for every subcommand's parser, which
    argparse builds with this class): ``--learning_rat 0.5`` is an unknown flag with a hint, as
    the same misspelling in YAML is, not a silent ``--learning_rate 0.5``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # type: ignore[override]
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = [s for s in self._option_string_actions if s.startswith("--")]
            words = message[len(prefix) :].split()
            hints = [f"{w}{_close_flag(w.split('=')[0], known)}" for w in words if w.startswith("-")] or words
            message = f"unknown argument(s): {', '.join(hints)}; see {self.prog} --help"
        self.exit(2, f"{self.prog}: error: {message}\n")


def _close_flag(word: str, known: list[str]) -> str:
    """`` (did you mean '--x'?)`` for a close option only, never one that means the opposite
    (``--use_gpu`` is not ``--use_cpu``)."""
    if _FLAG_ALIASES.get(word) in known:
        return f" (did you mean {_FLAG_ALIASES[word]!r}?)"
    norm = lambda flag: flag.replace("-", "_")  # noqa: E731 - --use-cpu is --use_cpu
    swapped = {norm(word).replace("gpu", "cpu"), norm(word).replace("cpu", "gpu")} - {norm(word)}
    candidates = [k for k in difflib.get_close_matches(word, known, n=3, cutoff=0.75) if norm(k) not in swapped]
    return did_you_mean(word, candidates[:1])


def _argtype(parse: Callable[[Any], Any], metavar: str | None = None) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = metavar if metavar else getattr(parse, "__name__", "value")
    return convert


def _int(minimum: int) -> Callable[[str], int]:
    return _argtype(lambda s: V.parse_int(s, minimum=minimum), "int")


def _add(group: Any, name: str, dest: str | None = None, **kwargs: Any) -> None:
    group.add_argument(f"--{name}", dest=dest or name, default=argparse.SUPPRESS, **kwargs)
    if "_" in name:  # Accelerate's dash spelling, kept out of --help to halve its length
        kwargs["help"] = argparse.SUPPRESS
        group.add_argument(f"--{name.replace('_', '-')}", dest=dest or name, default=argparse.SUPPRESS, **kwargs)


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """Add every settings flag (grouped as in ``accelerate launch --help``)."""
    hw = parser.add_argument_group("hardware and processes")
    _add(
        hw,
        "mixed_precision",
        type=_argtype(V.parse_mixed_precision),
        metavar="{no,fp16,bf16,fp8}",
        help="precision of the training processes (config file, else no)",
    )
    _add(hw, "num_processes", type=_int(1), metavar="N", help="processes on all machines together")
    _add(hw, "num_machines", type=_int(1), metavar="N")
    _add(hw, "machine_rank", type=_int(0), metavar="R", help="rank of this machine (0 on the main one)")
    _add(hw, "main_process_ip", metavar="IP", help="address of the machine with rank 0")
    _add(hw, "main_process_port", type=_int(0), metavar="PORT")
    _add(hw, "gpu_ids", metavar="IDS", help="GPUs to use, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES)")
    hw.add_argument(
        "--cpu",
        "--use_cpu",
        "--use-cpu",
        dest="use_cpu",
        action="store_const",
        const=True,
        default=argparse.SUPPRESS,
        help="train on CPU (gloo) even where GPUs exist",
    )
    _add(
        hw,
        "dynamo_backend",
        type=_argtype(V.parse_dynamo_backend),
        metavar="BACKEND",
        help=f"torch.compile backend: {', '.join(V.DYNAMO_BACKENDS)}",
    )
    _add(hw, "gradient_accumulation_steps", type=_int(1), metavar="N")
    _add(hw, "gradient_clipping", type=_argtype(V.parse_float), metavar="NORM")

    fsdp = parser.add_argument_group("FSDP2 (torch fully_shard)")
    _add(fsdp, "use_fsdp", action="store_const", const=True, help="shard with FSDP2")
    _add(fsdp, "fsdp_version", type=_int(1), metavar="2", help="2 (FSDP1 is not supported)")
    bool_t = _argtype(V.parse_bool, "bool")
    for name in (
        "fsdp_reshard_after_forward",
        "fsdp_activation_checkpointing",
        "fsdp_cpu_ram_efficient_loading",
        "fsdp_offload_params",
    ):
        _add(fsdp, name, type=bool_t, metavar="{true,false}")
    _add(fsdp, "fsdp_auto_wrap_policy", metavar="POLICY", help="TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP")
    _add(fsdp, "fsdp_transformer_layer_cls_to_wrap", metavar="CLS[,CLS]")
    _add(fsdp, "fsdp_min_num_params", type=_int(0), metavar="N")
    _add(fsdp, "fsdp_state_dict_type", metavar="TYPE", help="FULL_STATE_DICT or SHARDED_STATE_DICT")
    _add(
        fsdp,
        "fsdp_sharding_strategy",
        metavar="STRATEGY",
        help="FSDP1's spelling: FULL_SHARD (reshard after forward) or SHARD_GRAD_OP (keep)",
    )

    tp = parser.add_argument_group("tensor parallelism (Accelerate's ParallelismConfig)")
    _add(
        tp,
        "tp_size",
        type=_int(1),
        metavar="N",
        help="processes per model replica that split each Linear of the model's _tp_plan; the rest shard with "
        "FSDP2 (--use_fsdp) unless tp_size = num_processes",
    )
    _add(tp, "parallelism_config_tp_size", dest="tp_size", type=_int(1), metavar="N", help="Accelerate's --tp_size")
    _add(tp, "dp_shard_size", type=_int(1), metavar="N", help="FSDP2 shards (default num_processes / tp_size)")
    _add(
        tp,
        "parallelism_config_dp_shard_size",
        dest="dp_shard_size",
        type=_int(1),
        metavar="N",
        help="Accelerate's --dp_shard_size",
    )

    for key in V.UNSUPPORTED_PARALLEL_SIZES:
        _add(tp, f"parallelism_config_{key}", type=_int(1), metavar="1", help=argparse.SUPPRESS)

    ds = parser.add_argument_group("DeepSpeed")
    _add(ds, "use_deepspeed", action="store_const", const=True, help="use DeepSpeed ZeRO")
    _add(ds, "zero_stage", type=_int(0), choices=[0, 1, 2, 3], metavar="{0,1,2,3}")
    _add(ds, "offload_optimizer_device", metavar="{none,cpu,nvme}")
    _add(ds, "offload_param_device", metavar="{none,cpu,nvme}")
    _add(ds, "zero3_init_flag", type=bool_t, metavar="{true,false}")
    _add(ds, "deepspeed_config_file", metavar="JSON")

    fp8 = parser.add_argument_group("FP8 (need --mixed_precision fp8)")
    _add(
        fp8,
        "fp8_backend",
        type=_argtype(V.parse_fp8_backend),
        metavar="BACKEND",
        help=f"{', '.join(V.FP8_BACKENDS)} (any case; `lowprec env` lists what runs each)",
    )
    _add(
        fp8,
        "fp8_recipe",
        type=_argtype(V.parse_fp8_recipe),
        metavar="RECIPE",
        help=f"native recipe: {', '.join(V.FP8_RECIPES)}",
    )
    _add(
        fp8,
        "fp8_fallback",
        type=_argtype(V.parse_fp8_fallback),
        metavar="{bf16,emulate}",
        help="where the device has no FP8 GEMMs: train in bf16, or emulate the FP8 GEMMs",
    )
    _add(fp8, "fp8_format", type=_argtype(V.parse_fp8_format), metavar="{HYBRID,E4M3,E5M2}")
    for option in RECIPE_OPTIONS.values():  # margin, amax_history_len, amax_compute_algo, scale_rounding
        metavar = "{" + ",".join(option.choices) + "}" if option.choices else "N"
        _add(
            fp8,
            option.setting,
            type=_argtype(V.parse_recipe_option(option.name), option.setting if option.choices else "int"),
            metavar=metavar,
        )
    _add(fp8, "fp8_interval", type=_argtype(V.parse_recipe_int("interval"), "int"), metavar="N")
    _add(
        fp8,
        "fp8_override_linear_precision",
        type=_argtype(V.parse_override_linear_precision),
        metavar="FPROP,DGRAD,WGRAD",
        help='high-precision GEMMs, e.g. "false,false,true"',
    )
    _add(fp8, "fp8_opt_level", type=_argtype(V.parse_opt_level), metavar="{O1,O2}")
    fp8.add_argument(
        "--fp8_use_during_eval",
        "--fp8-use-during-eval",
        "--fp8_use_autocast_during_eval",
        "--fp8-use-autocast-during-eval",
        dest="fp8_use_autocast_during_eval",
        action="store_const",
        const=True,
        default=argparse.SUPPRESS,
        help="keep FP8 on in model.eval()",
    )
    _add(fp8, "fp8_enable_fsdp_float8_all_gather", type=bool_t, metavar="{true,false}")
    _add(fp8, "fp8_pad_inner_dim", type=bool_t, metavar="{true,false}")
    _add(
        fp8,
        "fp8_force_recompute_fp8_weight_in_bwd",
        type=_argtype(V.parse_bool_or_auto, "fp8_force_recompute_fp8_weight_in_bwd"),
        metavar="{true,false,auto}",
        help="re-cast the weight in backward instead of keeping its FP8 copy (auto: where FSDP/ZeRO-3 shards it)",
    )


_SETTINGS_FIELDS = frozenset(LaunchSettings.__dataclass_fields__)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the user typed (one layer for ``LaunchSettings.from_layers``)."""
    given = {k: v for k, v in vars(args).items() if k in _SETTINGS_FIELDS}
    for key in V.UNSUPPORTED_PARALLEL_SIZES:
        try:
            V.check_parallel_size(key, getattr(args, f"parallelism_config_{key}", None))
        except ValueError as err:
            raise UsageError(f"--parallelism_config_{key} {err}") from None
    strategy = getattr(args, "fsdp_sharding_strategy", None)
    if strategy is not None:
        try:
            given.setdefault("fsdp_reshard_after_forward", V.reshard_after_forward(strategy))
        except ValueError as err:
            raise UsageError(f"--fsdp_sharding_strategy {err}") from None
    if given.get("use_fsdp") and given.get("use_deepspeed"):
        raise UsageError("--use_fsdp and --use_deepspeed are both given; pick one")
    # One parallelism flag replaces the config file's choice instead of adding to it.
    if given.get("use_fsdp"):
        given.setdefault("use_deepspeed", False)
    if given.get("use_deepspeed"):
        given.setdefault("use_fsdp", False)
    return given


def check_cli_flags_apply(cli: dict[str, Any], settings: LaunchSettings) -> None:
    """A flag typed on the command line that would have no effect is an error (Accelerate
    dropped ``--fp8_*`` silently without fp8, and ``--zero_stage`` without DeepSpeed)."""

    def flags(prefixes: tuple[str, ...], extra: tuple[str, ...] = ()) -> list[str]:
        return sorted(f"--{k}" for k in cli if (k.startswith(prefixes) or k in extra))

    fp8 = flags(("fp8_",))
    if fp8 and not settings.fp8:
        raise UsageError(
            f"{', '.join(fp8)}: FP8 option(s), but mixed_precision is "
            f"{settings.mixed_precision!r}: add --mixed_precision fp8 or drop them"
        )
    fsdp = [f for f in flags(("fsdp_",)) if f != "--fsdp_version"]
    if fsdp and not settings.use_fsdp:
        raise UsageError(f"{', '.join(fsdp)}: FSDP option(s) without --use_fsdp: add it or drop them")
    ds = flags(
        (),
        ("zero_stage", "offload_optimizer_device", "offload_param_device", "zero3_init_flag", "deepspeed_config_file"),
    )
    if ds and not settings.use_deepspeed:
        raise UsageError(f"{', '.join(ds)}: DeepSpeed option(s) without --use_deepspeed: add it or drop them")
    if "gradient_clipping" in cli and not settings.use_deepspeed:
        raise UsageError(
            "--gradient_clipping is applied by DeepSpeed only (add --use_deepspeed); otherwise drop it "
            "and clip in the script with accelerator.clip_grad_norm_(model.parameters(), max_norm)"
        )
    unread = sorted(f"--{k}" for k in cli if k in UNREAD_FIELDS)
    if unread:
        raise UsageError(f"{', '.join(unread)}: no effect in lowprec (nothing reads it); drop it")
    if settings.fp8:
        fp8_cli = {k: v for k, v in cli.items() if k in FP8_FIELDS}
        chosen = fp8_backend_chosen(settings)
        check_fp8_fields(
            settings.fp8_backend, settings.fp8_recipe, fp8_cli, lambda k: f"--{k}", chosen, recipe_unread=chosen
        )


def fp8_backend_chosen(settings: LaunchSettings) -> bool:
    """Whether the launch names the FP8 backend (``fp8_backend``, or ``fp8_recipe``: native's).
    Where it does not, the script's kwargs handler (``TERecipeKwargs()``...) picks it and reads the
    ``ACCELERATE_FP8_*`` values, as under ``accelerate launch``, and logs once a set value it does
    not read (``warn_unread_env``, the recipe's own warning); launch checks them against nothing."""
    return settings.fp8_backend is not None or settings.fp8_recipe is not None
