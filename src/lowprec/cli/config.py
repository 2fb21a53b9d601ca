"""``lowprec config``: write the launch YAML that ``lowprec launch`` reads.

Three ways: the interactive wizard (no flags), ``--default`` (settings chosen from the
hardware here, the reason printed), or the same flags as ``launch`` (nothing asked). The file
goes to ``--config_file`` or the default location (``$LOWPREC_CONFIG_HOME/default_config.yaml``,
else ``~/.cache/lowprec/default_config.yaml``), and loads back into the same settings.

This is the parser; the run: :mod:`lowprec.cli.runners.config`.
"""

from __future__ import annotations

import argparse
from typing import Any

from lowprec.cli._flags import add_settings_flags

__all__ = ["NAME", "HELP", "add_parser"]

NAME = "config"
HELP = "write a launch config file (wizard, --default, or flags)"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Write the launch config that `lowprec launch` reads: interactive "
        "questions, --default (chosen from this hardware), or the same flags as launch.",
    )
    p.add_argument(
        "--config_file",
        "--config-file",
        metavar="YAML",
        default=None,
        help="where to write (default: $LOWPREC_CONFIG_HOME/default_config.yaml or "
        "~/.cache/lowprec/default_config.yaml)",
    )
    p.add_argument(
        "--default",
        action="store_true",
        help="no questions: pick settings for the hardware here (flags still override)",
    )
    add_settings_flags(p)
    return p
