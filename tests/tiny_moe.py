"""Small transformers mixture-of-experts models (hidden 64, 8 experts, top-2) built from configs:
code nobody here wrote, for the FP8 experts tests. Nothing is downloaded."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    )


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2
    )
    return Qwen3MoeForCausalLM(cfg)


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
    )
    return Qwen2MoeForCausalLM(cfg)


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        layer_types=["full_attention", "full_attention"],
    )
    return GptOssForCausalLM(cfg)


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        **{**COMMON, "intermediate_size": 128},
        num_key_value_heads=4,
        moe_intermediate_size=32,
        first_k_dense_replace=0,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
    )
    return DeepseekV3ForCausalLM(cfg)


MODELS = {
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
}
# (the MoE block's router attribute, whether the experts are stored transposed)
ROUTER = {"mixtral": "gate", "qwen3_moe": "gate", "qwen2_moe": "gate", "gpt_oss": "router", "deepseek_v3": "gate"}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised model (weights drawn by transformers' own init, then the router
    and expert weights redrawn at a scale where routing is not a tie)."""
    torch.manual_seed(seed)
    model = MODELS[name]()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2 and ("experts" in n or n.endswith((".gate.weight", ".router.weight"))):
                p.normal_(0.0, 0.1)
            elif n.endswith("_bias") and "experts" in n:
                p.normal_(0.0, 0.02)
    model.config._experts_implementation = "eager"  # transformers' reference loop (float64 too)
    return model


def moe_block(model: torch.nn.Module, layer: int = 0) -> torch.nn.Module:
    return model.model.layers[layer].mlp
