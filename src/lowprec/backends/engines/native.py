"""The native backend: lowprec's own FP8 engine (always available, any device); declared in
``lowprec/backends/native.py``."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, ContextManager, Optional, cast

import torch
from torch import nn

from lowprec import fp8
from lowprec.backends.base import BaseBackend, PrepareContext
from lowprec.backends.engines.shared import warn_if_nothing_converted
from lowprec.logs import log_once
from lowprec.catalog import check_fsdp_fp8_all_gather
from lowprec.distributed.amax_sync import reduce_delayed_amaxes
from lowprec.distributed.fsdp_float8 import enable_fsdp_float8_all_gather, precompute_float8_scales_for_fsdp
from lowprec.fp8.plain_save import strip_fp8_state_on_save
from lowprec.fp8.step_stage import ScalingStage
from lowprec.kwargs import NativeRecipeKwargs

__all__ = ["NativeBackend", "create"]

logger = logging.getLogger("lowprec")


class NativeBackend(BaseBackend):
    """Converts ``nn.Linear`` to :class:`lowprec.fp8.Float8Linear` in place (same Parameter
    objects, so an optimizer built before ``prepare`` keeps training the right tensors) and
    enters :func:`lowprec.fp8.autocast` around each forward."""

    def __init__(
        self,
        recipe: fp8.Recipe,
        *,
        name: str = "native",
        reason: str = "",
        module_filter: Optional[Callable[[nn.Module, str], bool]] = None,
        skip_first_last: bool = True,
        skip_patterns: tuple = ("lm_head", "router", "gate"),
        fsdp_float8_all_gather: bool = False,
        nothing_converted_hint: Optional[str] = None,
    ) -> None:
        self.recipe = recipe
        self.name = name
        self.engine = f"lowprec native engine ({recipe.name} recipe)"
        self.reason = reason or "native engine asked for"
        self.module_filter = module_filter
        self.skip_first_last = skip_first_last
        self.skip_patterns = tuple(skip_patterns)
        self.nothing_converted_hint = nothing_converted_hint
        self.report: Any = None
        if fsdp_float8_all_gather:
            check_fsdp_fp8_all_gather(recipe.name, recipe.scaling)
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self._fp8_all_gather_on = False  # the model is FSDP2-sharded with FP8 all-gather
        # per converted model: its FP8 scaling state as of the last step's end, restored when a
        # step is skipped (fp8/step_stage.py); and which of them each optimizer's model holds
        self._stages: dict[int, Any] = {}
        self._owned: dict[int, list] = {}

    def convert(self, model: nn.Module, ctx: PrepareContext) -> nn.Module:
        if ctx.emulate and self.recipe.gemm != "emulate":
            self.recipe = self.recipe.replace(gemm="emulate")
        # a transformers model's save_pretrained (the usual unwrap_model(model).save_pretrained)
        # writes weights only, not the FP8 scaling state (fp8/plain_save.py)
        strip_fp8_state_on_save(model)
        if fp8.has_fp8_layers(model):
            self._check_experts(model, ctx)
            self._stage(model)  # converted by the user before prepare: staged all the same
            return model  # prepared twice (e.g. several prepare calls): convert once
        self.report = fp8.convert(
            model,
            recipe=self.recipe,
            module_filter=self.module_filter,
            skip_first_last=self.skip_first_last,
            skip_patterns=self.skip_patterns,
            warn_if_none=False,  # warn_if_nothing_converted below, with the kwargs that fix it
        )
        # one line on the console (rank 0); the per-layer table at debug level and, from the
        # trainer, in output_dir/fp8_conversion.txt
        if int(os.environ.get("RANK", "0")) == 0:
            logger.info("lowprec: %s", self.report.summary())
        logger.debug("lowprec: FP8 conversion (%s):\n%s", self.engine, self.report)
        warn_if_nothing_converted(
            self.report.num_converted + len(self.report.experts),
            self.report.skipped,
            self.engine,
            (
                self.nothing_converted_hint
                if self.nothing_converted_hint is not None
                else "To convert the first and last Linear too: NativeRecipeKwargs(skip_first_last=False); "
                if self.skip_first_last
                else ""
            )
            + "FP8 GEMMs need both dims of a weight divisible by 16",
        )
        self._check_experts(model, ctx)
        if self.fsdp_float8_all_gather and ctx.distributed_type == "FSDP":
            # new weight Parameters: the Accelerator remaps the optimizer to them by name
            enable_fsdp_float8_all_gather(model)
            self._fp8_all_gather_on = True
            n = sum(1 for m in model.modules() if isinstance(m, fp8.Float8Experts))
            if n:
                log_once(
                    f"lowprec: fp8_enable_fsdp_float8_all_gather covers Linear weights; the 3-D expert weights "
                    f"of {n} mixture-of-experts module(s) are all-gathered in their own dtype"
                )
        elif self.fsdp_float8_all_gather:
            log_once(
                f"lowprec: fp8_enable_fsdp_float8_all_gather applies under FSDP2 only; "
                f"{ctx.distributed_type} all-gathers no weights, so it has no effect here"
            )
        self._stage(model)
        return model

    def _check_experts(self, model: nn.Module, ctx: PrepareContext) -> None:
        """Delayed scaling's histories are agreed across data-parallel ranks after each step
        (``reduce_amax``); an expert's per-expert history cannot be: each rank routes its own
        tokens, so an expert records amaxes on some ranks and not on others."""
        if ctx.distributed_type == "NO" or not (self.recipe.kind.keeps_history and self.recipe.reduce_amax):
            return
        if any(isinstance(m, fp8.Float8Experts) and m.fp8_gemms() for m in model.modules()):
            raise ValueError(
                f"fp8_recipe: {self.recipe.name} over several processes with FP8 mixture-of-experts layers: "
                "per-expert amax histories cannot be agreed across ranks (each rank routes its own tokens). "
                "Use a current-scaling recipe (tensorwise, rowwise, blockwise, mxfp8), keep the experts in "
                "high precision (fp8_filter: [experts]), or train on one process"
            )

    def _stage(self, model: nn.Module) -> None:
        if id(model) not in self._stages:
            stage = ScalingStage(model)
            if not stage.empty:
                self._stages[id(model)] = stage
                self._owned.clear()

    def _stages_of(self, model: nn.Module) -> list:
        """The stages of the layers ``model`` holds (it may be a DDP / DeepSpeed wrapper of the
        converted model): found once per model, then cached."""
        found = self._owned.get(id(model))
        if found is None:
            held = {id(m) for m in model.modules()}
            found = self._owned[id(model)] = [s for s in self._stages.values() if id(s.first) in held]
        return found

    def fp8_context(self, model: nn.Module) -> ContextManager:
        stage = self._stages.get(id(model))
        if stage is not None and not torch.compiler.is_compiling():
            stage.refresh()  # a state dict loaded since the last step: copy the state again
        # layers own their recipe (and its eval rule); the region only switches FP8 on
        return fp8.autocast(enabled=True)

    def after_optimizer_step(self, model: nn.Module) -> None:
        if self._fp8_all_gather_on:
            # all weights' scales for the next FP8 all-gather: one all-reduce, not one per layer
            precompute_float8_scales_for_fsdp(model)
        if self.recipe.kind.keeps_history and self.recipe.reduce_amax:
            # every rank casts with the same scales next step (one all-reduce for all layers)
            reduce_delayed_amaxes(model)
        for stage in self._stages_of(model):
            stage.accept()  # keep this step's scaling state; count amax spikes

    def after_skipped_step(self, model: nn.Module) -> None:
        for stage in self._stages_of(model):
            stage.discard()  # the skipped step's amaxes, counters and scales: undone

    def plain_state_dict(self, state_dict: dict) -> dict:
        return fp8.plain_state_dict(state_dict)

    def describe(self) -> dict:
        return {**super().describe(), "recipe": self.recipe.to_dict()}


def create(handler: NativeRecipeKwargs, why: str) -> NativeBackend:
    return NativeBackend(
        handler.to_recipe(),
        reason=why,
        module_filter=handler.module_filter_func,
        skip_first_last=handler.skip_first_last,
        skip_patterns=handler.skip_patterns,
        # _resolve_fields (the handler's __post_init__) filled it: a bool, never None
        fsdp_float8_all_gather=cast(bool, handler.enable_fsdp_float8_all_gather),
        nothing_converted_hint=handler.nothing_converted_hint,
    )
