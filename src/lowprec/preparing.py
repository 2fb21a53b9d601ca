"""``Accelerator.prepare`` and its parts: models converted by the FP8 backend and wrapped (precision
wrapper, tensor / expert parallelism, DDP / FSDP2 / DeepSpeed), optimizers pointed at the final
parameters and hooked to the backend, schedulers and dataloaders wrapped. A mixin of
:class:`lowprec.accelerator.Accelerator`, whose state (``_models``, ``_optimizers``, ``backend``,
the handlers, the process facts) it reads and extends.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lowprec.accelerator_host import AcceleratorHost
from lowprec.backends.base import Backend, named_params, remap_optimizer_params
from lowprec.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
)
from lowprec.state import DistributedType
from lowprec.utils.data_loader import DataLoaderDispatcher, DataLoaderShard, data_seed_default, skip_first_batches
from lowprec.utils.fp8_health import ModelHealth
from lowprec.utils.deepspeed import DeepSpeedOptimizer, build_ds_config, deepspeed_initialize
from lowprec.utils.distributed import wrap_ddp, wrap_fsdp2
from lowprec.utils.optimizer import AcceleratedOptimizer, AcceleratedScheduler, note_replaced, retarget_scheduler
from lowprec.utils.precision import autocast_context, wrap_forward
from lowprec.utils.parallelism import apply_ep, apply_tp, data_shard, dp_mesh


__all__ = ["PrepareMixin"]


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and not isinstance(obj, torch.optim.Optimizer)
    )


class PrepareMixin(AcceleratorHost):
    """``prepare`` and ``prepare_*`` of the Accelerator (see the module docstring)."""

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
        own_experts, replicas = apply_ep(pc, model)  # expert parallelism: after FP8 conversion, before DDP / FSDP2
        if replicas is not None:  # more processes than ep_size: expert gradients averaged after backward
            self._expert_replicas.append(replicas)
        if not evaluation_mode:
            if dt.is_ddp and (pc is None or not pc.tp_enabled):
                ddp = self.handlers.get(DistributedDataParallelKwargs) or DistributedDataParallelKwargs()
                model = wrap_ddp(model, self.device, ddp.to_kwargs(), ignore=own_experts)
                ddp.register_comm_hook(model)  # Accelerate's comm_hook / comm_wrapper, if any
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
            model = cast(nn.Module, torch.compile(model, **self.dynamo_plugin.compile_kwargs()))  # an OptimizedModule
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
        optimizer = given = results[opts[0]]
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
        note_replaced(wrapped, given, optimizer)  # ZeRO steps the client optimizer's param groups
        if self.backend is not None:
            wrapped.after_step, wrapped.after_skip = self._step_hooks(engine.module)
            self.backend.after_wrap(engine, self._ctx())
        self._ds_engine = engine
        self._models.append(engine)
        self._optimizers.append(wrapped)  # type: ignore[arg-type]
        self._retarget_schedulers()
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
        backend = cast(Backend, self.backend)  # called only with a backend
        after_step, after_skip = (
            functools.partial(f, model) for f in (backend.after_optimizer_step, backend.after_skipped_step)
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
            opt.replace_optimizer(new_opt)
            self._retarget_schedulers()
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
                # a backend returns a new model only for the one it was given (owner is not None)
                self._models[self._models.index(cast(nn.Module, owner))] = new_model
                self._optimizer_models[id(opt)] = new_model

    def _retarget_schedulers(self) -> None:
        """Schedulers prepared in an earlier call, on an optimizer a backend has just replaced."""
        for sched in self._schedulers:
            retarget_scheduler(sched.scheduler, self._optimizers)

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        retarget_scheduler(scheduler, self._optimizers)  # built on an optimizer a backend replaced
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
            self._data_seed = data_seed_default(broadcast=self.use_distributed)
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
            seedable=cfg.use_seedable_sampler,
        )
        self._dataloaders.append(shard)
        return shard

    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
        return skip_first_batches(dataloader, num_batches)
