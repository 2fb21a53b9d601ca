"""``lowprec config``: write the launch YAML that ``lowprec launch`` reads.

Three ways: the interactive wizard (no flags), ``--default`` (settings chosen from the
hardware here, the reason printed), or the same flags as ``launch`` (nothing asked). The file
goes to ``--config_file`` or the default location (``$LOWPREC_CONFIG_HOME/default_config.yaml``,
else ``~/.cache/lowprec/default_config.yaml``), and loads back into the same settings.
"""

from __future__ import annotations

import argparse
from typing import Any

from lowprec.cli._flags import add_settings_flags, check_cli_flags_apply, settings_from_args
from lowprec.config.env import LaunchSettings
from lowprec.cli.wizard import run_wizard

__all__ = ["NAME", "HELP", "add_parser", "run", "hardware_default"]

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


def hardware_default() -> tuple[LaunchSettings, str]:
    """Settings for this machine and the reason, resolved once (STYLE rule 4)."""
    import torch

    if not torch.cuda.is_available():
        from lowprec.fp8.gemm.cpu import cpu_gemm_choice

        # use_cpu: true, so the file says what the machine is (not use_cpu: false on a GPU-less box)
        return LaunchSettings(mixed_precision="bf16", use_cpu=True), (
            "no CUDA device: use_cpu: true, bf16 autocast on CPU (FP8 runs here, correct but slower than bf16 because "
            f"of its casts; its GEMMs would be {cpu_gemm_choice().describe()})"
        )
    count = torch.cuda.device_count()
    cc = min(torch.cuda.get_device_capability(i) for i in range(count))
    procs = {"num_processes": count}
    if cc >= (8, 9):
        return LaunchSettings(mixed_precision="fp8", fp8_backend="native", fp8_recipe="tensorwise", **procs), (
            f"{count} GPU(s) with compute capability {cc[0]}.{cc[1]} >= 8.9: native FP8 GEMMs, tensorwise recipe"
        )
    if torch.cuda.is_bf16_supported():
        return LaunchSettings(mixed_precision="bf16", **procs), (
            f"compute capability {cc[0]}.{cc[1]} < 8.9 has no FP8 GEMMs; bf16 is supported"
        )
    return LaunchSettings(mixed_precision="fp16", **procs), (
        f"compute capability {cc[0]}.{cc[1]} has neither FP8 nor bf16: fp16 with loss scaling"
    )


def run(args: argparse.Namespace) -> int:
    from lowprec.config.launch_config import default_config_path, write_launch_config

    cli = settings_from_args(args)
    if args.default or cli:
        base: dict[str, Any] = {}
        if args.default:
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
