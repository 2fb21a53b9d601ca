"""Messages logged once per process, for every layer of lowprec (torch-free: imports nothing of
lowprec). A fallback or a refusal that a call can hit on every step is said once, with its
reason, on the ``lowprec`` logger."""

from __future__ import annotations

import logging

__all__ = ["log_once", "logger"]

logger = logging.getLogger("lowprec")
_LOGGED: set[str] = set()


def log_once(message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` to the ``lowprec`` logger the first time this process sees it."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.log(level, message)
