"""``AcceleratorHost``: what the Accelerator's mixins (``PrepareMixin``, ``ProcessControlMixin``,
``CheckpointingMixin``, ``TrackingMixin``, ``ParallelismMixin``, ``SettingsMixin``) use of the
:class:`lowprec.accelerator.Accelerator` they are mixed into, declared once for the type checker.

Each mixin inherits this class. It holds class-level annotations only and, for what the
Accelerator or another mixin defines as a property or a method, stubs under ``TYPE_CHECKING``:
at runtime the class is empty (no attribute, no method), so attribute lookup and the
Accelerator's method resolution are as without it. It imports nothing of lowprec at runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # types only: at runtime this module imports nothing of lowprec
    import torch
    from torch import nn

    from lowprec.backends.base import Backend, PrepareContext
    from lowprec.kwargs import GradientAccumulationPlugin
    from lowprec.parallelism_config import ParallelismConfig
    from lowprec.state import AcceleratorState
    from lowprec.state.gradient import GradientState
    from lowprec.state.partial import DistributedType
    from lowprec.tracking import GeneralTracker
    from lowprec.utils.data_loader import DataLoaderShard
    from lowprec.utils.dataclasses import DataLoaderConfiguration, TorchDynamoPlugin
    from lowprec.utils.fp8_health import HealthHooks
    from lowprec.utils.nonfinite import NonFiniteGuard
    from lowprec.utils.optimizer import AcceleratedOptimizer, AcceleratedScheduler

__all__ = ["AcceleratorHost"]


class AcceleratorHost:
    """The Accelerator's attributes, properties and methods its mixins read (see the module
    docstring); ``Accelerator.__init__`` sets the attributes."""

    # set in Accelerator.__init__
    state: AcceleratorState
    handlers: dict
    dynamo_plugin: TorchDynamoPlugin
    dataloader_config: DataLoaderConfiguration
    backend: Optional[Backend]
    parallelism_config: Optional[ParallelismConfig]
    accumulation: GradientAccumulationPlugin
    gradient_state: GradientState
    device_placement: bool
    step_scheduler_with_optimizer: bool
    log_with: list
    trackers: list[GeneralTracker]
    scaler: Optional[torch.amp.GradScaler]
    nonfinite: NonFiniteGuard
    _models: list[nn.Module]
    _expert_replicas: list[Any]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[DataLoaderShard]
    _custom_objects: list[Any]
    _param_maps: list[tuple[dict, dict]]
    _optimizer_models: dict[int, Optional[nn.Module]]
    _data_seed: Optional[int]
    _ds_engine: Any
    _fp8_health: HealthHooks

    if TYPE_CHECKING:
        # the Accelerator's read-only properties
        @property
        def device(self) -> torch.device: ...
        @property
        def process_index(self) -> int: ...
        @property
        def num_processes(self) -> int: ...
        @property
        def is_main_process(self) -> bool: ...
        @property
        def is_local_main_process(self) -> bool: ...
        @property
        def distributed_type(self) -> DistributedType: ...
        @property
        def mixed_precision(self) -> str: ...
        @property
        def use_distributed(self) -> bool: ...
        @property
        def split_batches(self) -> bool: ...
        @property
        def gradient_accumulation_steps(self) -> int: ...

        # CheckpointingMixin's
        @property
        def logging_dir(self) -> Optional[str]: ...

        # the Accelerator's methods, and those of one mixin another calls
        def _ctx(self) -> PrepareContext: ...
        def unwrap_model(
            self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = False
        ) -> nn.Module: ...
        def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any: ...
        def wait_for_everyone(self) -> None: ...  # ProcessControlMixin's
        def free_memory(self, *objects: Any) -> list: ...
        def log(self, values: dict, step: Optional[int] = None, log_kwargs: Optional[dict] = None) -> None: ...
