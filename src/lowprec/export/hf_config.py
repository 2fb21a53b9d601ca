"""The Hugging Face ``config.json`` an export writes: a transformers model's own config, or, for
lowprec's built-in Llama-style model, the transformers ``LlamaConfig`` it is equivalent to (same
parameter names, SwiGLU MLP, RMSNorm, non-interleaved RoPE, grouped-query attention)."""

from __future__ import annotations

from typing import Any

from torch import nn

from lowprec.train.model import LlamaForCausalLM

__all__ = ["hf_config_of", "builtin_to_llama", "builtin_to_mixtral"]


def builtin_to_llama(cfg: dict[str, Any]) -> dict[str, Any]:
    """lowprec's ``LlamaConfig`` (``config.json`` of a built-in run) as transformers' Llama config."""
    dim, heads = int(cfg["dim"]), int(cfg["n_heads"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": dim,
        "intermediate_size": int(cfg["ffn_dim"]),
        "num_hidden_layers": int(cfg["n_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("n_kv_heads") or heads),
        "head_dim": dim // heads,
        "max_position_embeddings": int(cfg["max_seq_len"]),
        "rope_theta": float(cfg["rope_theta"]),
        "rms_norm_eps": float(cfg["norm_eps"]),
        "tie_word_embeddings": bool(cfg["tie_embeddings"]),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "bfloat16",
    }


def builtin_to_mixtral(cfg: dict[str, Any]) -> dict[str, Any]:
    """A built-in MoE config (``builtin:moe-tiny``) as transformers' Mixtral config: the same
    attention and norms as Llama, ``mlp.gate`` (softmax over every expert, the top k renormalised)
    and ``mlp.experts`` (fused SwiGLU ``gate_up_proj`` / ``down_proj``) as ``MixtralSparseMoeBlock``."""
    out = builtin_to_llama(cfg)
    for k in ("mlp_bias",):
        out.pop(k)
    out.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=int(cfg["n_experts"]),
        num_experts_per_tok=int(cfg["experts_per_token"]),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.01)),
        output_router_logits=False,
        router_jitter_noise=0.0,
        sliding_window=None,
    )
    return out


def hf_config_of(model: nn.Module) -> dict[str, Any]:
    hf: Any = getattr(model, "config", None)  # duck-typed: a transformers config, or anything else
    if hasattr(hf, "to_dict") and hasattr(hf, "model_type"):  # a transformers PreTrainedConfig
        d = hf.to_dict()
        d.pop("quantization_config", None)
        if not d.get("architectures"):
            d["architectures"] = [type(model).__name__]
        d["dtype"] = "bfloat16"
        return d
    if isinstance(model, LlamaForCausalLM):
        cfg = model.config.to_dict()
        return builtin_to_mixtral(cfg) if cfg.get("n_experts") else builtin_to_llama(cfg)
    raise ValueError(
        f"export_model: a {type(model).__name__} has no Hugging Face config; pass config= "
        "(the config.json dict transformers should load it with)"
    )
