"""The blockwise recipe's grouped expert GEMMs on lowprec's Triton kernel: every expert's
``A_g @ B_g`` in one launch, DeepSeek-V3 block scales.

The output and grad_input GEMMs of the blockwise recipe's grouped path (``grouped_gemm.route``
sends them here; grad_weight stays per expert): A the token groups cast in 1 x b tiles along
the contraction dim (scales (c_g, K/b)), B each expert's weight in b x b blocks (b = the
recipe's ``block_size``, 32/64/128), E4M3 or E5M2 A. The kernel
(``triton_grouped_gemm.grouped_block_scaled_mm_kernel``) runs the dense blockwise kernel's K loop
(``triton_block_gemm.block_scaled_acc``: float32 accumulation, the scales applied per K tile)
inside the grouped kernel's group walk: ragged groups and empty experts as they are, nothing
padded.

What ``mm(a, b, out_dtype)`` hands the kernel: the live groups' FP8 rows one after another (one
copy of A when there is more than one group), the expert operands (E, K, N) in their own layout:
read where the cast wrote them when they are views of one buffer (the experts' weights cast in
one pass, :func:`experts_view`), else stacked (one copy), the dequantization scales concatenated
(S, K/b) and stacked (E, K/b, N/b), the int32 cumulative group ends.

Accuracy, checked under the Triton interpreter in CI (``tests/test_fp8_gemm_kernels_interpret.py``):
each group's rows against the dense Triton blockwise GEMM for its expert within
``cpu_gemm.py``'s bound, bit for bit where every partial sum is exact. On hardware the first-use
self-check allows ``2**-7 * max |ref|`` against the float32 emulation, as the dense one does.
Where it runs: CUDA sm_89+, triton importable, ``LOWPREC_DISABLE_TRITON`` unset, the self-check
passed on the device (a failure is logged once; the per-expert loop runs instead). **Not yet run
on a GPU** (none drawn for the session that wrote it): ``tests/test_gpu_fp8.py`` runs it on the
next GPU run; its cubins for sm_89/sm_90/sm_100 are compiled in CI
(``tests/test_fp8_kernels_compile.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from lowprec.fp8.cast.quantize import Float8Data, quantize_blockwise
from lowprec.fp8.gemm import grouped_triton
from lowprec.fp8.kernels.select import checked_once, emulation_gap, self_check_verdict

__all__ = ["KERNEL", "supported", "may_run", "ready", "mm", "pack", "experts_view", "self_check", "probe"]


KERNEL = "lowprec Triton blockwise grouped FP8 GEMM"
_CHECKED: dict[int | None, bool] = {}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)


def supported(a: Sequence[Optional[Float8Data]], b: Sequence[Float8Data]) -> bool:
    """Operands the kernel takes: every live group in 1 x b tiles, every expert operand in
    b x b blocks (one b, 32/64/128), FP8 dtypes, one across the groups and one across the experts."""
    live = [g for g in a if g is not None]
    if not live or len(a) != len(b) or any(t.granularity != "block" or t.block is None for t in (*live, *b)):
        return False
    bs = live[0].tiles[1]
    return (
        bs in (32, 64, 128)
        and all(g.tiles == (1, bs) for g in live)
        and all(w.tiles == (bs, bs) for w in b)
        and all(t.data.dtype in _FP8 for t in (*live, *b))
        and len({g.data.dtype for g in live}) == 1
        and len({w.data.dtype for w in b}) == 1
    )


def may_run(device: torch.device) -> bool:
    """Whether the kernel could run on ``device`` (for reports: no kernel runs, no check)."""
    return grouped_triton.may_run(device)


def ready(device: torch.device) -> bool:
    """Whether blockwise grouped GEMMs may run on the kernel on ``device`` (checks it once)."""
    return may_run(device) and self_check(device)


def _inv(scale: torch.Tensor) -> torch.Tensor:
    return scale.reciprocal().to(torch.float32)  # the dequantization scales, as the dense kernel takes them


def pack(
    a: Sequence[Optional[Float8Data]], b: Sequence[Float8Data]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """``(mat_a, mat_b, scale_a, scale_b, offs, sizes)``: the kernel's operands (see the module
    docstring); ``sizes`` are the groups' row counts (0 for an empty group)."""
    sizes = [0 if g is None else g.data.shape[0] for g in a]
    live = [g for g in a if g is not None and g.data.shape[0]]
    device = b[0].data.device
    mat_a = grouped_triton.stack_groups(live)
    # the scales gathered first, then one reciprocal each (not one per expert)
    scale_a = _inv(live[0].scale if len(live) == 1 else torch.cat([g.scale for g in live]))
    scale_b = _inv(torch.stack([w.scale for w in b]))
    mat_b = experts_view(b)
    mat_b = grouped_triton.stack_experts(b) if mat_b is None else mat_b
    return mat_a, mat_b, scale_a, scale_b, grouped_triton.group_ends(sizes, device), sizes


def experts_view(b: Sequence[Float8Data]) -> Optional[torch.Tensor]:
    """The expert operands (E, K, N) as one strided view where they are equal views of one
    buffer at a constant distance (the experts' weights cast in one pass,
    ``block_cast.cast_experts_square``): read where the cast wrote them, no stack; else None."""
    if len(b) < 2 or torch.compiler.is_compiling():  # a trace: the stack (views' bases are eager facts)
        return None
    first = b[0].data
    base = first._base
    if base is None:
        return None
    step = b[1].data.storage_offset() - first.storage_offset()
    same = all(
        w.data._base is base
        and w.data.shape == first.shape
        and w.data.stride() == first.stride()
        and w.data.storage_offset() == first.storage_offset() + e * step
        for e, w in enumerate(b)
    )
    if not same or step <= 0:
        return None
    return first.as_strided((len(b), *first.shape), (step, *first.stride()), first.storage_offset())


def mm(a: Sequence[Optional[Float8Data]], b: Sequence[Float8Data], out_dtype: torch.dtype) -> torch.Tensor:
    """The live groups' ``dequant(a[g]) @ dequant(b[g])`` stacked, (sum c_g, N), in one launch
    (``supported(a, b)`` must hold)."""
    from lowprec.fp8.kernels import gemm_ops  # imports triton: only reached where the kernel runs

    mat_a, mat_b, scale_a, scale_b, offs, sizes = pack(a, b)
    bm = gemm_ops.grouped_tile(mat_a.device)[0]
    tiles_m = sum(-(-s // bm) for s in sizes)
    block = b[0].tiles[1]
    kernel_out = out_dtype if out_dtype in _OUT else torch.float32
    out = gemm_ops.grouped_block_scaled_mm(mat_a, mat_b, scale_a, scale_b, offs, block, tiles_m, kernel_out)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def self_check(device: torch.device) -> bool:
    """Once per device: does the kernel compile, run and agree with the float32 emulation?"""
    return checked_once(_CHECKED, device, _check)


def probe(device: torch.device, gemm: str, dy: bool = False, block: int = 128):
    """A small blockwise grouped problem on ``device``: ragged groups (one empty, one over a
    64-row tile), K and N not multiples of the block; ``gemm`` ``output`` (B from (N, K) weights,
    handed over transposed) or ``grad_input`` (B the (K, N) weight as it is); ``dy``: E5M2 groups.
    ``(groups, expert operands)``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    k, n, sizes = 160, 136, (70, 0, 3, 129)
    a_dtype = torch.float8_e5m2 if dy else torch.float8_e4m3fn
    e4m3 = torch.float8_e4m3fn
    groups = [
        quantize_blockwise((torch.randn(s, k, generator=gen) * 3).to(device), a_dtype, (1, block)) if s else None
        for s in sizes
    ]
    if gemm == "output":
        experts = [
            quantize_blockwise(torch.randn(n, k, generator=gen).to(device), e4m3, (block, block)).t() for _ in sizes
        ]
    else:
        experts = [quantize_blockwise(torch.randn(k, n, generator=gen).to(device), e4m3, (block, block)) for _ in sizes]
    return groups, experts


def _check(device: torch.device) -> bool:
    def cases() -> str:
        for gemm, dy in (("output", False), ("grad_input", True)):
            groups, experts = probe(device, gemm, dy)
            gap = emulation_gap(mm(groups, experts, torch.float32), grouped_triton.loop_reference(groups, experts))
            if gap:
                return f"{gap} ({gemm})"
        return ""

    return self_check_verdict(device, KERNEL, "blockwise grouped expert GEMMs", "run one GEMM per expert", cases)
