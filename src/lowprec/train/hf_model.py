"""Hugging Face causal LMs in the trainer: find them (a local directory or the local Hugging Face
cache, never the network), load them, and save what training made of them.

``base_model`` is the built-in ``builtin:<name>``, a local directory written by
``save_pretrained``, or a hub id (``org/name``) that is already in the local cache
(``$HF_HUB_CACHE``, or ``$HF_HOME/hub``, default ``~/.cache/huggingface/hub``). Nothing here
downloads: a hub id that is not cached is a one-line error naming the files that are missing
and the command that fetches them on a machine with network.

Outputs (:func:`export_pretrained`): ``output_dir`` holds a ``save_pretrained`` directory
(``config.json``, ``model.safetensors`` in bf16, ``generation_config.json``, the tokenizer
files) that ``AutoModelForCausalLM.from_pretrained(output_dir)`` loads; with an adapter, the
adapter (``adapter_config.json``, ``adapter_model.safetensors``, loaded by peft) and, with
``merge_lora: true``, the merged model in ``output_dir/merged``. The built-in models keep
their own format (:mod:`lowprec.train.outputs`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import pickle
import re
import shutil
import tempfile
from typing import Any, Callable, Iterator, Optional, cast

import torch
from torch import nn

from lowprec.durable import fsync_dir, fsync_tree
from lowprec.errors import did_you_mean
from lowprec.checkpoint.serialization import load_error_reason
from lowprec.distributed.expert_parallel import expert_parallel_names
from lowprec.fp8 import plain_state_dict, unconvert
from lowprec.train.adapters import is_peft_model
from lowprec.train.chat_templates import template_text
from lowprec.train.hf_files import has_tokenizer, locate_pretrained
from lowprec.train.tokenizer import (
    HFTokenizer,
    directory_error,
    is_remote_code_refusal,
    load_tokenizer,
    remote_code_message,
)

__all__ = [
    "load_causal_lm",
    "export_pretrained",
    "tokenizer_choice",
    "load_run_tokenizer",
    "set_chat_template",
]

logger = logging.getLogger("lowprec")


@contextlib.contextmanager
def quiet_hf_libraries(progress_bar: bool, base_model: str) -> Iterator[None]:
    """A Hugging Face model's run: transformers' own progress bars (loading and writing weights)
    follow the run's ``progress_bar`` (``--quiet`` turns them off too), and on a machine without
    CUDA DeepSpeed, which transformers' ``save_pretrained`` imports through Accelerate where it is
    installed, is told its accelerator (``DS_ACCELERATOR=cpu``, what it would pick) instead of
    printing a warning that it guessed. Both are put back after the run."""
    if str(base_model).startswith("builtin:") or importlib.util.find_spec("transformers") is None:
        yield
        return
    from transformers.utils import logging as hf_logging  # installed: checked above

    bars = hf_logging.is_progress_bar_enabled()
    if not progress_bar:
        hf_logging.disable_progress_bar()
    ds_env = "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available()
    if ds_env:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if ds_env:
            os.environ.pop("DS_ACCELERATOR", None)


def _transformers(what: str):
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"{what} needs the optional package 'transformers': pip install 'lowprec[transformers]'"
        ) from None
    return transformers


def _model_class(transformers, model_type: Optional[str]):
    """``model_type`` as Axolotl reads it: a transformers class name (AutoModelForCausalLM,
    LlamaForCausalLM, ...). Only causal LMs train here."""
    if model_type in (None, "AutoModelForCausalLM"):
        return transformers.AutoModelForCausalLM
    names = [n for n in dir(transformers) if n.endswith("ForCausalLM")]
    cls = getattr(transformers, model_type, None) if model_type in names else None
    if cls is None:
        raise ValueError(
            f"model_type: {model_type!r} is not a transformers causal LM class{did_you_mean(model_type, names)}; "
            "use AutoModelForCausalLM (the default) or a class such as LlamaForCausalLM"
        )
    return cls


def load_causal_lm(
    path: str, model_type: Optional[str] = None, trust_remote_code: bool = False, load_in_4bit: bool = False
) -> nn.Module:
    """A causal LM from a local directory, float32 master weights, offline. ``load_in_4bit``
    (QLoRA) quantizes its Linear layers but the output head to NF4 through bitsandbytes, with bf16
    compute and double quantization (Axolotl's QLoRA settings); embeddings, norms and the head stay
    float32."""
    transformers = _transformers(f"base_model: {path}")
    cls = _model_class(transformers, model_type)
    kwargs: dict[str, Any] = {}
    if load_in_4bit:
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )  # the per-block scales are quantized too
    try:
        model = cls.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code, dtype=torch.float32, **kwargs
        )
    except (pickle.UnpicklingError, EOFError) as exc:  # pytorch_model.bin: transformers reads it weights-only
        pickles = sorted(f for f in os.listdir(path) if f.endswith(".bin"))
        raise ValueError(
            f"base_model: {path}: {', '.join(pickles) or 'its weights'} cannot be read "
            f"({load_error_reason(exc)}); restore the file or use a model saved as safetensors"
        ) from None
    except Exception as exc:  # noqa: BLE001 - what the directory's files make transformers raise
        if not directory_error(exc):
            raise
        if is_remote_code_refusal(exc):
            raise ValueError(f"base_model: {remote_code_message(path)}") from None
        first = " ".join(str(exc).split())[:300] or type(exc).__name__
        hint = (
            ""
            if trust_remote_code
            else " (a model with its own code needs trust_remote_code: true, which runs that code)"
        )
        raise ValueError(f"base_model: {path} cannot be loaded as a causal LM: {first}{hint}") from None
    if load_in_4bit:
        # bitsandbytes packs a Linear4bit's weights for its CPU inference kernel at the first
        # eval-mode forward (an evaluation), and training then runs on the packed weights: a run
        # resumed after an evaluation (fresh, unpacked weights) no longer matched the uninterrupted
        # one. Evaluation runs the training GEMMs instead (same numerics, resumable).
        for m in model.modules():
            if type(m).__name__ == "Linear4bit" and hasattr(m, "support_avx512bf16_for_cpu"):
                m.support_avx512bf16_for_cpu = False
    logger.info(
        "lowprec: base_model %s: %s, %.2f M parameters",
        path,
        type(model).__name__,
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model


def _bf16_state(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The wrapped model's plain tensors (no FP8 scaling state), prefix stripped, floats in bf16."""

    out = {}
    for k, t in plain_state_dict(state_dict).items():
        if not k.startswith(prefix):
            continue
        t = t.detach().to("cpu")
        out[k[len(prefix) :]] = (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
    return out


def export_pretrained(
    wrapper: nn.Module,
    state_dict: dict[str, torch.Tensor],
    tokenizer: Any,
    output_dir: str,
    merge_lora: bool = False,
    trust_remote_code: bool = False,
) -> dict[str, str]:
    """Write the trained model where ``from_pretrained`` finds it; returns {what: path}.

    ``wrapper`` is the trainer's wrapper around the model (unwrapped from DDP; ``.model``), ``state_dict`` its
    full state dict (gathered under FSDP2). A full fine-tune saves the model; a peft model
    saves its adapter and, with ``merge_lora``, the merged model in ``output_dir/merged``."""

    inner = cast(nn.Module, wrapper.model)  # the wrapped transformers model, a submodule
    tok = getattr(tokenizer, "hf_tokenizer", None)
    files: dict[str, str] = {}
    if is_peft_model(inner):
        files.update(save_adapter(inner, output_dir, merge_lora, trust_remote_code))
        targets = [output_dir] + ([files["merged"]] if "merged" in files else [])
    else:
        _save_model(inner, _bf16_state(state_dict, "model."), output_dir)
        files["model"] = os.path.join(output_dir, "model.safetensors")
        targets = [output_dir]
    if tok is not None:
        for d in targets:
            _write_whole(d, tok.save_pretrained)
    return files


_PARTIAL = ".export-"  # prefix of the temporary directory an export writes into, inside its target
# a model's weight files, one or sharded with an index (adapter_model.safetensors is not one)
_WEIGHTS = re.compile(r"^model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")


def _write_whole(out: str, write: Callable[[str], Any]) -> None:
    """``write(directory)`` (a ``save_pretrained``) into a temporary directory inside ``out``,
    then each file it wrote moved over its real name in ``out``: ``save_pretrained`` writes in
    place, so a run killed or out of disk mid-write left a half-written ``model.safetensors``
    over the last good one. Files are fsynced before the moves and ``out`` after them. What a
    killed export left is removed first (a run holds its ``output_dir`` locked: nobody else
    writes there)."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name.startswith(_PARTIAL) and os.path.isdir(os.path.join(out, name)):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=_PARTIAL, dir=out)
    try:
        write(tmp)
        fsync_tree(tmp)
        written = sorted(os.listdir(tmp))
        for name in written:
            target = os.path.join(out, name)
            if os.path.isdir(target) and not os.path.islink(target):  # a subfolder written again
                shutil.rmtree(target)
            os.replace(os.path.join(tmp, name), target)
        if any(_WEIGHTS.match(n) for n in written):  # save_pretrained's own clean-up: an earlier export's shards
            for name in os.listdir(out):
                if _WEIGHTS.match(name) and name not in written:
                    os.remove(os.path.join(out, name))
        fsync_dir(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_model(model: nn.Module, state_dict: Optional[dict[str, torch.Tensor]], out: str) -> None:
    """``save_pretrained`` in bf16 (config says so, so dtype="auto" loads bf16), whole or not at
    all (:func:`_write_whole`). Without a state dict the model itself is cast: only done at the
    very end, to a model nothing trains again."""
    hf: Any = model  # a transformers PreTrainedModel (duck-typed: save_pretrained, config)
    if state_dict is None:
        model.to(torch.bfloat16)

    def write(d: str) -> None:
        hf.save_pretrained(d, state_dict=state_dict, safe_serialization=True)
        # save_pretrained writes the dtype of the model's own (float32 master) parameters; the
        # file holds bf16, and the config says what the file holds
        config = copy.deepcopy(hf.config)
        config.dtype = torch.bfloat16
        config.save_pretrained(d)

    _write_whole(out, write)


def set_chat_template(cfg: Any, tokenizer: Any) -> None:
    """The top-level ``chat_template`` the config sets becomes the Hugging Face tokenizer's own, so
    the tokenizer saved with the model prompts in the format it trained on, as Axolotl's
    ``load_tokenizer`` does ('saved to the tokenizer_config.json for easier inferencing'). Called
    once the data is tokenized (a dataset's ``tokenizer_default`` read the tokenizer's own)."""
    tok = getattr(tokenizer, "hf_tokenizer", None)
    if tok is None or "chat_template" not in cfg.model_fields_set:
        return
    try:
        tok.chat_template = template_text(
            cfg.chat_template, getattr(tok, "chat_template", None), cfg.chat_template_jinja
        )
    except ValueError:  # tokenizer_default on a tokenizer without one, no data using it: nothing to save
        return


def tokenizer_choice(cfg: Any) -> tuple[str, str]:
    """(``byte`` or a tokenizer directory, the reason): ``tokenizer_config``, else ``tokenizer``,
    else the base model's own tokenizer (Hugging Face) or the byte tokenizer (built-in)."""
    if cfg.tokenizer_config is not None:
        return locate_pretrained(cfg.tokenizer_config, "tokenizer_config", tokenizer=True), "tokenizer_config"
    if cfg.tokenizer is not None:
        return cfg.tokenizer, "tokenizer from the config"
    if cfg.base_model.startswith("builtin:"):
        return "byte", f"the byte tokenizer of {cfg.base_model}"
    path = locate_pretrained(cfg.base_model)
    if not has_tokenizer(path):
        raise ValueError(
            f"base_model: {path} has no tokenizer files (tokenizer.json or tokenizer_config.json); "
            "set tokenizer_config: <tokenizer directory> (or tokenizer: byte)"
        )
    return path, "base_model's own tokenizer"


def load_run_tokenizer(cfg: Any):
    """The tokenizer :func:`tokenizer_choice` picks, with ``special_tokens``, ``tokens``,
    ``tokenizer_type`` and ``trust_remote_code``."""

    spec, _ = tokenizer_choice(cfg)
    special = cfg.special_tokens.model_dump(exclude_none=True) if cfg.special_tokens else None
    if spec == "byte" or not os.path.isdir(spec):
        return load_tokenizer(spec, special, cfg.tokens)  # the byte tokenizer, or its own one-line error
    return HFTokenizer(spec, special, cfg.tokenizer_type, cfg.trust_remote_code, cfg.tokens)


def save_adapter(
    peft_model: nn.Module, output_dir: str, merge: bool, trust_remote_code: bool = False
) -> dict[str, str]:
    """The adapter (``adapter_model.safetensors`` + ``adapter_config.json``) and, with ``merge``,
    the merged model in ``output_dir/merged``. Merging changes the model in place, so it runs
    last; FP8 layers go back to ``nn.Linear`` first (merged weights are plain weights)."""
    pm: Any = peft_model  # a peft PeftModel (duck-typed: save_pretrained, get_base_model, merge_and_unload)
    _write_whole(output_dir, lambda d: pm.save_pretrained(d, safe_serialization=True))
    files = {"adapter": os.path.join(output_dir, "adapter_model.safetensors")}
    if merge:
        if expert_parallel_names(peft_model):  # each process holds some experts: the frozen base's are on disk
            merged = _merge_on_full_precision_base(peft_model, output_dir, trust_remote_code, "expert parallelism")
        elif getattr(pm.get_base_model(), "is_loaded_in_4bit", False):
            unconvert(peft_model)
            merged = _merge_on_full_precision_base(peft_model, output_dir, trust_remote_code, "a 4-bit base")
        else:
            unconvert(peft_model)
            merged = pm.merge_and_unload()
        out = os.path.join(output_dir, "merged")
        _save_model(merged, None, out)
        files["merged"] = out
    return files


def _merge_on_full_precision_base(
    peft_model: nn.Module, adapter_dir: str, trust_remote_code: bool = False, why: str = "a 4-bit base"
) -> nn.Module:
    """QLoRA's merge, as ``axolotl merge-lora`` does it: the saved adapter onto the base model
    loaded again unquantized (float32, then saved bf16). Merging into the NF4 weights instead
    would round the merged weights to 4 bits, which is neither the base nor the trained model.
    Under expert parallelism each process holds a share of the (frozen) experts: the whole base
    is the one on disk."""
    from peft import PeftModel

    pm: Any = peft_model  # a peft PeftModel (duck-typed: peft_config, get_input_embeddings)
    base_path = pm.peft_config["default"].base_model_name_or_path
    logger.info("lowprec: merge_lora with %s: merging the adapter onto %s loaded in full precision", why, base_path)
    base: Any = load_causal_lm(base_path, trust_remote_code=trust_remote_code)  # the run's setting, as when it loaded
    rows = pm.get_input_embeddings().num_embeddings
    if base.get_input_embeddings().num_embeddings != rows:
        base.resize_token_embeddings(rows)  # the trainer resized it for new tokens
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
