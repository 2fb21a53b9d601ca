"""The Accelerator's read-outs of its settings under Accelerate 1.15's names (the dataloader
configuration, the distributed setup), ``join_uneven_inputs``, ``clear`` and
``verify_device_map``: members Accelerate scripts call that lowprec had no spelling for."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional

from torch import nn

from lowprec.accelerator_host import AcceleratorHost

__all__ = ["SettingsMixin"]


class SettingsMixin(AcceleratorHost):
    """Needs ``self.dataloader_config``, ``self.state``, ``self._dataloaders`` and ``free_memory``."""

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        # as in Accelerate: dataloaders prepared from now on; prepared ones keep theirs
        self.dataloader_config.even_batches = value

    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    deepspeed_plugin = property(lambda self: self.state.deepspeed_plugin)
    is_fsdp2 = property(lambda self: self.distributed_type == "FSDP")  # lowprec's FSDP is FSDP2 only

    @property
    def multi_device(self) -> bool:
        """Data parallel over several accelerators (DDP on GPUs and the like; not CPU processes)."""
        return self.use_distributed and self.distributed_type.is_ddp and self.distributed_type != "MULTI_CPU"

    @property
    def should_save_model(self) -> bool:
        """Whether this process calls ``save_model``: every one. lowprec's ``save_model`` gathers
        sharded weights and ends in a barrier, the main process writing; Accelerate answers True too
        once a parallelism config is set (without one, the local main process only)."""
        return True

    def verify_device_map(self, model: nn.Module) -> bool:
        """True when a big-model dispatch spread ``model`` over several devices (an
        ``hf_device_map`` of more than one entry on any submodule), which training cannot use."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    def clear(self, *objects: Any) -> list:
        """Accelerate's alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: Optional[bool] = None) -> Iterator[None]:
        """Under DDP, ``torch.distributed.algorithms.Join`` over ``joinables`` (prepared models or
        optimizers) when batches are uneven (``even_batches`` False, this argument overriding the
        prepared sharded loaders' setting inside the block), so processes that run out of data
        shadow the others' collectives. Elsewhere nothing (one process: silently, as Accelerate)."""
        if not (self.use_distributed and self.distributed_type.is_ddp):
            if self.use_distributed:  # a UserWarning, as Accelerate's (scripts filter on its words)
                warnings.warn(
                    f"join_uneven_inputs is only supported for multi-GPU / multi-CPU training with DDP; under "
                    f"{self.distributed_type} it does nothing (torch's Join shadows DDP's collectives only)",
                    UserWarning,
                    stacklevel=3,
                )
            yield
            return
        from torch.distributed.algorithms import Join

        overridden = [d for d in self._dataloaders if not d.dispatches] if even_batches is not None else []
        if even_batches is not None and len(overridden) < len(self._dataloaders):
            warnings.warn(
                "join_uneven_inputs(even_batches=...) is only supported for map-style datasets: a dispatched "
                "(iterable) dataloader keeps its batches",
                UserWarning,
                stacklevel=3,
            )
        saved = [d.even_batches for d in overridden]
        for d in overridden:
            d.even_batches = bool(even_batches)
        uneven = not (self.even_batches if even_batches is None else even_batches)
        # the non-finite guard's per-step all-reduce is no collective Join shadows: decided
        # without it inside the block (lowprec.utils.nonfinite, NonFiniteGuard.ranks_agree)
        agreed = self.nonfinite.ranks_agree
        self.nonfinite.ranks_agree = agreed or uneven
        try:
            with Join(joinables, enable=uneven, throw_on_early_termination=False):
                yield
        finally:
            self.nonfinite.ranks_agree = agreed
            for d, value in zip(overridden, saved):
                d.even_batches = value
