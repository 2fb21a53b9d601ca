"""``lowprec.Accelerator``: Hugging Face Accelerate's training-loop API over lowprec.

It holds no numerics. At construction it resolves, once and with logged reasons, the precision,
the device, the distributed type and (for fp8) one backend; ``prepare`` then asks the backend to
convert models, wraps them (precision wrapper, DDP / FSDP2) and wraps optimizers, schedulers and
dataloaders. Objects may be prepared in any mix and order, over several calls.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lowprec.accelerate_objects import from_accelerate
from lowprec.backends.base import Backend, PrepareContext, named_params, remap_optimizer_params
from lowprec.backends.registry import FP8Settings, resolve_fp8_settings, select_backend
from lowprec.backends.spec import get_spec
from lowprec.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    RecipeKwargs,
    env_get,
    env_int,
)
from lowprec.errors import did_you_mean
from lowprec.state import AcceleratorState, Decision, DistributedType
from lowprec.tracking import TrackingMixin, filter_trackers
from lowprec.utils.aliases import alias
from lowprec.utils.checkpointing import CheckpointingMixin
from lowprec.utils.data_loader import DataLoaderShard, GradientState, skip_first_batches
from lowprec.utils.dispatcher import DataLoaderDispatcher
from lowprec.utils.fp8_health import HealthHooks, ModelHealth
from lowprec.utils.dataclasses import DataLoaderConfiguration, FP8BackendType, ProjectConfiguration, TorchDynamoPlugin
from lowprec.utils.deepspeed import DeepSpeedOptimizer, build_ds_config, deepspeed_clip, deepspeed_initialize
from lowprec.utils.distributed import clip_grad_norm, trigger_sync_in_backward, wrap_ddp, wrap_fsdp2
from lowprec.utils.nonfinite import NonFiniteGuard
from lowprec.utils.operations import gather, gather_object, has_tensor, pad_across_processes, reduce
from lowprec.utils.optimizer import AcceleratedOptimizer, AcceleratedScheduler
from lowprec.utils.modeling import extract_model_from_parallel
from lowprec.utils.precision import autocast_context, wrap_forward
from lowprec.utils.parallelism import ParallelismMixin, apply_ep, apply_tp, data_shard, dp_mesh, for_accelerator
from lowprec.utils.process_control import ProcessControlMixin
from lowprec.utils.distributed import full_model_state_dict
from lowprec.utils.operations import recursively_apply

__all__ = ["Accelerator", "FP8BackendType"]

logger = logging.getLogger("lowprec")


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and not isinstance(obj, torch.optim.Optimizer)
    )


class Accelerator(ProcessControlMixin, CheckpointingMixin, TrackingMixin, ParallelismMixin):
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
        if "kwarg_handlers" in kwargs:  # the spelling Accelerate's own FP8 docs use
            handlers += list(kwargs.pop("kwarg_handlers") or [])
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
    def fp8_backend(self) -> FP8BackendType:
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

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: Optional[list] = None) -> Any:
        if device_placement is None:
            placement: list = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(
                f"prepare(device_placement=...) has {len(device_placement)} entries for {len(args)} "
                "objects; give one bool per object"
            )
        else:
            placement = list(device_placement)
        results = list(args)
        if self.distributed_type == DistributedType.DEEPSPEED:
            self._prepare_deepspeed(results)
        for i, obj in enumerate(args):
            if isinstance(obj, nn.Module) and not self._is_ds(results[i]):
                results[i] = self.prepare_model(obj, device_placement=placement[i])
        for i, obj in enumerate(args):
            if isinstance(results[i], torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer):
                results[i] = self.prepare_optimizer(obj)
        self._finish_optimizers(results)
        for i, obj in enumerate(args):
            if isinstance(obj, DataLoader):
                results[i] = self.prepare_data_loader(obj, device_placement=placement[i])
            elif _is_scheduler(obj) and not isinstance(obj, AcceleratedScheduler):
                results[i] = self.prepare_scheduler(obj)
        for i, obj in enumerate(results):
            if obj is not args[i] or isinstance(obj, nn.Module):
                with contextlib.suppress(AttributeError, TypeError):
                    obj._is_accelerate_prepared = True
        return results[0] if len(results) == 1 else tuple(results)

    def prepare_model(
        self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if any(model is m or self.unwrap_model(m) is model for m in self._models):
            return model
        offloaded = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()} & {"cpu", "disk"}
        if (getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)) and offloaded:
            raise ValueError(
                "a model loaded in 8-bit or 4-bit with CPU or disk offload cannot be trained; "
                "load it with every layer on the accelerator (device_map={'': 0})"
            )
        placement = self.device_placement if device_placement is None else device_placement
        before = named_params(model)
        if placement:
            model = model.to(self.device)
        model = self._convert_and_wrap_forward(model)
        dt, pc = self.distributed_type, self.parallelism_config
        apply_tp(pc, model, self.device.type)  # tensor parallelism: after FP8 conversion, before FSDP2
        own_experts = apply_ep(pc, model)  # expert parallelism: after FP8 conversion, before DDP / FSDP2
        if not evaluation_mode:
            if dt.is_ddp and (pc is None or not pc.tp_enabled):
                kw = (self.handlers.get(DistributedDataParallelKwargs) or DistributedDataParallelKwargs()).to_kwargs()
                model = wrap_ddp(model, self.device, kw, ignore=own_experts)
            elif dt == DistributedType.FSDP:
                model = wrap_fsdp2(
                    model,
                    self.mixed_precision,
                    self.state.fsdp_plugin,
                    self.device,
                    dp_mesh(pc, self.device.type),
                    ignore=own_experts,
                )
            elif dt == DistributedType.DEEPSPEED:
                raise ValueError(
                    "under DeepSpeed, pass the model together with its optimizer in one prepare() "
                    "call (deepspeed.initialize takes both); for inference use evaluation_mode=True"
                )
            if self.backend is not None:
                self.backend.after_wrap(model, self._ctx())
        if self.dynamo_plugin.enabled:
            model = torch.compile(model, **self.dynamo_plugin.compile_kwargs())
        self._param_maps.append((before, named_params(self.unwrap_model(model))))
        self._models.append(model)
        return model

    def _convert_and_wrap_forward(self, model: nn.Module) -> nn.Module:
        """Backend conversion, then the precision wrapper (autocast outside, FP8 region inside)."""
        if self.backend is not None:
            model = self.backend.convert(model, self._ctx())
            # fp8_guard / fp8_health on the converted model; driven by its optimizer's steps
            self._fp8_health.attach(model, self.handlers.get("recipe"), self._log_health)
        fp8_ctx = self.backend.fp8_context if self.backend is not None else None
        # under FSDP2 the MixedPrecisionPolicy sets dtypes; elsewhere torch.autocast does
        mp = "no" if self.distributed_type == DistributedType.FSDP else self.mixed_precision
        autocast = functools.partial(autocast_context, self.device.type, mp, self.handlers.get(AutocastKwargs))
        if self.mixed_precision != "no" or fp8_ctx is not None:
            wrap_forward(model, autocast, fp8_ctx)
        return model

    @staticmethod
    def _is_ds(obj: Any) -> bool:
        return type(obj).__name__ == "DeepSpeedEngine" or isinstance(obj, DeepSpeedOptimizer)

    def _prepare_deepspeed(self, results: list) -> None:
        """deepspeed.initialize on the (model, optimizer) pair of this call, in place in results."""
        models = [i for i, o in enumerate(results) if isinstance(o, nn.Module)]
        opts = [i for i, o in enumerate(results) if isinstance(o, torch.optim.Optimizer)]
        if not models and not opts:
            return
        if len(models) != 1 or len(opts) != 1:
            raise ValueError(
                "under DeepSpeed, pass exactly one model and its optimizer in the same prepare() call "
                f"(got {len(models)} model(s) and {len(opts)} optimizer(s)): deepspeed.initialize takes both"
            )
        loaders = [o for o in results if isinstance(o, DataLoader)] + [d.base for d in self._dataloaders]
        micro = (loaders[0].batch_size if loaders else None) or 1
        model = results[models[0]].to(self.device)
        before = named_params(model)
        model = self._convert_and_wrap_forward(model)
        optimizer = results[opts[0]]
        remap_optimizer_params(optimizer, before, named_params(model))
        if self.backend is not None:
            optimizer, model = self.backend.prepare_optimizer(optimizer, model, self._ctx())
        cfg = build_ds_config(
            self.state.deepspeed_plugin,
            self.mixed_precision,
            micro,
            self.gradient_accumulation_steps,
            self.num_processes,
            self.nonfinite.enabled,
        )
        engine, ds_opt = deepspeed_initialize(model, optimizer, cfg)
        wrapped = DeepSpeedOptimizer(engine, ds_opt, self.nonfinite)
        if self.backend is not None:
            wrapped.after_step, wrapped.after_skip = self._step_hooks(engine.module)
            self.backend.after_wrap(engine, self._ctx())
        self._ds_engine = engine
        self._models.append(engine)
        self._optimizers.append(wrapped)  # type: ignore[arg-type]
        self._optimizer_models[id(wrapped)] = engine
        results[models[0]], results[opts[0]] = engine, wrapped

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None
    ) -> AcceleratedOptimizer:
        wrapped = AcceleratedOptimizer(optimizer, self.scaler, self.gradient_state, guard=self.nonfinite)
        self._optimizers.append(wrapped)
        self._finish_optimizers([])
        return wrapped

    def _owner(self, optimizer: Any) -> Optional[nn.Module]:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for model in self._models:
            if ids & {id(p) for p in model.parameters()}:
                return model
        return None

    def _step_hooks(self, model: nn.Module) -> tuple:  # after a step that ran; after a skipped one (FP8 state undone)
        after_step, after_skip = (
            functools.partial(f, model) for f in (self.backend.after_optimizer_step, self.backend.after_skipped_step)
        )
        return self._fp8_health.after_step(self.unwrap_model(model), after_step), after_skip  # + fp8_guard

    def _log_health(self, values: dict, step: int) -> None:
        if self.trackers:
            self.log(values, step=step)

    def fp8_health(self, model: nn.Module) -> Optional[ModelHealth]:
        """The FP8 health monitor of a prepared ``model`` (``NativeRecipeKwargs(fp8_guard=...)`` or
        ``fp8_health=True``), or None: ``.records`` (the last check's), ``.steps`` (optimizer steps
        seen), ``.monitor.moved_layers()`` (the layers in bf16 now)."""
        return self._fp8_health.of(self.unwrap_model(model))

    def _finish_optimizers(self, results: list) -> None:
        """Point every optimizer at the final parameters (conversion and FSDP2 may make new
        ones) and give the backend its optimizer hook once the owning model is known."""
        for opt in self._optimizers:
            if isinstance(opt, DeepSpeedOptimizer):
                continue
            for before, after in self._param_maps:
                remap_optimizer_params(opt.optimizer, before, after)
            if id(opt) in self._optimizer_models:
                continue
            owner = self._owner(opt.optimizer)
            if owner is None and self.backend is not None and self.backend.needs_model_for_optimizer:
                continue  # wait for the model (a later prepare call)
            self._optimizer_models[id(opt)] = owner
            if self.backend is None:
                continue
            # the model as held (DDP-wrapped): MS-AMP O-levels hook DDP's gradient all-reduce
            new_opt, new_model = self.backend.prepare_optimizer(opt.optimizer, owner, self._ctx())
            opt.optimizer = new_opt
            if owner is not None:
                opt.after_step, opt.after_skip = self._step_hooks(owner)
            if new_model is not None and new_model is not owner:
                idx = next((i for i, r in enumerate(results) if r is owner), None)
                if idx is None:
                    raise ValueError(
                        f"the {self.backend.engine} backend replaced the model while preparing its "
                        "optimizer; pass the model and the optimizer in the same prepare() call"
                    )
                results[idx] = new_model
                self._models[self._models.index(owner)] = new_model
                self._optimizer_models[id(opt)] = new_model

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        wrapped = AcceleratedScheduler(
            scheduler,
            self._optimizers,
            self.gradient_state,
            self.step_scheduler_with_optimizer,
            self.accumulation.adjust_scheduler,
            1 if self.split_batches else self.num_processes,
        )
        self._schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: Optional[bool] = None) -> DataLoaderShard:
        if self._data_seed is None:
            seed = torch.tensor([torch.initial_seed() % (2**31)], dtype=torch.int64)
            if self.use_distributed:
                dist.broadcast(seed, src=0)
            self._data_seed = int(seed)
        placement = self.device_placement if device_placement is None else device_placement
        cfg = self.dataloader_config
        rank, world = data_shard(self.parallelism_config, self.process_index, self.num_processes, self.device.type)
        dispatch = cfg.dispatch_batches
        if dispatch is None:  # Accelerate's default: a stream cannot be sharded by index
            dispatch = isinstance(data_loader.dataset, IterableDataset) and world > 1
        shard = (DataLoaderDispatcher if dispatch else DataLoaderShard).wrap(
            data_loader,
            rank=rank,
            world_size=world,
            device=self.device if placement else None,
            seed=self._data_seed if cfg.data_seed is None else cfg.data_seed,
            gradient_state=self.gradient_state,
            split_batches=cfg.split_batches,
            even_batches=cfg.even_batches,
            non_blocking=cfg.non_blocking,
        )
        self._dataloaders.append(shard)
        return shard

    def skip_first_batches(self, dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard:
        return skip_first_batches(dataloader, num_batches)

    # ------------------------------------------------------------------ training step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.nonfinite.note_loss(loss)
        if self._ds_engine is not None:
            # DeepSpeed refuses NaN/inf gradients itself; make a non-finite loss reach it as such
            self._ds_engine.backward(
                self.nonfinite.nan_if_nonfinite(loss), **kwargs
            )  # DeepSpeed scales by its accumulation steps
            return
        loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

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
        if hasattr(model, "no_sync"):  # DDP
            with model.no_sync():
                yield
        elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
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
        """Unscales first (fp16 and MS-AMP alike), then clips. On accumulation micro-steps it does
        nothing and returns None: clipping a partial sum would distort the final gradient."""
        if not self.sync_gradients:
            return None
        if self._ds_engine is not None:
            return deepspeed_clip(self._ds_engine, max_norm)
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
        return full_model_state_dict(self.unwrap_model(model) if unwrap else model)

    def free_memory(self, *objects: Any):
        """Forget every prepared object (and the bookkeeping that holds references to them),
        then collect garbage; like Accelerate, returns a list with ``None`` for each object passed, so
        ``model, opt = accelerator.free_memory(model, opt)`` drops the caller's references too."""
        import gc

        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self._param_maps, self._optimizer_models, self._custom_objects = [], {}, []
        self._fp8_health.clear()
        self._ds_engine = None
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)
