"""``lowprec`` command line: one subcommand per entry of :data:`COMMANDS`.

A subcommand is two things, named in :data:`COMMANDS`:

* its parser's module in ``lowprec.cli``, which defines ``NAME`` and ``HELP`` (strings),
  ``add_parser(subparsers) -> argparse.ArgumentParser`` and, optionally,
  ``split_argv(parser, tokens) -> (own_tokens, passthrough)`` when the command passes trailing
  arguments through untouched (``launch``; ``passthrough[0]`` and the rest land in the first and
  second positional of the parser). Every parser is built at start-up (``lowprec --help``), so
  these modules import neither torch nor pydantic;
* its runner, ``"module:function"`` with ``function(args) -> int`` (the exit code): imported
  by :func:`runner`, only when that command runs, so its module imports what the command's
  work needs (torch, pydantic, matplotlib) at its top. The runners of the commands that do
  work live in :mod:`lowprec.cli.runners`.

A listed parser module that does not exist is skipped (a command added to the table before its
module).

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
from typing import Callable

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

__all__ = ["COMMANDS", "main", "build_parser", "runner"]

# command -> (its parser's module, its runner "module:function"); the order is --help's
COMMANDS: dict[str, tuple[str, str]] = {
    "launch": ("lowprec.cli.launch", "lowprec.cli.launch:run"),
    "config": ("lowprec.cli.config", "lowprec.cli.runners.config:run"),
    "env": ("lowprec.cli.env", "lowprec.cli.env:run"),
    "train": ("lowprec.cli.train", "lowprec.cli.runners.train:run"),
    "compare": ("lowprec.cli.compare", "lowprec.cli.runners.compare:run"),
    "export": ("lowprec.cli.export", "lowprec.cli.runners.export:run"),
    "report": ("lowprec.cli.report", "lowprec.cli.runners.report:run"),
}


def _load_commands() -> dict[str, ModuleType]:
    modules = {}
    for name, (qualified, _) in COMMANDS.items():
        try:
            modules[name] = importlib.import_module(qualified)
        except ModuleNotFoundError as exc:
            if exc.name != qualified:  # the module exists but one of its imports is missing
                raise
    return modules


def runner(name: str) -> Callable[..., int]:
    """The function that runs command ``name``: the one place a command's work is imported."""
    module, _, function = COMMANDS[name][1].partition(":")
    return getattr(importlib.import_module(module), function)


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
        args = _parse(argv)[1]
    except SystemExit as exc:  # argparse: --help (0) or a bad command line (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    try:
        return int(runner(args.command)(args) or 0)
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
        print(f"lowprec: {str(exc) or 'interrupted'}", file=sys.stderr)  # a bare Ctrl-C has no text
        return 130  # the shell's code for SIGINT


if __name__ == "__main__":
    sys.exit(main())
