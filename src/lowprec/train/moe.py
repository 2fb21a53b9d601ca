"""The built-in model's mixture-of-experts MLP (``builtin:moe-tiny``): top-k routing over
SwiGLU experts stored as two 3-D Parameters, transformers 5's fused layout (``MixtralExperts``)::

    model.layers.{i}.mlp.gate                      TopKRouter: weight (n_experts, dim), float32 softmax
    model.layers.{i}.mlp.experts.gate_up_proj      (n_experts, 2 * ffn_dim, dim)  [gate; up]
    model.layers.{i}.mlp.experts.down_proj         (n_experts, dim, ffn_dim)

Routing is Mixtral's: softmax over all experts, the top ``experts_per_token`` renormalised to
sum to 1. Training adds Switch Transformer's load-balancing loss, ``n_experts * sum_e f_e * P_e``
(``f_e``: the fraction of routed (token, choice) pairs that went to expert ``e``, ``P_e``: its
mean router probability; 1.0 when balanced), times ``router_aux_loss_coef``, to the model's
loss, as ``MixtralForCausalLM`` does with ``output_router_logits``; eval losses are the plain
cross-entropy. Because the experts module has the fused layout and the attributes transformers'
``use_experts_implementation`` records, ``fp8.convert`` runs it in FP8 the way it runs
Mixtral's (``lowprec/fp8/modules/experts.py``); in high precision it runs the same routing and one GEMM
per expert holding tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.fp8.modules.autocast import torch_autocast_dtype
from lowprec.fp8.modules.experts import experts_layout, run_experts
from lowprec.fp8.modules.grouped import grouped_mm_hp

if TYPE_CHECKING:
    from lowprec.train.model import LlamaConfig

__all__ = ["TopKRouter", "MoEExperts", "MoEBlock"]


class TopKRouter(nn.Module):
    """``(probabilities (T, E) float32, top-k weights (T, k), top-k expert ids (T, k))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = F.linear(x.float(), self.weight.float()).softmax(dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        return probs, weights / weights.sum(dim=-1, keepdim=True), index


class MoEExperts(nn.Module):
    """SwiGLU experts in transformers' fused layout (see module docstring)."""

    # the layout attributes transformers' use_experts_implementation records on its classes
    has_gate, has_bias, is_transposed, has_post_expert_norm = True, False, False, False
    _is_expert_parallel = False

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_experts = cfg.n_experts
        self.num_experts_per_tok = cfg.experts_per_token  # transformers' name, read by the cost model
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.ffn_dim, cfg.dim))
        self.down_proj = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim))

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        layout = experts_layout(self)
        assert layout is not None  # this class has the fused layout by construction
        hp = torch_autocast_dtype(hidden.device.type, hidden.dtype)

        def gemm(proj: str, x: torch.Tensor, weight: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
            return grouped_mm_hp(x, weight, counts, hp)

        return run_experts(self, layout, hidden, top_k_index, top_k_weights, gemm)


class MoEBlock(nn.Module):
    """Router + experts; ``aux_loss`` holds the last training forward's load-balancing loss."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = MoEExperts(cfg)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs, weights, index = self.gate(h)
        if self.training and torch.is_grad_enabled():
            n = probs.shape[-1]
            routed = F.one_hot(index, n).sum(dim=1).float().mean(dim=0) / index.shape[-1]  # f_e
            self.aux_loss = n * (routed * probs.mean(dim=0)).sum()
        else:
            self.aux_loss = None
        return self.experts(h, index, weights.to(h.dtype)).reshape(shape)
