"""Configuration: launch settings and their environment variables (``env``), the launch YAML
schema (``launch_config``) and single-value parsers (``values``).

Importing this package pulls in neither torch nor pydantic: ``lowprec.config.env`` is read by
every launched process. Import ``lowprec.config.launch_config`` for the YAML schema.
"""

from __future__ import annotations

from lowprec.config.env import ENV_VARS, FP8_OVERRIDE_VARS, LaunchSettings, owned_env_var

__all__ = ["LaunchSettings", "ENV_VARS", "FP8_OVERRIDE_VARS", "owned_env_var"]
