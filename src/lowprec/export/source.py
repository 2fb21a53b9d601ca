"""``export_run``: a ``lowprec train`` output directory, or one of its checkpoints, to an FP8 export.

The model is rebuilt as the trainer built it (the run's ``resolved_config.yaml``: base model,
recipe, ``fp8_filter``) and converted with the same rules, so the same layers are FP8. Its
weights are the float32 master weights of the checkpoint (a ``checkpoint-N`` directory given,
or a run's newest checkpoint when it is from the run's last step), so the trained FP8 casts are
recomputed from exactly the weights the last forward read. Without such a checkpoint the run's
bf16 ``model.safetensors`` is used, and the report says so. A run that did not finish (no
``summary.json``, or one saying it was interrupted) is refused: its directory may hold an earlier
run's model files.

A LoRA / QLoRA run exports its adapter merged into the base model: the run's ``merged/`` when
``merge_lora`` wrote it, else the base model (full precision, QLoRA's too) with the adapter
merged by peft. Merged weights are not what any training forward cast, so their FP8 casts are
made at export (the report says so). An adapter trained on an FP8 base is refused: its
``merge_lora`` writes ``merged/`` in the base's FP8 format already (lowprec.export.fp8_merge),
unless ``merge_lora_format: bf16`` wrote a bf16 ``merged/``, which exports as above.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from lowprec.backends.spec import trainer_backends
from lowprec.export.casts import scheme_for
from lowprec.export.model import ExportReport, export_model
from lowprec.fp8 import DEFAULT_SKIP_PATTERNS, Recipe, convert
from lowprec.train.checkpoints import list_checkpoints
from lowprec.train.model import LlamaConfig, LlamaForCausalLM
from lowprec.export.fp8_base import is_fp8_base
from lowprec.train.hf_files import locate_pretrained, missing_model_files
from lowprec.train.hf_model import load_causal_lm

__all__ = ["export_run", "load_run", "export_after_training"]

_NOT_A_RUN = (
    "is neither a `lowprec train` output_dir (it has resolved_config.yaml) nor one of its checkpoint-N "
    "directories (lowprec_state.json); give one of those"
)


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _locate(path: str) -> tuple[str, str | None]:
    """(run directory, checkpoint directory or None)."""
    if not os.path.isdir(path):
        raise ValueError(
            f"RUN_OR_CHECKPOINT: {path} is not a directory; give a `lowprec train` output_dir or one of "
            "its checkpoint-N directories"
        )
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "lowprec_state.json")):
        run = os.path.dirname(path)
        if not os.path.isfile(os.path.join(run, "resolved_config.yaml")):
            raise ValueError(
                f"RUN_OR_CHECKPOINT: checkpoint {path} is not inside its run's output_dir "
                "(no resolved_config.yaml beside it); export from the run directory it came from"
            )
        return run, path
    if not os.path.isfile(os.path.join(path, "resolved_config.yaml")):
        raise ValueError(f"RUN_OR_CHECKPOINT: {path} {_NOT_A_RUN}")
    found = list_checkpoints(path)
    last_step = _finished_steps(path, found[-1][1] if found else None)
    if found and found[-1][0] == last_step:
        return path, found[-1][1]
    return path, None


def _finished_steps(run: str, latest: str | None) -> int | None:
    """The steps of a run that finished (its ``summary.json``, which the trainer removes when a
    run starts and writes when it ends). A run that did not finish (interrupted, killed, still
    running) may hold an earlier run's model files in its directory: refused, naming what to do."""
    path = os.path.join(run, "summary.json")
    try:
        summary = _read_json(path) if os.path.isfile(path) else None
    except (OSError, ValueError):
        summary = None
    if isinstance(summary, dict) and not summary.get("interrupted"):
        return summary.get("steps")
    why = (
        f"it was interrupted at step {summary.get('steps')} (summary.json)"
        if isinstance(summary, dict)
        else "it has no complete summary.json (still running, or stopped before its end)"
    )
    hint = (
        f"export its newest checkpoint, {latest}, or let the run finish (resume_from_checkpoint: auto)"
        if latest
        else "let the run finish (resume_from_checkpoint: auto continues a stopped one) or train it again"
    )
    raise ValueError(
        f"RUN_OR_CHECKPOINT: {run} did not finish: {why}, so its model files may be an earlier run's; {hint}"
    )


def _recipe(cfg: dict[str, Any]) -> Recipe | None:
    if not cfg.get("fp8") or cfg.get("fp8_backend") in trainer_backends():  # a library backend's layers
        return None
    spec = cfg.get("fp8_recipe") or "tensorwise"
    if isinstance(spec, str):
        return Recipe.from_name(spec)
    spec = dict(spec)
    return Recipe.from_name(spec.pop("name"), **spec)


def _checkpoint_weights(ckpt: str) -> dict[str, torch.Tensor]:
    state = _read_json(os.path.join(ckpt, "lowprec_state.json"))
    if state.get("sharded"):
        raise ValueError(
            f"RUN_OR_CHECKPOINT: {ckpt} is a sharded (FSDP) checkpoint; export the run directory "
            "after training ends (its model.safetensors), or a checkpoint of a single-process run"
        )
    path = os.path.join(ckpt, "model_0.safetensors")
    if not os.path.isfile(path):
        raise ValueError(f"RUN_OR_CHECKPOINT: {ckpt} has no model_0.safetensors; it is damaged or not a checkpoint")
    return load_file(path)


def load_run(path: str) -> tuple[nn.Module, nn.Module, dict[str, Any], list[str]]:
    """(the converted model to export, the module the trainer converted, the run's config, notes)."""
    run, ckpt = _locate(path)
    with open(os.path.join(run, "resolved_config.yaml")) as f:
        cfg = yaml.safe_load(f)
    notes: list[str] = []
    if cfg.get("adapter"):
        if ckpt is not None and os.path.abspath(path) == os.path.abspath(ckpt):  # one asked for, not the newest
            raise ValueError(
                f"RUN_OR_CHECKPOINT: {ckpt} is a checkpoint of a {cfg['adapter']} run; export the run "
                f"directory ({run}): its adapter, merged into the base model"
            )
        model, note = _merged_adapter_model(run, cfg)
        notes.append(note)
        return _convert_for_export(model, nn.ModuleDict({"model": model}), cfg, notes)
    builtin = str(cfg.get("base_model", "")).startswith("builtin:")
    if builtin:
        if not os.path.isfile(os.path.join(run, "config.json")):
            raise ValueError(
                f"RUN_OR_CHECKPOINT: {run} has no config.json (the run did not finish); export one of "
                "its checkpoint-N directories"
            )
        model = LlamaForCausalLM(LlamaConfig(**_read_json(os.path.join(run, "config.json"))))
        target: nn.Module = model
        prefix = ""
    else:
        # transformers, optional: only a Hugging Face run needs it

        if missing_model_files(run):
            raise ValueError(
                f"RUN_OR_CHECKPOINT: {run} holds no saved model ({', '.join(missing_model_files(run))}); "
                "export a run that finished"
            )
        model = load_causal_lm(run, cfg.get("model_type"), bool(cfg.get("trust_remote_code")))
        target, prefix = nn.ModuleDict({"model": model}), "model."  # the trainer's names: its wrapper's .model
    if ckpt is not None:
        sd = _checkpoint_weights(ckpt)
        sd = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        result = model.load_state_dict(sd, strict=False)
        tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
        missing = [k for k in result.missing_keys if k not in tied]
        if missing:
            raise ValueError(
                f"RUN_OR_CHECKPOINT: {ckpt} does not hold this run's model (missing {missing[0]}); "
                "it is from another run"
            )
        notes.append(f"source: the float32 master weights of {os.path.basename(ckpt)}")
    elif builtin:
        model.load_state_dict(load_file(os.path.join(run, "model.safetensors")))
        notes.append(
            "source: the run's bf16 model.safetensors (no checkpoint from its last step), so FP8 casts "
            "are of the bf16-rounded weights"
        )
    else:
        notes.append(
            "source: the run's bf16 save_pretrained model (no checkpoint from its last step), so FP8 "
            "casts are of the bf16-rounded weights"
        )
    return _convert_for_export(model, target, cfg, notes)


def _convert_for_export(
    model: nn.Module, target: nn.Module, cfg: dict[str, Any], notes: list[str]
) -> tuple[nn.Module, nn.Module, dict[str, Any], list[str]]:
    model.float().eval()
    recipe = _recipe(cfg)
    if recipe is not None:
        skip = tuple(DEFAULT_SKIP_PATTERNS) + tuple(cfg.get("fp8_filter") or ())
        convert(target, recipe, skip_patterns=skip)
    return model, target, cfg, notes


def _merged_adapter_model(run: str, cfg: dict[str, Any]) -> tuple[nn.Module, str]:
    """A LoRA / QLoRA run's model with its adapter merged: the run's ``merged/`` when
    ``merge_lora`` wrote one, else the base model (full precision, also for QLoRA, as
    ``axolotl merge-lora`` does) with the run's adapter merged by peft."""
    merged = os.path.join(run, "merged")
    remote = bool(cfg.get("trust_remote_code"))
    if os.path.isdir(merged) and is_fp8_base(merged):
        raise ValueError(
            f"RUN_OR_CHECKPOINT: {run} trained an adapter on an FP8 base and merge_lora already wrote {merged} in "
            "the base's FP8 format (the merged layers re-quantized once); serve or load that directory as it is"
        )
    if os.path.isdir(merged) and not missing_model_files(merged):
        model = load_causal_lm(merged, cfg.get("model_type"), remote)
        return model, "source: the run's merged/ model (the adapter merged into the base by merge_lora, bf16)"
    if not os.path.isfile(os.path.join(run, "adapter_config.json")):
        raise ValueError(
            f"RUN_OR_CHECKPOINT: {run} trained a {cfg['adapter']} adapter but holds neither merged/ nor "
            "adapter_config.json (the run did not finish); export a finished run"
        )
    base_path = locate_pretrained(str(cfg.get("base_model")))
    if is_fp8_base(base_path):
        raise ValueError(
            f"RUN_OR_CHECKPOINT: {run} trained an adapter on the FP8 base {base_path}, which is FP8 already: serve "
            "it with the adapter (adapter_model.safetensors), or train with merge_lora: true, which writes merged/ "
            "in the base's FP8 format"
        )
    try:
        from peft import PeftModel
    except ImportError:
        raise ValueError(
            f"RUN_OR_CHECKPOINT: {run} holds a {cfg['adapter']} adapter; merging it needs peft: pip install peft"
        ) from None
    base: Any = load_causal_lm(base_path, cfg.get("model_type"), remote)  # a transformers PreTrainedModel
    with open(os.path.join(run, "adapter_config.json")) as f:
        adapter_cfg = json.load(f)
    rows = _adapter_embedding_rows(run, adapter_cfg)
    if rows is not None and base.get_input_embeddings().num_embeddings != rows:
        base.resize_token_embeddings(rows)  # the trainer grew it for added tokens
    model = PeftModel.from_pretrained(base, run).merge_and_unload()
    note = (
        f"source: the base model {base_path} in float32 with the run's {cfg['adapter']} adapter merged "
        "(peft merge_and_unload), so FP8 casts are of the merged weights"
    )
    return model, note


def _adapter_embedding_rows(run: str, adapter_cfg: dict[str, Any]) -> int | None:
    """The embedding rows the adapter was trained with, where it saved the embeddings
    (``lora_modules_to_save`` with added tokens); None otherwise."""
    if not adapter_cfg.get("modules_to_save"):
        return None
    weights = load_file(os.path.join(run, "adapter_model.safetensors"))
    rows = [t.shape[0] for k, t in weights.items() if "embed_tokens" in k and t.dim() == 2]
    return rows[0] if rows else None


def export_run(path: str, out_dir: str, format: str = "hf-fp8", *, requantize: bool = False) -> ExportReport:
    """Export a ``lowprec train`` output directory or checkpoint (see the module docstring)."""
    run, checkpoint = _locate(path)
    with open(os.path.join(run, "resolved_config.yaml")) as f:
        cfg = yaml.safe_load(f)
    scheme_for(format, None if requantize else _recipe(cfg))  # a bad format before any loading
    _refuse_writing_a_source(out_dir, run, checkpoint, cfg, format)
    _refuse_a_foreign_out(out_dir)
    model, _, _, notes = load_run(path)
    report = export_model(
        model, out_dir, format, requantize=requantize, notes=notes, adapter_merged=bool(cfg.get("adapter"))
    )
    _copy_tokenizer(run, out_dir, _model_dirs(run, cfg))
    return report


def _model_dirs(run: str, cfg: dict[str, Any]) -> tuple[str, ...]:
    """Where an adapter run's model files are: its merged/ model, else its base model's directory."""
    base = str(cfg.get("base_model", ""))
    if not cfg.get("adapter") or base.startswith("builtin:"):
        return ()
    return (os.path.join(run, "merged"), locate_pretrained(base))


def _refuse_writing_a_source(out_dir: str, run: str, checkpoint: str | None, cfg: Any, format: str) -> None:
    """The export writes model.safetensors, config.json, README.md and the tokenizer files: into
    the run, its checkpoint, its merged/ model or a local base model it would overwrite what it
    reads (the run's own bf16 model first)."""
    base = cfg.get("base_model") if isinstance(cfg, dict) else None
    sources = [run, os.path.join(run, "merged"), checkpoint] + ([base] if isinstance(base, str) else [])
    out = os.path.realpath(out_dir)
    hit = next((s for s in sources if s and os.path.isdir(s) and os.path.realpath(s) == out), None)
    if hit is not None:
        raise ValueError(
            f"--out {out_dir}: that is {hit}, which this export reads; writing there would overwrite its model. "
            f"Choose a new directory, e.g. {os.path.join(run, format)}"
        )


def _refuse_a_foreign_out(out_dir: str) -> None:
    """An ``out_dir`` with files in it that an earlier export did not write (another model, a
    run): the export would overwrite its config.json and tokenizer and leave its other files,
    which a loader may read with the export's. An earlier export there is replaced."""
    held = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if held and "lowprec_export.json" not in held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ValueError(
            f"--out {out_dir}: it already holds files ({shown}) and is not an earlier lowprec export; "
            "choose a new or empty directory"
        )


# what save_pretrained writes beside the weights that a server reads: the tokenizer (its vocabulary
# files, added tokens, chat templates: one, or named ones in additional_chat_templates/) and the
# generation defaults (eos ids, sampling)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
_TEMPLATES_DIR = "additional_chat_templates"


def _copy_tokenizer(run: str, out_dir: str, model_dirs: tuple[str, ...] = ()) -> None:
    """The run's tokenizer files, and ``generation_config.json`` from the run or, where it has none
    (a LoRA run saves its adapter, not the model), the first of ``model_dirs`` that has one."""
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(run, name)):
            shutil.copy(os.path.join(run, name), os.path.join(out_dir, name))
    templates = os.path.join(out_dir, _TEMPLATES_DIR)
    if os.path.isdir(templates):  # an earlier export's
        shutil.rmtree(templates)
    if os.path.isdir(os.path.join(run, _TEMPLATES_DIR)):
        shutil.copytree(os.path.join(run, _TEMPLATES_DIR), templates)
    for d in (run, *model_dirs):
        if os.path.isfile(os.path.join(d, "generation_config.json")):
            shutil.copy(os.path.join(d, "generation_config.json"), os.path.join(out_dir, "generation_config.json"))
            break


def export_after_training(model: nn.Module, formats: list[str], output_dir: str) -> dict[str, str]:
    """The trainer's ``export:`` key: each format to ``output_dir/<format>`` from the trained model
    in memory (its float32 master weights: the FP8 casts of the last step). ``model`` is the
    trainer's unwrapped model: the built-in model, or its wrapper of a transformers model."""
    hf: Any = getattr(model, "model", None)  # duck-typed: a wrapped transformers model, or anything else
    target = hf if hasattr(getattr(hf, "config", None), "model_type") else model
    files = {}
    for fmt in formats:
        out = os.path.join(output_dir, fmt)
        report = export_model(target, out, fmt, notes=["source: the trained model at the end of training"])
        _copy_tokenizer(output_dir, out)
        logging.getLogger("lowprec").info("%s", report)
        files[f"export_{fmt}"] = out
    return files
