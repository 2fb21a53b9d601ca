"""``lowprec config``'s run (its parser: :mod:`lowprec.cli.config`): the wizard, ``--default`` or
the flags, written as the launch YAML."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from lowprec.cli._flags import check_cli_flags_apply, settings_from_args
from lowprec.cli.wizard import run_wizard
from lowprec.config.env import LaunchSettings
from lowprec.config.launch_config import default_config_path, write_launch_config
from lowprec.errors import UsageError

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
    path = _write(settings, args.config_file)
    print(f"lowprec config: wrote {path}")
    print(path.read_text(), end="")
    return 0


def _write(settings: LaunchSettings, config_file: str | None) -> Path:
    """Write the file, or one line naming where it was to go and what to give instead."""
    target = Path(config_file).expanduser() if config_file else default_config_path()
    if config_file:
        where, fix = f"--config_file {config_file}", "give a file path you can write"
    else:
        home = os.environ.get("LOWPREC_CONFIG_HOME")
        where = f"the default config file {target}" + (f" (LOWPREC_CONFIG_HOME={home})" if home else "")
        fix = "give --config_file PATH" + (", or set LOWPREC_CONFIG_HOME to a writable directory" if home else "")
    if target.is_dir():
        raise UsageError(f"{where}: is a directory; {fix} (e.g. {target / 'default_config.yaml'})")
    try:
        return write_launch_config(settings, target)
    except OSError as err:
        raise UsageError(f"{where}: cannot be written ({err.strerror or err}); {fix}") from None
