"""The Accelerator's process-control methods (Accelerate's names): barriers, "main process
first" blocks, run-on-one-process decorators, splitting inputs, a cross-process trigger, the
profiler. They act through ``PartialState``, so a script may use either."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional

import torch

from lowprec.accelerate_objects import from_accelerate
from lowprec.accelerator_host import AcceleratorHost
from lowprec.state.partial import PartialState
from lowprec.utils.dataclasses import ProfileKwargs

__all__ = ["ProcessControlMixin"]


class ProcessControlMixin(AcceleratorHost):
    """Needs ``self.device``, ``self.reduce`` and ``self.handlers``."""

    _flag_tensor: Optional[torch.Tensor] = None

    @property
    def _process(self) -> PartialState:
        return PartialState()

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    def wait_for_everyone(self) -> None:
        self._process.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def main_process_first(self):
        return self._process.main_process_first()

    def local_main_process_first(self):
        return self._process.local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        return self._process.split_between_processes(inputs, apply_padding=apply_padding)

    # decorators: usable as @accelerator.on_main_process (they need no instance of the state)
    def on_main_process(self, function: Optional[Callable] = None):
        return self._process.on_main_process(function)

    def on_local_main_process(self, function: Optional[Callable] = None):
        return self._process.on_local_main_process(function)

    def on_last_process(self, function: Optional[Callable] = None):
        return self._process.on_last_process(function)

    def on_process(self, function: Optional[Callable] = None, process_index: Optional[int] = None):
        return self._process.on_process(function, process_index=process_index)

    def on_local_process(self, function: Optional[Callable] = None, local_process_index: Optional[int] = None):
        return self._process.on_local_process(function, local_process_index=local_process_index)

    # a flag any process can raise and all processes see (e.g. to stop early together)
    def set_trigger(self) -> None:
        self._flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process if any process called ``set_trigger`` since the last check (a
        collective: every process must call it); the flag is then cleared."""
        flag = self._flag_tensor if self._flag_tensor is not None else torch.tensor(0, device=self.device)
        if self.reduce(flag).item() >= 1:
            self._flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None):
        """``torch.profiler.profile`` over the block (CPU, plus CUDA when present). A handler may
        give ``activities``, ``schedule_option``, ``on_trace_ready``, ``record_shapes``,
        ``profile_memory``, ``with_stack``, ``with_flops`` and ``output_trace_dir`` (a Chrome trace
        per process is written there)."""
        from torch.profiler import ProfilerActivity, profile, schedule

        h = (
            from_accelerate(profile_handler, "profile_handler")
            if profile_handler is not None
            else self.handlers.get(ProfileKwargs)
        )
        acts = getattr(h, "activities", None) or (
            [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        )
        acts = [getattr(ProfilerActivity, a.upper()) if isinstance(a, str) else a for a in acts]
        sched = getattr(h, "schedule_option", None)
        kw = {
            k: getattr(h, k)
            for k in ("record_shapes", "profile_memory", "with_stack", "with_flops")
            if getattr(h, k, None) is not None
        }
        with profile(
            activities=acts,
            schedule=schedule(**sched) if sched else None,
            on_trace_ready=getattr(h, "on_trace_ready", None),
            **kw,
        ) as prof:
            yield prof
        out_dir = getattr(h, "output_trace_dir", None)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(out_dir, f"trace_rank{self.process_index}.json"))
