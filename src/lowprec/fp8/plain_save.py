"""``save_pretrained`` of a converted transformers model writes weights only.

The FP8 scaling state (delayed scaling's amax histories, scales and step counters; nvfp4's
rounding stream) is training state, not weights. :func:`strip_fp8_state_on_save` names its keys
in each ``PreTrainedModel``'s ``_keys_to_ignore_on_save`` (transformers' own hook, keys matched
exactly), computed when saving, so a peft merge or a later conversion is covered and the files
load into the plain model with no unexpected keys. Duck-typed: transformers is not imported.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any, Iterable, Iterator

from torch import nn

from lowprec.fp8.convert import plain_state_dict

__all__ = ["IgnoreOnSave", "fp8_state_keys", "strip_fp8_state_on_save"]


def fp8_state_keys(model: nn.Module) -> set[str]:
    """The ``state_dict`` keys of ``model`` that hold FP8 scaling state, not weights."""
    sd = model.state_dict()
    return set(sd) - set(plain_state_dict(sd))


class IgnoreOnSave(Set):
    """``_keys_to_ignore_on_save`` of one PreTrainedModel: the keys it had, plus its FP8 state
    keys as they are when ``save_pretrained`` reads them (iteration and ``len``)."""

    def __init__(self, model: nn.Module, before: Iterable[str] | None) -> None:
        self.model = model  # a strong reference: deepcopy maps it to the copy
        self.before = frozenset(before or ())

    def _keys(self) -> frozenset[str]:
        return self.before | fp8_state_keys(self.model)

    def __contains__(self, key: object) -> bool:
        return key in self._keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


def strip_fp8_state_on_save(model: nn.Module) -> int:
    """Install :class:`IgnoreOnSave` on every PreTrainedModel inside ``model`` (a peft model
    holds one); returns how many."""
    n = 0
    for module in model.modules():
        if hasattr(module, "save_pretrained") and hasattr(module, "_keys_to_ignore_on_save"):
            pretrained: Any = module  # a PreTrainedModel: the attribute is transformers'
            current = pretrained._keys_to_ignore_on_save
            if not isinstance(current, IgnoreOnSave):
                pretrained._keys_to_ignore_on_save = IgnoreOnSave(module, current)
            n += 1
    return n
