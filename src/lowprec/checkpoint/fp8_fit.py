"""Whether a checkpoint's FP8 scaling state fits this run's recipe. A delayed recipe's amax
histories are ``amax_history_len`` long (the last dimension: a Linear's ``(L,)``, grouped
experts' ``(E, L)``); resuming with another length would otherwise end in torch's size-mismatch
message for one buffer, with no word of the setting. The check names it instead."""

from __future__ import annotations

from typing import Mapping, Sequence

from torch import nn

from lowprec.errors import CheckpointError

__all__ = ["check_amax_histories"]

_HISTORY = "fp8_amax_history_"


def check_amax_histories(saved: Mapping[str, Sequence[int]], model: nn.Module, where: str) -> None:
    """Raise one :class:`CheckpointError` line when ``saved`` (state-dict key -> shape, as read
    from ``where``) holds amax histories of another length than ``model``'s buffers."""
    for name, buffer in model.named_buffers():
        theirs = saved.get(name)
        if theirs is None or not name.rpartition(".")[2].startswith(_HISTORY):
            continue
        ours = tuple(buffer.shape)
        theirs = tuple(theirs)
        # only the history length differs; another expert count is another model, said elsewhere
        if theirs and ours and theirs[:-1] == ours[:-1] and theirs[-1] != ours[-1]:
            raise CheckpointError(
                f"{where}: the checkpoint's FP8 amax histories are {theirs[-1]} long, this run's "
                f"amax_history_len is {ours[-1]}: resume with amax_history_len={theirs[-1]} (or start a new run)"
            )
