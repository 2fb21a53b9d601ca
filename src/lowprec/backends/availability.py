"""Whether a module is installed (a spec lookup; nothing is imported); ``spec.is_available``
asks it for a backend's library."""

from __future__ import annotations

import importlib.util

__all__ = ["module_available"]


def module_available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a stand-in module in sys.modules may lack __spec__
        import sys

        return module in sys.modules
