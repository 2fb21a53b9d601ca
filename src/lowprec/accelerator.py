"""``lowprec.Accelerator``: Hugging Face Accelerate's training-loop API over lowprec.

It holds no numerics. At construction it resolves, once and with logged reasons, the precision,
the device, the distributed type and (for fp8) one backend; ``prepare`` then asks the backend to
convert models, wraps them (precision wrapper, DDP / FSDP2) and wraps optimizers, schedulers and
dataloaders. Objects may be prepared in any mix and order, over several calls.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Optional

import torch
from torch import nn

from lowprec.accelerate_objects import from_accelerate
from lowprec.backends.base import Backend, PrepareContext
from lowprec.backends.registry import FP8Settings, resolve_fp8_settings, select_backend
from lowprec.backends.spec import get_spec
from lowprec.preparing import PrepareMixin
from lowprec.kwargs import (
    AutocastKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    RecipeKwargs,
    env_get,
    env_int,
)
from lowprec.errors import did_you_mean
from lowprec.logs import log_once
from lowprec.state import AcceleratorState, Decision, DistributedType
from lowprec.tracking import TrackingMixin, filter_trackers
from lowprec.utils.aliases import alias
from lowprec.utils.checkpointing import CheckpointingMixin
from lowprec.utils.data_loader import DataLoaderShard, GradientState
from lowprec.utils.fp8_health import HealthHooks
from lowprec.utils.dataclasses import DataLoaderConfiguration, FP8BackendType, ProjectConfiguration, TorchDynamoPlugin
from lowprec.utils.deepspeed import deepspeed_clip
from lowprec.utils.distributed import clip_grad_norm, grad_norm, trigger_sync_in_backward
from lowprec.utils.nonfinite import NonFiniteGuard
from lowprec.utils.operations import gather, gather_object, has_tensor, pad_across_processes, reduce
from lowprec.utils.optimizer import AcceleratedOptimizer, AcceleratedScheduler
from lowprec.utils.modeling import extract_model_from_parallel
from lowprec.utils.precision import autocast_context
from lowprec.utils.parallelism import ParallelismMixin, for_accelerator, tp_size_of
from lowprec.utils.process_control import ProcessControlMixin
from lowprec.utils.settings import SettingsMixin
from lowprec.utils.distributed import full_model_state_dict
from lowprec.utils.operations import recursively_apply

__all__ = ["Accelerator", "FP8BackendType"]

logger = logging.getLogger("lowprec")


class Accelerator(
    PrepareMixin, ProcessControlMixin, CheckpointingMixin, TrackingMixin, ParallelismMixin, SettingsMixin
):
    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = False,
        mixed_precision: Optional[str] = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        rng_types: Optional[list] = None,
        project_dir: Optional[str] = None,
        gradient_accumulation_plugin: Optional[GradientAccumulationPlugin] = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Optional[list] = None,
        fp8_fallback: Optional[str] = None,
        skip_nonfinite_steps: bool = True,
        max_consecutive_skipped_steps: Optional[int] = 3,
        dataloader_config: Optional[DataLoaderConfiguration] = None,
        log_with: Any = None,
        project_config: Optional[ProjectConfiguration] = None,
        **kwargs: Any,
    ) -> None:
        # Accelerate's own objects (transformers.Trainer builds them) become lowprec's, or are
        # refused with one line (accelerate_objects.py); nothing is dropped silently
        deepspeed_plugin, fsdp_plugin, gradient_accumulation_plugin, dataloader_config, project_config = (
            from_accelerate(o, n)
            for o, n in (
                (deepspeed_plugin, "deepspeed_plugin"),
                (fsdp_plugin, "fsdp_plugin"),
                (gradient_accumulation_plugin, "gradient_accumulation_plugin"),
                (dataloader_config, "dataloader_config"),
                (project_config, "project_config"),
            )
        )
        if "kwarg_handlers" in kwargs:  # the spelling Accelerate's own FP8 docs use
            kwargs_handlers = [*(kwargs_handlers or []), *(kwargs.pop("kwarg_handlers") or [])]
        kwargs_handlers = [from_accelerate(h, "kwargs_handlers") for h in kwargs_handlers or []]
        for key in ("dynamo_plugin", "parallelism_config", "torch_tp_plugin"):
            if key in kwargs:
                kwargs[key] = from_accelerate(kwargs[key], key)
        parallelism_config = self._parallelism_from_kwargs(kwargs)  # tensor parallelism (utils/parallelism.py)
        fp8_hardware = kwargs.pop("fp8_hardware", None)  # the trainer's sm_89 decision (train/resolve.py)
        self._init_extras(kwargs_handlers, kwargs, dataloader_config, split_batches)
        recipe_handler: Optional[RecipeKwargs] = self.handlers.get("recipe")

        explicit_mp = mixed_precision is not None or env_get("ACCELERATE_MIXED_PRECISION") is not None
        sharded = fsdp_plugin is not None or deepspeed_plugin is not None
        if recipe_handler is not None and not explicit_mp and sharded:
            mixed_precision = "fp8"  # Accelerate's FSDP/DeepSpeed rule: a recipe alone enables FP8
        self.state = AcceleratorState(
            mixed_precision=mixed_precision,
            cpu=cpu,
            fp8_fallback=fp8_fallback,
            fsdp_plugin=fsdp_plugin,
            deepspeed_plugin=deepspeed_plugin,
            init_kwargs=self.handlers.get(InitProcessGroupKwargs),
            fp8_hardware=fp8_hardware,
            tp_size=tp_size_of(parallelism_config),  # named in the distributed_type decision
        )
        self.fp8_settings, self.backend = self._resolve_fp8(recipe_handler)
        self.parallelism_config = for_accelerator(parallelism_config, self.num_processes, self.distributed_type)

        # The argument wins; the launcher's variable fills in only when the script left the
        # default of 1 (Accelerate's rule, so `launch --gradient_accumulation_steps` still works).
        steps = gradient_accumulation_steps
        if steps == 1:
            steps = env_int("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", 1)
        plugin = gradient_accumulation_plugin or GradientAccumulationPlugin(num_steps=steps)
        if gradient_accumulation_plugin is not None and gradient_accumulation_steps != 1:
            raise ValueError("pass gradient_accumulation_steps or gradient_accumulation_plugin, not both")
        self.accumulation = plugin
        self.gradient_state = GradientState(plugin)
        self.step = 0
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types
        if rng_types is not None:
            logger.warning(
                "lowprec: Accelerator(rng_types=...) is accepted and ignored: prepared dataloaders "
                "shuffle with their own generator, seeded identically on every process"
            )
        self._init_project(project_dir, project_config)
        self.log_with = filter_trackers(log_with, self.logging_dir)
        self.trackers: list = []
        self.scaler = self._make_scaler()
        # skip steps with NaN/inf loss or gradients, every precision (utils/nonfinite.py)
        self.nonfinite = NonFiniteGuard(
            skip_nonfinite_steps, max_consecutive_skipped_steps, self.use_distributed, self.device
        )
        self._models: list[nn.Module] = []
        self._expert_replicas: list[Any] = []  # ExpertReplicas of prepared models (ep_size < processes)
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[DataLoaderShard] = []
        self._custom_objects: list[Any] = []
        self._param_maps: list[tuple[dict, dict]] = []
        self._optimizer_models: dict[int, Optional[nn.Module]] = {}
        self._data_seed: Optional[int] = None
        self._ds_engine: Any = None
        self._fp8_health = HealthHooks()  # NativeRecipeKwargs(fp8_guard=...): utils/fp8_health.py

    # ------------------------------------------------------------------ construction helpers
    def _init_extras(
        self, kwargs_handlers: Optional[list], kwargs: dict, dataloader_config, split_batches: bool
    ) -> None:
        """The kwargs handlers, the dynamo plugin and the dataloader configuration, with the
        spellings Accelerate also accepts; an unknown keyword is an error with a suggestion."""
        handlers = list(kwargs_handlers or [])
        # torch.compile of prepared models (Accelerate's dynamo_backend / dynamo_plugin)
        self.dynamo_plugin = kwargs.pop("dynamo_plugin", None) or TorchDynamoPlugin(
            backend=kwargs.pop("dynamo_backend", None)
        )
        if kwargs:
            known = list(inspect.signature(Accelerator.__init__).parameters) + ["kwarg_handlers"]
            bad = next(iter(kwargs))
            raise TypeError(f"Accelerator() got an unexpected argument {bad!r}{did_you_mean(bad, known)}")
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches:  # Accelerate's older spelling of DataLoaderConfiguration(split_batches=True)
            self.dataloader_config.split_batches = True
        self.handlers = self._sort_handlers(handlers)

    def _resolve_fp8(self, recipe_handler: Optional[RecipeKwargs]) -> tuple[Optional[FP8Settings], Optional[Backend]]:
        """The FP8 settings (the one resolver) and the backend they name, or ``(None, None)``."""
        if recipe_handler is not None and self.state.requested_mixed_precision != "fp8":
            raise ValueError(
                f"{type(recipe_handler).__name__} was passed but mixed_precision="
                f"{self.state.requested_mixed_precision!r}; set mixed_precision='fp8' (argument, "
                "--mixed_precision fp8, or ACCELERATE_MIXED_PRECISION=fp8) or drop the recipe"
            )
        if self.state.mixed_precision != "fp8":
            if recipe_handler is not None:
                logger.warning("lowprec: FP8 recipe ignored: %s", self.state.decisions["fp8_hardware"].reason)
            return None, None
        settings = resolve_fp8_settings(recipe_handler)
        backend = select_backend(settings)
        self.state._decide("fp8_backend", Decision(backend.engine, backend.reason))
        return settings, backend

    @staticmethod
    def _sort_handlers(handlers: list) -> dict:
        out: dict = {}
        for h in handlers:
            if not isinstance(h, KwargsHandler):
                raise TypeError(f"kwargs_handlers takes lowprec.utils *Kwargs objects, got {type(h).__name__}")
            key = "recipe" if isinstance(h, RecipeKwargs) else type(h)
            if key in out:
                first = type(out[key]).__name__
                raise ValueError(
                    f"kwargs_handlers has two FP8 recipes ({first} and {type(h).__name__}); pass one"
                    if key == "recipe"
                    else f"kwargs_handlers has two {first}; pass one"
                )
            out[key] = h
        return out

    def _make_scaler(self):
        mp, device = self.state.mixed_precision, self.state.device
        needs = mp == "fp16" or (self.backend is not None and self.backend.needs_grad_scaler)
        if not needs or self.distributed_type == DistributedType.DEEPSPEED:
            return None
        if mp == "fp16" and device.type == "cpu":
            logger.info("lowprec: fp16 on CPU runs torch.autocast('cpu', float16) with a CPU GradScaler (slow)")
        kw = (self.handlers.get(GradScalerKwargs) or GradScalerKwargs()).to_kwargs()
        return torch.amp.GradScaler(device.type, **kw)

    # ------------------------------------------------------------------ properties
    device = property(lambda self: self.state.device)
    process_index = property(lambda self: self.state.process_index)
    local_process_index = property(lambda self: self.state.local_process_index)
    num_processes = property(lambda self: self.state.num_processes)
    is_main_process = property(lambda self: self.state.is_main_process)
    is_local_main_process = property(lambda self: self.state.local_process_index == 0)
    distributed_type = property(lambda self: self.state.distributed_type)
    mixed_precision = property(lambda self: self.state.mixed_precision)
    use_distributed = property(lambda self: self.state.use_distributed)
    split_batches = property(lambda self: self.dataloader_config.split_batches)

    sync_gradients = alias("gradient_state.sync_gradients")

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.num_steps = int(value)

    fp8_enabled = property(lambda self: self.state.mixed_precision == "fp8")
    native_amp = property(lambda self: self.state.mixed_precision != "no")
    skipped_steps = property(lambda self: self.nonfinite.skipped)  # non-finite steps skipped, scaler's too

    @property
    def fp8_backend(self) -> FP8BackendType | str:
        # the declaration's ACCELERATE_FP8_BACKEND spelling; a plug-in beyond the enum: its string
        value = "NO" if self.backend is None else get_spec(self.backend.name).env_value
        return FP8BackendType(value) if value in FP8BackendType.__members__ else value

    @property
    def fp8_backend_info(self) -> dict:
        """What runs FP8 and why (``engine``, ``reason``, recipe/config)."""
        return {} if self.backend is None else self.backend.describe()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(o.step_was_skipped for o in self._optimizers)

    def _ctx(self) -> PrepareContext:
        return PrepareContext(self.distributed_type, self.device, self.state.fp8_emulate)

    # ------------------------------------------------------------------ training step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.nonfinite.note_loss(loss)
        if self._ds_engine is not None:
            # DeepSpeed refuses NaN/inf gradients itself; make a non-finite loss reach it as such
            self._ds_engine.backward(
                self.nonfinite.nan_if_nonfinite(loss), **kwargs
            )  # DeepSpeed scales by its accumulation steps
            return
        if self.nonfinite.ranks_agree:  # join_uneven_inputs: no collective of the guard's own
            loss = self.nonfinite.nan_if_nonfinite(loss)
        loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)
        if self.sync_gradients:  # where DDP's all-reduce ran: the expert replicas' average
            for replicas in self._expert_replicas:
                replicas.reduce()

    def _do_sync(self) -> None:
        gs = self.gradient_state
        if gs.sync_with_dataloader and gs.end_of_dataloader:
            self.step = 0
            gs.sync_gradients = True
        else:
            self.step += 1
            # sync_each_batch only skips no_sync (Accelerate's meaning); the optimizer still
            # steps at the accumulation boundary
            gs.sync_gradients = self.step % gs.num_steps == 0
        if self._ds_engine is not None:
            self._ds_engine.set_gradient_accumulation_boundary(gs.sync_gradients)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        wrapped: Any = model  # DDP's or FSDP2's methods, found by hasattr
        if hasattr(wrapped, "no_sync"):  # DDP
            with wrapped.no_sync():
                yield
        elif hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
            wrapped.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                wrapped.set_requires_gradient_sync(True)
        else:
            yield

    def trigger_sync_in_backward(self, model: nn.Module):
        return trigger_sync_in_backward(model)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module):
        self._do_sync()
        with contextlib.ExitStack() as stack:
            if not self.sync_gradients and not self.accumulation.sync_each_batch:
                for m in models:
                    stack.enter_context(self.no_sync(m))
            yield

    def autocast(self, autocast_handler: Optional[AutocastKwargs] = None):
        """Mixed-precision region for code outside the prepared model's forward (e.g. a loss).
        Under fp8 this is bf16 autocast plus the FP8 backend's region."""
        handler = from_accelerate(autocast_handler, "autocast_handler") or self.handlers.get(AutocastKwargs)
        stack = contextlib.ExitStack()
        stack.enter_context(autocast_context(self.device.type, self.mixed_precision, handler))
        if self.backend is not None and (handler is None or handler.enabled):
            model = self._models[0] if self._models else nn.Module()
            stack.enter_context(self.backend.fp8_context(model))
        return stack

    def unscale_gradients(self, optimizer: Any = None) -> None:
        if self.scaler is None:
            return
        opts = (
            self._optimizers
            if optimizer is None
            else (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        )
        for opt in opts:
            if isinstance(opt, AcceleratedOptimizer) and not opt.unscaled:
                self.scaler.unscale_(opt.optimizer)
                opt.unscaled = True

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0):
        """The total gradient norm; clips at the accumulation boundary only, after unscaling (fp16
        and MS-AMP alike). On a micro-step it clips nothing (clipping a partial sum would distort
        the final gradient; Accelerate clips each micro-step's) and returns the norm of the partial
        gradients so far, divided by the loss scale, the gradients untouched. Under DeepSpeed the
        engine clips inside its own step at the boundary; this returns the engine's global norm
        (its last step's; None before the first), as Accelerate does."""
        if self._ds_engine is not None:
            deepspeed_clip(self._ds_engine, max_norm)  # only configures the engine's next step
            return self._ds_engine.get_global_grad_norm()
        if not self.sync_gradients:
            log_once(
                "lowprec: clip_grad_norm_ on an accumulation micro-step returns the partial gradients' "
                "norm and clips nothing: lowprec clips once, at the accumulation boundary (Accelerate "
                "clips every micro-step's partial sum)",
                logging.INFO,  # the documented behaviour, and the accumulate() loop calls it every step
            )
            norm = grad_norm(parameters, norm_type)
            if self.scaler is not None and not all(o.unscaled for o in self._optimizers):
                norm = norm / self.scaler.get_scale()  # still scaled: the boundary's unscale_ is to come
        else:
            self.unscale_gradients()
            norm = clip_grad_norm(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        if not self.sync_gradients:
            return
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ------------------------------------------------------------------ collectives
    def gather(self, tensor: Any) -> Any:
        return gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather, then drop the samples duplicated to pad the last batch."""
        if use_gather_object or not has_tensor(input_data):
            data = gather_object(input_data)
        else:
            data = gather(input_data)
        rem = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and rem > 0:
            if isinstance(data, list) and not has_tensor(data):
                return data[:rem]
            return recursively_apply(lambda t: t[:rem], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return pad_across_processes(tensor, dim, pad_index, pad_first)

    # ------------------------------------------------------------------ models and checkpoints
    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = False
    ) -> nn.Module:
        """The user's model, out of DDP / DeepSpeed / torch.compile wrappers (a compiled model
        stays compiled with ``keep_torch_compile=True``)."""
        return extract_model_from_parallel(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """The full (unsharded) weights as ``save_model`` writes them, without FP8 scaling state, so
        ``save_pretrained(dir, state_dict=...)`` loads into the unconverted model; ``save_state``
        keeps that state in its own files. Collective under FSDP2 and expert parallelism."""
        sd = full_model_state_dict(self.unwrap_model(model) if unwrap else model)
        return sd if self.backend is None else self.backend.plain_state_dict(sd)

    def free_memory(self, *objects: Any):
        """Forget every prepared object (and the bookkeeping that holds references to them),
        then collect garbage; like Accelerate, returns a list with ``None`` for each object passed, so
        ``model, opt = accelerator.free_memory(model, opt)`` drops the caller's references too.
        Objects given to ``register_for_checkpointing`` stay registered, as under Accelerate (a
        ``find_executable_batch_size`` loop calls this before preparing again, and ``save_state``
        must still write them)."""
        import gc

        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self._param_maps, self._optimizer_models = [], {}
        self._fp8_health.clear()
        self._ds_engine = None
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)
