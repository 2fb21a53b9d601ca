"""``lowprec.logging.get_logger``: Accelerate's multi-process logger, for scripts that import it
(``from accelerate.logging import get_logger`` in Accelerate's and transformers' examples).

The logger it returns takes two extra keywords on every call: ``main_process_only`` (default
True: only process 0 logs) and ``in_order`` (every process logs, one after the other, with a
barrier between them); ``warning_once`` logs a given warning once per process. The level comes
from ``log_level`` or ``ACCELERATE_LOG_LEVEL`` when given, as under Accelerate.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Optional

from lowprec.state.partial import PartialState

__all__ = ["MultiProcessAdapter", "get_logger"]


def _process_state() -> PartialState:
    if not PartialState._shared_state:
        raise RuntimeError(
            "lowprec.logging: create the Accelerator (or PartialState()) before logging through "
            "get_logger(...): which process logs is only known then"
        )
    return PartialState()


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``logging.LoggerAdapter`` whose calls accept ``main_process_only`` and ``in_order``;
    messages start with ``[RANK <process index>]``, as Accelerate's do."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        msg, kwargs = super().process(msg, kwargs)
        return f"[RANK {_process_state().process_index}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        state = _process_state()
        msg, kwargs = self.process(msg, kwargs)
        if in_order:
            for index in range(state.num_processes):
                if index == state.process_index:
                    self.logger.log(level, msg, *args, **kwargs)
                state.wait_for_everyone()
        elif not main_process_only or state.is_main_process:
            self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)  # noqa: B019 - one entry per distinct warning, for the process's life
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning`` once per distinct message (transformers' ``logger.warning_once``)."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: Optional[str] = None) -> MultiProcessAdapter:
    """A logger for ``name`` whose calls take ``main_process_only`` / ``in_order`` (see the module
    docstring); ``log_level`` (else ``ACCELERATE_LOG_LEVEL``) sets its level and the root's."""
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
