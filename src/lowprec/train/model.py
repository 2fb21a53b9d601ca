"""A Llama-style decoder-only transformer: the built-in model of the trainer and benchmarks.

RMSNorm -> causal self-attention (RoPE, optional grouped-query attention, SDPA) -> residual,
RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and an LM head (tied to the embedding by
default). Module names follow Hugging Face ``LlamaForCausalLM`` exactly, so layer filters,
FSDP wrap policies (``LlamaDecoderLayer``) and state-dict keys read the same as for HF models::

    model.embed_tokens
    model.layers.{i}.input_layernorm
    model.layers.{i}.self_attn.{q_proj,k_proj,v_proj,o_proj}
    model.layers.{i}.post_attention_layernorm
    model.layers.{i}.mlp.{gate_proj,up_proj,down_proj}     # gate_proj: SwiGLU gate, not a router
    model.norm
    lm_head

Every Linear has in/out features that are multiples of 16, because ``torch._scaled_mm`` (the FP8
GEMM) requires it; ``LlamaConfig`` rejects shapes that break this and pads the vocabulary.

``forward(input_ids, labels=None, attention_mask=None)`` follows Hugging Face semantics: labels
are aligned with ``input_ids`` (often the same tensor), the model shifts them by one, and
positions labelled -100 are ignored. So ``model(**batch).loss`` works as in Accelerate scripts.

Named sizes (``LlamaConfig.from_name``; parameter counts with tied embeddings):

=========== ====== ====== ====== ===== ====== ======== =========== ==================================
name        vocab  dim    layers heads kv     ffn      params      use
=========== ====== ====== ====== ===== ====== ======== =========== ==================================
llama-tiny  272    128    4      4     2      384      0.82 M      CPU tests, golden loss curves
llama-small 272    512    8      8     4      1408     23.7 M      CPU/GPU examples
llama-base  272    768    12     12    12     3072     113 M       GPU examples (GPT-2-small class)
llama-1b    128256 2048   16     32    8      8192     1.24 B      GPU benchmarks (Llama-3.2-1B shape)
moe-tiny    272    128    4      4     2      8 x 192  2.7 M       CPU: mixture of experts, top-2 of 8
=========== ====== ====== ====== ===== ====== ======== =========== ==================================

``n_experts > 0`` (``moe-tiny``) replaces each SwiGLU MLP by a mixture of experts
(``lowprec/train/moe.py``): ``mlp.gate`` (the router) and ``mlp.experts`` (``gate_up_proj``,
``down_proj``: 3-D Parameters, transformers' fused layout), ``experts_per_token`` experts per
token, each ``ffn_dim`` wide (moe-tiny: 2 x 192 active per token, as llama-tiny's 384).

The first three use the byte tokenizer's vocabulary (272 = 259 padded to 16); llama-1b keeps
Llama 3's vocabulary so that benchmarks pay for a realistic embedding and LM head. Any vocab
at least as large as the tokenizer's works; pass ``vocab_size=`` to override.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.fp8.modules.activations import rms_norm, rms_norm_plain, swiglu
from lowprec.fp8.modules.recompute import checkpoint
from lowprec.train.model_config import MODEL_NAMES, LlamaConfig, round_up
from lowprec.train.moe import MoEBlock, MoEExperts, TopKRouter
from lowprec.train.packing import packed_causal_mask

__all__ = [
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaDecoderLayer",
    "CausalLMOutput",
    "build_model",
    "MODEL_NAMES",
    "round_up",
]


# ---------------------------------------------------------------------- modules
class CausalLMOutput(NamedTuple):
    """``loss`` is None without labels. A NamedTuple (not a dataclass) so that
    ``torch.compile(fullgraph=True)`` returns it without a graph break."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class RMSNorm(nn.Module):
    # set by fp8.convert with Recipe(fp8_activations=True): backward keeps x in E4M3 (fp8/modules/activations.py)
    fp8_activations = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # with fp8_activations: the same output, an E4M3 copy of x saved for backward
        return (rms_norm if self.fp8_activations else rms_norm_plain)(x, self.weight, self.eps)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim) in float32, HF's non-interleaved layout.

    Computed per forward instead of cached in a buffer: it is (T x head_dim) work, it survives
    ``.to(bfloat16)`` (a buffer would be rounded) and meta-device init with no re-init step."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, hd) by position: x*cos + rotate_half(x)*sin, in float32."""
    h = x.float()
    x1, x2 = h.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (h * cos + rotated * sin).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kv_dim = cast(int, cfg.n_kv_heads) * cfg.head_dim  # LlamaConfig.__post_init__ fills None with n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        # head counts from the projections' outputs (-1), not the config: under tensor
        # parallelism (_tp_plan) each process holds n_heads / tp_size of them
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_heads, n_kv_heads = q.shape[1], k.shape[1]
        if n_kv_heads != n_heads:
            # GQA: each kv head serves n_heads / n_kv_heads query heads (HF repeat_kv layout).
            # expand+reshape rather than SDPA's enable_gqa, which needs torch >= 2.5.
            rep = n_heads // n_kv_heads
            k = k[:, :, None].expand(b, n_kv_heads, rep, t, self.head_dim).reshape(b, n_heads, t, self.head_dim)
            v = v[:, :, None].expand(b, n_kv_heads, rep, t, self.head_dim).reshape(b, n_heads, t, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, n_heads * self.head_dim))


class LlamaMLP(nn.Module):
    # set by fp8.convert with Recipe(fp8_activations=True): backward keeps gate, up in E4M3
    fp8_activations = False

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.fp8_activations:  # same output; E4M3 copies of gate and up saved for backward
            return self.down_proj(swiglu(gate, up))
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class LlamaDecoderLayer(nn.Module):
    """Named as in HF so FSDP wrap policies (``transformer_layer_cls_to_wrap``) find it."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp: nn.Module = MoEBlock(cfg) if cfg.n_experts else LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class LlamaForCausalLM(nn.Module):
    # tensor parallelism (transformers' convention, read by lowprec.parallelism_config): attention
    # heads and the MLP's hidden units split across processes, one all-reduce per block half
    _tp_plan = {
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
    }
    # sequence parallelism on top of it (ParallelismConfig(sequence_parallel=True)): the residual
    # stream and the norms hold a slice of the sequence per process; attention and MLP inputs are
    # all-gathered (in FP8 for FP8 layers), their rowwise outputs reduce-scattered
    _sp_plan = {
        "model.embed_tokens": "sequence_shard_output",
        "model.layers.*.input_layernorm": "sequence_parallel",
        "model.layers.*.self_attn": "sequence_gather",
        "model.layers.*.post_attention_layernorm": "sequence_parallel",
        "model.layers.*.mlp": "sequence_gather",
        "model.norm": "sequence_parallel",
        "lm_head": "sequence_gather_local",
    }

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"LlamaForCausalLM takes a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.n_experts:  # no tensor-parallel plan for experts (expert parallelism: not yet)
            self._tp_plan = {}
            self._sp_plan = {}
        self.init_weights()

    gradient_checkpointing = False

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each decoder layer in backward (``gradient_checkpointing: true``), as the
        transformers method of the same name; only ``use_reentrant: false`` is supported."""
        if (gradient_checkpointing_kwargs or {}).get("use_reentrant", False):
            raise ValueError("gradient_checkpointing_kwargs: use_reentrant: true is not supported; use false")
        self.gradient_checkpointing = True

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (tie_embeddings). ``to_empty()`` allocates each
        parameter separately, which unties them; ``init_weights`` re-ties first."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) for embeddings and Linears, init_std / sqrt(2 * n_layers) for the
        projections that write into the residual stream (GPT-2 / nanoGPT), ones for norms.
        Deterministic under ``torch.manual_seed``; call again after ``to_empty()`` from meta."""
        self.tie_weights()
        std = self.config.init_std
        resid_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and self.config.tie_embeddings:
                    continue  # same Parameter as embed_tokens
                s = resid_std if name.endswith(("o_proj", "down_proj")) else std
                nn.init.normal_(module.weight, mean=0.0, std=s)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, TopKRouter):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, MoEExperts):
                nn.init.normal_(module.gate_up_proj, mean=0.0, std=std)
                nn.init.normal_(module.down_proj, mean=0.0, std=resid_std)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied LM head counts once)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.model.embed_tokens.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """input_ids, labels, attention_mask, position_ids: (B, T). ``labels`` are aligned with
        input_ids and shifted here (position t predicts labels[t+1]); -100 is ignored.
        ``attention_mask`` has 1 for tokens and 0 for padding; without it attention is plain
        causal (the fast path). ``position_ids`` restarting at 0 mark packed examples
        (``sample_packing``): RoPE uses them and attention stays within each example."""
        b, t = input_ids.shape
        if t > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {t} exceeds the model's max_seq_len={self.config.max_seq_len}; "
                "raise max_seq_len or shorten seq_len"
            )
        cos, sin = rope_cos_sin(t, self.config.head_dim, self.config.rope_theta, input_ids.device)
        mask = None if attention_mask is None else _padding_causal_mask(attention_mask)
        if position_ids is not None:
            cos, sin = cos[position_ids][:, None], sin[position_ids][:, None]  # (B, 1, T, hd)
            packed = packed_causal_mask(position_ids)
            mask = packed if mask is None else mask & packed
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # recompute the layer in backward instead of keeping its activations; fp8's
                # checkpoint re-enters the FP8 region for the recompute (torch's alone would
                # recompute FP8 layers in high precision: a CheckpointError)

                h = checkpoint(layer, h, cos, sin, mask)
            else:
                h = layer(h, cos, sin, mask)
        logits = self.lm_head(self.model.norm(h))
        loss = None
        if labels is not None:
            # Cross-entropy in float32 even when the logits are bf16 (autocast / bf16 weights).
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
            if self.config.n_experts and self.training:  # the routers' load-balancing loss (moe.py)
                aux: list[torch.Tensor] = [
                    a for b in self.model.layers if isinstance(a := getattr(b.mlp, "aux_loss", None), torch.Tensor)
                ]
                if aux:
                    loss = loss + self.config.router_aux_loss_coef * torch.stack(aux).mean()
        return CausalLMOutput(loss, logits)


def _padding_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 1/0 padding mask -> (B, 1, T, T) boolean SDPA mask (True = attend).

    A query always sees itself, so rows of padding tokens are never fully masked (SDPA would
    return NaN there, and NaN times a zero gradient is still NaN)."""
    t = attention_mask.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    keys = attention_mask.bool()[:, None, None, :]
    eye = torch.eye(t, dtype=torch.bool, device=attention_mask.device)
    return causal & (keys | eye)


def build_model(name_or_config: str | LlamaConfig, **overrides: Any) -> LlamaForCausalLM:
    """``build_model("llama-tiny", vocab_size=tok.vocab_size)`` or ``build_model(config)``.

    Parameters are created on the current default device; build on ``torch.device("meta")``
    to inspect large sizes without memory, then ``to_empty(device=...)`` and ``init_weights()``."""
    if isinstance(name_or_config, LlamaConfig):
        cfg = name_or_config.replace(**overrides) if overrides else name_or_config
    elif isinstance(name_or_config, str):
        cfg = LlamaConfig.from_name(name_or_config, **overrides)
    else:
        raise TypeError(
            f"build_model takes a model name {MODEL_NAMES} or a LlamaConfig, got {type(name_or_config).__name__}"
        )
    return LlamaForCausalLM(cfg)
