"""LoRA adapters through peft (Axolotl's ``adapter: lora | qlora`` and ``lora_*`` keys).

The base model's weights are frozen; FP8 then applies to them and never to the adapters: the
default conversion filter (``lowprec.fp8.convert``) converts the ``base_layer`` inside each
peft ``lora.Linear`` and keeps ``lora_A`` / ``lora_B`` in high precision (named in the report).
A frozen ``Float8Linear`` runs two GEMMs instead of three: autograd asks for no weight
gradient, so the weight-gradient GEMM and the FP8 copy of the input it would need are skipped;
its weight's FP8 cast is made once and reused while the weight is unchanged (fp8/modules/frozen.py).

``merge_lora: true`` folds the adapters into the base weights at the end and saves the merged
model next to the adapter (``output_dir/merged``), as ``axolotl merge-lora`` does. On an FP8
base (hf-fp8 / compressed-tensors) merged/ is written in the base's format, the merged layers
re-quantized once (``lowprec.export.fp8_merge``).
"""

from __future__ import annotations

import importlib.util
import logging
import re
from typing import Any, Optional, Sequence

from torch import nn

from lowprec.errors import did_you_mean

__all__ = [
    "LoraSettings",
    "apply_lora",
    "is_peft_model",
    "check_adapter_backend",
    "linear_module_names",
    "check_new_tokens",
]

logger = logging.getLogger("lowprec")


class LoraSettings:
    """The ``lora_*`` keys, as read from the config (Axolotl's names and defaults)."""

    def __init__(
        self,
        r: int = 8,
        alpha: Optional[float] = None,
        dropout: float = 0.0,
        target_modules: Optional[Sequence[str]] = None,
        target_linear: bool = False,
        modules_to_save: Optional[Sequence[str]] = None,
        fan_in_fan_out: Optional[bool] = None,
        target_parameters: Optional[Sequence[str]] = None,
    ) -> None:
        self.r, self.dropout = int(r), float(dropout)
        self.alpha = float(alpha) if alpha is not None else float(r)  # peft's default alpha is 8; Axolotl's r
        # a string is a regex over whole module names (Axolotl, peft), unless lora_target_linear adds
        # the linear layers' names to it: then, as in Axolotl, it is one more name
        self.regex: Optional[str] = target_modules if isinstance(target_modules, str) and not target_linear else None
        self.target_modules = [target_modules] if isinstance(target_modules, str) else list(target_modules or [])
        self.target_linear = bool(target_linear)
        self.modules_to_save = list(modules_to_save or [])
        self.fan_in_fan_out = fan_in_fan_out
        self.target_parameters = list(target_parameters or [])

    @classmethod
    def from_config(cls, cfg: Any) -> "LoraSettings":
        return cls(
            r=cfg.lora_r or 8,
            alpha=cfg.lora_alpha,
            dropout=cfg.lora_dropout or 0.0,
            target_modules=cfg.lora_target_modules,
            target_linear=bool(cfg.lora_target_linear),
            modules_to_save=cfg.lora_modules_to_save,
            fan_in_fan_out=cfg.lora_fan_in_fan_out,
            target_parameters=cfg.lora_target_parameters,
        )


def check_adapter_backend(adapter: Optional[str], packages: frozenset) -> None:
    """One-line errors for what ``adapter`` needs and this machine lacks (called by resolve)."""
    if adapter is None:
        return
    if "peft" not in packages:
        raise ValueError(f"adapter: {adapter} needs the optional package 'peft': pip install 'lowprec[peft]'")
    if adapter == "qlora" and "bitsandbytes" not in packages:
        # bitsandbytes >= 0.48 runs its NF4 layers on CPU as well as CUDA, so the package is all it needs
        raise ValueError(
            "adapter: qlora loads the base model in 4 bits through the optional package 'bitsandbytes': "
            "pip install 'lowprec[qlora]' (or pip install bitsandbytes), or use adapter: lora"
        )


def _gemm_leaf(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def linear_module_names(model: nn.Module) -> list[str]:
    """Last name components of the GEMM layers (nn.Linear, transformers Conv1D), output head
    excluded: what ``lora_target_linear: true`` targets (Axolotl's rule; peft's "all-linear")."""
    hf: Any = model  # a transformers model when it has get_output_embeddings (duck-typed)
    head = hf.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {n.rpartition(".")[2] for n, m in model.named_modules() if _gemm_leaf(m) and m is not head and n}
    return sorted(names)


def check_new_tokens(model: nn.Module, lora: LoraSettings, new_tokens: dict[str, str]) -> None:
    """Axolotl's rule: tokens new to the vocabulary (``special_tokens``, ``tokens``) have embedding
    and output rows that no adapter trains (the base weights are frozen), so with LoRA the input
    and output embeddings must be trained in full through ``lora_modules_to_save``. A new
    ``pad_token`` is exempt, as in Axolotl: padding is masked out of attention and loss."""
    trained = [t for t, key in new_tokens.items() if key != "special_tokens.pad_token"]
    if not trained:
        return
    hf: Any = model  # a transformers PreTrainedModel (duck-typed)
    layers = [hf.get_input_embeddings(), hf.get_output_embeddings()]
    names = [n.rpartition(".")[2] for n, m in model.named_modules() if n and any(m is x for x in layers)]
    missing = [n for n in dict.fromkeys(names) if n not in lora.modules_to_save]
    if missing:
        keys = sorted({new_tokens[t] for t in trained})
        shown = ", ".join(trained[:5]) + (f" and {len(trained) - 5} more" if len(trained) > 5 else "")
        raise ValueError(
            f"{'/'.join(keys)}: {len(trained)} token(s) new to the tokenizer ({shown}) get embedding rows that LoRA "
            f"alone leaves untrained; set lora_modules_to_save: [{', '.join(dict.fromkeys(names))}] to train "
            "those layers in full next to the adapters (as Axolotl requires)"
        )


def _check_target_parameters(model: nn.Module, targets: Sequence[str]) -> None:
    """Each ``lora_target_parameters`` entry ends the name of some parameter of the model (peft's
    rule), else one line naming it and the model's multi-dimensional expert-like parameters."""
    names = [n for n, p in model.named_parameters() if p.dim() >= 2]
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in names):
            tails = sorted({".".join(n.split(".")[-2:]) for n, p in model.named_parameters() if p.dim() == 3})
            hint = (
                f"; its 3-D (expert) parameters end in {', '.join(tails)}"
                if tails
                else "; it has no 3-D (expert) parameter"
            )
            raise ValueError(
                f"lora_target_parameters: no parameter of the model ends in {t!r}{did_you_mean(t.rpartition('.')[2], tails)}{hint}"
            )


def apply_lora(model: nn.Module, lora: LoraSettings) -> nn.Module:
    """``peft.get_peft_model`` with the config's LoRA settings; every base weight frozen. A base
    loaded in 4 bits goes through peft's ``prepare_model_for_kbit_training`` first (as peft's
    QLoRA recipe does: it freezes the base, keeps norms and embeddings in float32 and makes the
    input embeddings' output need grad so the adapters below the first layer get gradients)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False):
        # gradient checkpointing stays the trainer's gradient_checkpointing key, not peft's default
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)

    available = linear_module_names(model)
    targets = list(lora.target_modules) + (available if lora.target_linear else [])
    targets = list(dict.fromkeys(targets))
    if lora.regex is not None:
        if not any(re.fullmatch(lora.regex, n) for n, _ in model.named_modules()):
            raise ValueError(
                f"lora_target_modules: the regex '{lora.regex}' matches no module of the model (a string is a "
                f"regex over whole module names, e.g. 'model.layers.[\\d]+.self_attn.(q|v)_proj'); its GEMM "
                f"layers are {', '.join(available)}: give a list of those names to match them anywhere"
            )
        targets = []  # peft takes the string itself
    if not targets and not lora.target_parameters and lora.regex is None:
        raise ValueError(
            "adapter: lora needs lora_target_modules (e.g. [q_proj, v_proj]), lora_target_linear: true or "
            "lora_target_parameters (a mixture-of-experts model's expert weights)"
        )
    _check_target_parameters(model, lora.target_parameters)
    known = {n.rpartition(".")[2] for n, _ in model.named_modules()}
    for t in targets:
        if t not in known and not any(ch in t for ch in "*.?["):
            raise ValueError(
                f"lora_target_modules: no module named {t!r} in the model{did_you_mean(t, available)}; "
                f"its GEMM layers are {', '.join(available)}"
            )
    for t in lora.modules_to_save:
        if t not in known:
            raise ValueError(
                f"lora_modules_to_save: no module named {t!r} in the model{did_you_mean(t, sorted(known))}"
            )
    kwargs: dict[str, Any] = {}
    if lora.fan_in_fan_out is not None:
        kwargs["fan_in_fan_out"] = lora.fan_in_fan_out
    elif any(type(m).__name__ == "Conv1D" for m in model.modules()):
        kwargs["fan_in_fan_out"] = True  # GPT-2's Conv1D stores weights (in, out); peft needs to know
    config = LoraConfig(
        r=lora.r,
        # peft annotates lora_alpha as int but only divides it by r; lowprec takes fractional alphas (lora_alpha: float)
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=lora.regex if lora.regex is not None else targets,
        target_parameters=lora.target_parameters or None,
        modules_to_save=lora.modules_to_save or None,
        bias="none",
        task_type="CAUSAL_LM",
        **kwargs,
    )
    peft_model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    logger.info(
        "lowprec: adapter %s r=%d alpha=%g on %s: %d trainable parameters of %d (%.2f%%)",
        "qlora" if getattr(model, "is_loaded_in_4bit", False) else "lora",
        lora.r,
        lora.alpha,
        ", ".join(([f"regex {lora.regex}"] if lora.regex is not None else targets) + lora.target_parameters),
        trainable,
        total,
        100.0 * trainable / max(total, 1),
    )
    return peft_model


def is_peft_model(model: nn.Module) -> bool:
    return importlib.util.find_spec("peft") is not None and type(model).__module__.startswith("peft.")
