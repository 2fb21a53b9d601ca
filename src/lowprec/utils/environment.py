"""Environment helpers with Accelerate's names (``accelerate.utils.clear_environment``)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["clear_environment"]


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty ``os.environ``; the caller's environment comes back exactly
    afterwards (variables the block set are gone, removed ones return)."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
