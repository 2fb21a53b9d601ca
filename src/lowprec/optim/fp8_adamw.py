"""FP8AdamW: Adam/AdamW with an FP8 first moment, an FP16 second moment, fp32 or no masters.

Per parameter ``p`` the state holds

=================== ============================= =============================================
``exp_avg``         FP8 E4M3, ``p``'s shape       ``m * scale`` (blockwise power-of-2 scales)
``exp_avg_scale``   float32 ``(numel/block,)``    one scale per ``block_size`` elements
``exp_avg_sq``      FP16, ``p``'s shape           ``sqrt(v) * scale`` (see moments.py: why sqrt)
``exp_avg_sq_scale`` float32 ``()``               one power-of-2 scale per tensor
``master_param``    float32 (only if ``p`` is not, the weights the update is applied to;
                    and ``master_weights`` fp32)
``step``            float32 ``()``                as torch.optim.Adam keeps it
=================== ============================= =============================================

So the moments cost ``1 + 2 + 4 / block_size`` bytes per parameter (3.03 at block 128) instead
of 8. Each step decodes one parameter's moments to fp32, applies the textbook Adam(W) update in
fp32 with the fresh moments, and re-encodes them; the transient fp32 buffers are those of the
largest single parameter.

16-bit parameters (a bf16 or fp16 model): ``master_weights="fp32"`` (default) keeps a 4-byte
master copy, 7.03 bytes per parameter with the moments. ``master_weights="stochastic"`` keeps
none: the update is computed in fp32 from the 16-bit weight and written back with stochastic
rounding (unbiased: an update smaller than half a bf16 ulp still moves the weight on average,
where round-to-nearest would drop it every step), 3.03 bytes per parameter. The rounding noise
is seeded like the moments' (``seed``, step, parameter index), so runs and resumed runs are
identical. MS-AMP instead keeps a 16-bit master with a scaling factor (5.03 bytes here);
Kahan-compensated bf16 updates would also cost 2 more bytes. ``master_weights="nearest"`` keeps
none and rounds to nearest (what ``torch.optim.AdamW`` does on bf16 parameters).

Why blockwise scales for ``m``: E4M3 spans ~2^17 from its max to its smallest subnormal, and
``m`` of one weight matrix can span more (rows seen by rare tokens); a per-tensor scale flushes
those to zero. COAT's dynamic-range *expansion* (``|x|^k`` before the cast) attacks the same
problem for per-group scales; with 128-element blocks we measured no need for it (log entry).

Gradients: ``p.grad`` when set, otherwise the FP8 gradient held by O1
(``lowprec.optim.fp8_grads``), read directly without materialising a high-precision ``.grad``.

DTensor parameters (FSDP2 shards): each process steps its shard with the scales of the whole
parameter (one small all_gather per step for all parameters), so the state of a shard is bitwise
that slice of the one-process state and checkpoints reshard to any process count (``sharded.py``).

Flat parameters (DeepSpeed ZeRO partitions, which concatenate many model parameters): mark the
boundaries with :func:`set_block_segments` so that no block of the first moment mixes two model
parameters (lowprec's DeepSpeed glue does this; see ``moments.py``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, cast

import torch
from torch.optim import Optimizer

from lowprec.fp8.cast.formats import is_fp8_dtype
from lowprec.fp8.cast.quantize import dequantize
from lowprec.optim.fp8_grads import clear_fp8_grads, held_grad
from lowprec.optim.moments import (
    EXP_AVG_DTYPES,
    EXP_AVG_SQ_DTYPES,
    decode_exp_avg,
    decode_exp_avg_sq,
    encode_exp_avg,
    encode_exp_avg_sq,
    stochastic_round,
)
from lowprec.optim.sharded import (
    ShardRange,
    as_state_dtensor,
    chunked_uniform,
    agree_amaxes,
    decode_exp_avg_shard,
    encode_moments_shard,
    finish_moments_shard,
    full_block_scales,
    local_state,
    prepare_moments_shard,
    shard_range,
)

__all__ = ["FP8AdamW", "FP8Adam", "set_block_segments", "block_segments"]

DEFAULT_BLOCK_SIZE = 128
ROUNDINGS = ("nearest", "stochastic")
MASTER_WEIGHTS = ("fp32", "stochastic", "nearest")


def _master_mode(value) -> str:
    """``master_weights`` as one of MASTER_WEIGHTS (True/False keep their old meaning)."""
    mode = {True: "fp32", False: "nearest"}.get(value, value) if isinstance(value, bool) else value
    if mode not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights={value!r}; use one of {MASTER_WEIGHTS} (or True / False)")
    return mode


SEGMENTS_ATTR = "_lowprec_block_segments"


def set_block_segments(p: torch.Tensor, lengths) -> None:
    """Declare ``p`` (flat) as consecutive segments of ``lengths`` elements: FP8AdamW's
    first-moment blocks then restart at each segment. Set it before the first step and keep it:
    the block scales saved in a checkpoint follow this layout."""
    lengths = tuple(int(n) for n in lengths)
    if any(n < 0 for n in lengths) or sum(lengths) != p.numel():
        raise ValueError(
            f"block segments {lengths[:8]}{'...' if len(lengths) > 8 else ''} must be >= 0 and "
            f"sum to the parameter's {p.numel()} elements (they sum to {sum(lengths)})"
        )
    setattr(p, SEGMENTS_ATTR, tuple(n for n in lengths if n))


def block_segments(p: torch.Tensor) -> tuple[int, ...] | None:
    """The segments set by :func:`set_block_segments` (None: blocks run over the flat tensor)."""
    return getattr(p, SEGMENTS_ATTR, None)


class FP8AdamW(Optimizer):
    """Drop-in ``torch.optim.AdamW`` (``adamw=False``: ``torch.optim.Adam``) with compressed state.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (per group).
        adamw: decoupled weight decay (AdamW) when True, L2 added to the gradient (Adam) when False.
        exp_avg_dtype: storage of the first moment: FP8 E4M3 (default) or E5M2 with scales,
            or float16/bfloat16/float32 unscaled.
        exp_avg_sq_dtype: storage of ``sqrt`` of the second moment: float16 (default),
            bfloat16 or float32, with a per-tensor power-of-2 scale.
        block_size: elements per scale of the FP8 first moment; None for one scale per tensor.
        master_weights: for non-fp32 parameters (bf16/fp16 models): ``"fp32"`` (or True, the
            default) keeps fp32 master copies; ``"stochastic"`` keeps none and writes each
            update back with seeded stochastic rounding; ``"nearest"`` (or False) keeps none
            and rounds to nearest. fp32 parameters are updated in place in every mode.
        exp_avg_rounding: ``"nearest"`` (default) or ``"stochastic"`` for the FP8 first
            moment. Stochastic removes the stall of nearly constant gradients (14 -> 28 dB)
            but costs ~3 dB with noisy gradients (docs/LOG.md, optim entry).
        exp_avg_sq_rounding: ``"stochastic"`` (default) or ``"nearest"`` for ``sqrt(v)``.
            Round-to-nearest lets FP16 ``sqrt(v)`` drift low by ~6% over a few thousand steps.
        seed: seed of the rounding noise. The noise of parameter ``i`` at step ``t`` comes
            from generators seeded with ``(seed, t, i, moment)`` and the element's position:
            runs, resumed runs, data-parallel replicas and FSDP2 shards round identically, and
            no RNG state needs checkpointing.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        adamw: bool = True,
        exp_avg_dtype: torch.dtype = torch.float8_e4m3fn,
        exp_avg_sq_dtype: torch.dtype = torch.float16,
        block_size: int | None = DEFAULT_BLOCK_SIZE,
        master_weights: bool | str = "fp32",
        exp_avg_rounding: str = "nearest",
        exp_avg_sq_rounding: str = "stochastic",
        seed: int = 0,
    ):
        if not 0.0 <= lr:
            raise ValueError(f"lr={lr} must be >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"eps={eps} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas} must each lie in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        if exp_avg_dtype not in EXP_AVG_DTYPES:
            raise ValueError(f"exp_avg_dtype={exp_avg_dtype} is not supported; use one of {EXP_AVG_DTYPES}")
        if exp_avg_sq_dtype not in EXP_AVG_SQ_DTYPES:
            raise ValueError(
                f"exp_avg_sq_dtype={exp_avg_sq_dtype} is not supported; use one of "
                f"{EXP_AVG_SQ_DTYPES} (FP8 has too few mantissa bits for Adam's second moment)"
            )
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"block_size={block_size!r} must be a positive int or None")
        # Storage choices are optimizer-wide attributes, not per-group hyper-parameters, so
        # that LR schedulers and tools that walk param_groups see exactly AdamW's keys.
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.block_size = block_size
        self.master_weights = _master_mode(master_weights)
        for name, value in (("exp_avg_rounding", exp_avg_rounding), ("exp_avg_sq_rounding", exp_avg_sq_rounding)):
            if value not in ROUNDINGS:
                raise ValueError(f"{name}={value!r}; use one of {ROUNDINGS}")
        self.exp_avg_rounding = exp_avg_rounding
        self.exp_avg_sq_rounding = exp_avg_sq_rounding
        self.seed = int(seed)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw)
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------- state
    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        sr = self._shard(p)
        local = cast(Any, p).to_local() if sr is not None else p  # a DTensor where it has a shard range
        zeros = torch.zeros_like(local, dtype=torch.float32)
        state["step"] = torch.zeros((), dtype=torch.float32)
        if sr is not None:  # a DTensor shard: the one-process layout's slice (optim/sharded.py)
            (state["exp_avg"], state["exp_avg_scale"], state["exp_avg_sq"], state["exp_avg_sq_scale"]) = (
                encode_moments_shard(
                    sr, zeros, zeros, self.exp_avg_dtype, self.exp_avg_sq_dtype, self.block_size, collective=False
                )
            )  # zeros on every process: nothing to agree on
        else:
            state["exp_avg"], state["exp_avg_scale"] = encode_exp_avg(
                zeros, self.exp_avg_dtype, self.block_size, segments=block_segments(p)
            )
            state["exp_avg_sq"], state["exp_avg_sq_scale"] = encode_exp_avg_sq(zeros, self.exp_avg_sq_dtype)
        if self.master_weights == "fp32" and p.dtype != torch.float32:
            state["master_param"] = local.detach().to(torch.float32).clone()
        return state

    def _shard(self, p: torch.Tensor) -> ShardRange | None:
        """Where a DTensor parameter's shard lies (None for a plain tensor); computed once, from
        the mesh (no communication)."""
        shards = self.__dict__.setdefault("_shard_ranges", {})
        if p not in shards:
            sr = shard_range(p)
            if sr is not None and block_segments(p) is not None:
                raise ValueError("set_block_segments (flat ZeRO partitions) does not apply to DTensor parameters")
            shards[p] = sr
        return shards[p]

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        held = held_grad(p)  # raises if .grad is set too (DDP wrapped after apply_opt_level)
        if held is not None:
            return dequantize(held)
        if p.grad is None:
            return None
        if p.grad.is_sparse:
            raise TypeError("FP8AdamW does not support sparse gradients; use dense embeddings")
        g = cast(Any, p.grad).to_local() if self._shard(p) is not None else p.grad
        return g.to(torch.float32)

    def _noise(
        self, local: torch.Tensor, sr: ShardRange | None, step: int, index: int, moment: int, rounding: str, dtype
    ) -> torch.Tensor | None:
        if rounding != "stochastic" or dtype == torch.float32:
            return None
        mixed = (self.seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + index * 3 + moment) % (1 << 63)
        # element i of the parameter gets the same noise in one process and in whichever FSDP2
        # shard holds it (optim/sharded.py)
        start, total = (sr.start, sr.total) if sr is not None else (0, local.numel())
        return chunked_uniform(mixed, start, local.numel(), total, local.device).view(local.shape)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1  # position of the parameter across groups: seeds its rounding noise
        # DTensor shards: new moments wait here until one all_gather agrees every parameter's
        # boundary-block and tensor amaxes (optim/sharded.py), then are encoded
        pending: list[tuple[dict, object, int, int, torch.Tensor]] = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                g = self._grad(p)
                if g is None or p.numel() == 0:
                    continue
                state = self.state[p] if len(self.state[p]) else self._init_state(p)
                sr = self._shard(p)
                local = p.to_local() if sr is not None else p  # a DTensor's shard, updated in place
                master = state.get("master_param", local)
                if master.dtype != torch.float32:  # no master copy: update a transient fp32 copy
                    master = local.to(torch.float32)
                if wd and not group["adamw"]:
                    g = g.add(master, alpha=wd)
                state["step"] += 1
                t = state["step"].item()

                segments = block_segments(p)
                if sr is not None:
                    m = decode_exp_avg_shard(sr, state["exp_avg"], state["exp_avg_scale"], self.block_size)
                else:
                    m = decode_exp_avg(state["exp_avg"], state["exp_avg_scale"], self.block_size, segments)
                v = decode_exp_avg_sq(state["exp_avg_sq"], state["exp_avg_sq_scale"])
                m.lerp_(g, 1.0 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)

                if wd and group["adamw"]:
                    master.mul_(1.0 - lr * wd)
                bias1 = 1.0 - beta1**t
                bias2 = 1.0 - beta2**t
                denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
                master.addcdiv_(m, denom, value=-lr / bias1)
                step = int(t)
                if master is not local:
                    mode = "stochastic" if self.master_weights == "stochastic" else "nearest"
                    noise = self._noise(local, sr, step, index, 2, mode, p.dtype)
                    local.copy_(master if noise is None else stochastic_round(master, p.dtype, noise))

                if sr is not None:
                    pm = prepare_moments_shard(sr, m, v, self.exp_avg_dtype, self.exp_avg_sq_dtype, self.block_size)
                    pending.append((state, pm, step, index, local))
                    continue
                m_noise = self._noise(local, sr, step, index, 0, self.exp_avg_rounding, self.exp_avg_dtype)
                v_noise = self._noise(local, sr, step, index, 1, self.exp_avg_sq_rounding, self.exp_avg_sq_dtype)
                state["exp_avg"], state["exp_avg_scale"] = encode_exp_avg(
                    m, self.exp_avg_dtype, self.block_size, m_noise, segments
                )
                state["exp_avg_sq"], state["exp_avg_sq_scale"] = encode_exp_avg_sq(v, self.exp_avg_sq_dtype, v_noise)
            clear_fp8_grads(group["params"])  # held FP8 gradients are used up by the step
        for (state, pm, step, index, local), everyone in zip(pending, agree_amaxes([e[1] for e in pending])):
            # noise drawn only now: it depends on the element, not on when it is drawn
            m_noise = self._noise(local, pm.sr, step, index, 0, self.exp_avg_rounding, self.exp_avg_dtype)
            v_noise = self._noise(local, pm.sr, step, index, 1, self.exp_avg_sq_rounding, self.exp_avg_sq_dtype)
            (state["exp_avg"], state["exp_avg_scale"], state["exp_avg_sq"], state["exp_avg_sq_scale"]) = (
                finish_moments_shard(pm, everyone, m_noise, v_noise)
            )
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            clear_fp8_grads(group["params"])

    # ------------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but keeps each state tensor's saved dtype.

        ``torch.optim.Optimizer.load_state_dict`` casts floating state to the parameter's dtype,
        which would turn the FP8 payload into fp32 (wasting memory) and, for bf16 parameters,
        round the FP16 second moment through bf16 (losing bits). We load, then put back the
        saved tensors exactly.
        """
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        saved_groups = state_dict["param_groups"]
        for saved_g, g in zip(saved_groups, self.param_groups):
            for pid, p in zip(saved_g["params"], g["params"]):
                if pid not in saved_state:
                    continue
                sr = self._shard(p)
                for k, v in saved_state[pid].items():
                    if isinstance(v, torch.Tensor):
                        if sr is not None:  # DTensor parameter: keep this process's shard
                            v = local_state(sr, k, v, self.block_size)
                        if k == "exp_avg" and v.dtype == torch.uint8 and is_fp8_dtype(self.exp_avg_dtype):
                            v = v.view(self.exp_avg_dtype)  # saved from FSDP2 shards as bytes
                        dev = v.device if k == "step" else p.device
                        self.state[p][k] = v.detach().to(device=dev, copy=True)

    def state_dict(self) -> dict:
        """As torch's; for DTensor (FSDP2) parameters in the one-process layout that DCP
        reshards: payloads (FP8 as uint8) and masters as DTensors placed like the parameter, the first moment's
        block scales whole on every process (optim/sharded.py). Collective then."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            sr = self._shard(p) if i in sd["state"] else None
            if sr is None:
                continue
            st = dict(sd["state"][i])  # torch packs the live dicts: never edit those
            for k in ("exp_avg", "exp_avg_sq", "master_param"):
                if k in st:  # FP8 as bytes: gloo cannot all-gather FP8 (FULL_STATE_DICT gathers)
                    t = st[k]
                    st[k] = as_state_dtensor(sr, t.view(torch.uint8) if is_fp8_dtype(t.dtype) else t)
            st["exp_avg_scale"] = full_block_scales(sr, st["exp_avg_scale"], self.block_size)
            sd["state"][i] = st
        return sd


class FP8Adam(FP8AdamW):
    """:class:`FP8AdamW` with Adam's L2 weight decay (default 0, as ``torch.optim.Adam``)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        **kwargs,
    ):
        kwargs.setdefault("adamw", False)
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
