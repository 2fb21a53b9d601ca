"""FP8 backends behind one protocol (:class:`Backend`): native, torchao, te, msamp.

Each is declared as data in ``backends/<name>.py`` (its ``SPEC``, a :class:`BackendSpec`;
torch-free, so the launcher reads them without importing torch) and implemented in
``backends/engines/<name>.py`` (the running backend: torch, ``lowprec.fp8``, its library),
which a declaration names with :class:`~lowprec.backends.spec.Implementation` and which is
imported only when a backend is built. ``spec.py`` is the registry of declarations,
``registry.py`` the FP8 resolver, ``base.py`` the protocol and what every backend shares.

Attributes load lazily (PEP 562) for the same reason.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Backend",
    "BaseBackend",
    "BackendSpec",
    "Implementation",
    "NativeBackend",
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
    "Implementation": "spec",
    "NativeBackend": "engines.native",
    "select_backend": "registry",
    "default_handler": "registry",
    "native_recipe_for": "registry",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"lowprec.backends.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'lowprec.backends' has no attribute {name!r}")
