"""``GradientState``: where the training loop is (Accelerate's ``accelerate.state.GradientState``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lowprec.state.shared import SharedState

if TYPE_CHECKING:
    from lowprec.utils.data_loader import DataLoaderShard

__all__ = ["GradientState"]


class GradientState(SharedState):
    """Where the training loop is, shared by every instance in the process (Accelerate's borg:
    ``GradientState()`` anywhere sees the Accelerator's). An Accelerator passes its settings and
    starts a fresh loop position; a bare ``GradientState()`` only reads."""

    _shared_state: dict = {}

    def __init__(self, num_steps: Any = None, sync_with_dataloader: bool = True) -> None:
        self.__dict__ = self._shared_state
        plugin_kwargs: dict = {}
        if num_steps is not None and not isinstance(num_steps, int):  # a GradientAccumulationPlugin
            plugin_kwargs = num_steps.to_kwargs()
            num_steps, sync_with_dataloader = num_steps.num_steps, num_steps.sync_with_dataloader
        if num_steps is None and self._shared_state:
            return
        self.num_steps = 1 if num_steps is None else num_steps
        self.sync_with_dataloader = sync_with_dataloader
        # Accelerate's record of the plugin (its fields that differ from the defaults);
        # transformers.Trainer reads plugin_kwargs.get("sync_each_batch")
        self.plugin_kwargs = plugin_kwargs or {k: v for k, v in (("num_steps", num_steps),) if v not in (None, 1)}
        if not sync_with_dataloader:
            self.plugin_kwargs["sync_with_dataloader"] = False
        self.sync_gradients = True
        self.end_of_dataloader = False
        self.remainder = -1  # real samples in the last global batch (-1: no padding)
        self.active: list["DataLoaderShard"] = []

    @property
    def in_dataloader(self) -> bool:
        return bool(self.active)

    @property
    def active_dataloader(self):
        return self.active[-1] if self.active else None

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients
