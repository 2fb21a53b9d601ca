"""``lowprec train CONFIG.yaml [--key value ...] [--num_processes N]``: the YAML trainer's parser
(the run: :mod:`lowprec.cli.runners.train`).

Every key of the trainer schema (:class:`lowprec.train.config.TrainConfig`) is also a flag; the
flags and their help are generated from the schema. A flag's value is read as YAML, so
``--fp8_filter "[o_proj]"`` and ``--fsdp_config "{reshard_after_forward: false}"`` work, and
flags win over the file. ``--num_processes N`` (N > 1) re-runs this command under torchrun
through ``lowprec launch``'s command builder (DDP, or FSDP2 with ``fsdp_version: 2``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lowprec.cli.train_keys import KEYS

__all__ = ["NAME", "HELP", "add_parser", "add_config_flags", "config_command"]

NAME = "train"
HELP = "train the built-in (or a local HF) model from an Axolotl-style YAML config"


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--key`` flag per schema key (``--key-with-dashes`` too), default: not given."""
    # plain data generated from the schema: building the parser imports neither pydantic nor torch

    group = parser.add_argument_group("config keys (override the YAML; values are read as YAML)")
    for name, description, shown in KEYS:
        spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        group.add_argument(
            *spellings,
            dest=f"cfg__{name}",
            metavar="VALUE",
            default=argparse.SUPPRESS,
            help=f"{description} (default: {shown})".replace("%", "%%"),
        )


def config_command(
    subparsers: Any, name: str, summary: str, description: str, usage: str, config_help: str
) -> argparse.ArgumentParser:
    """A subcommand that reads a trainer YAML config (positional, optional): ``train``, ``compare``.
    The caller adds its own flags, then :func:`add_config_flags`."""
    p = subparsers.add_parser(name, help=summary, description=description, usage=usage)
    p.add_argument("config", nargs="?", help=config_help)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = config_command(
        subparsers,
        NAME,
        HELP,
        "Train from an Axolotl-style YAML config; every config key is also a --flag.",
        "lowprec train CONFIG.yaml [--key value ...] [--num_processes N]",
        "the YAML config (omit to run on defaults and flags alone)",
    )
    p.add_argument(
        "--num_processes",
        "--num-processes",
        type=int,
        default=1,
        metavar="N",
        help="processes on this machine (N > 1: torchrun, gloo on CPU, nccl on GPU)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or info log")
    add_config_flags(p)
    return p
