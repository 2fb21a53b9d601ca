"""Which optional FP8 libraries are installed (a spec lookup; nothing is imported)."""

from __future__ import annotations

import importlib.util

__all__ = ["is_available", "module_available"]


def module_available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a stand-in module in sys.modules may lack __spec__
        import sys

        return module in sys.modules


def is_available(name: str) -> bool:
    """A backend's library (by any spelling of the backend), or any module by import name."""
    from lowprec.backends.spec import spelling_table

    spec = spelling_table().get(str(name).lower())
    if spec is not None:
        return spec.available()
    return module_available(name)
