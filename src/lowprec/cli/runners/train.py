"""``lowprec train``'s run (its parser: :mod:`lowprec.cli.train`): validate the config, then train
here, or re-run this command under torchrun with ``--num_processes N`` (N > 1) through ``lowprec
launch``'s command builder (DDP, or FSDP2 with ``fsdp_version: 2``)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
from typing import Any, Sequence

from lowprec.cli._torchrun import CONTINUE_VAR, report_stop
from lowprec.cli._worker import exit_mode
from lowprec.cli.launch import build_command, wait_through_ctrl_c, worker_threads_env
from lowprec.config.deepspeed_schema import check_deepspeed_config
from lowprec.config.env import LaunchSettings, owned_env_var
from lowprec.config.json_file import read_json_object
from lowprec.errors import EXIT_NONFINITE, EXIT_STORAGE, NonFiniteError, StorageError
from lowprec.train.checkpoints import resolve_resume
from lowprec.train.config import load_config, parse_override_value
from lowprec.train.tp_dims import check_tensor_parallel_dims
from lowprec.train.run_lock import hold_output_dir, launcher_env, make_output_dir

__all__ = ["run", "overrides_from_args", "relaunch_command", "resume_command"]

_UNDER_LAUNCHER = "LOWPREC_TRAIN_CHILD"


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k[len("cfg__") :]: parse_override_value(v) for k, v in vars(args).items() if k.startswith("cfg__")}


def relaunch_command(argv: Sequence[str], num_processes: int) -> list[str]:
    """``python -m lowprec.cli._torchrun ... -m lowprec.cli.main train <argv without --num_processes>``."""

    rest, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        if tok in ("--num_processes", "--num-processes"):
            skip = True
            continue
        if tok.startswith(("--num_processes=", "--num-processes=")):
            continue
        rest.append(tok)
    settings = LaunchSettings(num_processes=num_processes)
    return build_command(settings, "lowprec.cli.main", ["train", *rest], module=True)


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The command line again, from the parsed namespace (flags as typed, config first)."""
    argv = [args.config] if args.config else []
    for k, v in vars(args).items():
        if k.startswith("cfg__"):
            argv += [f"--{k[len('cfg__') :]}", v]
    return argv + (["--quiet"] if args.quiet else [])


def resume_command(args: argparse.Namespace) -> str:
    """``lowprec train ... --resume_from_checkpoint auto``: this command line, continuing."""
    argv = [a for a in _argv_of(args)]
    for i, tok in enumerate(argv[:-1]):
        if tok == "--resume_from_checkpoint":
            del argv[i : i + 2]
            break
    if getattr(args, "num_processes", 1) > 1:
        argv += ["--num_processes", str(args.num_processes)]
    return shlex.join(["lowprec", "train", *argv, "--resume_from_checkpoint", "auto"])


def _child_env() -> dict[str, str]:
    """The workers' environment: the YAML is the only source of settings, so launch variables
    inherited from the shell (ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_FSDP, ...) are dropped."""

    env = {k: v for k, v in os.environ.items() if not owned_env_var(k)}
    env[_UNDER_LAUNCHER] = "1"
    return env


def _drop_launch_env() -> None:
    """The YAML is the one source of precision and distribution settings: launch variables left
    in the shell (Axolotl issue #760: a stale ``mixed_precision: fp8`` broke every run) are
    dropped, and named, instead of silently changing the run."""

    dropped = sorted(k for k in os.environ if owned_env_var(k) and k != "CUDA_VISIBLE_DEVICES")
    for k in dropped:
        del os.environ[k]
    if dropped and int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("lowprec").warning(
            "lowprec train: ignoring %s from the environment (the YAML config sets precision and distribution)",
            ", ".join(dropped),
        )


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a line is logged, not as it was when the handler
    was made (callers that swap stderr, pytest's capture among them, would leave it closed)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _setup_logging(quiet: bool) -> None:
    log = logging.getLogger("lowprec")
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    rank = int(os.environ.get("RANK", "0"))
    log.setLevel(logging.WARNING if quiet or rank != 0 else logging.INFO)
    log.propagate = False


def _check_tensor_parallel(cfg: Any, processes: int) -> None:
    """Before any worker starts: the process count must split into tensor-parallel groups, the
    model's heads and MLP units into tensor_parallel_size parts, and more than one group needs
    FSDP2 to hold the data-parallel dimension."""
    tp = cfg.tensor_parallel_size
    if tp > 1 and processes % tp:
        raise ValueError(
            f"tensor_parallel_size: {tp} does not divide --num_processes {processes}; launch a "
            f"multiple of {tp} processes or change tensor_parallel_size"
        )
    check_tensor_parallel_dims(cfg.base_model, tp)  # heads and MLP units split evenly
    ep = cfg.ep_size
    if ep > 1 and processes % ep:
        raise ValueError(
            f"ep_size: {ep} does not divide --num_processes {processes}: every {ep} processes share the "
            f"experts (more are replicas); launch a multiple of {ep} processes or change ep_size"
        )
    if tp > 1 and processes // tp > 1 and cfg.fsdp_version != 2:
        raise ValueError(
            f"tensor_parallel_size: {tp} with --num_processes {processes} leaves {processes // tp} "
            f"data-parallel groups, which FSDP2 shards: add fsdp_version: 2, or run {tp} processes"
        )


def _check_resume_processes(cfg: Any, processes: int) -> None:
    """Before any worker starts: a checkpoint of another process count whose data position
    this count cannot continue is one line (resume_check.check_process_count)."""
    if cfg.resume_from_checkpoint is None:
        return
    path, _ = resolve_resume(cfg.resume_from_checkpoint, os.path.abspath(cfg.output_dir))
    if path is not None:
        # here, not at the top: it reads checkpoints with torch, which a launching process never imports
        from lowprec.train.resume_check import check_process_count

        check_process_count(path, processes, cfg)


def _check_deepspeed(cfg: Any, processes: int) -> None:
    """DeepSpeed's schema check, then the launch: DeepSpeed initialises its process group from
    the launcher's variables, so a plain one-process run would fail inside deepspeed.initialize."""
    ds = cfg.deepspeed
    body, source = (read_json_object(ds), f"deepspeed config {ds}") if isinstance(ds, str) else (ds, "deepspeed")
    check_deepspeed_config(body, source, cfg.micro_batch_size, cfg.gradient_accumulation_steps)
    if processes == 1 and "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "deepspeed is set but this is a one-process run, and DeepSpeed runs under a launcher: "
            "add --num_processes 2 (or more), or drop deepspeed"
        )


def run(args: argparse.Namespace) -> int:
    overrides = overrides_from_args(args)
    if args.quiet:
        overrides.setdefault("progress_bar", False)
    cfg = load_config(args.config, overrides)  # validate before launching any worker
    if args.num_processes < 1:
        raise ValueError(f"--num_processes {args.num_processes}: use 1 or more")
    _check_tensor_parallel(cfg, int(os.environ.get("WORLD_SIZE", args.num_processes)))
    _check_resume_processes(cfg, int(os.environ.get("WORLD_SIZE", args.num_processes)))
    if cfg.deepspeed is not None:
        _check_deepspeed(cfg, args.num_processes)
    if args.num_processes > 1 and "WORLD_SIZE" not in os.environ:
        exit_mode()  # each worker runs under cli/_worker.py, which reads LOWPREC_WORKER_EXIT
        cmd = relaunch_command(_argv_of(args), args.num_processes)
        # the launcher holds the output_dir lock for its workers' whole life: a second run is
        # refused here, before any worker starts (rank 0 sees the launcher named in launcher_env)
        with hold_output_dir(make_output_dir(cfg.output_dir)):
            env = {**_child_env(), CONTINUE_VAR: resume_command(args), **launcher_env(cfg.output_dir)}
            env.update(worker_threads_env(LaunchSettings(num_processes=args.num_processes), env))
            code, _ = wait_through_ctrl_c(subprocess.Popen(cmd, env=env))
        return 128 - code if code < 0 else code
    # here, not at the top: the trainer imports torch, which a launching process never needs
    from lowprec.train.trainer import train

    _setup_logging(args.quiet)
    _drop_launch_env()
    try:
        result = train(cfg)
    except (NonFiniteError, StorageError, KeyboardInterrupt) as exc:
        rank = int(os.environ.get("RANK", "0"))
        code = (
            EXIT_NONFINITE
            if isinstance(exc, NonFiniteError)
            else EXIT_STORAGE
            if isinstance(exc, StorageError)
            else 130
        )
        if code != 130:
            # under the launcher: every rank stops alike; rank 0's reason becomes the one line
            # the launcher prints (with the multi-process command that continues)
            report_stop(str(exc), rank, code)  # does not return under a launcher
        if rank != 0:  # every rank stops alike; rank 0 says why
            return code
        # one line, with the command that continues the run (the CLI prints it and exits 3 / 74 / 130);
        # a worker of `--num_processes N` has lost that flag: its launcher's command (with it) is in the env
        again = os.environ.get(CONTINUE_VAR) if _UNDER_LAUNCHER in os.environ else None
        text = f"{exc or 'interrupted'}; to continue: {again or resume_command(args)}"
        if isinstance(exc, StorageError):
            raise StorageError(exc.errno, text) from None
        raise type(exc)(text) from None
    if int(os.environ.get("RANK", "0")) == 0:
        ev = "n/a" if result.final_eval_loss is None else f"{result.final_eval_loss:.4f}"
        tr = "n/a" if result.final_train_loss is None else f"{result.final_train_loss:.4f}"
        precision = result.precision + (" (no layer converted)" if result.fp8_nothing_converted else "")
        print(
            f"lowprec train: {result.steps} steps ({precision}), final train loss {tr}, "
            f"validation loss {ev}, {result.tokens_per_s:.0f} tokens/s, {result.wall_s:.1f} s; "
            f"outputs in {result.output_dir}"
        )
    return 0
