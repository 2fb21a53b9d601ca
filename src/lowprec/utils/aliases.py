"""Properties that stand for another attribute: Accelerate's second names for one value
(``step_was_skipped`` for ``_is_overflow``, ``iteration`` for ``epoch``) and a wrapper's view of
what it wraps (``AcceleratedOptimizer.param_groups`` is the wrapped optimizer's)."""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Optional

__all__ = ["alias"]


def alias(path: str, doc: Optional[str] = None, settable: bool = True) -> property:
    """A property reading (and, if ``settable``, writing) ``self.<path>``; ``path`` may be
    dotted (``"optimizer.param_groups"``)."""
    owner, _, name = path.rpartition(".")
    holder = attrgetter(owner) if owner else (lambda obj: obj)

    def get(self: Any) -> Any:
        return getattr(holder(self), name)

    def set_(self: Any, value: Any) -> None:
        setattr(holder(self), name, value)

    return property(get, set_ if settable else None, doc=doc or f"``self.{path}``")
