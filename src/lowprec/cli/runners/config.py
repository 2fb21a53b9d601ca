"""``lowprec config``'s run (its parser: :mod:`lowprec.cli.config`): the wizard, ``--default`` or
the flags, written as the launch YAML."""

from __future__ import annotations

import argparse
from typing import Any

from lowprec.cli._flags import check_cli_flags_apply, settings_from_args
from lowprec.cli.wizard import run_wizard
from lowprec.config.env import LaunchSettings
from lowprec.config.launch_config import default_config_path, write_launch_config

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    cli = settings_from_args(args)
    if args.default or cli:
        base: dict[str, Any] = {}
        if args.default:
            from lowprec.cli.hardware import hardware_default  # torch: only --default asks the hardware

            defaults, reason = hardware_default()
            base = defaults.explicit()
            print(f"lowprec config: {reason}")
        settings = LaunchSettings.from_layers(base, cli)
        check_cli_flags_apply(cli, settings)
    else:
        settings = run_wizard()
    path = write_launch_config(settings, args.config_file or default_config_path())
    print(f"lowprec config: wrote {path}")
    print(path.read_text(), end="")
    return 0
