"""Accelerate's "borg" states: every instance of a class shares one ``__dict__``.

``PartialState`` and ``GradientState`` set ``self.__dict__ = self._shared_state`` in
``__init__``; this base gives both the test helper ``_reset_state()`` and ``initialized``.
"""

from __future__ import annotations

__all__ = ["SharedState"]


class SharedState:
    """Base of a class whose instances share ``_shared_state`` (each subclass declares its own)."""

    _shared_state: dict

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the shared state (Accelerate's test helper; the next instance re-resolves)."""
        cls._shared_state.clear()

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}
