"""Grouped expert GEMMs on lowprec's Triton kernel: every expert's ``A_g @ B_g`` in one launch.

The grouped path's GEMM where ``torch._scaled_grouped_mm`` cannot serve (``grouped_gemm.py``
decides): a GPU it is not built for (Ada sm_89; a torch without it), or operands it does not
take (tensorwise's E5M2 dY in grad_input). The kernel (:mod:`lowprec.fp8.kernels.triton_grouped_gemm`)
takes tensor or row/column scales, E4M3 or E5M2 operands, ragged groups and empty experts as
they are: no group is padded, an empty expert owns no tile.

What ``mm(a, b, out_dtype)`` hands the kernel: the live groups' FP8 rows one after another
(one copy of A, 1 byte per element, when there is more than one group, unless the casts wrote
them into one buffer: ``packed_a``, tensorwise where the fused casts run), the expert operands
stacked (E, K, N) in their own layout (one copy of the weights, unless they are one buffer
already: ``packed_b``, taken in either storage layout), the dequantization scales as they are
(per group or per row for A, per expert or per column for B: nothing expanded for per-tensor
scales) and the int32 cumulative group ends.

Accuracy against the per-expert loop (``gemm.scaled_mm`` per expert), checked under the Triton
interpreter in CI (``tests/test_fp8_kernels_interpret.py``): the same exact FP8 products summed in
float32 in another order (at most ``K * eps32 * (|A| @ |B|)``, ``cpu_gemm.py``'s bound), the same
scale epilogue on the float32 accumulator, one rounding of the output; where every partial sum is
exact the two agree bit for bit. On hardware the FP8 MMA's accumulation is the tensor cores', so
the first-use self-check allows ``2**-7 * max |ref|``, as for the blockwise Triton GEMM.
Where it runs: CUDA sm_89+, triton importable, ``LOWPREC_DISABLE_TRITON`` unset, and the
self-check passed on the device (a failure is logged once; the loop runs instead). **Not yet run
on a GPU** (no device time in the session that wrote it): ``tests/test_gpu_fp8.py`` compares it
with the loop on the next GPU run; its cubins for sm_89/sm_90/sm_100 are compiled in CI
(``tests/test_fp8_kernels_compile.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from lowprec.fp8.gemm.capability import cuda_capability, is_cuda
from lowprec.fp8.kernels.select import checked_once, emulation_gap, self_check_verdict, triton_allowed
from lowprec.fp8.cast.quantize import Float8Data, quantize

__all__ = [
    "KERNEL",
    "supported",
    "may_run",
    "ready",
    "mm",
    "self_check",
    "pack",
    "probe",
    "loop_reference",
    "group_ends",
    "stack_groups",
    "stack_experts",
]


KERNEL = "lowprec Triton grouped FP8 GEMM"
_CHECKED: dict[int | None, bool] = {}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _one(g: Float8Data, along_rows: bool) -> bool:
    """Tensor or axis scales with one scale per row of an A group (``along_rows``) or per
    column of a B operand; E4M3 or E5M2."""
    if g.data.dtype not in _FP8 or g.granularity not in ("tensor", "axis") or g.scale.dim() not in (0, 2):
        return False
    return g.scale.dim() == 0 or g.scale.shape[1 if along_rows else 0] == 1


def supported(a: Sequence[Optional[Float8Data]], b: Sequence[Float8Data]) -> bool:
    """Operands the kernel takes: every group and expert operand tensor- or axis-scaled (one
    scale per A row, per B column), one FP8 dtype across the groups and one across the experts."""
    live = [g for g in a if g is not None]
    return (
        bool(live)
        and len(a) == len(b)
        and all(_one(g, True) for g in live)
        and all(_one(w, False) for w in b)
        and len({g.data.dtype for g in live}) == 1
        and len({w.data.dtype for w in b}) == 1
    )


def may_run(device: torch.device) -> bool:
    """Whether the kernel could run on ``device`` (for reports: no kernel runs, no check)."""
    return is_cuda(device) and cuda_capability(device) >= (8, 9) and triton_allowed()


def ready(device: torch.device) -> bool:
    """Whether grouped GEMMs may run on the kernel on ``device`` (checks the device once)."""
    return may_run(device) and self_check(device)


def _inv(scale: torch.Tensor) -> torch.Tensor:
    return scale.reciprocal().to(torch.float32)  # the dequantization scale, as the loop's GEMM takes it


def stack_groups(live: Sequence[Float8Data]) -> torch.Tensor:
    """The live groups' FP8 rows one after another, (S, K) (one copy where there are several)."""
    if len(live) == 1:
        return live[0].data
    return torch.cat([g.data.view(torch.uint8) for g in live]).view(live[0].data.dtype)


def pack(
    a: Sequence[Optional[Float8Data]],
    b: Sequence[Float8Data],
    packed_a: Optional[torch.Tensor] = None,
    packed_b: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool, list[int]]:
    """``(mat_a, mat_b, scale_a, scale_b, offs, a_row_scales, sizes)``: the kernel's operands (see
    the module docstring); ``sizes`` are the groups' row counts (0 for an empty group).
    ``packed_a`` (S, K) / ``packed_b`` (E, K, N, either storage layout): the groups' rows and the
    expert operands already in one buffer each, as the casts wrote them: taken as they are."""
    sizes = [0 if g is None else g.data.shape[0] for g in a]
    live = [g for g in a if g is not None and g.data.shape[0]]
    device = b[0].data.device
    mat_a = packed_a if packed_a is not None else stack_groups(live)
    row_scales = any(g.scale.dim() for g in live)
    if row_scales:  # one scale per row, per-tensor groups broadcast to their rows
        scale_a = torch.cat([torch.broadcast_to(_inv(g.scale), (g.data.shape[0], 1))[:, 0] for g in live])
    else:  # one per group: the empty ones' never read
        ones = torch.ones((), device=device)
        scale_a = torch.stack([ones if g is None else _inv(g.scale) for g in a])
    mat_b = packed_b if packed_b is not None else stack_experts(b)
    n = b[0].data.shape[1]
    if any(w.scale.dim() for w in b):
        scale_b = torch.stack([torch.broadcast_to(_inv(w.scale), (1, n))[0] for w in b])
    else:
        scale_b = torch.stack([_inv(w.scale) for w in b])
    return mat_a, mat_b, scale_a, scale_b, group_ends(sizes, device), row_scales, sizes


def group_ends(sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    """The kernels' ``offs``: int32 cumulative group ends on ``device``."""
    ends = torch.tensor(list(sizes), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    # from pinned memory, not waiting: a copy from pageable memory would wait for the stream
    pinned = is_cuda(device) and torch.cuda.is_available()  # (a traced stand-in device has nothing to pin)
    return ends.pin_memory().to(device, non_blocking=True) if pinned else ends.to(device)


def stack_experts(b: Sequence[Float8Data]) -> torch.Tensor:
    """The expert operands stacked (E, K, N), each in its own storage layout (one copy)."""
    first = b[0].data
    if first.stride(0) == 1 and first.stride(1) != 1:  # transposed views of (N, K) rows: stack those
        return torch.stack([w.data.t() for w in b]).transpose(1, 2)
    return torch.stack([w.data for w in b])


def mm(
    a: Sequence[Optional[Float8Data]],
    b: Sequence[Float8Data],
    out_dtype: torch.dtype,
    packed_a: Optional[torch.Tensor] = None,
    packed_b: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The live groups' ``dequant(a[g]) @ dequant(b[g])`` stacked, (sum c_g, N), in one launch
    (``supported(a, b)`` must hold); ``packed_a`` / ``packed_b`` as :func:`pack` takes them."""
    from lowprec.fp8.kernels import gemm_ops  # imports triton: only reached where the kernel runs

    mat_a, mat_b, scale_a, scale_b, offs, row_scales, sizes = pack(a, b, packed_a, packed_b)
    bm = gemm_ops.grouped_tile(mat_a.device)[0]
    tiles_m = sum(-(-s // bm) for s in sizes)
    kernel_out = out_dtype if out_dtype in _OUT else torch.float32
    out = gemm_ops.grouped_scaled_mm(mat_a, mat_b, scale_a, scale_b, offs, row_scales, tiles_m, kernel_out)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def self_check(device: torch.device) -> bool:
    """Once per device: does the kernel compile, run and agree with the float32 emulation?"""
    return checked_once(_CHECKED, device, _check)


def probe(device: torch.device, row_scales: bool, dy: bool = False):
    """A small grouped problem on ``device``: ragged groups (one empty, one over a row tile), K
    and N not multiples of the tiles; per-tensor or per-row/column scales; ``dy``: E5M2 groups
    (tensorwise's grad_input). ``(groups, expert operands)``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    k, n, sizes = 160, 136, (70, 0, 3, 129)
    a_dtype = torch.float8_e5m2 if dy else torch.float8_e4m3fn
    gran = "axis" if row_scales else "tensor"
    groups = [
        quantize((torch.randn(s, k, generator=gen) * 3).to(device), a_dtype, gran, dim=1) if s else None for s in sizes
    ]
    experts = [
        quantize(torch.randn(n, k, generator=gen).to(device), torch.float8_e4m3fn, gran, dim=1).t() for _ in sizes
    ]
    return groups, experts


def loop_reference(a: Sequence[Optional[Float8Data]], b: Sequence[Float8Data]) -> torch.Tensor:
    """The groups' products from dequantized operands in float32 (the emulation)."""
    return torch.cat([g.dequantize() @ w.dequantize() for g, w in zip(a, b) if g is not None])


def _check(device: torch.device) -> bool:
    def cases() -> str:
        for row_scales, dy in ((False, False), (True, False), (False, True)):
            groups, experts = probe(device, row_scales, dy)
            gap = emulation_gap(mm(groups, experts, torch.float32), loop_reference(groups, experts))
            if gap:
                kind = "row/column" if row_scales else "per-tensor"
                return f"{gap} ({kind} scales{', E5M2 A' if dy else ''})"
        return ""

    return self_check_verdict(device, KERNEL, "grouped expert GEMMs", "run one scaled GEMM per expert", cases)
