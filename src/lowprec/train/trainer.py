"""The training loop of ``lowprec train``: a client of :class:`lowprec.Accelerator` like any script.

    plan = resolve(config)                       # every auto decided once, reasons logged
    accelerator = Accelerator(mixed_precision=plan.mixed_precision, kwargs_handlers=[recipe])
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for step:  for micro-batch:  with accelerator.accumulate(model): loss -> accelerator.backward
               clip, optimizer.step, scheduler.step, zero_grad
               log / evaluate / checkpoint (accelerator.save_state)
    export model.safetensors (bf16, plain model), plots, resolved config

The data loader is the model helper's :class:`TokenBatches` (deterministic block order per
epoch, sharded by rank); it and a :class:`TrainerState` are registered for checkpointing, so
``accelerator.save_state`` stores the data position and the step next to the weights,
optimizer, scheduler, FP8 scaling state and RNG, and a resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, cast

import torch
from torch import nn

from lowprec.backends.spec import trainer_backends
from lowprec.durable import os_error_of
from lowprec.checkpoint.state import clean_interrupted_saves
from lowprec.errors import CheckpointError, NonFiniteError, StorageError
from lowprec.export import export_after_training
from lowprec.export.fp8_base import check_trainer_fp8_base, is_fp8_base, load_fp8_base
from lowprec.export.fp8_merge import merge_lora_fp8_base
from lowprec.train import checkpoints as ckpt
from lowprec.train.config import TrainConfig
from lowprec.train.config.fp8 import FP8RecipeSpec
from lowprec.train.health import attach_health
from lowprec.train.metrics import MetricsWriter, peak_memory_mb, read_metrics, truncate_after
from lowprec.train.outputs import write_conversion_report
from lowprec.train.run_lock import hold_output_dir, make_output_dir
from lowprec.train.loop import Run, run_loop
from lowprec.train.resolve import Capabilities, Decision, RunPlan, resolve, total_steps
from lowprec import Accelerator, __version__
from lowprec.fp8 import DEFAULT_SKIP_PATTERNS, Float8BaseLinear, has_fp8_layers
from lowprec.fp8.modules.autocast import replay_context
from lowprec.kwargs import (
    AutocastKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    NativeRecipeKwargs,
)
from lowprec.kwargs import DeepSpeedPlugin
from lowprec.parallelism_config import ParallelismConfig
from lowprec.train.adapters import LoraSettings, apply_lora, check_new_tokens
from lowprec.train.data_setup import run_data
from lowprec.train.generations import EvalTable
from lowprec.train.hf_files import locate_pretrained
from lowprec.train.hf_model import export_pretrained, load_causal_lm, quiet_hf_libraries, set_chat_template
from lowprec.train.model import LlamaConfig, LlamaForCausalLM
from lowprec.train.outputs import export_model, write_resolved_config
from lowprec.train.packing import packed_causal_mask
from lowprec.train.plots import plot_fp8_report, plot_loss
from lowprec.train.resume_check import apply_changes, check_process_count, check_resume, saved_settings, settings_of
from lowprec.utils.dataclasses import DataLoaderConfiguration

__all__ = ["train", "RunResult", "Interrupted", "build_optimizer", "build_scheduler", "lr_lambda"]

logger = logging.getLogger("lowprec")


@dataclass
class RunResult:
    output_dir: str
    precision: str
    steps: int
    final_train_loss: Optional[float]
    final_eval_loss: Optional[float]
    tokens_per_s: float
    peak_mem_mb: float
    wall_s: float
    train_losses: list = field(default_factory=list)  # (step, loss) per logging window
    eval_losses: list = field(default_factory=list)  # (step, loss)
    files: dict = field(default_factory=dict)
    # fp8: true where no layer converted (the run trained in high precision; warned at convert)
    fp8_nothing_converted: bool = False


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training, after the run's summary was written; the message says where."""


# ------------------------------------------------------------------------ pieces
def lr_lambda(step: int, warmup: int, total: int, kind: str) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based): linear warmup
    from 1/(warmup+1), then cosine or linear decay to 0 at ``total``, or constant."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms, biases), or SGD."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.learning_rate, momentum=0.9)
    fused = cfg.optimizer == "adamw_torch_fused"
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), fused=fused or None)


def scheduler_warmup(cfg: TrainConfig, total_steps: int, warmup: Optional[int] = None) -> int:
    """The warmup the schedule uses: clamped below the run's steps (and said so) in train()."""
    return min(cfg.warmup_steps if warmup is None else warmup, max(0, total_steps - 1))


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int, warmup: Optional[int] = None):
    warmup = scheduler_warmup(cfg, total_steps, warmup)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, warmup, total_steps, cfg.lr_scheduler))


def _build_model(
    cfg: TrainConfig, vocab_size: int, new_tokens: Optional[dict] = None
) -> tuple[nn.Module, dict[str, Any]]:
    if cfg.base_model.startswith("builtin:"):
        mc = LlamaConfig.from_name(cfg.base_model[len("builtin:") :])
        if vocab_size > mc.vocab_size:
            mc = mc.replace(vocab_size=vocab_size)
        return LlamaForCausalLM(mc), mc.to_dict()

    path = locate_pretrained(cfg.base_model)
    # an hf-fp8 directory: its FP8 layers load frozen, in FP8, for LoRA
    if cfg.merge_lora_format == "fp8" and not is_fp8_base(path):
        raise ValueError(
            f"merge_lora_format: fp8 writes the merge in an FP8 base_model's own format, and {cfg.base_model} is not "
            "an FP8 checkpoint; drop merge_lora_format (bf16 merge) and export the run to FP8 with export: [hf-fp8]"
        )
    model: Any  # a transformers PreTrainedModel (duck-typed: get_input_embeddings, resize_token_embeddings, config)
    if is_fp8_base(path):
        sharded = (
            cfg.fsdp_version is not None or cfg.deepspeed is not None or cfg.tensor_parallel_size > 1 or cfg.ep_size > 1
        )
        check_trainer_fp8_base(path, cfg.adapter, sharded)
        try:
            model = load_fp8_base(path)
        except ValueError as exc:  # the directory's scheme or files: name the key it came from
            raise ValueError(f"base_model: {exc}") from None
    else:
        model = load_causal_lm(path, cfg.model_type, cfg.trust_remote_code, bool(cfg.load_in_4bit))
    if vocab_size > model.get_input_embeddings().num_embeddings:
        logger.info(
            "lowprec: resizing the token embeddings from %d to %d (the tokenizer's size, padded to 16)",
            model.get_input_embeddings().num_embeddings,
            vocab_size,
        )
        model.resize_token_embeddings(vocab_size)
    if cfg.adapter is not None:
        lora = LoraSettings.from_config(cfg)
        check_new_tokens(model, lora, new_tokens or {})
        model = apply_lora(model, lora)
    return _HFLoss(model), model.config.to_dict()


class _HFLoss(nn.Module):
    """A Hugging Face causal LM behind the built-in model's ``forward(input_ids, labels)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model: Any = model  # a transformers PreTrainedModel or peft PeftModel (duck-typed)

    def forward(self, input_ids, labels=None, attention_mask=None, position_ids=None):
        if position_ids is not None and attention_mask is None:
            # packed rows: transformers' SDPA path does not infer example boundaries from
            # position_ids (5.x; measured on logits in tests/test_train_datasets.py), so pass the
            # block-diagonal causal mask, a 4-D mask it uses as given

            attention_mask = packed_causal_mask(position_ids)
        return self.model(input_ids=input_ids, labels=labels, attention_mask=attention_mask, position_ids=position_ids)


def _accelerator(cfg: TrainConfig, plan: RunPlan):
    handlers: list = []
    recipe = cast(FP8RecipeSpec, cfg.fp8_recipe)  # the field's validator turns a recipe name into a spec
    library = trainer_backends().get(cfg.fp8_backend) if cfg.fp8 else None
    if library is not None:  # e.g. torchao; recipe / filter limits checked in the schema
        # trainer_backends() lists the backends with trainer_recipes, which all have a trainer_handler
        handlers.append(cast(Callable[[str], Any], library.trainer_handler)(recipe.name))
    elif cfg.fp8:
        handlers.append(
            NativeRecipeKwargs(
                recipe=recipe.name,
                overrides=recipe.overrides,
                skip_patterns=tuple(DEFAULT_SKIP_PATTERNS) + tuple(cfg.fp8_filter),
                # the trainer always keeps the first and last Linear in high precision (no key)
                nothing_converted_hint="lowprec train keeps the first and last Linear in high precision; ",
                enable_fsdp_float8_all_gather=cfg.fp8_enable_fsdp_float8_all_gather,
                force_recompute_fp8_weight_in_bwd=None
                if cfg.fp8_force_recompute_fp8_weight_in_bwd == "auto"
                else cfg.fp8_force_recompute_fp8_weight_in_bwd,
            )
        )
        if not plan.bf16_autocast:
            handlers.append(AutocastKwargs(enabled=False))
    fsdp = None
    if cfg.fsdp_version == 2:
        fc = cfg.fsdp_config
        fsdp = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            transformer_cls_names_to_wrap=(fc.transformer_layer_cls_to_wrap if fc else "LlamaDecoderLayer",),
            reshard_after_forward=fc.reshard_after_forward if fc else True,
            state_dict_type=fc.state_dict_type if fc else "FULL_STATE_DICT",
        )
    deepspeed = None
    if cfg.deepspeed is not None:  # a JSON file path or an inline mapping, as in Axolotl
        deepspeed = DeepSpeedPlugin(hf_ds_config=cfg.deepspeed, gradient_clipping=cfg.max_grad_norm)

    return Accelerator(
        # tensor parallelism over tensor_parallel_size processes, FSDP2 (fsdp_version: 2) over the rest
        # expert parallelism (ep_size) over every process, DDP over the rest
        parallelism_config=ParallelismConfig(
            tp_size=cfg.tensor_parallel_size,
            sequence_parallel=cfg.sequence_parallel,
            ep_size=cfg.ep_size,
            ep_combine=cfg.ep_combine,
        )
        if cfg.tensor_parallel_size > 1 or cfg.ep_size > 1
        else None,
        mixed_precision=plan.mixed_precision,
        kwargs_handlers=handlers,
        fsdp_plugin=fsdp,
        deepspeed_plugin=deepspeed,
        # explicit, so an ambient ACCELERATE_GRADIENT_ACCUMULATION_STEPS cannot change the run
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.gradient_accumulation_steps),
        fp8_fallback=cfg.fp8_fallback,
        fp8_hardware=plan.fp8_hardware,  # the sm_89 rule, evaluated once, by resolve()
        skip_nonfinite_steps=cfg.skip_nonfinite_steps,
        max_consecutive_skipped_steps=cfg.max_consecutive_skipped_steps,
        # the schedule counts optimizer steps and the loader is not prepared: step the scheduler
        # once per optimizer step (Accelerate's split_batches rule), not once per process
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )


class _RankZeroOnly(logging.Filter):
    """Under ``launch`` every rank runs the same setup: only rank 0 tells the user about it
    (errors still come from every rank)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_RANK_ZERO_LOGGERS = ("lowprec", "lowprec.fp8")


def _quiet_other_ranks() -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        for log in map(logging.getLogger, _RANK_ZERO_LOGGERS):
            if not any(isinstance(f, _RankZeroOnly) for f in log.filters):
                log.addFilter(_RankZeroOnly())


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _write_interrupted(output_dir: str, state: ckpt.TrainerState, main: bool, last: Optional[str]) -> str:
    """``summary.json`` of an interrupted run (written even before the first log line)."""
    import json

    path = os.path.join(output_dir, "summary.json")
    if main:
        with open(path, "w") as f:
            json.dump(
                {
                    "interrupted": True,
                    "steps": state.step,
                    "tokens": state.tokens,
                    "last_checkpoint": last,
                    "output_dir": output_dir,
                },
                f,
                indent=1,
            )
    return path


# ------------------------------------------------------------------------ the loop
def train(
    cfg: TrainConfig,
    caps: Optional[Capabilities] = None,
    *,
    on_log: Optional[Callable[[dict], None]] = None,
) -> RunResult:
    """One training run: set up, resume, the loop (``loop.py``), outputs."""
    wall0 = time.perf_counter()
    _quiet_other_ranks()
    plan = resolve(cfg, caps, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    output_dir = os.path.abspath(cfg.output_dir)
    lock: Any = contextlib.nullcontext()
    if int(os.environ.get("RANK", "0")) == 0:  # before any log line: a bad path is a one-line error
        make_output_dir(output_dir)
        # one run per output_dir, taken before the process group exists (run_lock.py: who holds it)
        lock = hold_output_dir(output_dir)
    with lock, quiet_hf_libraries(cfg.progress_bar, cfg.base_model):
        return _train(cfg, plan, output_dir, on_log, wall0)


def _train(
    cfg: TrainConfig, plan: RunPlan, output_dir: str, on_log: Optional[Callable[[dict], None]], wall0: float
) -> RunResult:
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    if cfg.tf32 != "auto" and torch.cuda.is_available():  # TF32 is an NVIDIA matmul mode; CPUs have none
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(cfg.tf32)
    acc = _accelerator(cfg, plan)
    main = acc.is_main_process
    decisions = dict(plan.decisions)
    if main:
        plan.log(skip=set(getattr(acc.state, "decisions", {})))  # the accelerator logged those
        for note in cfg.notes:  # keys the rest of the config makes inert (config/inert.py)
            logger.warning("lowprec: note: %s", note)
    acc.wait_for_everyone()
    tokenizer, loader, val_loader = run_data(cfg, acc)
    set_chat_template(cfg, tokenizer)  # saved with the model, as Axolotl does
    total = total_steps(cfg, len(loader), decisions, main)
    run = _build(cfg, plan, acc, tokenizer, total, output_dir, loader, val_loader, decisions)
    run.tokenizer = tokenizer
    run.on_log = on_log
    resume_path = _resume(run, decisions)
    attach_health(run)
    run.writer = MetricsWriter(output_dir, main, plan.use_tensorboard, resume_path is not None, run.state.step)
    if cfg.eval_table_size and val_loader is not None:
        run.table = EvalTable.build(
            cfg, val_loader, tokenizer, output_dir, f"{cfg.base_model} ({plan.label})", decisions, logger
        )
        if main and resume_path is not None:  # metrics.jsonl was cut back to the checkpoint's step
            run.table.records = read_metrics(output_dir, "generations")
    if main:
        # summary.json says a run here finished (lowprec export trusts the model files by it): not this one yet
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(output_dir, "summary.json"))
        write_resolved_config(cfg.to_yaml_dict(), decisions, output_dir)
        write_conversion_report(
            acc, output_dir, tuple(run.health.moves() if run.health is not None else run.kept_moves)
        )
    try:
        loop = run_loop(run)
    except NonFiniteError as exc:
        raise NonFiniteError(run.stop_line(str(exc))) from None
    except KeyboardInterrupt:
        summary = _write_interrupted(output_dir, run.state, main, ckpt.latest_checkpoint(output_dir))
        raise Interrupted(
            run.stop_line(f"interrupted at step {run.state.step} of {total} (summary: {summary})")
        ) from None
    except Exception as exc:  # noqa: BLE001 - only a failed write is turned into one line
        _raise_storage(run, exc)
        raise
    finally:
        with contextlib.suppress(OSError):  # a full disk also fails the last flush; said above
            run.writer.close()
    try:
        return _finish(run, plan, loop, wall0)
    except Exception as exc:  # noqa: BLE001
        _raise_storage(run, exc)
        raise


def _raise_storage(run: Run, exc: BaseException) -> None:
    """A failed write (disk full, directory made read-only) as one line naming the path and the
    last good checkpoint (the CLI's exit 74); any other exception is left alone."""
    if isinstance(exc, StorageError):  # save_state's, which names the checkpoint
        raise StorageError(exc.errno, run.stop_line(f"stopped at step {run.state.step}: {exc}")) from None
    err = os_error_of(exc, run.output_dir)
    if err is None or err.errno is None:
        return
    raise StorageError(
        err.errno,
        run.stop_line(
            f"stopped at step {run.state.step}: cannot write {err.filename or run.output_dir} ({err.strerror}); "
            "free space or make the directory writable, then resume"
        ),
    ) from None


def _build(
    cfg: TrainConfig, plan: RunPlan, acc, tokenizer, total: int, output_dir: str, loader, val_loader, decisions: dict
) -> Run:
    """Model, optimizer and schedule, prepared by the accelerator; the run's shared state."""
    _seed_everything(cfg.seed)
    model, model_config = _build_model(cfg, tokenizer.vocab_size, getattr(tokenizer, "new_tokens", None))
    if cfg.gradient_checkpointing:  # built-in and transformers models share the method name
        kwargs = dict(cfg.gradient_checkpointing_kwargs or {"use_reentrant": False})
        if isinstance(model, _HFLoss):
            # transformers passes these to torch.utils.checkpoint: the recompute re-enters the
            # FP8 region of the first forward, as lowprec.fp8.checkpoint (fp8/modules/recompute.py) does for the built-in model
            model.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={**kwargs, "context_fn": replay_context}
            )
        else:
            cast(LlamaForCausalLM, model).gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if plan.weights_dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    optimizer = build_optimizer(cfg, model)
    warmup = decisions["warmup_steps"].value if "warmup_steps" in decisions else None
    scheduler = build_scheduler(cfg, optimizer, total, warmup)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    if plan.torch_compile:
        model = cast(nn.Module, torch.compile(model))  # a module compiles to an OptimizedModule, a module too

    state = ckpt.TrainerState(
        settings=settings_of(cfg, plan, model_config, total, scheduler_warmup(cfg, total, warmup))
    )
    acc.register_for_checkpointing(loader, state)
    inner = acc.unwrap_model(model)

    # telemetry reads lowprec's own Float8Linear; torchao's layers (fp8_backend: torchao) have none
    fp8_layers = bool(cfg.fp8) and acc.fp8_enabled and has_fp8_layers(inner)
    native = bool(cfg.fp8) and trainer_backends().get(cfg.fp8_backend) is None
    return Run(
        cfg=cfg,
        acc=acc,
        output_dir=output_dir,
        total=total,
        label=plan.label,
        model=model,
        inner=inner,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        val_loader=val_loader,
        state=state,
        fp8_layers=fp8_layers,
        fp8_nothing_converted=native and not fp8_layers,
        main=acc.is_main_process,
        model_config=model_config,
        # a fraction (eval_steps: 0.25) or a per-epoch count is resolved into decisions; else a number of steps
        eval_every=decisions["eval_steps"].value if "eval_steps" in decisions else cast(Optional[int], cfg.eval_steps),
        save_every=decisions["save_steps"].value if "save_steps" in decisions else cast(Optional[int], cfg.save_steps),
    )


def _resume(run: Run, decisions: dict) -> Optional[str]:
    """Load the checkpoint to continue from, or clear an earlier run's checkpoints."""
    acc, output_dir, main = run.acc, run.output_dir, run.main
    if main:  # saves killed mid-write: a moved-aside checkpoint back under its name, partial copies removed
        clean_interrupted_saves(output_dir, r"checkpoint-\d+")
    acc.wait_for_everyone()
    resume_path, resume_why = ckpt.resolve_resume(run.cfg.resume_from_checkpoint, output_dir)
    decisions["resume"] = Decision(resume_path, resume_why)
    if main:
        logger.info("lowprec: resume = %s (%s)", resume_path, resume_why)
    if resume_path is not None:
        # before loading: a checkpoint that means nothing under this config is refused by key
        saved = saved_settings(resume_path, acc._custom_objects.index(run.state))
        changes = check_resume(saved, run.state.settings, resume_path)
        moved = check_process_count(resume_path, acc.num_processes, run.cfg)
        if main and moved is not None:
            logger.warning(moved)
        try:
            acc.load_state(resume_path)
        except AssertionError as exc:  # torch.distributed.checkpoint wraps a reader's failure so
            raise CheckpointError(
                f"checkpoint {resume_path} cannot be loaded ({' '.join(str(exc).split())[:200] or 'AssertionError'}); "
                "it is damaged or from another run: resume from an earlier checkpoint (resume_from_checkpoint: "
                "<its directory>) or start afresh in a new output_dir"
            ) from None
        apply_changes(run, changes, main)
        if main:
            truncate_after(output_dir, run.state.step)
    elif main:
        # checkpoints of an earlier run here would be mistaken for this run's by a later
        # resume_from_checkpoint: auto (and outrank its own by step number)
        stale = ckpt.list_checkpoints(output_dir)
        if stale:
            logger.warning(
                "lowprec: fresh run in %s: removing %d checkpoint(s) of an earlier run (%s); set "
                "resume_from_checkpoint: auto to continue a run instead",
                output_dir,
                len(stale),
                ", ".join(os.path.basename(p) for _, p in stale),
            )
            ckpt.rotate(output_dir, 0)
    acc.wait_for_everyone()
    return resume_path


MERGE_SHARD_BYTES = 10 * 10**9  # merged/ of an FP8 base: shards of at most 10 GB plus an index


def _merge_fp8_base(run: Run, output_dir: str) -> str:
    """``merge_lora`` on an FP8 base: ``output_dir/merged`` in the base's FP8 format, the merged
    layers re-quantized once, or in bf16 (``merge_lora_format: bf16``)."""
    out = os.path.join(output_dir, "merged")
    # logs what it wrote (and, for fp8, that the merged scales are new); files of at most 10 GB,
    # Accelerate's save_model default: the merge holds one file's new tensors at a time
    peft_model = cast(nn.Module, run.inner.model)  # inner is the _HFLoss wrapper of a peft model
    merge_lora_fp8_base(peft_model, out, run.cfg.merge_lora_format or "fp8", max_shard_bytes=MERGE_SHARD_BYTES)
    tok = getattr(run.tokenizer, "hf_tokenizer", None)
    if tok is not None:
        tok.save_pretrained(out)
    return out


def _finish(run: Run, plan: RunPlan, loop, wall0: float) -> RunResult:
    """Export the model and plots (never a non-finite model), write ``summary.json``."""
    acc, output_dir, main, cfg, state = run.acc, run.output_dir, run.main, run.cfg, run.state
    files: dict[str, str] = {}
    try:  # a NaN model is never exported
        acc.nonfinite.check_model(run.model, f"export to {output_dir}/model.safetensors")
    except NonFiniteError as exc:
        raise NonFiniteError(run.stop_line(str(exc))) from None
    sd = acc.get_state_dict(run.model)  # collective under FSDP2: every process calls it
    # an FP8 base merges into its FP8 weights (re-quantized in its format), last: it unloads the adapters
    fp8_merge = cfg.merge_lora and any(isinstance(m, Float8BaseLinear) for m in run.inner.modules())
    if main:
        if cfg.base_model.startswith("builtin:"):
            files["model"] = export_model(sd, run.model_config, output_dir)
        else:
            files.update(
                export_pretrained(
                    run.inner, sd, run.tokenizer, output_dir, cfg.merge_lora and not fp8_merge, cfg.trust_remote_code
                )
            )
        if cfg.export:  # the trainer's export: key
            formats = cast(list[str], cfg.export)  # format names; the exporter only reads the list
            files.update(export_after_training(run.inner, formats, output_dir))
        if fp8_merge:
            files["merged"] = _merge_fp8_base(run, output_dir)
        records = read_metrics(output_dir)
        files["loss_plot"] = plot_loss(
            records, os.path.join(output_dir, "loss.png"), f"{cfg.base_model} ({plan.label})"
        )
        if run.fp8_layers:
            p = plot_fp8_report(records, os.path.join(output_dir, "fp8_report.png"))
            if p:
                files["fp8_report"] = p
        files["metrics"] = os.path.join(output_dir, "metrics.jsonl")
        files["resolved_config"] = os.path.join(output_dir, "resolved_config.yaml")
    acc.wait_for_everyone()
    records = read_metrics(output_dir) if main else []
    train_recs = [r for r in records if r["kind"] == "train"]
    tok_s = sum(r["tokens"] for r in train_recs[-1:]) / max(state.train_time_s, 1e-9) if train_recs else 0.0
    eval_recs = [r for r in records if r["kind"] == "eval"]
    result = RunResult(
        output_dir=output_dir,
        precision=plan.label,
        fp8_nothing_converted=run.fp8_nothing_converted,
        steps=state.step,
        final_train_loss=loop.last_train
        if loop.last_train is not None
        else (train_recs[-1]["loss"] if train_recs else None),
        # a run resumed from its final step's checkpoint evaluates nothing itself: the metrics
        # (cut back to that checkpoint) hold the final evaluation
        final_eval_loss=loop.last_eval
        if loop.last_eval is not None
        else (eval_recs[-1]["loss"] if eval_recs else None),
        tokens_per_s=tok_s,
        peak_mem_mb=peak_memory_mb(acc.device),
        wall_s=time.perf_counter() - wall0,
        train_losses=[(r["step"], r["loss"]) for r in train_recs],
        eval_losses=[(r["step"], r["loss"]) for r in eval_recs],
        files=files,
    )
    if main:
        import dataclasses
        import json

        with open(os.path.join(output_dir, "summary.json"), "w") as f:  # lowprec compare --reuse reads the version
            json.dump({**dataclasses.asdict(result), "lowprec_version": __version__}, f, indent=1)
    with contextlib.suppress(Exception):
        acc.end_training()
    return result
