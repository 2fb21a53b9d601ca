"""``lowprec launch``'s flags from ``accelerate launch`` that are not launch settings.

What each does is in :mod:`lowprec.config.accelerate_flags`; this adds them to the parser
(Accelerate's spellings, dash forms included; kept out of ``--help`` except the ones with an
effect) and turns what the user gave (flag > config file) into :class:`LaunchOptions`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lowprec.cli._flags import _add, _argtype, _int
from lowprec.config import accelerate_flags as A
from lowprec.config import values as V
from lowprec.errors import UsageError

__all__ = ["add_accelerate_flags", "LaunchOptions", "launch_options"]

_SWITCH: dict[str, Any] = dict(action="store_const", const=True)


def add_accelerate_flags(parser: argparse.ArgumentParser) -> None:
    run = parser.add_argument_group("processes (as accelerate launch)")
    run.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no notes, only warnings")
    _add(run, "multi_gpu", **_SWITCH, help="several GPU processes (num_processes: all GPUs unless given)")
    _add(run, "num_cpu_threads_per_process", type=_int(1), metavar="N", help="OMP_NUM_THREADS of each process")
    _add(run, "debug", **_SWITCH, help="ACCELERATE_DEBUG_MODE=true: check shapes of collective operations")
    _add(run, "no_python", **_SWITCH, help="run the script as an executable, not with python")
    _add(run, "same_network", **_SWITCH, help="(lowprec always rendezvous at main_process_ip:main_process_port)")
    _add(run, "rdzv_backend", metavar="BACKEND", help="torchrun rendezvous on several machines: static (default), c10d")
    _add(
        run, "dynamo_mode", metavar="MODE", help="torch.compile's mode (ACCELERATE_DYNAMO_MODE; with --dynamo_backend)"
    )
    _add(run, "dynamo_use_fullgraph", **_SWITCH, help="torch.compile(fullgraph=True) (ACCELERATE_DYNAMO_USE_FULLGRAPH)")
    _add(run, "dynamo_use_dynamic", **_SWITCH, help="torch.compile(dynamic=True) (ACCELERATE_DYNAMO_USE_DYNAMIC)")
    for name, kind in A.TORCHRUN_OPTIONS.items():
        parse = _int(0) if kind is int else (_argtype(V.parse_float, "float") if kind is float else str)
        _add(run, name, type=parse, metavar="VALUE", help=f"torchrun --{name}")
    run.add_argument("-t", dest="tee", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    quiet = parser.add_argument_group("accepted for Accelerate, refused or ignored (launch says which and why)")
    for name in (*A.REFUSED, *A.IGNORED):
        kwargs: dict[str, Any] = dict(help=argparse.SUPPRESS)
        if name in A.SWITCHES:
            kwargs.update(_SWITCH)
        elif name in A.APPENDED:
            kwargs.update(action="append")
        if name == "tpu_use_cluster":  # Accelerate's --tpu_cluster / --no_tpu_cluster (both switches)
            for spelling in ("tpu_cluster", "no_tpu_cluster"):
                _add(quiet, spelling, dest=name, **{**kwargs, **_SWITCH})
            continue
        _add(quiet, name, **kwargs)


@dataclass(frozen=True)
class LaunchOptions:
    quiet: bool = False
    multi_gpu: bool = False
    no_python: bool = False
    rdzv_backend: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # for every process
    torchrun: list[str] = field(default_factory=list)  # torchrun's options
    notes: list[str] = field(default_factory=list)


_DYNAMO_VARS = {
    "dynamo_mode": "ACCELERATE_DYNAMO_MODE",
    "dynamo_use_fullgraph": "ACCELERATE_DYNAMO_USE_FULLGRAPH",
    "dynamo_use_dynamic": "ACCELERATE_DYNAMO_USE_DYNAMIC",
}


def launch_options(args: argparse.Namespace, yaml_options: Mapping[str, Any], config_file: str | None) -> LaunchOptions:
    """Flags beat the config file's keys of the same name; refused ones are errors, ignored ones
    one note per reason (a config file's only where it differs from Accelerate's default)."""
    given = vars(args)
    for name, why in A.REFUSED.items():
        if given.get(name):
            raise UsageError(f"--{name}: {why}")
    notes = A.ignored_note(sorted(n for n in A.IGNORED if n in given), "--{}")
    from_yaml = sorted(n for n in A.IGNORED if n in yaml_options and n not in given)
    notes += A.ignored_note([n for n in from_yaml if A.unless_default(n, yaml_options[n])], f"{{}} in {config_file}")
    if given.get("no_python") and given.get("module"):
        raise UsageError("--no_python and -m/--module both given: --no_python runs an executable; drop one")
    env = {}
    if "num_cpu_threads_per_process" in given:
        env["OMP_NUM_THREADS"] = str(given["num_cpu_threads_per_process"])
    if given.get("debug", yaml_options.get("debug")) in (True, "true", "yes"):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    for name, var in _DYNAMO_VARS.items():  # TorchDynamoPlugin reads them, as Accelerate's does
        value = given.get(name, yaml_options.get(name))
        if value is not None:
            env[var] = str(value) if name == "dynamo_mode" else str(value).lower()  # true | false
    torchrun = [f"--{name}={given[name]}" for name in A.TORCHRUN_OPTIONS if name in given]
    rdzv = given.get("rdzv_backend", yaml_options.get("rdzv_backend"))
    return LaunchOptions(
        quiet=bool(given.get("quiet")),
        multi_gpu=bool(given.get("multi_gpu")),
        no_python=bool(given.get("no_python")),
        rdzv_backend=None if rdzv is None else str(rdzv),
        env=env,
        torchrun=torchrun,
        notes=notes,
    )
