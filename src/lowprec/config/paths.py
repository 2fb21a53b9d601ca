"""Where the launch config lives by default (no pydantic here: ``launch`` without a config
file must not pay for importing it)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_config_path"]


def default_config_path() -> Path:
    """``$LOWPREC_CONFIG_HOME/default_config.yaml``, else ``~/.cache/lowprec/default_config.yaml``."""
    home = os.environ.get("LOWPREC_CONFIG_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "lowprec"
    return base / "default_config.yaml"
