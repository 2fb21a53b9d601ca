"""What may change when a run resumes from a checkpoint, and what may not.

Every checkpoint of ``lowprec train`` records the settings it was trained with (in its
:class:`~lowprec.train.checkpoints.TrainerState`). On resume they are compared with this run's,
key by key, by the table :data:`RULES`:

* ``refuse``: the checkpoint means nothing under the new value (weights of another shape,
  optimizer state of another algorithm, FP8 scaling state of another recipe, a data position in
  other batches). One line names each key with its saved and new value and the fix (the CLI's
  exit 2), before anything is loaded.
* ``apply``: a legitimate change of course (a lower learning rate after a spike, a longer run, a
  larger effective batch). The run continues with the new value, one log line per key
  ("changed X from A to B on resume"). Without this the checkpoint would silently win for the
  values it stores itself (the optimizer's groups keep the old learning rate, weight decay and
  betas), so :func:`apply_changes` writes the new ones into the restored optimizer and schedule.

* ``note``: what the run computes on, not what it means (the torch version, the CPU FP8 GEMM
  kernel). Continuing is right, but the resumed run will not match the uninterrupted one bit for
  bit: one log line per key says so, so that a difference in a comparison is not a mystery.

Keys in none of the lists (logging, evaluation, checkpointing, output) change freely. The mixed
precision and FP8 backend are also checked by ``Accelerator.load_state`` itself.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import torch
from lowprec.checkpoint.serialization import deepspeed_mismatch, load_object, saved_zero_stage, zero_stage_mismatch
from lowprec.checkpoint.state import checkpoint_meta
from lowprec.config.json_file import read_json_object
from lowprec.fp8.gemm.cpu import cpu_gemm_choice
from lowprec.kwargs import DeepSpeedPlugin
from lowprec.train.data import position_on

__all__ = ["RULES", "settings_of", "saved_settings", "check_resume", "check_process_count", "apply_changes"]

logger = logging.getLogger("lowprec")

REFUSE, APPLY, NOTE = "refuse", "apply", "note"
# key -> (decision, why); the why of a refused key is the reason printed; of an applied key, what
# happens from the next step
RULES: dict[str, tuple[str, str]] = {
    "base_model": (REFUSE, "the weights are that model's"),
    "model": (REFUSE, "the weights have that shape"),
    "adapter": (REFUSE, "the adapter weights belong to that adapter"),
    "lora_r": (REFUSE, "the adapter weights have that rank"),
    "lora_alpha": (REFUSE, "the adapter was trained under that scaling"),
    "lora_target_modules": (REFUSE, "the adapter weights sit in those layers"),
    "lora_target_linear": (REFUSE, "the adapter weights sit in those layers"),
    "lora_modules_to_save": (REFUSE, "those layers' trained copies are part of the weights"),
    "precision": (REFUSE, "its weights, optimizer and scaling state are kept in that precision (keys fp16/bf16/fp8)"),
    "fp8_recipe": (REFUSE, "its FP8 scaling state (scales, amax histories) belongs to that recipe"),
    "fp8_filter": (REFUSE, "the layers that hold FP8 scaling state are those it selects"),
    "optimizer": (REFUSE, "its optimizer state (moments, momentum) belongs to that algorithm"),
    "datasets": (REFUSE, "its data position is a place in that corpus"),
    "micro_batch_size": (REFUSE, "its data position counts batches of that size"),
    "sequence_len": (REFUSE, "its data position counts sequences of that length"),
    "seed": (REFUSE, "its data position is a place in the order that seed shuffles"),
    # what the example stream is made of: another value makes other examples (or other tokens)
    "val_set_size": (REFUSE, "its data position is a place among the examples that split leaves for training"),
    "dataset_max_bytes": (REFUSE, "its data position is a place in the corpus that cap reads"),
    "sample_packing": (REFUSE, "its data position counts batches packed (or not) that way"),
    "pad_to_sequence_len": (REFUSE, "its data position counts batches padded (or not) that way"),
    "chat_template": (REFUSE, "its examples are the conversations rendered with that template"),
    "chat_template_jinja": (REFUSE, "its examples are the conversations rendered with that template"),
    "train_on_inputs": (REFUSE, "its examples are those with a token to learn under that mask"),
    "special_tokens": (REFUSE, "the tokenizer and the embeddings trained with those tokens"),
    "tokens": (REFUSE, "the tokenizer and the embeddings trained with those tokens"),
    "eot_tokens": (REFUSE, "its examples' loss masks end turns at those tokens"),
    # applied: the weights, optimizer state and data position stay meaningful
    "learning_rate": (APPLY, "the schedule continues at this step with the new peak rate"),
    "weight_decay": (APPLY, "the optimizer uses it from the next step"),
    "adam_beta1": (APPLY, "the optimizer uses it from the next step"),
    "adam_beta2": (APPLY, "the optimizer uses it from the next step"),
    "total_steps": (APPLY, "max_steps or num_epochs: the schedule decays over the new total"),
    "warmup_steps": (APPLY, "the schedule is recomputed with it"),
    "lr_scheduler": (APPLY, "the schedule is recomputed with it"),
    # the data position counts micro-batches, so no sample is skipped or repeated; only the
    # effective batch (and tokens per step) changes from the next step, as in a batch-size ramp
    "gradient_accumulation_steps": (APPLY, "each optimizer step takes that many micro-batches from the next step"),
    "max_grad_norm": (APPLY, "gradients are clipped to it from the next step"),
    # noted: the same run on other arithmetic
    "torch": (NOTE, "torch's kernels may round differently"),
    "bf16": (NOTE, "the layers outside FP8 compute in another dtype"),
    "cpu_fp8_gemm": (NOTE, "the two CPU FP8 GEMM kernels sum in different orders (LOWPREC_CPU_FP8_GEMM chooses one)"),
}
_LORA = ("adapter", "lora_r", "lora_alpha", "lora_target_modules", "lora_target_linear", "lora_modules_to_save")
# a changed key on the left changes those on the right with it
_FOLLOWS = {"base_model": ("model",), "precision": ("fp8_recipe", "fp8_filter")}
_SCHEDULE = ("learning_rate", "total_steps", "warmup_steps", "lr_scheduler")


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def settings_of(cfg: Any, plan: Any, model_config: Optional[dict], total: int, warmup: int) -> dict[str, Any]:
    """This run's values of every key in :data:`RULES` (JSON data, as a checkpoint stores it)."""
    y = cfg.to_yaml_dict()
    shape = {k: v for k, v in (model_config or {}).items() if isinstance(v, int) and not isinstance(v, bool)}
    fp8 = plan.mixed_precision == "fp8"
    recipe = y.get("fp8_recipe")
    if isinstance(recipe, dict) and set(recipe) == {"name"}:  # shown as the user wrote it
        recipe = recipe["name"]
    out = {
        "base_model": cfg.base_model,
        "model": shape,
        **{k: y.get(k) for k in _LORA},
        "precision": plan.label,
        "fp8_recipe": recipe if fp8 else None,
        "fp8_filter": list(cfg.fp8_filter) if fp8 else None,
        "total_steps": total,
        "warmup_steps": warmup,
        "torch": torch.__version__,
        "cpu_fp8_gemm": _cpu_fp8_gemm(plan) if fp8 else None,
    }
    # every other key is the config's value, as the user wrote it
    out.update({key: y.get(key) for key in RULES if key not in out})
    return _plain(out)


def _cpu_fp8_gemm(plan: Any) -> Optional[str]:
    """The kernel FP8 GEMMs run on when this run trains on CPU (None on a GPU)."""
    device = getattr(plan.decisions.get("device"), "value", None)
    if device != "cpu":
        return None

    return cpu_gemm_choice().path


def saved_settings(checkpoint: str, index: int) -> Optional[dict[str, Any]]:
    """The settings a checkpoint recorded (``custom_checkpoint_<index>``, the TrainerState), or
    None for a checkpoint of an earlier version (or one whose file is missing: load_state says)."""

    path = os.path.join(checkpoint, f"custom_checkpoint_{index}.safetensors")
    if not os.path.isfile(path):
        return None
    state = load_object(path)  # no pickle; a damaged file is one line naming it
    settings = state.get("settings") if isinstance(state, dict) else None
    return settings if isinstance(settings, dict) and settings else None


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(", ", ": "))


def _model_diff(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in keys[:3])


def check_resume(saved: Optional[dict[str, Any]], now: dict[str, Any], checkpoint: str) -> dict[str, tuple]:
    """Refuse (``ValueError``, one line) when a ``refuse`` key differs; else the ``apply`` keys
    that differ, ``{key: (saved, now)}``."""
    if saved is None:
        logger.warning(
            "lowprec: %s records no training settings (an earlier lowprec version): resuming without "
            "checking that optimizer, FP8 recipe and data settings match",
            checkpoint,
        )
        return {}
    changed: dict[str, tuple[Any, Any]] = {
        k: (saved[k], now.get(k)) for k in RULES if k in saved and saved[k] != now.get(k)
    }
    notes = {k: changed.pop(k) for k in [k for k in changed if RULES[k][0] == NOTE]}
    for cause, consequences in _FOLLOWS.items():  # named once, by the key the user changed
        if cause in changed:
            for k in consequences:
                changed.pop(k, None)
    refused = [k for k in changed if RULES[k][0] == REFUSE]
    if refused:

        def one(k: str) -> str:
            old, new = changed[k]
            if k == "model":
                return f"model shape ({_model_diff(old, new)})"
            return f"{k}: {_show(old)} (now {_show(new)})"

        first = refused[0]
        raise ValueError(
            f"resume_from_checkpoint: {checkpoint} was trained with {'; '.join(one(k) for k in refused)}, and "
            f"{RULES[first][1]}: set {'it' if len(refused) == 1 else 'them'} back to continue that run, or start a "
            "fresh one (drop resume_from_checkpoint, or choose another output_dir)"
        )
    for k, (old, new) in notes.items():
        logger.warning(
            "lowprec: resuming with %s %s, the checkpoint was written with %s: the run continues, but not "
            "bit for bit as the uninterrupted one (%s)",
            k,
            _show(new),
            _show(old),
            RULES[k][1],
        )
    return changed


def apply_changes(run: Any, changes: dict[str, tuple], main: bool) -> None:
    """Put the ``apply`` changes into the restored optimizer, schedule and accelerator (which
    load_state set to the checkpoint's values), one log line each."""
    cfg, acc = run.cfg, run.acc
    groups = run.optimizer.param_groups
    if "weight_decay" in changes:
        groups[0]["weight_decay"] = cfg.weight_decay  # group 0 holds the matrices (build_optimizer)
    if {"adam_beta1", "adam_beta2"} & set(changes):
        for g in groups:
            if "betas" in g:
                g["betas"] = (cfg.adam_beta1, cfg.adam_beta2)
    if "gradient_accumulation_steps" in changes:
        # the accumulation counter restarts on an optimizer-step boundary of the new size
        acc.step = run.state.step * cfg.gradient_accumulation_steps
    if set(_SCHEDULE) & set(changes):
        sched = getattr(run.scheduler, "scheduler", run.scheduler)  # the prepared scheduler's own
        if "learning_rate" in changes:
            sched.base_lrs = [cfg.learning_rate for _ in groups]
            for g in groups:
                g["initial_lr"] = cfg.learning_rate
        # the rate of the next step under the new schedule, as LambdaLR computes it
        for g, base, fn in zip(groups, sched.base_lrs, sched.lr_lambdas):
            g["lr"] = base * fn(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in groups]
    if main:
        for key, (old, new) in changes.items():
            logger.warning(
                "lowprec: changed %s from %s to %s on resume (%s)", key, _show(old), _show(new), RULES[key][1]
            )


def check_process_count(checkpoint: str, processes: int, cfg: Any) -> Optional[str]:
    """A checkpoint resumed on another process count (``processes``; the data is split over
    ``processes / tensor_parallel_size``): None on the same count; else the line saying what
    changes (logged by the run), or a ValueError when the saved data position falls inside one
    of this run's batches (:func:`lowprec.train.data.position_on`). Called before any worker
    starts, so that the error is the CLI's one line."""
    meta = checkpoint_meta(checkpoint)
    saved_procs = meta.get("num_processes", processes)
    under_ds = any(name.startswith("deepspeed_") for name in os.listdir(checkpoint))
    stage = saved_zero_stage(checkpoint, 0, meta) if under_ds else None
    if under_ds != (cfg.deepspeed is not None):
        raise ValueError(
            deepspeed_mismatch(checkpoint, under_ds, "resume_from_checkpoint: ", "deepspeed", saved_procs, stage)
        )
    wrong = under_ds and zero_stage_mismatch(
        checkpoint, stage, _zero_stage(cfg.deepspeed), "resume_from_checkpoint: ", "deepspeed"
    )
    if wrong:
        raise ValueError(wrong)
    if saved_procs == processes:
        return None
    if under_ds:
        raise ValueError(
            f"resume_from_checkpoint: {checkpoint} was saved by {saved_procs} processes under DeepSpeed, whose "
            f"partitioned files load on that count only: resume with --num_processes {saved_procs}"
        )
    world = processes // max(1, cfg.tensor_parallel_size)
    loader, settings = None, {}
    for name in sorted(os.listdir(checkpoint)):
        if name.startswith("custom_checkpoint_") and name.endswith(".safetensors"):
            state = load_object(os.path.join(checkpoint, name))
            if isinstance(state, dict) and {"position", "world_size", "batch_size"} <= set(state):
                loader = state
            elif isinstance(state, dict) and isinstance(state.get("settings"), dict):
                settings = state["settings"]
    if loader is not None:
        try:
            position_on(loader, world)
        except ValueError as exc:
            raise ValueError(f"resume_from_checkpoint: {checkpoint}: {exc}") from None
    before = (loader or {}).get("world_size", saved_procs) * settings.get("micro_batch_size", cfg.micro_batch_size)
    before *= settings.get("gradient_accumulation_steps", cfg.gradient_accumulation_steps)
    now = world * cfg.micro_batch_size * cfg.gradient_accumulation_steps
    keep = before // (world * cfg.micro_batch_size) if before % (world * cfg.micro_batch_size) == 0 else None
    return (
        f"lowprec: resuming {checkpoint} (saved by {saved_procs} processes) on {processes}: the whole saved model, "
        "optimizer and FP8 scaling state load (under ep_size each process takes its experts' share), the data "
        "continues at the same sequence; "
        f"an optimizer step takes {now} sequences (it took {before})"
        + ("" if now == before or keep is None else f": gradient_accumulation_steps {keep} keeps {before}")
    )


def _zero_stage(deepspeed: Any) -> Any:
    """The ZeRO stage a ``deepspeed:`` setting (a JSON file or a mapping) runs: its
    ``zero_optimization.stage``, else the plugin's (``ACCELERATE_DEEPSPEED_ZERO_STAGE``, 2);
    not a number ("auto"): left to DeepSpeed."""
    body = read_json_object(deepspeed) if isinstance(deepspeed, str) else deepspeed
    stage = (body.get("zero_optimization") or {}).get("stage")
    return DeepSpeedPlugin(hf_ds_config={}).zero_stage if stage is None else stage
