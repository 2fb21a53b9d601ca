"""Process-wide facts (device, rank, world size, distributed type) and the helpers that act on
them: Accelerate's ``PartialState`` and ``DistributedType``.

``PartialState`` shares one dictionary across every instance of a process (Accelerate's "borg"
pattern): ``PartialState()`` anywhere sees what the last ``Accelerator`` resolved. One deliberate
difference: each ``Accelerator`` re-resolves these facts (Accelerate refuses a second
Accelerator whose ``cpu`` flag differs), because lowprec lets several Accelerators with different
settings live in one process (tests, notebooks).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from enum import Enum
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lowprec.kwargs import env_flag, env_get, env_int
from lowprec.state.process_group import destroy_group, init_default_group
from lowprec.state.shared import SharedState
from lowprec.kwargs import InitProcessGroupKwargs

__all__ = ["DistributedType", "PartialState", "ProcessFacts", "split_between"]

logger = logging.getLogger("lowprec")


class DistributedType(str, Enum):
    """Accelerate's members; lowprec runs NO, MULTI_CPU, MULTI_GPU (DDP), FSDP (FSDP2) and
    DEEPSPEED. Compares equal to its string value."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"

    @property
    def is_ddp(self) -> bool:
        """Plain data parallel (DistributedDataParallel), whatever the device."""
        return self.value.startswith("MULTI_")

    def __str__(self) -> str:
        return self.value


def _resolve_device(cpu: bool, local_rank: int) -> tuple[torch.device, str]:
    forced = env_get("ACCELERATE_TORCH_DEVICE")
    if forced is not None:
        return torch.device(forced), "env ACCELERATE_TORCH_DEVICE"
    if cpu:
        return torch.device("cpu"), "cpu=True / ACCELERATE_USE_CPU"
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank), f"CUDA available, LOCAL_RANK={local_rank}"
    return torch.device("cpu"), "no CUDA device"


def _is_hf_dataset(obj: Any) -> bool:
    """A ``datasets.Dataset`` (slicing one gives a dict of columns; ``select`` keeps the type)."""
    return type(obj).__module__.split(".")[0] == "datasets" and hasattr(obj, "select")


def split_between(inputs: Any, index: int, count: int, apply_padding: bool = False) -> Any:
    """Process ``index``'s contiguous share of ``inputs`` (list, tuple, tensor, ``datasets.Dataset``,
    or dict of them); the first ``len % count`` processes get one more; with ``apply_padding``
    every share has the same length, padded by repeating the input's last element (Accelerate's
    rule). One process gets ``inputs`` itself, as under Accelerate."""
    if count == 1:
        return inputs
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) != 1:
            raise ValueError("split_between_processes: every value of the dict needs the same length")
        return {k: split_between(v, index, count, apply_padding) for k, v in inputs.items()}
    n = len(inputs)
    per, extra = divmod(n, count)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    missing = (per + 1 - (end - start)) if apply_padding and extra and n else 0
    if _is_hf_dataset(inputs):
        return inputs.select([*range(start, end), *[n - 1] * missing])
    part = inputs[start:end]
    if missing:
        last = inputs[-1:]
        if isinstance(part, torch.Tensor):
            part = torch.cat([part, last.repeat(missing, *([1] * (part.ndim - 1)))])
        else:
            part = part + type(part)(last) * missing
    return part


class ProcessFacts:
    """What follows from ``process_index``, ``local_process_index`` and ``num_processes``: one
    definition for :class:`PartialState` and ``AcceleratorState``."""

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    # process control: PartialState's and AcceleratorState's (Accelerate has both)
    def wait_for_everyone(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    @contextlib.contextmanager
    def _goes_first(self, first: bool):
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def main_process_first(self):
        """The main process runs the block, then the others (e.g. a dataset download)."""
        return self._goes_first(self.is_main_process)

    def local_main_process_first(self):
        return self._goes_first(self.is_local_main_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        yield split_between(inputs, self.process_index, self.num_processes, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        destroy_group(group)

    def __repr__(self) -> str:
        """The summary Accelerate's ``print(accelerator.state)`` gives (its examples log it)."""
        facts = self.__dict__
        if "device" not in facts:  # after _reset_state()
            return f"{type(self).__name__}() (reset: make an Accelerator or PartialState again)"
        backend = facts.get("backend") or (dist.get_backend() if dist.is_initialized() else None)
        return (
            f"Distributed environment: {facts.get('distributed_type')}"
            + (f"  Backend: {backend}" if backend else "")
            + f"\nNum processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {facts['device']}\n"
        )

    def __getattr__(self, name: str) -> Any:
        """Accelerate's message for a state read after ``_reset_state()`` (``_known_attrs``)."""
        cls = type(self).__name__
        if name in getattr(type(self), "_known_attrs", ()):
            raise AttributeError(
                f"`{cls}` object has no attribute `{name}`. This happens if `{cls}._reset_state()` "
                "was called and an `Accelerator` or `PartialState` was not reinitialized."
            )
        raise AttributeError(f"'{cls}' object has no attribute '{name}'")


class PartialState(SharedState, ProcessFacts):
    """Device, ranks and distributed type of this process, shared by every instance."""

    _shared_state: dict = {}
    _known_attrs = (
        "device",
        "distributed_type",
        "num_processes",
        "process_index",
        "local_process_index",
        "backend",
        "debug",
        "decisions",
    )

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if not self.initialized:
            self._setup(cpu, kwargs.get("init_kwargs"))

    def _setup(self, cpu: bool, init_kwargs: Any) -> None:
        rank, world, local = env_int("RANK", 0), env_int("WORLD_SIZE", 1), env_int("LOCAL_RANK", 0)
        device, why = _resolve_device(cpu or env_flag("ACCELERATE_USE_CPU"), local)
        self.decisions = {"device": (device, why)}
        self.device = device
        self.debug = env_flag("ACCELERATE_DEBUG_MODE")
        self.backend = None
        if world > 1 and not dist.is_initialized():
            kw = init_kwargs or InitProcessGroupKwargs()
            self.backend = kw.backend or ("nccl" if device.type == "cuda" else "gloo")
            init_default_group(self.backend, rank, world, kw.timeout, kw.init_method)
            if device.type == "cuda":
                torch.cuda.set_device(device)
        if dist.is_initialized():
            self.backend = dist.get_backend()
            rank, world = dist.get_rank(), dist.get_world_size()
        self.process_index, self.num_processes, self.local_process_index = rank, world, local
        multi = DistributedType.MULTI_GPU if device.type == "cuda" else DistributedType.MULTI_CPU
        self.distributed_type = multi if world > 1 else DistributedType.NO

    # ------------------------------------------------------------------ derived facts
    @property
    def default_device(self) -> torch.device:
        return self.device

    def _on(self, function: Optional[Callable], run: Callable[[], bool]):
        if function is None:  # used as @decorator() with parentheses
            return lambda f: self._on(f, run)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any):
            return function(*args, **kwargs) if run() else None

        return wrapper

    def on_main_process(self, function: Optional[Callable] = None):
        """Decorator: the function runs on the main process only (elsewhere returns None)."""
        return self._on(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Optional[Callable] = None):
        return self._on(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Optional[Callable] = None):
        return self._on(function, lambda: self.is_last_process)

    def on_process(self, function: Optional[Callable] = None, process_index: Optional[int] = None):
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._on(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Optional[Callable] = None, local_process_index: Optional[int] = None):
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._on(function, lambda: self.local_process_index == local_process_index)
