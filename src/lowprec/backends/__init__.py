"""FP8 backends behind one protocol (:class:`Backend`): native, torchao, te, msamp."""

from lowprec.backends.availability import is_available
from lowprec.backends.base import Backend, BaseBackend, PrepareContext, remap_optimizer_params
from lowprec.backends.registry import default_handler, native_recipe_for, select_backend

__all__ = [
    "Backend",
    "BaseBackend",
    "PrepareContext",
    "is_available",
    "remap_optimizer_params",
    "select_backend",
    "default_handler",
    "native_recipe_for",
]
