"""FP8 backends behind one protocol (:class:`Backend`), each declared as data
(:class:`BackendSpec` in ``backends/<name>.py``): native, torchao, te, msamp.

Attributes load lazily (PEP 562) so that the launcher can read the declarations
(:mod:`lowprec.backends.spec`) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Backend",
    "BaseBackend",
    "BackendSpec",
    "PrepareContext",
    "is_available",
    "remap_optimizer_params",
    "select_backend",
    "default_handler",
    "native_recipe_for",
]

_WHERE = {
    "Backend": "base",
    "BaseBackend": "base",
    "PrepareContext": "base",
    "remap_optimizer_params": "base",
    "BackendSpec": "spec",
    "is_available": "spec",
    "select_backend": "registry",
    "default_handler": "registry",
    "native_recipe_for": "registry",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"lowprec.backends.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'lowprec.backends' has no attribute {name!r}")
