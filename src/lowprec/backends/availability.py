"""Which optional FP8 libraries are installed (a spec lookup; nothing is imported)."""

from __future__ import annotations

import importlib.util

__all__ = ["MODULES", "is_available"]

# backend name -> top-level module that provides it
MODULES = {"torchao": "torchao", "te": "transformer_engine", "msamp": "msamp", "deepspeed": "deepspeed"}


def is_available(name: str) -> bool:
    module = MODULES.get(name, name)
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a stand-in module in sys.modules may lack __spec__
        import sys

        return module in sys.modules
