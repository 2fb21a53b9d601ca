"""Grouped scaled GEMMs: every expert's ``A_g @ B_e`` in one call (``torch._scaled_grouped_mm`` or
lowprec's Triton grouped GEMM), or one GEMM per expert.

``grouped_mm(a, b, counts, out_dtype)``: ``a[e]`` is expert ``e``'s token group, a
:class:`Float8Data` (c_e, K) (``None`` for an expert without tokens), ``b[e]`` its weight
operand, logical (K, N); the result is the groups' products stacked, (sum c_e, N).

Paths
-----
``scaled_grouped_mm``  one ``torch._scaled_grouped_mm`` call (CUDA sm_90 / sm_100 in torch >= 2.8)
    when every operand is E4M3 with tensor or row/column scales. Its contract, which torch's
    meta kernel (``_meta_grouped_mm_common``) checks and ``tests/test_fp8_grouped.py`` runs on
    meta tensors:

    ========  ========================================  ======================================
    mat_a     (M, K) float8_e4m3fn, row-major           group g: rows offs[g-1] .. offs[g]
    mat_b     (E, K, N) float8_e4m3fn, column-major      the transpose of a contiguous (E, N, K)
    scale_a   (M,) float32                              dequantization scale (1 / scale) per row
    scale_b   (E, N) float32                            per expert and output column
    offs      (E,) int32                                group ends; out (M, N) bf16
    ========  ========================================  ======================================

    A tensor-scaled group's one scale is repeated on its rows (and an expert weight's on its
    columns): the same numbers as a per-tensor GEMM. Groups are padded to 16 rows (zero bytes,
    scale 1; padded rows are dropped from the output), the alignment torchtitan and torchao
    give FP8 grouped GEMMs; the padding is written while packing, which copies the FP8 operand
    once (1 byte per element; a fused permute-pad-cast would avoid it). Where no group needs
    padding the groups' rows are concatenated (or read where the casts wrote them into one
    buffer: ``packed_a``), and nothing is gathered from the output. Before its first use
    on a device the kernel is checked once against :func:`reference_scaled_grouped_mm` (a
    failure is logged and the Triton or per-expert path runs instead): **unverified on a GPU so far**
    (no GPU was drawn for the session that wrote it).
``triton``  lowprec's Triton grouped FP8 GEMM (:mod:`lowprec.fp8.gemm.grouped_triton`), one launch for
    all groups, where torch's kernel cannot serve: CUDA sm_89+ without it (Ada; a torch without
    ``_scaled_grouped_mm``; it failed its check), or operands it does not take (tensorwise's
    E5M2 dY in grad_input). Tensor or row/column scales, E4M3 or E5M2, no padding. Self-checked
    at first use on the device; checked against the loop under the Triton interpreter in CI and
    compiled to sm_89/sm_90/sm_100 cubins there.
``blockwise_loop``  the blockwise recipe's grouped GEMMs where torch's blockwise GEMM (cuBLAS, sm_90)
    takes every expert: one per expert, as the dense layer runs them, each writing its group's
    rows of one (S, N) output (:func:`per_expert_into`: no concatenation). Kept over the Triton
    grouped GEMM because the two have not been timed against each other on a GPU (the bytes
    outside the GEMMs are the same: neither packs its operands here).
``triton_block``  the blockwise recipe's grouped GEMMs (1 x b tiles for A, b x b blocks for B) on
    lowprec's Triton blockwise grouped GEMM (:mod:`lowprec.fp8.gemm.grouped_block_triton`), one
    launch for all groups, where it runs (CUDA sm_89+, its first-use self-check passed) and
    torch's blockwise GEMM does not take every expert (sm_89, sm_100; groups not multiples of 16).
``loop``  one :func:`~lowprec.fp8.gemm.dispatch.scaled_mm` per expert holding tokens: every device and
    granularity, the dense Linear's GEMM path (on CPU the exact bf16 upcast).

These are the 2-D x 3-D GEMMs (the output, grad_input). grad_weight, each expert's ``dY_e^T @
x_e`` contracting over its own tokens, has its own: where the one-call path runs, the tensorwise
and rowwise casts take lowprec's Triton grouped weight gradient
(:mod:`lowprec.fp8.gemm.grouped_wgrad`: one launch for all experts, float32 written in place,
self-checked at first use, **not yet run on a GPU**), and so do the blockwise casts (its block
mode: 128 x 1 tiles along each group's tokens); a failed check and every other device run one
``scaled_mm`` per expert (torch's row- and block-scaled GEMMs write bf16 there, copied into the
float32 gradient). The choice is logged once per device.

The choice is made per call (:func:`route`) in that order, and logged once per device and
choice: which kernel runs the grouped GEMMs, and why the faster one did not.

:func:`reference_scaled_grouped_mm` computes what the kernel computes from the same packed
arguments (float32, dequantized operands): CPU tests run the single-call path through it.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from lowprec.fp8.gemm import grouped_block_triton, grouped_triton
from lowprec.fp8.gemm.capability import cuda_capability, is_cuda, traced
from lowprec.fp8.gemm.dispatch import gemm_path, scaled_mm
from lowprec.fp8.cast.quantize import Float8Data

__all__ = [
    "grouped_mm",
    "native_grouped_available",
    "single_call_operands",
    "pack_2d3d",
    "reference_scaled_grouped_mm",
    "ALIGN",
    "route",
    "single_call_ready",
    "per_expert_into",
]

logger = logging.getLogger("lowprec.fp8")

ALIGN = 16  # rows per group: a multiple of 16 for the FP8 grouped kernel
_E4M3 = torch.float8_e4m3fn
_CHECKED: dict[str, bool] = {}  # device -> the kernel passed its one-time check


def native_grouped_available(device: torch.device) -> bool:
    """Whether torch's grouped FP8 kernel exists for ``device`` (no kernel call)."""
    if not is_cuda(device) or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return cuda_capability(device)[0] in (9, 10)  # torch builds it for sm_90 and sm_100


def single_call_operands(a: Float8Data, b: Float8Data) -> bool:
    """Whether one group's operands fit the single-call kernel: E4M3 both, tensor or axis
    scales (the axis along the kernel's rows for ``a``, columns for ``b``), a contraction of a
    whole number of 16-byte runs (torch checks both operands' leading strides: K % 16 for FP8;
    an expert width such as 200 or 40 takes another path)."""
    grans = ("tensor", "axis")
    return (
        a.data.shape[1] % 16 == 0
        and a.data.dtype == _E4M3
        and b.data.dtype == _E4M3
        and a.granularity in grans
        and b.granularity in grans
        and a.scale.dim() in (0, 2)
        and b.scale.dim() in (0, 2)
        and (a.scale.dim() == 0 or a.scale.shape[1] == 1)  # one scale per row of A
        and (b.scale.dim() == 0 or b.scale.shape[0] == 1)  # one per column of B
    )


def pack_2d3d(
    a: Sequence[Optional[Float8Data]],
    b: Sequence[Float8Data],
    align: int = ALIGN,
    packed_a: Optional[torch.Tensor] = None,
    packed_b: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mat_a, mat_b, scale_a, scale_b, offs, rows)``: the arguments of
    ``torch._scaled_grouped_mm`` in its order (see the module docstring), and ``rows``, the real
    (unpadded) rows of its output in group order. ``packed_a`` / ``packed_b``: the groups' rows
    (S, K) and the experts' operands (E, K, N) already in one buffer each, as the casts wrote
    them (used where they need no padding, and B where it is column-major)."""
    first = b[0]
    k, n = first.data.shape
    device = first.data.device
    sizes = [0 if g is None else g.data.shape[0] for g in a]
    padded = [-(-s // align) * align for s in sizes]
    total = sum(padded)
    live = [g for g in a if g is not None and g.data.shape[0]]
    pad = padded != sizes
    if not pad and packed_a is not None:
        mat_a = packed_a.view(torch.uint8)
        scale_a = torch.cat([torch.broadcast_to(_inv(g.scale), (g.data.shape[0], 1))[:, 0] for g in live])
    elif not pad:  # no group to pad: the groups' rows one after another (one copy, nothing zeroed)
        mat_a = (
            live[0].data.view(torch.uint8) if len(live) == 1 else torch.cat([g.data.view(torch.uint8) for g in live])
        )
        scale_a = torch.cat([torch.broadcast_to(_inv(g.scale), (g.data.shape[0], 1))[:, 0] for g in live])
    else:
        mat_a = torch.zeros(total, k, dtype=torch.uint8, device=device)
        scale_a = torch.ones(total, dtype=torch.float32, device=device)
    rows = []
    start = 0
    for g, s, p in zip(a, sizes, padded):
        if g is not None and s:
            if pad:
                mat_a[start : start + s] = g.data.view(torch.uint8)
                scale_a[start : start + s] = torch.broadcast_to(_inv(g.scale), (s, 1))[:, 0]
            rows.append(torch.arange(start, start + s, device=device))
        start += p
    # (E, N, K) contiguous, handed over transposed: column-major (E, K, N)
    if packed_b is not None and packed_b.stride(-2) == 1:
        mat_b = packed_b
    else:
        mat_b = torch.stack([e.data.t().contiguous() for e in b]).transpose(-2, -1)
    scale_b = torch.stack([torch.broadcast_to(e.scale.reciprocal().to(torch.float32), (1, n))[0] for e in b])
    offs = torch.tensor(padded, device=device).cumsum(0).to(torch.int32)
    index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64, device=device)
    return mat_a.view(_E4M3), mat_b, scale_a, scale_b.contiguous(), offs, index


def _inv(scale: torch.Tensor) -> torch.Tensor:
    return scale.reciprocal().to(torch.float32)  # the dequantization scale


def reference_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, out_dtype=torch.bfloat16) -> torch.Tensor:
    """What ``torch._scaled_grouped_mm`` computes (2-D x 3-D), in float32 from dequantized
    operands: ``out[rows of g] = (mat_a[rows] * scale_a[rows, None]) @ (mat_b[g] * scale_b[g])``."""
    out = torch.zeros(mat_a.shape[0], mat_b.shape[-1], dtype=out_dtype, device=mat_a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            lhs = mat_a[start:end].to(torch.float32) * scale_a[start:end, None]
            rhs = mat_b[g].to(torch.float32) * scale_b[g][None, :]
            out[start:end] = (lhs @ rhs).to(out_dtype)
        start = end
    return out


def _native(mat_a, mat_b, scale_a, scale_b, offs, out_dtype=torch.bfloat16) -> torch.Tensor:
    return torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


# the kernel behind the single-call path; tests put the reference here to run it on CPU
KERNEL: dict[str, Callable] = {"scaled_grouped_mm": _native}


def _checked(device: torch.device) -> bool:
    """The kernel against the reference once per device: a small problem with an empty group."""
    if traced():  # fp8.trace_as: decisions only, no kernel runs (as the fused casts' checks)
        return True
    key = str(device)
    if key not in _CHECKED:
        ok, why = False, ""
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            a = [Float8Data((torch.randn(20, 64, generator=gen)).to(device).to(_E4M3), torch.ones((), device=device))]
            a.append(None)  # type: ignore[arg-type]
            b = [
                Float8Data(torch.randn(64, 32, generator=gen).to(device).to(_E4M3), torch.ones((), device=device))
                for _ in range(2)
            ]
            args = pack_2d3d(a, b)
            got = KERNEL["scaled_grouped_mm"](*args[:5]).float()
            ref = reference_scaled_grouped_mm(*args[:5]).float()
            err = (got - ref).abs().max().item()
            ok = err <= 2.0**-7 * ref.abs().max().item() + 1e-3
            why = f"differs from the reference by {err:.3g}"
        except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
            why = f"{type(exc).__name__}: {exc}"
        _CHECKED[key] = ok
        if not ok:
            logger.warning(
                "lowprec.fp8: torch._scaled_grouped_mm failed its check on %s (%s); grouped expert GEMMs run "
                "on lowprec's Triton grouped GEMM where it runs, else one scaled GEMM per expert",
                device,
                why,
            )
    return _CHECKED[key]


def native_ready(device: torch.device) -> bool:
    """torch's grouped kernel exists here and passed its one-time check."""
    return native_grouped_available(device) and _checked(device)


def single_call_ready(device: torch.device) -> bool:
    """A one-call grouped kernel runs here: torch's, or lowprec's Triton one (each checked once)."""
    return native_ready(device) or grouped_triton.ready(device)


_ROUTES_LOGGED: set[tuple[str, str]] = set()


def route(device: torch.device, a: Sequence[Optional[Float8Data]], b: Sequence[Float8Data]) -> str:
    """``scaled_grouped_mm`` | ``triton`` | ``blockwise_loop`` | ``triton_block`` | ``loop``: which
    kernel runs these grouped operands on ``device`` (the caller decided the device may run a
    one-call kernel); logged once per choice."""
    live = [(g, w) for g, w in zip(a, b) if g is not None and g.data.shape[0]]
    fits_native = all(single_call_operands(g, w) for g, w in live)
    if fits_native and native_ready(device):
        choice, why = "scaled_grouped_mm", "torch._scaled_grouped_mm, one call for all experts"
    else:
        if not native_grouped_available(device):
            reason = f"torch {torch.__version__} has no _scaled_grouped_mm for {device} (sm_90/sm_100 builds only)"
        elif not fits_native:
            reason = "torch._scaled_grouped_mm takes E4M3 operands with tensor or row/column scales only"
        else:
            reason = "torch._scaled_grouped_mm failed its check"
        if grouped_triton.supported(a, b) and grouped_triton.ready(device):
            choice, why = "triton", f"{grouped_triton.KERNEL}, one launch for all experts ({reason})"
        elif grouped_block_triton.supported(a, b) and all(
            gemm_path("auto", device, g, w) == "scaled_mm" for g, w in live
        ):
            # torch's blockwise GEMM (cuBLAS, sm_90) takes every expert: kept per expert, as the dense
            # layer keeps it; one Triton launch has not been timed against it on a GPU
            choice, why = "blockwise_loop", f"torch's blockwise GEMM per expert, as the dense layer runs it ({reason})"
        elif grouped_block_triton.supported(a, b) and grouped_block_triton.ready(device):
            choice, why = "triton_block", f"{grouped_block_triton.KERNEL}, one launch for all experts ({reason})"
        else:
            choice, why = "loop", f"one scaled GEMM per expert ({reason}; the Triton grouped GEMM cannot run these)"
    dtypes = "/".join(sorted({str(t.data.dtype).replace("torch.float8_", "") for g, w in live for t in (g, w)}))
    key = (str(device), f"{choice} {dtypes}")
    if key not in _ROUTES_LOGGED:
        _ROUTES_LOGGED.add(key)
        log = logger.info if choice != "loop" else logger.warning  # loop: no one-call kernel takes them
        log("lowprec.fp8: grouped expert GEMMs (%s operands) on %s: %s", dtypes, device, why)
    return choice


def grouped_mm(
    a: Sequence[Optional[Float8Data]],
    b: Sequence[Float8Data],
    out_dtype: torch.dtype,
    *,
    single_call: bool,
    path: str = "auto",
    packed_a: Optional[torch.Tensor] = None,
    packed_b: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The groups' products ``a[e] @ b[e]`` stacked (see the module docstring); ``single_call``:
    the caller's decision that this device runs a one-call grouped kernel (:func:`route` picks
    which for these operands; those no grouped kernel takes run the loop). ``packed_a`` /
    ``packed_b``: ``a``'s rows and ``b`` in one buffer each where the casts wrote them so (the
    grouped kernels read them there instead of copying the groups together)."""
    live = [(g, w) for g, w in zip(a, b) if g is not None and g.data.shape[0]]
    if not live:
        return torch.zeros(0, b[0].data.shape[1], dtype=out_dtype, device=b[0].data.device)
    choice = route(b[0].data.device, a, b) if single_call else "loop"
    if choice == "scaled_grouped_mm":
        mat_a, mat_b, scale_a, scale_b, offs, rows = pack_2d3d(a, b, packed_a=packed_a, packed_b=packed_b)
        out = KERNEL["scaled_grouped_mm"](mat_a, mat_b, scale_a, scale_b, offs)
        if rows.numel() != out.shape[0]:  # padded groups: drop their padding rows
            out = out.index_select(0, rows)
        return out if out.dtype == out_dtype else out.to(out_dtype)  # as gemm.as_dtype
    if choice == "triton":
        return grouped_triton.mm(a, b, out_dtype, packed_a, packed_b)
    if choice == "triton_block":
        return grouped_block_triton.mm(a, b, out_dtype)
    if choice == "blockwise_loop":
        return per_expert_into(live, out_dtype, path)
    outs = [scaled_mm(g, w, out_dtype, path=path) for g, w in live]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def per_expert_into(live: Sequence[tuple[Float8Data, Float8Data]], out_dtype: torch.dtype, path: str) -> torch.Tensor:
    """One :func:`~lowprec.fp8.gemm.dispatch.scaled_mm` per expert, each writing its group's rows of
    one (S, N) buffer (torch's blockwise GEMM takes ``out``: no concatenation after)."""
    w0 = live[0][1].data
    out = torch.empty(sum(g.data.shape[0] for g, _ in live), w0.shape[1], dtype=out_dtype, device=w0.device)
    start = 0
    for g, w in live:
        scaled_mm(g, w, out_dtype, path=path, out=out[start : start + g.data.shape[0]])
        start += g.data.shape[0]
    return out
