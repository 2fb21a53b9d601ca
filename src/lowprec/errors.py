"""User-facing errors: one line, naming the key or flag and the fix.

Library code raises ``ValueError``/``TypeError`` (or :class:`UsageError`, a ``ValueError``);
the CLI turns any of them into ``lowprec: error: <message>`` on stderr and exit code 2,
without a traceback (:func:`exit_with_usage_error`).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable
from typing import NoReturn

__all__ = [
    "UsageError",
    "CheckpointError",
    "NonFiniteError",
    "StorageError",
    "EXIT_NONFINITE",
    "EXIT_STORAGE",
    "did_you_mean",
    "exit_with_usage_error",
    "format_usage_error",
]

EXIT_USAGE = 2  # argparse's exit code for a bad command line; we use it for bad config too
EXIT_NONFINITE = 3  # training stopped: too many consecutive non-finite steps, or a non-finite model
EXIT_STORAGE = 74  # sysexits.h EX_IOERR: the disk is full or read-only; the last good checkpoint is kept


class UsageError(ValueError):
    """A mistake in what the user asked for (flag, YAML key, env var), not a bug."""


class CheckpointError(ValueError):
    """A checkpoint file that is missing, damaged, or not safe to read (one line naming the file)."""


class NonFiniteError(RuntimeError):
    """Training cannot go on: loss or gradients were not finite for too many consecutive steps,
    or a model with non-finite weights was about to be saved. Not a usage error (exit code 3)."""


class StorageError(OSError):
    """Writing a checkpoint or an output failed (disk full, directory made read-only, ...): one
    line naming the path and what was kept. An ``OSError``, so callers that handle those still
    do; the CLI prints it without a traceback and exits with :data:`EXIT_STORAGE`."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]" prefix
        return str(self.args[-1]) if len(self.args) == 1 else self.strerror or super().__str__()


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or ``''`` when nothing is close."""
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def format_usage_error(exc: BaseException) -> str:
    """The one line printed for ``exc``; multi-line messages are joined with '; '."""
    text = " ".join(str(exc).split("\n")) if str(exc) else type(exc).__name__
    return f"lowprec: error: {text.strip()}"


def exit_with_usage_error(exc: BaseException | str) -> NoReturn:
    """Print one line on stderr and exit with code 2."""
    line = format_usage_error(exc if isinstance(exc, BaseException) else UsageError(exc))
    print(line, file=sys.stderr)
    sys.exit(EXIT_USAGE)
