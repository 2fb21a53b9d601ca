"""``lowprec`` command line: one subcommand per module.

A subcommand is a module in ``lowprec.cli`` listed in :data:`COMMANDS` that defines

* ``NAME`` and ``HELP`` (strings),
* ``add_parser(subparsers) -> argparse.ArgumentParser``,
* ``run(args) -> int`` (the exit code),
* optionally ``split_argv(parser, tokens) -> (own_tokens, passthrough)`` when the command
  passes trailing arguments through untouched (``launch``); ``passthrough[0]`` and the rest
  land in the first and second positional of the parser.

A listed module that does not exist yet is skipped, so ``train`` and ``compare`` appear as
soon as ``lowprec/cli/train.py`` and ``compare.py`` are added. Modules must import heavy
libraries (torch) inside ``run``, not at module level: every command pays for every import.

A ``ValueError`` (``UsageError`` included) raised by a command is a user error: one line
``lowprec: error: ...`` on stderr, exit code 2, no traceback (set ``LOWPREC_DEBUG=1`` for it).
A run stopped on purpose is one ``lowprec: stopped: ...`` line: exit 3 (training diverged), 74
(``StorageError``: disk full or directory read-only; sysexits' EX_IOERR), 130 (interrupted).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from lowprec import __version__
from lowprec.cli._flags import LowprecArgumentParser
from lowprec.errors import (
    EXIT_NONFINITE,
    EXIT_STORAGE,
    EXIT_USAGE,
    NonFiniteError,
    StorageError,
    did_you_mean,
    format_usage_error,
)

__all__ = ["COMMANDS", "main", "build_parser"]

COMMANDS = ("launch", "config", "env", "train", "compare", "export", "report")


def _load_commands() -> dict[str, ModuleType]:
    modules = {}
    for name in COMMANDS:
        qualified = f"lowprec.cli.{name}"
        try:
            modules[name] = importlib.import_module(qualified)
        except ModuleNotFoundError as exc:
            if exc.name != qualified:  # the module exists but one of its imports is missing
                raise
    return modules


def build_parser() -> tuple[LowprecArgumentParser, dict[str, tuple[ModuleType, LowprecArgumentParser]]]:
    parser = LowprecArgumentParser(prog="lowprec", description="Low-precision (FP8/BF16/FP16) training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"lowprec {__version__}")
    modules = _load_commands()
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(modules) + "}")
    commands = {}
    for name, module in modules.items():
        commands[name] = (module, module.add_parser(sub))
    return parser, commands


def _parse(argv: list[str]):
    parser, commands = build_parser()
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv or ["--help"])  # --help / --version exit here
        parser.error("a command comes first: lowprec {" + ",".join(commands) + "} ...")
    name, tokens = argv[0], argv[1:]
    if name not in commands:
        parser.error(f"unknown command {name!r}{did_you_mean(name, commands)}; choose one of {', '.join(commands)}")
    module, sub = commands[name]
    if hasattr(module, "split_argv"):
        own, passthrough = module.split_argv(sub, tokens)
        args = sub.parse_args(own)
        positionals = [a for a in sub._actions if not a.option_strings]  # noqa: SLF001
        if len(positionals) >= 2:
            setattr(args, positionals[0].dest, passthrough[0] if passthrough else None)
            setattr(args, positionals[1].dest, passthrough[1:])
    else:
        args = sub.parse_args(tokens)
    args.command = name
    args.argv = list(tokens)  # the command line as typed (for "to continue: ..." hints)
    return module, args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        module, args = _parse(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad command line (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    try:
        return int(module.run(args) or 0)
    except ValueError as exc:
        if os.environ.get("LOWPREC_DEBUG"):
            raise
        print(format_usage_error(exc), file=sys.stderr)
        return EXIT_USAGE
    except NonFiniteError as exc:  # training diverged: not a usage error, still one line
        if os.environ.get("LOWPREC_DEBUG"):
            raise
        print(f"lowprec: stopped: {exc}", file=sys.stderr)
        return EXIT_NONFINITE
    except StorageError as exc:  # disk full / read-only: the line names the path and what was kept
        if os.environ.get("LOWPREC_DEBUG"):
            raise
        print(f"lowprec: stopped: {exc}", file=sys.stderr)
        return EXIT_STORAGE
    except KeyboardInterrupt as exc:
        if os.environ.get("LOWPREC_DEBUG"):
            raise
        print(f"lowprec: {exc or 'interrupted'}", file=sys.stderr)
        return 130  # the shell's code for SIGINT


if __name__ == "__main__":
    sys.exit(main())
