"""``lowprec launch``: resolve flags > config file > defaults, export, run the script.

One process runs as ``python script.py args`` (under DeepSpeed with the variables torchrun would
set for one process: DeepSpeed reads them); several processes or machines run under
torchrun (``python -m torch.distributed.run``). The settings travel as environment variables
(:mod:`lowprec.config.env`); the script's own arguments (everything after the script path,
including ones that look like our flags) are passed through untouched. The exit code is the
script's (128 + N when it dies from signal N).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowprec.cli._launch_options import LaunchOptions, add_accelerate_flags, launch_options
from lowprec.cli._flags import add_settings_flags, check_cli_flags_apply, fp8_backend_chosen, settings_from_args
from lowprec.config.env import (
    FP8_FIELDS,
    UNREAD_FIELDS,
    LaunchSettings,
    check_fp8_fields,
    fp8_fields_unread,
    owned_env_var,
)
from lowprec.backends.spec import spec_or_native
from lowprec.config.json_file import read_json_object
from lowprec.config.paths import default_config_path
from lowprec.errors import UsageError
from lowprec.cli._torchrun import CONTINUE_VAR, describe_exit
from lowprec.cli._worker import exit_mode

__all__ = ["NAME", "HELP", "add_parser", "split_argv", "run", "LaunchPlan", "plan_launch", "build_command"]

NAME = "launch"
HELP = "run a training script with the resolved precision and distributed settings"
DEFAULT_PORT = 29500


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Run a training script with the resolved precision and distributed settings: "
        "flags > config file > defaults, exported as environment variables; several processes "
        "or machines run under torchrun.",
        usage="lowprec launch [options] script.py [script args...]\n"
        "       lowprec launch [options] -m package.module [module args...]",
    )
    p.add_argument(
        "--config_file",
        "--config-file",
        metavar="YAML",
        default=None,
        help="launch config (default: $LOWPREC_CONFIG_HOME/default_config.yaml or "
        "~/.cache/lowprec/default_config.yaml when it exists)",
    )
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument(
        "--dry_run",
        "--dry-run",
        "--print_command",
        "--print-command",
        dest="dry_run",
        action="store_true",
        help="print the environment and command, run nothing",
    )
    add_settings_flags(p)
    add_accelerate_flags(p)
    p.add_argument("training_script", nargs="?", help="the script (or module with -m)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="passed to the script unchanged")
    return p


def split_argv(parser: argparse.ArgumentParser, tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(our options, [script, *script args])``: the script is the first token that is not an
    option of ours or an option's value. argparse's REMAINDER is not used to find it because it
    still scans the script's arguments for our option names (abbreviations, ``--help``)."""
    actions = parser._option_string_actions  # noqa: SLF001 - the parser's own option table
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            return list(tokens[:i]), list(tokens[i + 1 :])
        if tok.startswith("-") and tok != "-":
            action = actions.get(tok.split("=", 1)[0])
            takes_value = action is not None and action.nargs != 0  # nargs=0: a switch
            i += 2 if takes_value and "=" not in tok else 1
            continue
        return list(tokens[:i]), list(tokens[i:])
    return list(tokens), []


@dataclass(frozen=True)
class LaunchPlan:
    settings: LaunchSettings
    command: list[str]
    exported: dict[str, str]  # what this launch sets
    removed: list[str]  # inherited variables of the contract that were dropped
    env: dict[str, str]  # the child's full environment
    config_file: str | None
    notes: list[str]
    warnings: list[str] = field(default_factory=list)


def worker_threads_env(settings: LaunchSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS=1`` for the workers of a launch of several processes per machine when the
    environment does not set it: torchrun's own default there, set by the launcher as Accelerate's
    does, so torchrun does not print its four-line banner about it on every run."""
    if settings.distributed and settings.processes_per_machine > 1 and "OMP_NUM_THREADS" not in environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def wait_through_ctrl_c(proc: subprocess.Popen) -> tuple[int, bool]:
    """The child's exit code, and whether a Ctrl-C came meanwhile. The child got the same SIGINT
    from the terminal (one process group) and stops as it does (workers at the end of the step,
    writing their summary and checkpoint), so the launcher waits for it, holding what it holds
    (``lowprec train``'s output_dir lock), instead of killing it 0.25 s later as
    ``subprocess.run`` does."""
    interrupted = False
    while True:
        try:
            return proc.wait(), interrupted
        except KeyboardInterrupt:
            interrupted = True


def build_command(
    settings: LaunchSettings,
    script: str,
    script_args: Sequence[str],
    module: bool,
    options: LaunchOptions | None = None,
) -> list[str]:
    options = options or LaunchOptions()
    target = (["-m"] if module else []) + [script, *script_args]
    if not settings.distributed:
        return target if options.no_python else [sys.executable, *target]
    # torchrun's own run(), ending in one lowprec line when a worker fails (cli/_torchrun.py)
    cmd = [sys.executable, "-m", "lowprec.cli._torchrun", *options.torchrun]
    if settings.num_machines == 1 and not settings.main_process_port:  # None or 0: any free port
        # c10d rendezvous on a free local port: parallel launches on one box do not collide.
        cmd += ["--standalone", f"--nproc_per_node={settings.processes_per_machine}"]
    else:
        cmd += [
            f"--nproc_per_node={settings.processes_per_machine}",
            f"--nnodes={settings.num_machines}",
            f"--node_rank={settings.machine_rank}",
        ]
        address = f"{settings.main_process_ip or '127.0.0.1'}:{settings.main_process_port or DEFAULT_PORT}"
        if settings.num_machines > 1 and options.rdzv_backend not in (None, "static"):
            cmd += [f"--rdzv_backend={options.rdzv_backend}", f"--rdzv_endpoint={address}"]
        else:
            host, port = address.rsplit(":", 1)
            cmd += [f"--master_addr={host}", f"--master_port={port}"]
    if options.no_python:  # the script is an executable; torchrun runs it as it is
        return cmd + ["--no-python", *target]
    # each rank runs the script under cli/_worker.py: it records that the rank finished and leaves
    # without interpreter finalization (where torch's gloo threads can abort a finished rank)
    return cmd + ["-m", "lowprec.cli._worker", *target]


def plan_launch(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchPlan:
    environ = dict(os.environ if environ is None else environ)
    script = args.training_script
    if not script:
        raise UsageError("launch needs a training script: lowprec launch [options] script.py [args]")
    if not args.module and not Path(script).is_file():
        raise UsageError(f"training script {script!r} not found (for a module, add -m)")

    notes = []
    config_file = args.config_file
    if config_file is None:
        default = default_config_path()
        config_file = str(default) if default.is_file() else None
        if config_file is not None:  # an unseen file deciding the run confuses; say it is used
            notes.append(f"using the default config file {config_file}")
    yaml_layer: dict[str, Any] = {}
    yaml_options: dict[str, Any] = {}
    if config_file is not None:
        # pydantic (~0.1 s): only a launch with a config file pays for it
        from lowprec.config.launch_config import load_launch_config

        config = load_launch_config(config_file)
        yaml_layer, yaml_options = config.to_settings(), config.accelerate_options()
    options = launch_options(args, yaml_options, config_file)
    cli_layer = settings_from_args(args)
    _apply_multi_gpu(options, cli_layer, yaml_layer)
    try:
        settings = LaunchSettings.from_layers(yaml_layer, cli_layer)
    except UsageError as exc:  # a combination: say where each value named in it came from
        raise UsageError(f"{exc}{_origins(str(exc), yaml_layer, cli_layer, config_file)}") from None
    if getattr(args, "fsdp_sharding_strategy", None) is not None and not settings.use_fsdp:
        raise UsageError("--fsdp_sharding_strategy: FSDP option without --use_fsdp: add it or drop it")
    check_cli_flags_apply(cli_layer, settings)
    _check_files(settings, cli_layer, config_file)
    _check_fp8_library(settings, cli_layer, config_file)

    ignored = sorted(k for k in yaml_layer if k in FP8_FIELDS and k not in cli_layer)
    if ignored and not settings.fp8:
        notes.append(f"fp8_config in {config_file} is not used: mixed_precision is {settings.mixed_precision!r}")
    notes += _yaml_notes(yaml_layer, cli_layer, settings, config_file) + options.notes
    if options.torchrun and not settings.distributed:
        notes.append(
            f"{', '.join(o.split('=')[0] for o in options.torchrun)}: ignored: one process runs without "
            "torchrun (they apply with num_processes > 1)"
        )
    exported = {**settings.to_env(), **options.env, **_one_process_deepspeed_env(settings, environ)}
    exported = {**worker_threads_env(settings, {**environ, **exported}), **exported}
    removed = sorted(k for k in environ if owned_env_var(k) and k not in exported)
    overridden = sorted(k for k in exported if k in environ and environ[k] != exported[k])
    if removed:  # a stale shell variable changing nothing must still be seen (not only in --dry_run)
        notes.append(f"removed {', '.join(removed)} inherited from the environment (the launch settings decide)")
    if overridden:
        notes.append(
            "overriding "
            + ", ".join(f"{k}={environ[k]} with {exported[k]}" for k in overridden)
            + " from the environment (flags and config file decide)"
        )
    env = {k: v for k, v in environ.items() if k not in removed}
    env.update(exported)
    if settings.distributed:  # each rank runs under cli/_worker.py, which reads it
        exit_mode(environ)
    command = build_command(settings, script, args.training_script_args, args.module, options)
    notes = [] if options.quiet else notes
    asked_gpus = any(layer.get("use_cpu") is False or "gpu_ids" in layer for layer in (yaml_layer, cli_layer))
    warnings = _gpu_warnings(settings) if asked_gpus else []
    return LaunchPlan(settings, command, exported, removed, env, config_file, notes, warnings)


def _apply_multi_gpu(options: LaunchOptions, cli_layer: dict[str, Any], yaml_layer: Mapping[str, Any]) -> None:
    """``--multi_gpu``: several GPU processes (not CPU), as many as GPUs unless num_processes is given."""
    if not options.multi_gpu:
        return
    if cli_layer.get("use_cpu"):
        raise UsageError("--multi_gpu and --cpu both given: GPU or CPU processes; drop one")
    cli_layer["use_cpu"] = False
    if "num_processes" not in cli_layer and "num_processes" not in yaml_layer:
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise UsageError("--multi_gpu: no GPU found to count processes by; give --num_processes N")
        cli_layer["num_processes"] = count


def _gpu_warnings(settings: LaunchSettings) -> list[str]:
    """Several GPU processes asked for (``use_cpu: false``, ``gpu_ids``, ``--multi_gpu``: not the
    default) where torch sees no GPU: each rank falls
    back to the CPU and gloo (state/), so say it once here instead of letting it pass unseen.
    torch is imported only on this path (torchrun, which the launch starts next, imports it too)."""
    if not settings.distributed or settings.use_cpu:
        return []
    import torch

    if torch.cuda.is_available():
        return []
    return [
        f"no GPU found: running {settings.processes_per_machine} CPU process(es) on this machine with gloo "
        "(use_cpu is false / distributed_type MULTI_GPU); set --cpu (use_cpu: true) to say so, or launch where GPUs are"
    ]


def _origins(message: str, yaml_layer: Mapping[str, Any], cli_layer: Mapping[str, Any], config_file: str | None) -> str:
    """`` (num_machines from --num_machines; num_processes from cfg.yaml)`` for the settings a
    message names, so an error caused by a flag is not blamed on the file (or the reverse)."""
    import re

    named = dict.fromkeys(re.findall(r"\b([a-z][a-z0-9_]+)\b", message))
    parts = [
        f"{k} from --{k}" if k in cli_layer else f"{k} from {config_file}"
        for k in named
        if k in cli_layer or k in yaml_layer
    ]
    return f" ({'; '.join(parts)})" if parts else ""


def _where(name: str, section: str, cli_layer: Mapping[str, Any], config_file: str | None) -> str:
    """How the user wrote setting ``name``: ``--name``, or its key in the config file."""
    return f"--{name}" if name in cli_layer else f"{section} in {config_file}"


def _check_files(settings: LaunchSettings, cli_layer: Mapping[str, Any], config_file: str | None) -> None:
    """Every file the launch is given is read now, before any process starts (a missing
    DeepSpeed config otherwise surfaces as a traceback inside each worker)."""
    path = settings.deepspeed_config_file
    if path is None:
        return
    where = _where("deepspeed_config_file", "deepspeed_config.deepspeed_config_file", cli_layer, config_file)
    try:
        read_json_object(path)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}") from None


def _check_fp8_library(settings: LaunchSettings, cli_layer: Mapping[str, Any], config_file: str | None) -> None:
    """An fp8_format only the backend's library runs (TE's E5M2) where that library is not
    installed: the backend would fall back to the native engine, which refuses it inside every
    worker; refuse it here in one line instead."""
    if not settings.fp8 or settings.fp8_format is None:
        return
    spec = spec_or_native(settings.fp8_backend)
    native = spec_or_native("native").fp8_formats
    if settings.fp8_format in native or spec.library is None or spec.available():
        return
    where = _where("fp8_format", "fp8_config.fp8_format", cli_layer, config_file)
    raise UsageError(
        f"{where} {settings.fp8_format}: runs only on {spec.library}, which is not installed here (the "
        f"{spec.name} backend would fall back to lowprec's native engine); install {spec.library}, or use "
        f"{' or '.join(native)}"
    )


_DEEPSPEED_KEYS = ("zero_stage", "offload_optimizer_device", "offload_param_device", "deepspeed_config_file")


def _yaml_notes(
    yaml_layer: Mapping[str, Any], cli_layer: Mapping[str, Any], settings: LaunchSettings, config_file: str | None
) -> list[str]:
    """Config-file values that would change nothing: a note each (the same values as flags are
    usage errors, see ``check_cli_flags_apply``; a file may come from Accelerate, so it is not)."""
    from_yaml = {k: v for k, v in yaml_layer.items() if k not in cli_layer}
    notes = []
    unread = sorted(k for k in from_yaml if k in UNREAD_FIELDS and not (k == "dynamo_backend" and from_yaml[k] == "no"))
    if unread:
        notes.append(f"{', '.join(unread)} in {config_file}: no effect in lowprec (nothing reads it)")
    # a section the distributed_type does not select (Accelerate drops it silently): say so
    fsdp = sorted(k for k in from_yaml if k.startswith("fsdp_") and k != "fsdp_version")
    if fsdp and not settings.use_fsdp:
        notes.append(
            f"fsdp_config in {config_file} is not used ({', '.join(fsdp)}): FSDP2 shards only with "
            "distributed_type: FSDP (or --use_fsdp)"
        )
    ds = sorted(k for k in from_yaml if k in _DEEPSPEED_KEYS)
    if ds and not settings.use_deepspeed:
        notes.append(
            f"deepspeed_config in {config_file} is not used ({', '.join(ds)}): DeepSpeed runs only with "
            "distributed_type: DEEPSPEED (or --use_deepspeed)"
        )
    if "gradient_clipping" in from_yaml and not settings.use_deepspeed:
        notes.append(
            f"gradient_clipping in {config_file} is applied by DeepSpeed only; clip in the script "
            "with accelerator.clip_grad_norm_"
        )
    if settings.fp8:
        # refused settings and fields the recipe does not read are errors; fields another backend
        # reads stay notes (an Accelerate-written file may carry them). No backend named: the
        # script's handler picks one and reads them (fp8_backend_chosen)
        chosen = fp8_backend_chosen(settings)
        check_fp8_fields(
            settings.fp8_backend,
            settings.fp8_recipe,
            {k: v for k, v in from_yaml.items() if k in FP8_FIELDS},
            lambda k: f"fp8_config.{k.removeprefix('fp8_')} in {config_file}",
            backend_unread=False,
            recipe_unread=chosen,
        )
        dropped = fp8_fields_unread(settings.fp8_backend, from_yaml) if chosen else []
        if dropped:
            notes.append(
                f"fp8_config {', '.join(f.removeprefix('fp8_') for f in dropped)} in {config_file}: "
                f"the {settings.fp8_backend or 'native'} FP8 backend does not read it"
            )
    return notes


def _one_process_deepspeed_env(settings: LaunchSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """DeepSpeed on one process (no torchrun): the variables torchrun would set, which
    ``deepspeed.initialize`` reads (it asserts on LOCAL_RANK) and its process group
    rendezvous uses; a free local port unless main_process_port is set. Those already in the
    environment (a scheduler's) are kept."""
    if not settings.use_deepspeed or settings.distributed:
        return {}
    port = settings.main_process_port
    if not port:
        with socket.socket() as s:  # a free port, as torchrun --standalone picks one
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    wanted = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": settings.main_process_ip or "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    return {k: v for k, v in wanted.items() if k not in environ}


def format_plan(plan: LaunchPlan) -> str:
    lines = [f"# config file: {plan.config_file or '(none)'}"]
    lines += [f"# note: {n}" for n in plan.notes]
    lines += [f"# warning: {w}" for w in plan.warnings]
    lines.append("# environment of the training processes")
    lines += [f"unset {k}" for k in plan.removed]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(plan.exported.items())]
    lines.append("# command")
    lines.append(shlex.join(plan.command))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    plan = plan_launch(args)
    if args.dry_run:
        print(format_plan(plan))
        return 0
    for note in plan.notes:
        print(f"lowprec: note: {note}", file=sys.stderr)
    for warning in plan.warnings:
        print(f"lowprec: warning: {warning}", file=sys.stderr)

    again = plan.env.get(CONTINUE_VAR) or shlex.join(["lowprec", "launch", *getattr(args, "argv", sys.argv[2:])])
    code, interrupted = wait_through_ctrl_c(subprocess.Popen(plan.command, env={**plan.env, CONTINUE_VAR: again}))
    if not plan.settings.distributed:  # under torchrun, cli/_torchrun.py says it
        if interrupted:
            print(f"lowprec: interrupted; to continue: {again}", file=sys.stderr)
        elif code:
            print(f"lowprec: the script failed: {describe_exit(code)}; to continue: {again}", file=sys.stderr)
    code = 128 - code if code < 0 else code
    return (code or 130) if interrupted else code
