"""Bytes each op reads and writes, counted at the dispatcher: speed you can measure without a GPU.

A bandwidth-bound kernel's time is its bytes over the memory bandwidth, so on a GPU the
cost of everything around an FP8 GEMM (casts, amaxes, transposes, scale bookkeeping) is, to
first order, the bytes those ops move. :class:`ByteCounter` is a ``TorchDispatchMode`` that
records, for every non-view aten op (and every custom op, such as the fused Triton casts),
the bytes of its tensor inputs and outputs. Run on ``meta`` tensors inside
:func:`lowprec.fp8.trace_as` (which makes the dispatch take them for tensors on the traced GPU;
its docstring says why meta and not FakeTensorMode on "cuda"), it follows exactly the path a
GPU would take while nothing runs, so the counts are exact and deterministic on any machine.

Rules (one each):

* views (``t``, ``view``, ``expand``, ``detach``, ...) and allocations (``empty*``) move nothing;
* a tensor argument is read once per op, ``numel`` elements counted over its non-broadcast
  dims (an ``expand``-ed scalar is one element, not M);
* outputs are written; an in-place op writes its mutated argument (and reads it, except for
  ``copy_``/``fill_``/``zero_``, which only write it);
* a custom op (``torch.ops.lowprec.*``) declares its cost through its schema and fake
  implementation: its tensor inputs read, its outputs (and the buffers it writes, ``out`` /
  ``out_t`` arguments written, not read) written, once. That is the traffic of a
  single fused kernel, which is what those ops are. A conditional kernel declares its
  steady-state cost in :data:`STEADY_STATE_BYTES` instead (``recast_if_changed`` reads two
  scalars and returns unless delayed scaling's amax history was empty, as on the first step).

GEMMs (``mm``, ``addmm``, ``bmm``, ``_scaled_mm``, ..., and lowprec's Triton GEMMs
``lowprec.block_scaled_mm``, ``lowprec.grouped_scaled_mm``, ``lowprec.grouped_block_scaled_mm`` and
``lowprec.grouped_wgrad_scaled_mm``, ``lowprec.grouped_block_wgrad_scaled_mm``) are recorded with their FLOPs and kept
apart: the question the counts answer is how many bytes move *outside* the GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from lowprec.fp8.modules.autocast import autocast
from lowprec.fp8.gemm.capability import trace_as

__all__ = [
    "OpRecord",
    "ByteCounter",
    "tensor_bytes",
    "GEMM_OPS",
    "CUSTOM_GEMM_OPS",
    "STEADY_STATE_BYTES",
    "trace_linear",
    "trace_grouped",
]

GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm"})
# lowprec's own GEMM kernels (custom ops): (M, K) x (K, N) in their first two arguments
CUSTOM_GEMM_OPS = frozenset(
    {
        "lowprec.block_scaled_mm",
        "lowprec.grouped_scaled_mm",
        "lowprec.grouped_block_scaled_mm",
        "lowprec.grouped_wgrad_scaled_mm",  # its first two arguments: the groups of dY (c, N) and x (c, K)
        "lowprec.grouped_block_wgrad_scaled_mm",  # the same, block scales along the tokens
    }
)
_FREE = frozenset(
    {
        "_unsafe_view",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "lift_fresh",
        "lift_fresh_copy",
        "set_",
        "resize_",
        "_to_copy_noop",
    }
)
# (read, written) of conditional kernels in steady state; see the module docstring
STEADY_STATE_BYTES = {"lowprec.recast_if_changed": (8, 0)}
_WRITE_ONLY = frozenset({"copy_", "fill_", "zero_", "uniform_", "normal_", "bernoulli_"})
# a custom op's arguments that it writes without reading (the caller's output buffers)
_OUT_ARGS = frozenset({"out", "out_t"})


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes one pass over ``t`` touches: elements over its non-broadcast (stride != 0) dims."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


@dataclass
class OpRecord:
    """One op: ``name`` (e.g. ``aten._to_copy``), bytes read and written, and for GEMMs the
    FLOPs and operand dtype (what sets the GEMM's rate)."""

    name: str
    read: int
    written: int
    gemm: bool = False
    flops: int = 0
    operand_dtype: str = ""
    phase: str = ""

    @property
    def bytes(self) -> int:
        return self.read + self.written


def _gemm_flops(name: str, args) -> tuple[int, str]:
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    if isinstance(a, (list, tuple)):  # grouped weight gradient: dY_e^T (N, c_e) @ x_e (c_e, K) per group
        return sum(2 * d.shape[0] * d.shape[1] * g.shape[1] for d, g in zip(a, b)), str(a[0].dtype).replace(
            "torch.", ""
        )
    if a.dim() == 3:  # bmm: (B, M, K) x (B, K, N)
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2], str(a.dtype).replace("torch.", "")
    return 2 * a.shape[0] * a.shape[1] * b.shape[-1], str(a.dtype).replace("torch.", "")


@dataclass
class ByteCounter(TorchDispatchMode):
    """Record every op's traffic while active; ``phase`` labels records (e.g. fwd / bwd)."""

    records: list[OpRecord] = field(default_factory=list)
    phase: str = ""

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        name = func._schema.name.split("::")[-1]
        ns = func.namespace
        if ns == "aten" and (func.is_view or name in _FREE):
            return
        if f"{ns}.{name}" in STEADY_STATE_BYTES:
            self.records.append(OpRecord(f"{ns}.{name}", *STEADY_STATE_BYTES[f"{ns}.{name}"], phase=self.phase))
            return
        written_args, read_ids, read = [], set(), 0
        for arg, value in zip(
            func._schema.arguments, list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args) :]]
        ):
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            mutated = arg.alias_info is not None and arg.alias_info.is_write
            if mutated:
                written_args += tensors
            if mutated and (name in _WRITE_ONLY or arg.name in _OUT_ARGS):
                continue
            for t in tensors:
                if id(t) not in read_ids:
                    read_ids.add(id(t))
                    read += tensor_bytes(t)
        written = sum(tensor_bytes(t) for t in written_args)
        # a functional op's outputs are fresh tensors, and so are a custom op's beside the
        # arguments it writes (custom ops never return an alias of an input; aten's out= do)
        if not written_args or ns != "aten":
            written += sum(tensor_bytes(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        rec = OpRecord(f"{ns}.{name}", read, written, phase=self.phase)
        if (ns == "aten" and name in GEMM_OPS) or f"{ns}.{name}" in CUSTOM_GEMM_OPS:
            rec.gemm = True
            rec.flops, rec.operand_dtype = _gemm_flops(name, args)
        self.records.append(rec)

    # ------------------------------------------------------------------ summaries
    def outside_gemm_bytes(self) -> int:
        return sum(r.bytes for r in self.records if not r.gemm)

    def gemm_bytes(self) -> int:
        return sum(r.bytes for r in self.records if r.gemm)

    def gemms(self) -> list[OpRecord]:
        return [r for r in self.records if r.gemm]

    def by_op(self) -> dict[str, dict[str, int]]:
        """``{op name: {"calls": n, "bytes": b}}`` for the non-GEMM ops, largest first."""
        agg: dict[str, dict[str, int]] = {}
        for r in self.records:
            if r.gemm:
                continue
            d = agg.setdefault(r.name, {"calls": 0, "bytes": 0})
            d["calls"] += 1
            d["bytes"] += r.bytes
        return dict(sorted(agg.items(), key=lambda kv: -kv[1]["bytes"]))


def trace_linear(
    make,
    m: int,
    k: int,
    n: int,
    *,
    x_dtype: torch.dtype = torch.bfloat16,
    w_dtype: torch.dtype = torch.float32,
    sm: tuple[int, int] = (9, 0),
    triton: bool = True,
    steps: int = 1,
) -> ByteCounter:
    """Count one fwd+bwd of ``make(nn.Linear(k, n, bias=False))`` on meta tensors traced as CUDA.

    ``x`` (m, k) in ``x_dtype`` and a ``w_dtype`` master weight (bf16 activations, fp32
    weights: mixed-precision training). ``make`` returns the module to run (a Float8Linear,
    torchao's, or a wrapper); it runs with ``fp8.autocast()`` entered. With ``steps > 1`` only
    the last step is counted (delayed scaling's steady state has the same ops as step 0: fake
    tensors hold no values, so no branch depends on them). Nothing is allocated or launched.
    """

    with trace_as(sm=sm, triton=triton):
        lin = torch.nn.Linear(k, n, bias=False, device="meta", dtype=w_dtype)
        mod = make(lin)
        counter = ByteCounter()
        for step in range(steps):
            x = torch.empty(m, k, device="meta", dtype=x_dtype, requires_grad=True)
            dy = torch.empty(m, n, device="meta", dtype=x_dtype)
            lin.weight.grad = None
            _fwd_bwd(partial(mod, x), dy, counter if step == steps - 1 else None)
    return counter


def _fwd_bwd(forward, dy: torch.Tensor, counter: ByteCounter | None) -> None:
    """``forward()`` under ``fp8.autocast()`` then its backward with ``dy``; counted (phases
    ``fwd`` / ``bwd``) by ``counter`` unless it is None."""
    with autocast():
        if counter is None:
            y = forward()
        else:
            counter.phase = "fwd"
            with counter:
                y = forward()
    if counter is None:
        y.backward(dy)
        return
    counter.phase = "bwd"
    with counter:
        y.backward(dy)


def trace_grouped(
    make,
    counts: tuple[int, ...],
    k: int,
    n: int,
    *,
    sm: tuple[int, int] = (9, 0),
    triton: bool = True,
    x_dtype: torch.dtype = torch.bfloat16,
    w_dtype: torch.dtype = torch.float32,
) -> ByteCounter:
    """Count one fwd+bwd of a grouped expert GEMM on meta tensors traced as CUDA.

    ``x`` (sum(counts), k) in ``x_dtype``, grouped by expert (``counts[e]`` consecutive rows for
    expert ``e``), a ``w_dtype`` master weight (E, n, k) and ``dY`` (sum(counts), n) in
    ``x_dtype``. ``make(num_experts)`` returns ``run(x, weight, counts) -> y`` (lowprec's
    :class:`~lowprec.fp8.modules.grouped.Float8GroupedGemm`, torchao's grouped function, ...); it runs
    with ``fp8.autocast()`` entered. Forward, grad_input and grad_weight are counted (phases
    ``fwd`` / ``bwd``); nothing is allocated or launched.
    """

    experts, rows = len(counts), sum(counts)
    with trace_as(sm=sm, triton=triton):
        run = make(experts)
        weight = torch.empty(experts, n, k, device="meta", dtype=w_dtype, requires_grad=True)
        x = torch.empty(rows, k, device="meta", dtype=x_dtype, requires_grad=True)
        dy = torch.empty(rows, n, device="meta", dtype=x_dtype)
        counter = ByteCounter()
        _fwd_bwd(lambda: run(x, weight, tuple(counts)), dy, counter)
    return counter
