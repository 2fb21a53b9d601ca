"""Expert parallelism for lowprec's FP8 expert modules, with FP8 token dispatch.

:func:`apply_expert_parallel` shards every FP8 experts module of a model (``fp8/modules/experts.py``:
``builtin:moe-tiny``'s ``MoEExperts``, transformers' fused ``MixtralExperts``-style classes)
over the ``ep_size`` processes of a group: rank ``r`` owns experts ``r * E/ep .. (r+1) * E/ep - 1``.

Parameters
    Each rank keeps only its slice of the 3-D expert weights (and biases), **a plain local
    Parameter** ``(E/ep, ...)`` under the same name (no DTensor). The Parameter objects are
    new: build the optimizer after this call (the Accelerator remaps one built before
    ``prepare`` by name). ``state_dict()`` keys are unchanged and hold the rank's slice;
    :func:`gather_expert_state` (called by ``Accelerator.get_state_dict`` /
    ``full_model_state_dict``, on every rank) all-gathers them to the whole ``(E, ...)``
    tensors, and ``load_state_dict`` of a whole tensor keeps this rank's slice (a checkpoint of
    the unsharded model loads as it is). The grouped GEMMs' per-expert FP8 state (``fp8_<proj>``
    buffers, delayed scaling's histories) is sliced, gathered and loaded the same way, and the
    experts' optimizer state by :func:`gather_expert_optimizer_state` /
    :func:`slice_expert_optimizer_state`: a checkpoint holds every expert whole and loads on any
    ``ep_size`` (or one process without expert parallelism). Non-expert weights are
    replicated: their gradients are partial sums over each rank's tokens and need the
    data-parallel reduction the caller already does (DDP, FSDP2 with the experts as its
    ``ignored_params`` (the Accelerator does both), or the all-reduce of a test).

Forward, per experts module (every rank routes its own tokens with its own router)
    1. sort the (token, choice) rows by global expert (as the single-process path does), so
       the rows bound for each owner are contiguous; ``all_to_all_single`` of the per-expert
       counts (int64), then the **dispatch** ``all_to_all_single`` of the rows;
    2. the owner puts the rows it received in expert-major, sender-minor order: expert ``e``'s
       group holds rank 0's rows, then rank 1's, ..., which is the group one process would
       form from the ranks' batches concatenated in rank order;
    3. the owner runs the grouped GEMMs of its experts (gate, bias, post-norm as usual);
    4. the **combine** ``all_to_all_single`` returns each row to its sender, which weights the
       rows by its routing weights and sums each token's ``k`` rows (``experts.combine``).

Backward runs the same exchanges the other way (each one an autograd Function): the gradient
of the combined rows goes to the owners (the *gradient all-to-all*, FP8), the gradient of the
dispatched rows comes back to the senders (as the combine travels: its consumer, like the
combine's, is the residual stream).

What travels in FP8 (``payload="fp8"``, the default), packed as ``uint8`` (gloo has no FP8):

=======================  =============================================  =========================
exchange                 tensorwise                                      rowwise
=======================  =============================================  =========================
dispatch (forward)       E4M3 rows; one scale per expert: the per-       E4M3 rows + one float32
                         expert amax all-reduced (MAX, ``E`` floats)     scale per row (4 bytes
                         over the group first, so every sender casts     appended to the row)
                         with the scale the owner's GEMM derives; the
                         scales are not sent (every rank computes them)
gradient (backward)      the same, E5M2 (the recipe's dY dtype)          the same, the recipe's dY
                                                                         dtype (E4M3)
combine (forward)        ``combine="hp"`` (default): the GEMM's output   same
                         dtype; ``"bf16"``; ``"fp8"``: E4M3 + a float32
                         scale per row from the row's own amax
dispatch grad (backward) the same as the combine (``hp``: the input's    same
                         dtype)
=======================  =============================================  =========================

The combine stays in high precision by default: it feeds no GEMM (the rows are weighted and
summed into the residual stream), so FP8 there is one more rounding that one process does not
have. Measured (``benchmarks/ep_combine.py``, moe-tiny experts, 5 seeds of fresh random data,
2 and 4 processes): ``combine="fp8"`` sends 0.516x the bf16 bytes each way and lowers the output
SQNR vs float64 from 23.7-23.8 dB to 23.1 dB (-0.6 dB) and the input gradient's by 0.3
(tensorwise) to 0.6 dB (rowwise): more than the 0.5 dB the MoE targets allow, so it is opt-in
(``ParallelismConfig(ep_combine="fp8")``, trainer ``ep_combine: fp8``); its output is 31.8 dB from
a bf16 combine's, and training losses over 2 and 4 processes stay within 3e-3 of one process.

The owner dequantizes the rows to float32 and its grouped GEMM casts them again. Casting a
dequantized FP8 tensor with its own amax gives back the same FP8 values, so the output GEMM
(and grad_input) multiplies the FP8 values one process would: with rowwise's power-of-two
row scales bit for bit; tensorwise's re-derived scale can differ from the sender's in its last
float32 bit. What differs from one process: the grad_weight GEMM casts the dequantized rows
along the token dim (rowwise's column scales), i.e. from values already rounded once to FP8
(one more rounding, in grad_weight only), and the order of the float sums. Bytes per row:
``H`` (+4 for rowwise) against ``2 H`` in bf16.

Recipes whose first-GEMM input cast is not tensor- or row-scaled (delayed, blockwise, MX,
NVFP4), a projection kept in high precision, or FP8 off (``fp8.autocast(enabled=False)``):
the rows travel in bf16 (``payload="bf16"``, also the explicit baseline), logged once per
reason. Limits: no tensor parallelism inside an expert-parallel group; ``to_experts`` /
``unconvert`` of a sharded module is refused; ``ep_size`` must divide the expert count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lowprec.logs import log_once
from lowprec.fp8.modules.experts import GEMM_PREFIX, Float8Experts, combine, expert_rows, route
from lowprec.fp8.modules.linear_fn import cast
from lowprec.fp8.cast.formats import fp8_max
from lowprec.fp8.cast.torch_casts import saturate_
from lowprec.fp8.modules.sharding import EP_LOCAL

__all__ = [
    "ExpertParallelState",
    "apply_expert_parallel",
    "run_experts_parallel",
    "check_expert_parallel",
    "expert_parallel_names",
    "gather_expert_state",
    "gather_expert_optimizer_state",
    "slice_expert_optimizer_state",
]

PAYLOADS = ("fp8", "bf16")
COMBINES = ("hp", "bf16", "fp8")


@dataclass
class ExpertParallelState:
    """What a sharded experts module needs to exchange tokens (kept on the module)."""

    group: Any
    size: int
    rank: int
    num_experts: int  # global
    local: int  # experts on this rank
    payload: str = "fp8"
    # the owners' side of backward is scaled by this (the senders' gradient by its inverse):
    # 1 / ep_size gives DDP's averaging to the expert weights (their gradients are sums over
    # every rank's tokens); 1.0 leaves them sums (a loss already divided by the global count)
    grad_scale: float = 1.0
    # the owners' rows back to their senders (forward combine, backward dispatch gradient):
    # ``hp`` the rows' own dtype (bf16 under bf16 training), ``bf16``, or ``fp8`` (E4M3 + a
    # float32 scale per row, while FP8 is on)
    combine: str = "hp"

    @property
    def first(self) -> int:
        return self.rank * self.local

    def forward(self, module, hidden_states, top_k_index, top_k_weights, recipe, gemm) -> torch.Tensor:
        """``Float8Experts.forward``'s path for a sharded module: :func:`run_experts_parallel`."""
        return run_experts_parallel(module, hidden_states, top_k_index, top_k_weights, recipe, gemm)


# ------------------------------------------------------------------ validation
def check_expert_parallel(num_experts: int, ep_size: int, what: str = "ep_size") -> None:
    """One ValueError naming the key when ``ep_size`` cannot shard ``num_experts``."""
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"{what}={ep_size!r}: a positive integer (the processes sharing the experts)")
    if num_experts % ep_size:
        raise ValueError(
            f"{what}={ep_size} does not divide the model's {num_experts} experts; set {what} to a divisor "
            f"of {num_experts} (each process owns num_experts / {what} of them)"
        )


def _fp8_experts(model: nn.Module) -> list[tuple[str, Any]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Float8Experts)]


def apply_expert_parallel(
    model: nn.Module,
    ep_size: Optional[int] = None,
    group: Any = None,
    payload: str = "fp8",
    grad_scale: float = 1.0,
    combine: str = "hp",
) -> int:
    """Shard every FP8 experts module of ``model`` over ``group`` (default: a new group of every
    process; its size must equal ``ep_size`` when both are given); returns how many modules.
    The group should be one no other collective runs on during backward (DDP's gradient
    all-reduces would interleave with the all-to-alls in a different order on each rank). Call after
    ``fp8.convert`` and before building the optimizer. ``payload``: ``fp8`` or ``bf16`` (the
    rows' wire format to the owners); ``combine``: ``hp``, ``bf16`` or ``fp8`` (their way back);
    ``grad_scale``: see :class:`ExpertParallelState`. See the module docstring."""
    if payload not in PAYLOADS:
        raise ValueError(f"apply_expert_parallel(payload={payload!r}): one of {', '.join(PAYLOADS)}")
    if combine not in COMBINES:
        raise ValueError(f"apply_expert_parallel(combine={combine!r}): one of {', '.join(COMBINES)}")
    modules = _fp8_experts(model)
    if not modules:
        raise ValueError(
            f"ep_size={ep_size}: {type(model).__name__} has no FP8 expert modules (fused 3-D experts converted by "
            "lowprec.fp8.convert); convert the model with FP8 first, or set ep_size to 1"
        )
    if group is None:  # a group of its own: see the docstring
        group = dist.new_group(list(range(dist.get_world_size())))
    size = dist.get_world_size(group)
    if ep_size is not None and ep_size != size:
        raise ValueError(
            f"ep_size={ep_size} but the expert-parallel group has {size} processes; pass a group of {ep_size}"
        )
    rank = dist.get_rank(group)
    for name, m in modules:
        if m.__dict__.get("fp8_ep") is not None:
            raise ValueError(f"{name or type(m).__name__} is already expert-parallel")
        layout = m.fp8_layout
        if layout.grouped:
            raise ValueError(
                f"{name or type(m).__name__} is called with tokens already grouped (torchtitan's GroupedExperts): "
                "lowprec's expert parallelism dispatches the router's choices of transformers-style experts; "
                "use torchtitan's own expert parallelism for it, or ep_size 1"
            )
        check_expert_parallel(layout.num_experts, size)
        state = ExpertParallelState(
            group, size, rank, layout.num_experts, layout.num_experts // size, payload, grad_scale, combine
        )
        _shard(m, state)
    return len(modules)


def _sharded(model: nn.Module) -> list[tuple[str, Any]]:
    """``(prefix, module)`` of the sharded experts modules (prefix ends with a dot, or empty)."""
    return [(f"{n}." if n else "", m) for n, m in _fp8_experts(model) if m.__dict__.get("fp8_ep") is not None]


def _expert_keys(prefix: str, m: Any) -> list[str]:
    """The state_dict keys of ``m`` with a leading expert dim: the weights (biases), the
    grouped GEMMs' saved per-expert state."""
    ep: ExpertParallelState = m.fp8_ep
    return [
        prefix + k
        for k, v in m.state_dict(keep_vars=True).items()
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == ep.local
    ]


def gather_expert_state(model: nn.Module, state_dict: dict) -> dict:
    """``state_dict`` (the model's, this rank's slices) with every sharded expert tensor
    all-gathered along dim 0 to the whole model's ``(E, ...)``: a checkpoint one process loads.
    A collective: every rank of the expert-parallel group calls it."""
    for prefix, m in _sharded(model):
        ep: ExpertParallelState = m.fp8_ep
        for key in _expert_keys(prefix, m):
            local = state_dict[key].detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(ep.size)]
            dist.all_gather(parts, local, group=ep.group)
            state_dict[key] = torch.cat(parts)
    return state_dict


def _optimizer_experts(optimizer: Any, model: Optional[nn.Module] = None) -> list[tuple[Any, torch.Tensor, Any]]:
    """``(key in the optimizer's state_dict, parameter, its expert-parallel group)`` of every
    sharded expert parameter the optimizer holds. The key: its index (``Optimizer.state_dict``
    numbers parameters in group order) or, given ``model``, its name (torch.distributed's
    ``get_optimizer_state_dict`` keys states by fully qualified name, as under FSDP2)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    return [
        (names.get(id(p)) if model is not None else i, p, p._lowprec_ep_group)
        for i, p in enumerate(params)
        if hasattr(p, "_lowprec_ep_group")
    ]


def gather_expert_optimizer_state(optimizer: Any, state_dict: dict, model: Optional[nn.Module] = None) -> dict:
    """``state_dict`` (the optimizer's) with each sharded expert parameter's state tensors of its
    shape (AdamW's moments) all-gathered along dim 0 to the whole ``(E, ...)``: the state one
    process would hold, which :func:`slice_expert_optimizer_state` cuts back to a rank's slice.
    The slices come from the optimizer itself (under FSDP2 only rank 0's ``state_dict`` has
    states); they are written where ``state_dict`` has the parameter (``model``: keys are
    names). A collective over each expert group: every rank calls it. Scalars (``step``) are the
    same on every rank and stay as they are."""
    states = state_dict.get("state", {})
    for key, p, group in _optimizer_experts(optimizer, model):
        live = optimizer.state.get(p, {})
        whole = {}
        for k in sorted(k for k, v in live.items() if isinstance(v, torch.Tensor) and v.shape == p.shape):
            local = live[k].detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local, group=group)
            whole[k] = torch.cat(parts)
        if key in states:  # a copy: Optimizer.state_dict() hands out the live per-parameter dicts
            states[key] = {**states[key], **{k: v.to(states[key][k].device) for k, v in whole.items()}}
        elif states and whole:  # a state_dict with states, but not this expert's: its moments would be lost
            raise RuntimeError(
                f"expert-parallel checkpoint: the optimizer state being saved has no entry {key!r} for a sharded "
                f"expert parameter (its keys: {sorted(states)[:4]}...); the names differ from the model's "
                "(a wrapped or compiled model?): save from the model the optimizer was built for"
            )
    return state_dict


def slice_expert_optimizer_state(optimizer: Any, state_dict: dict, model: Optional[nn.Module] = None) -> dict:
    """``state_dict`` with every whole ``(E, ...)`` state tensor of a sharded expert parameter cut
    to this rank's slice (:func:`gather_expert_optimizer_state`'s inverse; nothing to do without
    expert parallelism or for a state already of the slice's shape). A state of another number
    of experts (one rank's slice saved by another process count) is a ValueError naming the
    parameter: cut, it would give this rank's moments to other experts."""
    states = state_dict.get("state", {})
    for key, p, group in _optimizer_experts(optimizer, model):
        if key not in states:
            continue
        local, first = p.shape[0], dist.get_rank(group) * p.shape[0]
        whole = local * dist.get_world_size(group)
        cut = {}
        for k, v in states[key].items():
            if isinstance(v, torch.Tensor) and v.dim() == p.dim() and v.shape[1:] == p.shape[1:]:
                if v.shape[0] not in (local, whole):
                    raise ValueError(
                        f"the optimizer state {k!r} of expert parameter {key!r} holds {v.shape[0]} experts; the "
                        f"model has {whole} ({local} on this process): a checkpoint that kept one process's experts "
                        "loads on that process count only; resume with the process count that saved it"
                    )
                v = v[first : first + local] if v.shape[0] != local else v
            cut[k] = v
        states[key] = cut
    return state_dict


def _load_slices(m: Any, state_dict: dict, prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook of a sharded module: a whole ``(E, ...)`` expert tensor (a
    checkpoint of the unsharded model, or :func:`gather_expert_state`'s) loads as this rank's slice."""
    ep: ExpertParallelState = m.fp8_ep
    for key in _expert_keys(prefix, m):
        v = state_dict.get(key)
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == ep.num_experts != ep.local:
            state_dict[key] = v[ep.first : ep.first + ep.local]


def expert_parallel_names(model: nn.Module) -> list[str]:
    """The fully qualified names of the parameters and buffers each rank keeps its own after
    :func:`apply_expert_parallel` (what DDP must neither broadcast nor all-reduce)."""
    out = []
    for prefix, m in _sharded(model):
        out += [prefix + n for n, _ in m.named_parameters()] + [prefix + n for n, _ in m.named_buffers()]
    return out


def _shard(m: Any, ep: ExpertParallelState) -> None:
    """Keep this rank's experts: each expert Parameter sliced along dim 0, the grouped GEMMs'
    per-expert buffers and slots too."""
    lo, hi = ep.first, ep.first + ep.local
    layout = m.fp8_layout
    names = list(layout.projections) + ([f"{p}_bias" for p in layout.projections] if layout.bias else [])
    for n in names:
        p = getattr(m, n)
        new = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
        new._lowprec_ep_group = ep.group  # type: ignore[attr-defined]  # clip_grad_norm: a norm over all ranks
        setattr(m, n, new)
    for g in m.fp8_gemms().values():
        for bname, buf in list(g._buffers.items()):
            if buf is not None and buf.dim() and buf.shape[0] == g.num_experts:
                g._buffers[bname] = buf[lo:hi].clone()
        g._slots = g._slots[lo:hi]
        for j, s in enumerate(g._slots):
            s.__dict__["_index"] = j
        g.num_experts = ep.local
        g.__dict__[EP_LOCAL] = True  # each rank's own weights: no wrapper frees them (sharding.weight_sharded)
    m.__dict__["fp8_ep"] = ep
    m._register_load_state_dict_pre_hook(_load_slices, with_module=True)


# ------------------------------------------------------------------ FP8 payloads
@dataclass
class _Wire:
    """How rows travel one way: ``mode`` is ``tensor`` (FP8, per-expert scales from an
    all-reduced amax), ``axis`` (FP8 + a float32 scale per row, the receiving GEMM's cast),
    ``row`` (E4M3 + a float32 scale per row from the row's amax: the combine, which feeds no GEMM)
    or ``hp`` (``dtype``, or the rows' own dtype when ``None``)."""

    mode: str
    dtype: Optional[torch.dtype]  # hp: None keeps the rows' own dtype
    spec: Any = None  # OperandCast of the receiving GEMM (tensor: its scale options)
    recipe: Any = None


def _in_fp8(module: nn.Module, proj: str) -> bool:
    """Whether projection ``proj`` of an experts module runs FP8 GEMMs now (converted, not moved
    to high precision by the FP8 guard)."""
    grouped = module._modules.get(GEMM_PREFIX + proj)
    return grouped is not None and not getattr(grouped, "high_precision", False)


def _wire_for(recipe: Any, has_fp8_gemm: bool, operand: str, payload: str) -> _Wire:
    """The wire format for the rows feeding the FP8 GEMM operand ``operand`` (``x``: the first
    projection's input, forward; ``dy``: the down projection's output gradient, backward)."""
    if payload == "bf16" or recipe is None:
        return _Wire("hp", torch.bfloat16)
    if not has_fp8_gemm:
        log_once(
            "lowprec expert parallelism: a projection kept in high precision receives its rows in bf16 "
            f"({operand}: FP8 payloads only feed FP8 GEMMs)"
        )
        return _Wire("hp", torch.bfloat16)
    plan = recipe.plan
    gemm = plan.fprop if operand == "x" else plan.dgrad
    spec = None if gemm.high_precision else gemm.casts[0]
    if (
        spec is None
        or getattr(recipe.kind, "keeps_history", False)
        or spec.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)
        or spec.granularity not in ("tensor", "axis")
    ):
        log_once(
            f"lowprec expert parallelism: recipe {recipe.name!r}: token rows ({operand}) travel in bf16 "
            "(FP8 dispatch supports tensor- and row-scaled casts without amax history: tensorwise, rowwise)"
        )
        return _Wire("hp", torch.bfloat16)
    return _Wire(spec.granularity, spec.dtype, spec, recipe)


def _combine_wire(recipe: Any, ep: ExpertParallelState) -> _Wire:
    """The wire format of the rows going back to their senders (forward combine, backward
    dispatch gradient): ``combine="fp8"`` E4M3 row-scaled while FP8 is on, ``bf16``, else the
    rows' own dtype."""
    if ep.combine == "fp8" and recipe is not None:
        return _Wire("row", torch.float8_e4m3fn)
    return _Wire("hp", torch.bfloat16 if ep.combine == "bf16" else None)


def _tensor_scales(rows: torch.Tensor, expert_of_row: torch.Tensor, wire: _Wire, ep: ExpertParallelState):
    """One scale per global expert: the recipe's scale for the amax of that expert's rows on
    every rank of the group (one all-reduce of ``E`` floats)."""
    amax = torch.zeros(ep.num_experts, dtype=torch.float32, device=rows.device)
    if rows.numel():
        row_amax = rows.detach().abs().amax(dim=1).to(torch.float32)
        amax.scatter_reduce_(0, expert_of_row, row_amax, "amax")
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=ep.group)
    scales = torch.ones_like(amax)
    for e, a in enumerate(amax.tolist()):
        if a > 0:  # the recipe's own cast of a tensor whose amax is a: the same scale options
            scales[e] = cast(amax[e].reshape(1, 1), wire.spec, 1, wire.recipe).scale.reshape(())
    return scales


def _encode(rows: torch.Tensor, expert_of_row: torch.Tensor, wire: _Wire, ep: ExpertParallelState):
    """``(wire tensor, per-expert scales or None)`` for ``rows`` (S, H)."""
    if wire.mode == "hp" or wire.dtype is None:
        return rows.detach().to(wire.dtype or rows.dtype), None
    if wire.mode == "tensor":
        scales = _tensor_scales(rows, expert_of_row, wire, ep)
        scaled = rows.detach().to(torch.float32) * scales[expert_of_row].unsqueeze(1)
        return saturate_(scaled, wire.dtype).view(torch.uint8), scales
    if wire.mode == "row":  # the combine: E4M3 at the row's own amax (no GEMM to match)
        y = rows.detach().to(torch.float32)
        amax = y.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, fp8_max(wire.dtype) / amax, torch.ones_like(amax))
        data = saturate_(y * scale, wire.dtype)
    else:  # axis: one scale per row, the receiving GEMM's cast
        q = cast(rows.detach(), wire.spec, 1, wire.recipe)
        data, scale = q.data, q.scale.reshape(-1, 1).to(torch.float32)
    return torch.cat([data.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1), None


def _decode(buf: torch.Tensor, expert_of_row: torch.Tensor, scales, wire: _Wire, width: int) -> torch.Tensor:
    """float32 rows (or the hp dtype) from what arrived."""
    if wire.mode == "hp" or wire.dtype is None:
        return buf
    if wire.mode == "tensor":
        return buf.view(wire.dtype).to(torch.float32) / scales[expert_of_row].unsqueeze(1)
    data = buf[:, :width].contiguous().view(wire.dtype).to(torch.float32)
    scale = buf[:, width:].contiguous().view(torch.float32)
    return data / scale


def _a2a(buf: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = buf.new_empty((sum(recv), *buf.shape[1:]))
    dist.all_to_all_single(out, buf.contiguous(), recv, send, group=group)
    return out


def _back(rows: torch.Tensor, r: "_Route", dtype: torch.dtype) -> torch.Tensor:
    """``rows`` (owner side, received order) to their senders in ``r.back_wire``, as ``dtype``."""
    buf, _ = _encode(rows.to(dtype), r.expert_recv, r.back_wire, r.ep)
    got = _a2a(buf, r.recv, r.send, r.ep.group)
    return _decode(got, r.expert_sent, None, r.back_wire, rows.shape[-1]).to(dtype)


@dataclass
class _Route:
    """One experts call's exchange: rows per destination / source, expert of each row on
    either side (global ids), the group, wire formats."""

    ep: ExpertParallelState
    send: list[int]
    recv: list[int]
    expert_sent: torch.Tensor  # (S,) global expert of each row this rank sends (its perm order)
    expert_recv: torch.Tensor  # (R,) global expert of each row received (source-major)
    width: int
    x_wire: _Wire
    dy_wire: _Wire
    back_wire: _Wire  # owners -> senders: the combine, the dispatch gradient


class _Dispatch(torch.autograd.Function):
    """Rows to their experts' owners (forward: ``x_wire``); their gradient back (``back_wire``)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, route: _Route) -> torch.Tensor:
        ctx.route, ctx.dtype = route, rows.dtype
        buf, scales = _encode(rows, route.expert_sent, route.x_wire, route.ep)
        got = _a2a(buf, route.send, route.recv, route.ep.group)
        out = _decode(got, route.expert_recv, scales, route.x_wire, route.width)
        return out.to(torch.float32 if route.x_wire.mode != "hp" else rows.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        r = ctx.route
        back = _back(grad, r, ctx.dtype)
        return (back if r.ep.grad_scale == 1.0 else back / r.ep.grad_scale), None


class _Combine(torch.autograd.Function):
    """Expert outputs back to their senders (forward: ``back_wire``); their gradient to the
    owners (backward: ``dy_wire``). ``anchor`` (the dispatched rows) keeps this node in the
    graph on a rank whose experts got no token (its ``rows`` then have no autograd history):
    every rank must run the backward all-to-all, or the ranks' collectives fall out of step."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, route: _Route, anchor: torch.Tensor) -> torch.Tensor:
        ctx.route, ctx.dtype = route, rows.dtype
        return _back(rows, route, rows.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        r = ctx.route
        if r.ep.grad_scale != 1.0:
            grad = grad * r.ep.grad_scale
        buf, scales = _encode(grad, r.expert_sent, r.dy_wire, r.ep)
        got = _a2a(buf, r.send, r.recv, r.ep.group)
        grad_rows = _decode(got, r.expert_recv, scales, r.dy_wire, grad.shape[-1]).to(ctx.dtype)
        return (grad_rows if ctx.needs_input_grad[0] else None), None, None


# ------------------------------------------------------------------ the forward
def run_experts_parallel(
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    recipe: Any,
    gemm: Callable[[str, torch.Tensor, torch.Tensor, tuple[int, ...]], torch.Tensor],
) -> torch.Tensor:
    """The experts' output for this rank's ``hidden_states`` (T, H), experts sharded over the
    module's group (see the module docstring); ``recipe``: the active FP8 recipe or ``None``."""
    ep: ExpertParallelState = module.fp8_ep
    layout = module.fp8_layout
    tokens, top_k = top_k_index.shape[0], top_k_index.shape[-1]
    perm, counts, counts_t = route(top_k_index, ep.num_experts)
    with torch.no_grad():
        module.tokens_per_expert.copy_(counts_t)
    x = hidden_states[perm // top_k]
    dev = x.device
    # the per-expert counts: what this rank sends each owner, what each sender sends here
    got = torch.empty(ep.size * ep.local, dtype=torch.int64, device=counts_t.device)
    dist.all_to_all_single(got, counts_t.to(torch.int64), group=ep.group)
    recv_m = got.view(ep.size, ep.local).cpu()  # [source, local expert]
    send = [sum(counts[r * ep.local : (r + 1) * ep.local]) for r in range(ep.size)]
    recv = [int(v) for v in recv_m.sum(1).tolist()]
    local_counts = tuple(int(v) for v in recv_m.sum(0).tolist())
    expert_sent = torch.repeat_interleave(torch.arange(ep.num_experts, device=dev), counts_t.to(dev))
    local_ids = torch.arange(ep.local).repeat(ep.size) + ep.first
    expert_recv = torch.repeat_interleave(local_ids, recv_m.reshape(-1)).to(dev)
    first, down = layout.projections
    fp8_on = recipe is not None
    x_wire = _wire_for(recipe, fp8_on and _in_fp8(module, first), "x", ep.payload)
    dy_wire = _wire_for(recipe, fp8_on and _in_fp8(module, down), "dy", ep.payload)
    if dy_wire.mode != "hp" and (layout.bias or layout.post_norm):
        # the down projection's bias / the post-norm read the same gradient outside the FP8 GEMM:
        # FP8 rows would round their gradients (measured 2-6% off on gpt-oss's down_proj_bias)
        log_once(
            f"lowprec expert parallelism: {type(module).__name__} has a down-projection bias or a post-expert "
            "norm: its output gradient rows travel in their own dtype, not FP8 (the bias/norm gradient reads them)"
        )
        dy_wire = _Wire("hp", None)
    r = _Route(ep, send, recv, expert_sent, expert_recv, x.shape[-1], x_wire, dy_wire, _combine_wire(recipe, ep))
    xr = _Dispatch.apply(x, r)
    # source-major -> expert-major (expert e: rank 0's rows, rank 1's, ...)
    starts = torch.cumsum(recv_m.reshape(-1), 0) - recv_m.reshape(-1)
    starts_m = starts.view(ep.size, ep.local)
    pieces = [
        torch.arange(int(starts_m[s, j]), int(starts_m[s, j] + recv_m[s, j]))
        for j in range(ep.local)
        for s in range(ep.size)
    ]
    order = (torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)).to(dev)
    expert_of_row = None
    if layout.bias:  # local expert index of each row: the row of this rank's bias slice
        counts_dev = torch.tensor(local_counts, device=dev)
        expert_of_row = torch.repeat_interleave(torch.arange(ep.local, device=dev), counts_dev)
    out = expert_rows(module, layout, xr[order], local_counts, expert_of_row, gemm)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=dev)
    y = _Combine.apply(out[inv], r, xr)
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    return combine(y, perm, tokens, top_k).to(hidden_states.dtype)
