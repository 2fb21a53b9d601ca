"""Local SGD (Accelerate's ``accelerate.local_sgd.LocalSGD``): under DDP, each process takes
``local_sgd_steps`` optimizer steps on its own gradients (DDP's all-reduce off, ``no_sync``),
then the processes average their parameters; fewer all-reduces, for slow interconnects.

::

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            ...
            optimizer.step()
            local_sgd.step()

Parameters each process keeps for itself (expert parallelism's experts, which DDP ignores) are
not averaged. FSDP2 shards and DeepSpeed partitions have no whole copy to average: refused.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

__all__ = ["LocalSGD"]


class LocalSGD:
    """See the module docstring. ``enabled=False``, or one process: every call does nothing."""

    def __init__(self, accelerator: Any, model: nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        dt = accelerator.distributed_type
        if enabled and dt != "NO" and not dt.is_ddp:
            raise ValueError(
                f"LocalSGD averages whole models between DDP processes; under {dt} each process holds a part "
                "of the model: use it with DDP (lowprec launch --multi_gpu / --cpu --num_processes N), or drop it"
            )
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
            raise ValueError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): use an integer >= 1")
        self.enabled = enabled and dt != "NO" and accelerator.num_processes > 1
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.num_steps = 0
        self._no_sync: Any = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            if not hasattr(self.model, "no_sync"):
                raise ValueError("LocalSGD needs the model returned by accelerator.prepare (DDP-wrapped)")
            self._no_sync = cast(Any, self.model).no_sync()
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            if exc[0] is None:
                self._average()
            self._no_sync.__exit__(*exc)

    def step(self) -> None:
        """Call after each ``optimizer.step()``: every ``local_sgd_steps`` calls, the average."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        import torch.distributed as dist

        own: set[str] = getattr(self.model, "parameters_to_ignore", set())
        world = self.accelerator.num_processes
        for name, p in self.model.named_parameters():
            if name.removeprefix("module.") in own:
                continue
            dist.all_reduce(p.data)
            p.data.div_(world)
