"""The built-in model's shape (:class:`LlamaConfig`) and its named sizes, without torch: the
trainer's schema checks ``base_model: builtin:<name>`` and the model's limits with it before any
worker imports torch. The model itself is :mod:`lowprec.train.model` (the named sizes' table is
in its docstring)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

from lowprec.errors import did_you_mean

__all__ = ["LlamaConfig", "MODEL_NAMES", "GEMM_MULTIPLE", "round_up"]

# Linear dims must be multiples of this for FP8 GEMMs (torch._scaled_mm).
GEMM_MULTIPLE = 16


def round_up(n: int, multiple: int = GEMM_MULTIPLE) -> int:
    return -(-int(n) // multiple) * multiple


_TINY: dict[str, Any] = dict(vocab_size=272, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=512)
_PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": _TINY,
    "llama-small": dict(vocab_size=272, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408, max_seq_len=1024),
    "llama-base": dict(vocab_size=272, dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=3072, max_seq_len=2048),
    # Llama-3.2-1B: same widths, GQA 32/8, rope_theta 5e5, tied embeddings.
    "llama-1b": dict(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
    # llama-tiny's shape with 8 experts (top-2), each half as wide
    "moe-tiny": dict(_TINY, ffn_dim=192, n_experts=8, experts_per_token=2),
}
MODEL_NAMES = tuple(_PRESETS)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and initialisation of a Llama-style model.

    vocab_size: rounded up to a multiple of 16 (the LM head is a GEMM too).
    n_kv_heads: key/value heads for grouped-query attention; ``None`` means ``n_heads`` (MHA).
    ffn_dim: hidden width of the SwiGLU MLP (Llama uses about 8/3 * dim).
    max_seq_len: longest sequence ``forward`` accepts (RoPE angles are computed on the fly).
    init_std: std of the normal init; residual projections (o_proj, down_proj) use
        init_std / sqrt(2 * n_layers) so the residual stream's variance does not grow with depth.
    n_experts: 0 for the dense SwiGLU MLP; else a mixture of that many experts, each ffn_dim wide.
    experts_per_token: experts each token is routed to (top-k), 1..n_experts.
    router_aux_loss_coef: weight of the load-balancing loss added in training (MoE only).
    """

    vocab_size: int = 272
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_dim: int = 384
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    n_experts: int = 0
    experts_per_token: int = 2
    router_aux_loss_coef: float = 0.01
    name: str = dataclasses.field(default="custom", compare=False)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        if self.n_kv_heads is None:
            set_("n_kv_heads", self.n_heads)
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {f} must be a positive integer, got {v!r}")
        for f in ("n_experts", "experts_per_token"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"model {f} must be a non-negative integer, got {v!r}")
        if self.n_experts == 1 or (self.n_experts and not 1 <= self.experts_per_token <= self.n_experts):
            raise ValueError(
                f"model n_experts={self.n_experts}, experts_per_token={self.experts_per_token}: a mixture "
                "needs n_experts >= 2 and 1 <= experts_per_token <= n_experts (n_experts: 0 for a dense MLP)"
            )
        if isinstance(self.router_aux_loss_coef, bool) or not isinstance(self.router_aux_loss_coef, (int, float)):
            raise ValueError(f"model router_aux_loss_coef must be a number, got {self.router_aux_loss_coef!r}")
        set_("router_aux_loss_coef", float(self.router_aux_loss_coef))
        for f in ("rope_theta", "norm_eps", "init_std"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"model {f} must be a positive number, got {v!r}")
            set_(f, float(v))
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"model tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        set_("vocab_size", round_up(self.vocab_size))
        n_kv = cast(int, self.n_kv_heads)  # None became n_heads above; checked a positive int
        if self.dim % self.n_heads:
            raise ValueError(
                f"model dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                f"pick n_heads among {_divisors(self.dim, even_quotient=True)}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model head_dim = dim / n_heads = {self.head_dim} must be even for RoPE; change dim or n_heads"
            )
        if self.n_heads % n_kv:
            raise ValueError(
                f"model n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}; "
                f"pick n_kv_heads among {_divisors(self.n_heads)}"
            )
        for f, v in (("dim", self.dim), ("ffn_dim", self.ffn_dim)):
            if v % GEMM_MULTIPLE:
                raise ValueError(
                    f"model {f}={v} must be a multiple of {GEMM_MULTIPLE} (FP8 GEMMs need it); "
                    f"use {v - v % GEMM_MULTIPLE or GEMM_MULTIPLE} or {round_up(v)}"
                )
        if (n_kv * self.head_dim) % GEMM_MULTIPLE:
            raise ValueError(
                f"model n_kv_heads * head_dim = {self.n_kv_heads} * {self.head_dim} must be a "
                f"multiple of {GEMM_MULTIPLE} (the k_proj/v_proj width, an FP8 GEMM dim); "
                "raise n_kv_heads or head_dim"
            )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "LlamaConfig":
        """One of ``llama-tiny``, ``llama-small``, ``llama-base``, ``llama-1b``; keyword
        arguments override single fields (``vocab_size=tok.vocab_size``, ``n_layers=2``...)."""
        key = str(name).lower().replace("_", "-")
        if key not in _PRESETS:
            raise ValueError(f"unknown model name {name!r}{did_you_mean(key, _PRESETS)}; choose one of {MODEL_NAMES}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"name"}
        bad = sorted(set(overrides) - fields)
        if bad:
            hints = [f"{b!r}{did_you_mean(b, fields)}" for b in bad]
            raise ValueError(f"unknown model field(s) {', '.join(hints)}; fields are {sorted(fields)}")
        return cls(**{**_PRESETS[key], **overrides, "name": key})

    def replace(self, **changes: Any) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Analytic parameter count (equals ``LlamaForCausalLM(self).num_parameters()``)."""
        d, kv = self.dim, cast(int, self.n_kv_heads) * self.head_dim  # an int after __post_init__
        mlp = 3 * d * self.ffn_dim * max(self.n_experts, 1) + d * self.n_experts  # experts + router
        per_layer = 2 * d * d + 2 * d * kv + mlp + 2 * d
        body = self.n_layers * per_layer + d
        if exclude_embeddings:
            return body
        embed = self.vocab_size * d
        return body + embed + (0 if self.tie_embeddings else embed)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 * (matmul params) + 12 * L * d * T
        for attention scores and values (PaLM appendix B; causality is not halved)."""
        d, kv = self.dim, cast(int, self.n_kv_heads) * self.head_dim  # an int after __post_init__
        active = self.experts_per_token if self.n_experts else 1  # an MoE token runs top-k experts
        mlp = 3 * d * self.ffn_dim * active + d * self.n_experts
        matmul = self.n_layers * (2 * d * d + 2 * d * kv + mlp) + self.vocab_size * d
        return 6.0 * matmul + 12.0 * self.n_layers * d * seq_len


def _divisors(n: int, even_quotient: bool = False) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0 and (not even_quotient or (n // k) % 2 == 0)][:12]
