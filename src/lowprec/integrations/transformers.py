"""FP8 for ``transformers.Trainer`` and the trainers built on it (TRL's ``SFTTrainer``,
``DPOTrainer``, ``GRPOTrainer``; Axolotl).

    from lowprec.integrations.transformers import FP8Callback, enable_fp8

    model = AutoModelForCausalLM.from_pretrained(...)         # or a peft model
    report = enable_fp8(model, recipe="tensorwise")          # converts in place; report.summary()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[FP8Callback()])
    trainer.train()
    model.save_pretrained(out)                                 # plain weights, no FP8 state

Why each piece is what it is:

* **Conversion is the switch** (:mod:`lowprec.fp8.modules.autocast`): a converted layer runs FP8
  wherever it is called, so Trainer's wrappers (Accelerate's ``prepare``, DDP, its own
  ``torch.autocast``) and TRL's direct calls into ``model.base_model`` need nothing more. No
  forward wrapper is installed: a wrapped forward's ``*args, **kwargs`` signature makes Trainer
  drop every dataset column (``remove_unused_columns``).
* **Gradient checkpointing** (``gradient_checkpointing=True``, ``use_reentrant`` either way, TRL's
  default): the engine recognises a recompute and replays the first forward's FP8 decision and
  delayed scales (``fp8.autocast.recomputing_unmarked``); nothing is passed to transformers.
* **peft**: convert before or after ``get_peft_model``; the default rule keeps adapter layers
  (``lora_A``/``lora_B``) in high precision and converts the frozen base layers.
* **save_pretrained writes weights only**: the FP8 scaling state (delayed scaling's amax
  histories, scales and step counters; nvfp4's rounding stream) is training state. Its keys are
  named in each ``PreTrainedModel``'s ``_keys_to_ignore_on_save`` (transformers' own hook, keys
  matched exactly), computed when saving, so a peft merge or a later conversion is covered and
  the checkpoint loads into the plain model with no unexpected keys.
* **Resume** (``trainer.train(resume_from_checkpoint=...)``): Trainer's checkpoints go through
  ``save_pretrained``, so :class:`FP8Callback` writes the FP8 scaling state beside them, one
  file per process (``lowprec_fp8_state-rank<r>.safetensors``: each rank's delayed histories are its
  own), and puts it back when a resumed run begins: the resumed run continues as the
  uninterrupted one (losses equal on CPU). A resumed run that finds no such file logs one warning
  and starts the histories afresh (they refill within ``amax_history_len`` steps).
* **O1/O2 optimizers** (MS-AMP style, :mod:`lowprec.optim`): :func:`apply_opt_level` on the built
  Trainer, before ``train()``: O2 builds Trainer's own optimizer (its param groups, weight decay
  rules and ``optim`` kwargs) and rebuilds it as ``FP8AdamW``; O1's FP8 gradients are a DDP
  communication hook under several processes (through Accelerate's public ``ddp_handler``, which
  registers hooks on the DDP model it creates) and an in-place FP8 rounding of ``.grad`` on one
  (Trainer clips ``.grad`` before the step, so gradients are not held as FP8 payloads).
* :class:`FP8Callback` refuses a model with no FP8 layers (never a silent full-precision run),
  warns once if converted layers ran in high precision during training, and adds to Trainer's
  logs: Linear calls in FP8 and in high precision since the last log and, on logging steps, the
  telemetry's worst saturated and underflow fractions (under DDP the worst over every rank).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterable

import torch
from accelerate.utils import DistributedDataParallelKwargs
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from lowprec import fp8
from lowprec.checkpoint.serialization import load_object, save_object
from lowprec.durable import fsync_dir, fsync_file, temp_suffix
from lowprec.fp8.convert import DEFAULT_SKIP_PATTERNS, ConversionReport, ModuleFilter
from lowprec.fp8.plain_save import fp8_state_keys, strip_fp8_state_on_save
from lowprec.fp8.observe.guard import GUARD_MODES, GUARD_SCOPES, THRESHOLD_NAMES, Guard, HealthMonitor, Thresholds
from lowprec.distributed import register_fp8_allreduce
from lowprec.optim import OPT_LEVELS, hold_grads_in_fp8, to_fp8_adamw
from lowprec.utils.fp8 import has_ao_layers, has_transformer_engine_layers
from lowprec.optim.opt_level import check_o2_optimizer

__all__ = ["enable_fp8", "FP8Callback", "apply_opt_level", "fp8_counts", "fp8_state_keys", "FP8_STATE_FILE"]

FP8_STATE_FILE = "lowprec_fp8_state-rank{rank}.safetensors"  # in each Trainer checkpoint directory
GUARD_FILE = "lowprec_fp8_guard.json"  # FP8Callback(guard=...): moves, streaks, episodes (plain JSON)


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp-{temp_suffix()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    fsync_file(tmp)
    os.replace(tmp, path)  # never a half-written file under the final name
    fsync_dir(os.path.dirname(path))


logger = logging.getLogger("lowprec")


def enable_fp8(
    model: nn.Module,
    recipe: fp8.Recipe | str | None = "tensorwise",
    *,
    module_filter: ModuleFilter | None = None,
    skip_first_last: bool = True,
    skip_patterns: Iterable[str] = DEFAULT_SKIP_PATTERNS,
) -> ConversionReport:
    """Convert ``model`` (a transformers model, or a peft model around one) to FP8 in place for
    ``Trainer``; ``save_pretrained`` then writes plain weights. Arguments as
    :func:`lowprec.fp8.convert`. Raises ``ValueError`` when nothing converts (it would train in
    full precision)."""
    report = fp8.convert(
        model, recipe, module_filter, skip_first_last=skip_first_last, skip_patterns=skip_patterns, warn_if_none=False
    )  # nothing converted is the ValueError below
    if not fp8.has_fp8_layers(model):
        raise ValueError(
            f"enable_fp8: no Linear layer of {type(model).__name__} was converted ({len(report.skipped)} kept in high "
            "precision: see the report's skip reasons); training would run in full precision. Loosen "
            "skip_patterns/module_filter, or train without FP8"
        )
    strip_fp8_state_on_save(model)
    logger.info("lowprec: %s", report.summary())
    return report


class _Counts:
    """Float8Linear calls in training mode since the last log: FP8 and high precision. A layer
    records its decision on each call (``_fp8_forward_recipe``); a forward hook reads it."""

    def __init__(self) -> None:
        self.fp8 = self.hp = 0
        self.total_fp8 = self.total_hp = 0  # since training began, never reset
        self.handles: list = []

    def hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if module.training:
            if module.__dict__.get("_fp8_forward_recipe") is not None:
                self.fp8 += 1
                self.total_fp8 += 1
            else:
                self.hp += 1
                self.total_hp += 1

    def attach(self, model: nn.Module) -> int:
        if not self.handles:
            layers = [m for m in model.modules() if isinstance(m, fp8.Float8Linear)]
            self.handles = [m.register_forward_hook(self.hook) for m in layers]
        return len(self.handles)


def _library_fp8_layers(model: nn.Module) -> bool:
    """torchao's or TransformerEngine's FP8 layers (lowprec.Accelerator's torchao / te backends)."""
    return has_ao_layers(model) or has_transformer_engine_layers(model)


def _worst(model: nn.Module) -> dict[str, float]:
    """The largest saturated and underflow fractions over every layer and operand."""
    rows = [op for layer in fp8.telemetry(model).values() for op in layer.values() if op["scale"] > 0]
    if not rows:
        return {}
    return {
        "fp8_saturated_max": max(r["saturated"] for r in rows),
        "fp8_underflow_max": max(r["underflow"] for r in rows),
    }


def _worst_over_ranks(worst: dict[str, float], device: torch.device) -> dict[str, float]:
    """The worst fractions over every rank (each rank casts its own batch). Collective: Trainer
    logs the training loss on every rank at the same steps (it gathers the loss there too)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return worst
    keys = ("fp8_saturated_max", "fp8_underflow_max")
    t = torch.tensor([worst.get(k, -1.0) for k in keys], dtype=torch.float64, device=device)  # -1: no statistics
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: v for k, v in zip(keys, t.tolist()) if v >= 0}


class FP8Callback(TrainerCallback):
    """Trainer callback for a model converted with :func:`enable_fp8` or ``lowprec.fp8.convert``
    (see the module docstring). Pass it in ``Trainer(callbacks=[...])``; for reporters that run
    before it (TensorBoard, W&B) to see its keys, insert it first:
    ``trainer.callback_handler.callbacks.insert(0, FP8Callback())``.

    Args:
        telemetry: collect FP8 statistics on the steps that log (two extra elementwise passes
            per cast on those steps only) and add the worst fractions to the logs.
        guard: ``"off"``, ``"warn"`` or ``"act"``: the FP8 guard of ``lowprec train``'s
            ``fp8_guard`` (:mod:`lowprec.fp8.observe.guard`) on the logging steps' health signals. ``warn``
            logs one line per episode; ``act`` also moves the layer to high precision (bf16). The
            moves are written into Trainer's checkpoints (``lowprec_fp8_guard.json``) and taken
            back on resume. Under several processes every rank decides the same (the check is
            collective). Logs gain ``fp8_guard_moved_layers`` (the layers in bf16 now).
        guard_patience: unhealthy checks in a row before an episode (``fp8_guard_patience``).
        guard_recover_after: with ``guard="act"``, healthy checks in a row (the layer's would-be
            FP8 casts measured on the side) before a moved layer moves back to FP8
            (``fp8_guard_recover_after``); ``None`` (default): a moved layer stays in bf16.
        guard_scope: with ``guard="act"``, what a move moves (``fp8_guard_scope``): ``"layer"``
            (default: the whole layer) or ``"gemm"`` (only the GEMMs that read the unhealthy
            operand; the table in docs/guide.md).
        guard_thresholds: overrides of :class:`lowprec.fp8.observe.guard.Thresholds` (``saturated``,
            ``underflow``, ``max_to_rms``, ``sqnr_db``), as ``fp8_guard_thresholds``.
        health_sqnr_every: steps between the sampled shadow-GEMM SQNR readings.
    """

    def __init__(
        self,
        telemetry: bool = True,
        guard: str = "off",
        guard_patience: int = 3,
        guard_thresholds: dict[str, float] | None = None,
        health_sqnr_every: int = 50,
        guard_recover_after: int | None = None,
        guard_scope: str = "layer",
    ) -> None:
        if guard not in GUARD_MODES:
            raise ValueError(f"FP8Callback(guard={guard!r}): use one of {', '.join(GUARD_MODES)}")
        if guard != "off" and not telemetry:
            raise ValueError("FP8Callback(guard=...) reads the FP8 telemetry: keep telemetry=True")
        unknown = sorted(set(guard_thresholds or {}) - set(THRESHOLD_NAMES))
        if unknown:
            raise ValueError(f"FP8Callback(guard_thresholds=...): unknown {unknown}; use {', '.join(THRESHOLD_NAMES)}")
        if guard_recover_after is not None and guard != "act":
            raise ValueError(f"FP8Callback(guard_recover_after=...) moves layers back: use guard='act', not {guard!r}")
        if guard_scope not in GUARD_SCOPES:
            raise ValueError(
                f"FP8Callback(guard_scope={guard_scope!r}): use 'layer' (move the whole layer) or 'gemm' "
                "(move only the GEMMs that read the unhealthy operand)"
            )
        if guard_scope != "layer" and guard != "act":
            raise ValueError(
                f"FP8Callback(guard_scope={guard_scope!r}) says what act moves: use guard='act', not {guard!r}"
            )
        self.telemetry = telemetry
        self.counts = _Counts()
        self.model: nn.Module | None = None
        self.last_worst: dict[str, float] = {}  # the last log's telemetry, worst over every rank
        self._warned = False
        self.guard_mode = guard
        # a bad value fails here, not in train()
        Thresholds(patience=guard_patience, recover_after=guard_recover_after, **(guard_thresholds or {}))
        self._health_args = (
            guard_patience,
            health_sqnr_every,
            dict(guard_thresholds or {}),
            guard_recover_after,
            guard_scope,
        )
        self.health: HealthMonitor | None = None  # with a guard: lowprec train's probe and guard

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and not fp8.has_fp8_layers(model) and _library_fp8_layers(model):
            # torchao's / TransformerEngine's layers (lowprec.Accelerator with their backend): FP8
            # runs; the counts, telemetry and scaling state below are the native engine's
            logger.info("lowprec: FP8Callback: the FP8 layers are another library's; no FP8 counts or state")
            return
        if model is None or not fp8.has_fp8_layers(model):
            raise ValueError(
                "FP8Callback: the model has no FP8 layers, so it would train in full precision; call "
                "lowprec.integrations.transformers.enable_fp8(model) before building the Trainer (on "
                "lowprec's Accelerator: no Linear layer was converted, see its conversion log)"
            )
        self.model = model
        strip_fp8_state_on_save(model)  # converted by lowprec.Accelerator: save_pretrained stays plain
        self.counts.total_fp8 = self.counts.total_hp = 0  # fp8_counts: since this train() began
        if (
            getattr(args, "fsdp", None)
            and args.world_size > 1
            and not any(isinstance(m, FSDPModule) for m in model.modules())
        ):
            # accelerate 1.15 state.py: FSDP only for accelerator devices (MULTI_GPU, MULTI_XPU, ...), not MULTI_CPU
            logger.warning(
                "lowprec: TrainingArguments(fsdp=...) asked for FSDP but the model is not sharded: "
                "Accelerate turns FSDP on only on GPUs/accelerators, so on CPU Trainer runs DDP (FP8 "
                "layers run under DDP); for FSDP2 on CPU run Trainer on lowprec's Accelerator "
                "(lowprec.integrations.trainer_accelerator.LowprecAcceleratorMixin)"
            )
        if self.guard_mode != "off" and self.health is None:
            self.health = HealthMonitor(model, self.guard_mode, *self._health_args)
        if state.global_step > 0:
            self._restore(model, args, state)
        n = self.counts.attach(model)
        logger.info(
            "lowprec: %d FP8 layer(s) under Trainer; FP8 on wherever they run in training mode, off inside "
            "lowprec.fp8.autocast(enabled=False)",
            n,
        )

    def on_save(self, args, state, control, **kwargs):
        """Every process writes its FP8 scaling state into the checkpoint Trainer just saved
        (``save_pretrained`` left it out)."""
        if self.model is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if self.health is not None and args.process_index == 0:  # the same on every rank
            os.makedirs(folder, exist_ok=True)
            _write_json(os.path.join(folder, GUARD_FILE), self.health.state_dict())
        sd = self.model.state_dict()
        keys = fp8_state_keys(self.model)
        if not keys:
            return  # a recipe with no state (tensorwise, rowwise, ...): nothing to resume
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, FP8_STATE_FILE.format(rank=args.process_index))
        tmp = f"{path}.tmp-{temp_suffix()}"
        save_object({k: sd[k].detach().cpu() for k in sorted(keys)}, tmp, "FP8 scaling state")  # safetensors: no pickle
        fsync_file(tmp)
        os.replace(tmp, path)  # never a half-written file under the final name
        fsync_dir(folder)

    def _restore(self, model: nn.Module, args, state) -> None:
        """A resumed run (``global_step`` > 0 at ``on_train_begin``) takes back the FP8 scaling state
        its checkpoint holds: from ``args.resume_from_checkpoint`` when that names a directory,
        else from ``<output_dir>/checkpoint-<step>`` (``resume_from_checkpoint=True``'s choice)."""
        folders = [
            f
            for f in (
                args.resume_from_checkpoint if isinstance(args.resume_from_checkpoint, str) else None,
                os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"),
            )
            if f
        ]
        self._restore_guard(model, folders)
        keys = fp8_state_keys(model)
        if not keys:
            return
        name = FP8_STATE_FILE.format(rank=args.process_index)
        path = next((os.path.join(f, name) for f in folders if os.path.isfile(os.path.join(f, name))), None)
        if path is None:
            logger.warning(
                "lowprec: resuming at step %d without FP8 scaling state (no %s in %s): the delayed "
                "amax histories start afresh and refill within amax_history_len steps, so the losses "
                "differ from an uninterrupted run's",
                state.global_step,
                name,
                " or ".join(folders),
            )
            return
        saved = load_object(path)  # one line naming the file if it is damaged; nothing unpickled
        found = set(saved) if isinstance(saved, dict) else set()
        if found != keys:
            raise ValueError(
                f"{path} holds FP8 scaling state for {len(found)} key(s), this model has {len(keys)} (first "
                f"difference: {sorted(found ^ keys)[0]}): resume with the recipe and layers the checkpoint "
                "was trained with"
            )
        model.load_state_dict(saved, strict=False)
        logger.info("lowprec: FP8 scaling state of step %d restored from %s", state.global_step, path)

    def _restore_guard(self, model: nn.Module, folders: list[str]) -> None:
        """The guard's moves, streaks and episodes from the checkpoint; a checkpoint's moves are
        re-applied even with the guard off now (the layers were trained in bf16 from then on)."""
        path = next((os.path.join(f, GUARD_FILE) for f in folders if os.path.isfile(os.path.join(f, GUARD_FILE))), None)
        if path is None:
            return
        with open(path) as f:
            saved = json.load(f)
        if self.health is None:
            Guard(model, mode="act").restore(saved.get("moved", []))
            return
        self.health.load_state_dict(saved)
        moved = len(self.health.moved_layers())
        logger.info("lowprec: fp8_guard state restored from %s (%d layer(s) moved)", path, moved)

    def _logs_next_step(self, args, state) -> bool:
        strategy = getattr(args, "logging_strategy", "steps")
        every = getattr(state, "logging_steps", None) or args.logging_steps  # state's: a ratio resolved
        return (
            getattr(strategy, "value", strategy) == "steps"
            and bool(every)
            and (state.global_step + 1) % int(every) == 0
        )

    def on_step_begin(self, args, state, control, **kwargs):
        if self.telemetry and self.model is not None and self._logs_next_step(args, state):
            fp8.enable_telemetry(self.model)
            if self.health is not None:  # the guard's readings: input max-to-rms, sampled SQNR
                self.health.arm(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if self.telemetry and self.model is not None:
            fp8.disable_telemetry(self.model)  # the statistics of this step stay in the buffers

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self.model is None:  # training logs only
            return
        extra: dict[str, float] = {"fp8_linear_calls": self.counts.fp8, "hp_linear_calls": self.counts.hp}
        if self.counts.hp and not self.counts.fp8 and not self._warned:
            self._warned = True
            logger.warning(
                "lowprec: the converted layers ran %d call(s) in high precision and none in FP8 since the "
                "last log (inside lowprec.fp8.autocast(enabled=False)?)",
                self.counts.hp,
            )
        if self.telemetry:
            self.last_worst = _worst_over_ranks(_worst(self.model), args.device)
            extra.update(self.last_worst)
        if self.health is not None:
            self.health.check(state.global_step, fp8.telemetry(self.model))  # collective under several processes
            extra["fp8_guard_moved_layers"] = len(self.health.moved_layers())  # in bf16 now
        self.counts.fp8 = self.counts.hp = 0
        logs.update(extra)
        # Trainer stored a copy before calling the callbacks: keep the history complete too
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)


class _FP8AllReduceKwargs(DistributedDataParallelKwargs):
    """Accelerate's DDP kwargs, Trainer's values kept, whose ``register_comm_hook`` (Accelerate
    calls it on the DDP model it creates in ``prepare``) registers lowprec's FP8 all-reduce."""

    grad_dtype: torch.dtype = torch.float8_e4m3fn  # a class attribute, not a field: no DDP kwarg

    def register_comm_hook(self, model):
        model.lowprec_fp8_allreduce = register_fp8_allreduce(model, fp8_dtype=self.grad_dtype)
        logger.info("lowprec: O1 under Trainer's DDP: gradient buckets all-reduced in %s", self.grad_dtype)


def apply_opt_level(
    trainer, opt_level: str, *, grad_dtype: torch.dtype = torch.float8_e4m3fn, **fp8_adamw_kwargs
) -> None:
    """MS-AMP style ``"O1"`` / ``"O2"`` (:func:`lowprec.optim.apply_opt_level`) for a built
    ``transformers.Trainer`` (or TRL trainer); call it before ``trainer.train()``.

    O2 builds Trainer's own optimizer now (``trainer.create_optimizer()``: its ``optim``, param
    groups and weight-decay rules; ``adamw_torch`` and ``adam`` kinds) and rebuilds it as
    :class:`lowprec.optim.FP8AdamW` (FP8 first moment, FP16 second moment); Trainer keeps it and
    builds its scheduler on it. O1 (and O2's gradients): under DDP the gradient all-reduce is FP8
    (a hook registered when Accelerate creates the DDP model); on one process ``.grad`` is
    rounded through FP8 in place, not held as an FP8 payload, because Trainer clips ``.grad``
    before the optimizer step. Trainer's FSDP and DeepSpeed are refused: they create the
    optimizer after sharding, which this helper cannot reach."""
    level = str(opt_level).upper()
    if level not in OPT_LEVELS:
        raise ValueError(f"apply_opt_level: opt_level={opt_level!r} is not supported; use 'O1' or 'O2'")
    if fp8_adamw_kwargs and level != "O2":
        raise ValueError(f"apply_opt_level: {sorted(fp8_adamw_kwargs)} configure FP8AdamW and only apply to 'O2'")
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError(
            "apply_opt_level: Trainer's FSDP/DeepSpeed create the optimizer after sharding the model, "
            "which this helper cannot reach; use O1/O2 with DDP or one process, or lowprec.Accelerator"
        )
    if getattr(trainer.model, "lowprec_opt_level", None) is not None:
        raise ValueError(f"apply_opt_level: the model already runs {trainer.model.lowprec_opt_level}; call it once")
    if trainer.optimizer is None:
        trainer.create_optimizer()
    if level == "O2":
        check_o2_optimizer(
            trainer.optimizer,
            "apply_opt_level(trainer, 'O2')",
            "TrainingArguments(optim='adamw_torch'), or 'O1' (FP8 gradients, any optimizer)",
        )
        trainer.optimizer = to_fp8_adamw(trainer.optimizer, **fp8_adamw_kwargs)
    if trainer.args.world_size > 1:
        old = trainer.accelerator.ddp_handler or DistributedDataParallelKwargs()
        if type(old) is not DistributedDataParallelKwargs or old.comm_hook.value != "no":
            raise ValueError(
                f"apply_opt_level: Trainer's DDP already has a communication hook ({old.comm_hook}); "
                "O1 registers its own FP8 all-reduce: drop the other hook"
            )
        # the dtype on a subclass, not the instance: Accelerate turns instance attributes into DDP kwargs
        kind = type("_FP8AllReduceKwargs", (_FP8AllReduceKwargs,), {"grad_dtype": grad_dtype})
        handler = kind(**{f.name: getattr(old, f.name) for f in dataclasses.fields(old)})
        trainer.accelerator.ddp_handler = handler
    else:
        trainer.model.lowprec_fp8_grads = hold_grads_in_fp8(trainer.model.parameters(), grad_dtype, hold=False)
    trainer.model.lowprec_opt_level = level
    logger.info(
        "lowprec: %s under Trainer: optimizer %s, FP8 (%s) gradients via %s",
        level,
        type(trainer.optimizer).__name__,
        grad_dtype,
        "DDP all-reduce" if trainer.args.world_size > 1 else "in-place rounding of .grad",
    )


def fp8_counts(trainer) -> dict[str, Any]:
    """What ran in low precision since ``trainer.train()`` began on this process: Linear calls in
    FP8 (three FP8 GEMMs each: forward, input and weight gradients) and in high precision (from
    its :class:`FP8Callback`), gradient all-reduces in FP8 (O1/O2 under DDP, else absent) and the
    last log's telemetry (worst saturated / underflow fraction over every rank; absent before one).
    Under several processes each value is the list of every rank's, and the call is collective:
    make it on every rank."""
    cb = next((c for c in trainer.callback_handler.callbacks if isinstance(c, FP8Callback)), None)
    if cb is None:
        raise ValueError("fp8_counts: the trainer has no FP8Callback (pass callbacks=[FP8Callback()])")
    counts: dict[str, Any] = {
        "fp8_linear_calls": cb.counts.total_fp8,
        "hp_linear_calls": cb.counts.total_hp,
        **cb.last_worst,
    }
    allreduce = getattr(trainer.model_wrapped, "lowprec_fp8_allreduce", None)
    if allreduce is not None:
        counts["fp8_allreduce_calls"] = allreduce.calls
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return counts
    ranks: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, counts)
    return {k: [r.get(k) for r in ranks] for k in counts}
