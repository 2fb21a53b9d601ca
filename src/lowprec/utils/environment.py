"""Environment helpers with Accelerate's names (``accelerate.utils.clear_environment``)."""

from __future__ import annotations

from lowprec.config.env import clear_environment

__all__ = ["clear_environment"]
