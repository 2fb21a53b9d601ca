"""``torch.library`` operators around the Triton kernels (imports triton: load lazily).

Each kernel launch is wrapped in a real operator (``torch.ops.lowprec.*``) that works in eager
and under ``torch.compile(fullgraph=True)`` without a graph break; nothing reads a device value
on the host. The bodies allocate fresh outputs and launch the kernels.

Under ``torch.compile`` the operators are opaque (``torch.library.custom_op`` with a fake
implementation: the same body, launches skipped): the compiled graph calls them, and they
launch the very binaries the first-use self-check (:mod:`.selfcheck`) ran. As
``torch.library.triton_op``, Inductor would trace into the bodies and compile each kernel
itself, with its own specialisation: binaries nobody checked. On the third H200 run (torch
2.11, Triton 3.6) a compiled tensorwise model trained like that reached loss 7.2 in 10 steps
where eager, and bf16, reached 0.005 (``docs/LOG.md``, 2026-11-28). ``LOWPREC_INDUCTOR_KERNELS=1``
(read at import) brings the traced form back, for diagnosis.

Launch shapes are fixed (no autotuning, so no benchmark runs inside a training step);
``benchmarks/cast.py --sweep`` times the alternatives through :func:`launch_cast`.
"""

from __future__ import annotations

import struct

import torch
import triton

from lowprec.fp8.cast.formats import fp8_max
from lowprec.fp8.kernels.op_support import (  # noqa: F401  (re-exported: tests and callers read them here)
    _FAKE,
    _INTERPRETED,
    _TWO_PASS,
    INDUCTOR_KERNELS_ENV,
    TRACED,
    _check,
    _dims,
    _filled,
    _fp8_args,
    _kernel,
    _no_launch,
    _operator,
    _row_col_outputs,
    _skip,
    interpreting,
    set_two_pass,
    two_pass,
)
from lowprec.fp8.kernels.ops_nvfp4 import cast_nvfp4, cast_nvfp4_dual, cast_nvfp4_rht, nvfp4_dual_amax, rht_amax
from lowprec.fp8.kernels.triton_block import cast_blockwise_kernel
from lowprec.fp8.kernels.triton_mx import MX_TILE_N, cast_mx_kernel
from lowprec.fp8.kernels.triton_cast import (
    amax_cols_kernel,
    cast_rowwise_kernel,
    cast_transpose_amax_kernel,
    delayed_scale_kernel,
    recast_if_changed_kernel,
)
from lowprec.fp8.cast.scaling import AMAX_EPS

__all__ = [
    "cast_into",
    "cast_transpose_amax",
    "cast_amax",
    "cast_rowwise",
    "amax",
    "amax_cols",
    "cast_rowwise_dual",
    "cast_cols_t",
    "recast_if_changed",
    "delayed_scale_update",
    "launch_cast",
    "interpreting",
    "cast_block_1d",
    "cast_block_2d",
    "cast_mx",
    "cast_nvfp4",
    "cast_nvfp4_rht",
    "nvfp4_dual_amax",
    "cast_nvfp4_dual",
    "rht_amax",
]

_EPS_BITS = struct.unpack("<q", struct.pack("<d", AMAX_EPS))[0]  # float64 bits of AMAX_EPS

# (BLOCK_M, BLOCK_N, num_warps): 64x64 tiles, TransformerEngine's cast_transpose tile size.
TILE = (64, 64, 4)
ROW_TILE = (4, 512, 4)
# both axis casts: taller row blocks so the transposed store writes 32-byte runs
DUAL_TILE = (32, 128, 4)


def launch_cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    q: torch.Tensor | None,
    qt: torch.Tensor | None,
    amax_bits: torch.Tensor | None,
    tile: tuple[int, int, int] = TILE,
    soft_cast: bool | None = None,
) -> None:
    """Launch the cast kernel into uint8 ``q`` (and ``qt``, int32 ``amax_bits`` if given;
    with ``q`` and ``qt`` both None it computes the amax alone)."""
    if _skip(x):  # a trace (fp8.trace_as): outputs carry shapes only
        return
    m, n = x.shape
    bm, bn, warps = tile
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _kernel(cast_transpose_amax_kernel)[grid](
        x,
        scale,
        *_filled(q, qt, amax_bits),
        *_dims(x),
        WRITE_T=qt is not None,
        WRITE_AMAX=amax_bits is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        WRITE_Q=q is not None,
        num_warps=warps,
        **_fp8_args(fp8_dtype, soft_cast),
    )


@_operator("lowprec::cast_transpose_amax", ())
def cast_transpose_amax(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass: ``(q, q.t().contiguous(), amax)``; see ``reference.cast_transpose_amax``."""
    _check(x, fp8_dtype)
    m, n = x.shape
    q = torch.empty((m, n), dtype=torch.uint8, device=x.device)
    qt = torch.empty((n, m), dtype=torch.uint8, device=x.device)
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)  # bits of +0.0
    if two_pass("cast_transpose_amax", x):
        launch_cast(x, scale, fp8_dtype, q, None, amax_bits)
        launch_cast(x, scale, fp8_dtype, None, qt, None)
    else:
        launch_cast(x, scale, fp8_dtype, q, qt, amax_bits)
    return q.view(fp8_dtype), qt.view(fp8_dtype), amax_bits.view(torch.float32)


@_operator("lowprec::cast_amax", ())
def cast_amax(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass: ``(q, amax)`` (no transpose); see ``reference.cast_amax``."""
    _check(x, fp8_dtype)
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    launch_cast(x, scale, fp8_dtype, q, None, amax_bits)
    return q.view(fp8_dtype), amax_bits.view(torch.float32)


@_operator("lowprec::cast_into", ("out",))
def cast_into(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass: ``saturate(x * scale)`` written into ``out`` (uint8, ``x``'s shape, contiguous:
    a slice of one buffer holding several casts, such as every expert's); returns ``(its
    contiguous transpose where transpose, else (0, 0); amax(|x|))``. The launches of
    :func:`cast_transpose_amax` (``transpose``) or :func:`cast_amax`: the same compiled kernels
    their device self-checks ran, and the amax delayed scaling records from the same pass."""
    _check(x, fp8_dtype)
    m, n = x.shape
    qt = torch.empty((n, m) if transpose else (0, 0), dtype=torch.uint8, device=x.device)
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    if transpose and two_pass("cast_transpose_amax", x):
        launch_cast(x, scale, fp8_dtype, out, None, amax_bits)
        launch_cast(x, scale, fp8_dtype, None, qt, None)
    else:
        launch_cast(x, scale, fp8_dtype, out, qt if transpose else None, amax_bits)
    return qt.view(fp8_dtype), amax_bits.view(torch.float32)


@_operator("lowprec::cast_rowwise", ())
def cast_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, power_of_2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scales and the cast in one kernel: ``(q, scale (rows, 1))``."""
    _check(x, fp8_dtype)
    m, n = x.shape
    q = torch.empty((m, n), dtype=torch.uint8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    _launch_axes(x, fp8_dtype, power_of_2, q, scale, None, None, ROW_TILE)
    return q.view(fp8_dtype), scale


def _launch_axes(x, fp8_dtype, power_of_2, q, row_scale, col_scale, qt, tile) -> None:
    """cast_rowwise_kernel: row-scaled ``q`` (if given) and column-scaled ``qt`` (if given)."""
    if _skip(x):
        return
    m, n = x.shape
    bm, bn, warps = tile
    q_ptr, qt_ptr = _filled(q, qt)
    _kernel(cast_rowwise_kernel)[(triton.cdiv(m, bm),)](
        x,
        q_ptr,
        x if row_scale is None else row_scale,
        *_dims(x),
        BLOCK_M=bm,
        BLOCK_N=bn,
        col_scale_ptr=x if col_scale is None else col_scale,
        qt_ptr=qt_ptr,
        ROW=q is not None,
        COL=qt is not None,
        num_warps=warps,
        **_scale_args(fp8_dtype, power_of_2),
    )


def _scale_args(fp8_dtype: torch.dtype, power_of_2: bool) -> dict:
    """:func:`_fp8_args` and what a kernel that computes its scales takes besides: ``POW2`` and
    ``EPS_BITS``."""
    return dict(_fp8_args(fp8_dtype), POW2=power_of_2, EPS_BITS=_EPS_BITS)


@_operator("lowprec::amax", ())
def amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a float32 scalar, one read of ``x`` (no ``abs()`` tensor in between)."""
    _check(x, torch.float8_e4m3fn)
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    launch_cast(x, amax_bits, torch.float8_e4m3fn, None, None, amax_bits)
    return amax_bits.view(torch.float32)


@_operator("lowprec::amax_cols", ())
def amax_cols(x: torch.Tensor) -> torch.Tensor:
    """``amax_along(x, 0)``: per-column ``max |x|``, shape ``(1, cols)`` float32, one read."""
    _check(x, torch.float8_e4m3fn)
    m, n = x.shape
    bits = torch.zeros((1, n), dtype=torch.int32, device=x.device)
    bm, bn, warps = TILE
    if not _skip(x):
        _kernel(amax_cols_kernel)[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, bits, m, n, x.stride(0), x.stride(1), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps
        )
    return bits.view(torch.float32)


@_operator("lowprec::cast_rowwise_dual", ())
def cast_rowwise_dual(
    x: torch.Tensor, col_scale: torch.Tensor, fp8_dtype: torch.dtype, power_of_2: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both axis casts in one pass: ``(q, row_scale (rows, 1), qt)`` where ``qt`` (cols, rows)
    is ``x`` cast with ``col_scale`` (1, cols) and stored transposed."""
    _check(x, fp8_dtype)
    m, n = x.shape
    q = torch.empty((m, n), dtype=torch.uint8, device=x.device)
    qt = torch.empty((n, m), dtype=torch.uint8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if two_pass("cast_rowwise_dual", x):
        _launch_axes(x, fp8_dtype, power_of_2, q, scale, None, None, ROW_TILE)
        _launch_axes(x, fp8_dtype, power_of_2, None, None, col_scale, qt, DUAL_TILE)
    else:
        _launch_axes(x, fp8_dtype, power_of_2, q, scale, col_scale, qt, DUAL_TILE)
    return q.view(fp8_dtype), scale, qt.view(fp8_dtype)


@_operator("lowprec::cast_cols_t", ())
def cast_cols_t(x: torch.Tensor, col_scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast with per-column scales (1, cols), stored transposed: (cols, rows), one pass."""
    _check(x, fp8_dtype)
    m, n = x.shape
    qt = torch.empty((n, m), dtype=torch.uint8, device=x.device)
    _launch_axes(x, fp8_dtype, False, None, None, col_scale, qt, DUAL_TILE)
    return qt.view(fp8_dtype)


@_operator("lowprec::cast_rowwise_into", ("out", "out_t"))
def cast_rowwise_into(
    x: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype, pow2: bool, out: torch.Tensor, out_t: torch.Tensor
) -> torch.Tensor:
    """The axis casts written into the caller's buffers (uint8, contiguous: slices of one buffer
    holding several casts, such as every expert's): the row-scaled cast into ``out`` (``x``'s
    shape) and, with the column scales ``cols`` (1, n), the column-scaled one stored transposed
    into ``out_t`` (n, m); an empty ``out`` or ``out_t`` is not written. Returns the row scales
    (m, 1) ((0, 1) where ``out`` is empty). The launches of :func:`cast_rowwise_dual` (both),
    :func:`cast_rowwise` (``out`` alone) or :func:`cast_cols_t` (``out_t`` alone)."""
    _check(x, dtype)
    m, n = x.shape
    row, col = out.numel() > 0, out_t.numel() > 0
    scale = torch.empty((m if row else 0, 1), dtype=torch.float32, device=x.device)
    if row and col and two_pass("cast_rowwise_into", x):
        _launch_axes(x, dtype, pow2, out, scale, None, None, ROW_TILE)
        _launch_axes(x, dtype, pow2, None, None, cols, out_t, DUAL_TILE)
    elif row and col:
        _launch_axes(x, dtype, pow2, out, scale, cols, out_t, DUAL_TILE)
    elif row:
        _launch_axes(x, dtype, pow2, out, scale, None, None, ROW_TILE)
    elif col:
        _launch_axes(x, dtype, False, None, None, cols, out_t, DUAL_TILE)
    return scale


@_operator("lowprec::recast_if_changed", {"q", "qt"})
def recast_if_changed(
    x: torch.Tensor, scale_used: torch.Tensor, scale_cast: torch.Tensor, q: torch.Tensor, qt: torch.Tensor
) -> None:
    """Re-cast ``x`` into ``q`` and ``qt`` (its transpose; an empty ``qt``: none kept) with
    ``scale_used`` when it differs from ``scale_cast``, the scale they hold; a no-op kernel
    otherwise (no read of ``x``)."""
    _check(x, q.dtype)
    if _skip(x):
        return
    m, n = x.shape
    bm, bn, warps = TILE
    keep_t = qt.numel() == q.numel()  # an empty qt: no transposed copy to keep in step
    if not keep_t:
        stores: tuple[tuple[bool, bool], ...] = ((True, False),)
    elif two_pass("recast_if_changed", x):
        stores = ((True, False), (False, True))
    else:
        stores = ((True, True),)
    for write_q, write_t in stores:
        _kernel(recast_if_changed_kernel)[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x,
            scale_used,
            scale_cast,
            q.view(torch.uint8),
            (qt if keep_t else q).view(torch.uint8),  # never written without keep_t
            *_dims(x),
            BLOCK_M=bm,
            BLOCK_N=bn,
            WRITE_Q=write_q,
            WRITE_T=write_t,
            num_warps=warps,
            **_fp8_args(q.dtype),
        )


@_operator("lowprec::delayed_scale_update", {"history", "scale"})
def delayed_scale_update(
    history: torch.Tensor,
    scale: torch.Tensor,
    step: torch.Tensor,
    amax_now: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int,
    power_of_2: bool,
    interval: int,
    algo_max: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``delayed_scale_step`` in one kernel, updating ``history`` and ``scale`` in place;
    returns ``(scale to use now, scale before the update)``."""
    used = torch.empty((), dtype=torch.float32, device=history.device)
    old = torch.empty((), dtype=torch.float32, device=history.device)
    if _skip(history):
        return used, old
    n = history.numel()
    _kernel(delayed_scale_kernel)[(1,)](
        history,
        scale,
        step,
        amax_now,
        used,
        old,
        n,
        FP8_MAX=fp8_max(fp8_dtype),
        EPS_BITS=_EPS_BITS,
        MARGIN=margin,
        POW2=power_of_2,
        INTERVAL=interval,
        ALGO_MAX=algo_max,
        BLOCK=triton.next_power_of_2(n),
        num_warps=4,
    )
    return used, old


# blockwise casts: one 128x128 tile per program (8 warps: 64 float32 values per thread)
BLOCK_WARPS = 8


def _launch_block(x, fp8_dtype, block, power_of_2, square, q, qt, s, st) -> None:
    if _skip(x):
        return
    if q is not None and qt is not None and two_pass("cast_block_2d" if square else "cast_block_1d", x):
        _launch_block(x, fp8_dtype, block, power_of_2, square, q, None, s, None if square else st)
        _launch_block(x, fp8_dtype, block, power_of_2, square, None, qt, s if square else None, st)
        return
    m, n = x.shape
    _kernel(cast_blockwise_kernel)[(triton.cdiv(m, block), triton.cdiv(n, block))](
        x,
        *_filled(q, qt),
        x if s is None else s,
        x if st is None else st,
        *_dims(x),
        BLOCK=block,
        SQUARE=square,
        ROW=q is not None,
        COL=qt is not None,
        num_warps=BLOCK_WARPS if block >= 128 else 4,
        **_scale_args(fp8_dtype, power_of_2),
    )


def _check_block(x: torch.Tensor, fp8_dtype: torch.dtype, block: int) -> None:
    _check(x, fp8_dtype)
    if block < 16 or block > 128 or block & (block - 1):
        raise ValueError(f"the fused blockwise cast takes a power-of-two block of 16..128, got {block}")


@_operator("lowprec::cast_block_1d", ())
def cast_block_1d(
    x: torch.Tensor, fp8_dtype: torch.dtype, block: int, power_of_2: bool, rows: bool, cols: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-D tiles from one read: ``(q, row_scale, qt, col_scale)``. ``rows``: ``q`` (M, N) cast
    with 1 x block tiles, ``row_scale`` (M, ceil(N/block)) (column-major storage); ``cols``:
    ``qt`` (N, M) = ``x`` cast with block x 1 tiles, transposed, ``col_scale`` (ceil(M/block), N).
    Outputs not asked for are empty (0 elements)."""
    _check_block(x, fp8_dtype, block)
    m, n = x.shape
    dev = x.device
    q = torch.empty((m, n) if rows else (0,), dtype=torch.uint8, device=dev)
    rs = torch.empty((triton.cdiv(n, block), m) if rows else (0,), dtype=torch.float32, device=dev)
    qt = torch.empty((n, m) if cols else (0,), dtype=torch.uint8, device=dev)
    cs = torch.empty((triton.cdiv(m, block), n) if cols else (0,), dtype=torch.float32, device=dev)
    _launch_block(
        x,
        fp8_dtype,
        block,
        power_of_2,
        False,
        q if rows else None,
        qt if cols else None,
        rs if rows else None,
        cs if cols else None,
    )
    return q.view(fp8_dtype), rs.t() if rows else rs, qt.view(fp8_dtype), cs


@_operator("lowprec::cast_block_2d", ())
def cast_block_2d(
    x: torch.Tensor, fp8_dtype: torch.dtype, block: int, power_of_2: bool, rows: bool, cols: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Square tiles from one read: ``(q, scale, qt, scale_t)`` with ``scale`` (ceil(M/block),
    ceil(N/block)); ``rows``: ``q`` (M, N); ``cols``: ``qt`` (N, M) contiguous and the same
    scales stored transposed (``scale_t``, an (ceil(M/block), ceil(N/block)) column-major view).
    Outputs not asked for are empty."""
    _check_block(x, fp8_dtype, block)
    m, n = x.shape
    dev = x.device
    bm, bn = triton.cdiv(m, block), triton.cdiv(n, block)
    q = torch.empty((m, n) if rows else (0,), dtype=torch.uint8, device=dev)
    s = torch.empty((bm, bn), dtype=torch.float32, device=dev)
    qt = torch.empty((n, m) if cols else (0,), dtype=torch.uint8, device=dev)
    st = torch.empty((bn, bm) if cols else (0,), dtype=torch.float32, device=dev)
    _launch_block(
        x, fp8_dtype, block, power_of_2, True, q if rows else None, qt if cols else None, s, st if cols else None
    )
    return q.view(fp8_dtype), s, qt.view(fp8_dtype), st.t() if cols else st


_MX_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}  # as lowprec.fp8.cast.mx


@_operator("lowprec::cast_mx", ())
def cast_mx(
    x: torch.Tensor, fp8_dtype: torch.dtype, rceil: bool, rows: bool, cols: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP8 casts from one read (``triton_mx``): ``(q, scale, qt, scale_t)`` as uint8 (the FP8
    elements, the E8M0 scale bytes). ``rows``: ``quantize_mx(x)``'s data (M, N padded to 32) and
    scales (M, N/32); ``cols``: ``quantize_mx(x.t())``'s, (N, M padded) and (N, M/32). ``rceil``:
    the ``rceil`` scale rule, else ``floor``. Outputs not asked for are empty."""
    _check(x, fp8_dtype)
    m, n = x.shape
    mp, np_ = triton.cdiv(m, 32) * 32, triton.cdiv(n, 32) * 32
    dev = x.device
    q = torch.empty((m, np_) if rows else (0,), dtype=torch.uint8, device=dev)
    s = torch.empty((m, np_ // 32) if rows else (0,), dtype=torch.uint8, device=dev)
    qt = torch.empty((n, mp) if cols else (0,), dtype=torch.uint8, device=dev)
    st = torch.empty((n, mp // 32) if cols else (0,), dtype=torch.uint8, device=dev)
    if m and n:
        if rows and cols and two_pass("cast_mx", x):
            _launch_mx(x, fp8_dtype, rceil, q, s, None, None)
            _launch_mx(x, fp8_dtype, rceil, None, None, qt, st)
        else:
            _launch_mx(x, fp8_dtype, rceil, q if rows else None, s, qt if cols else None, st)
    return q.view(fp8_dtype), s, qt.view(fp8_dtype), st


def _launch_mx(x, fp8_dtype, rceil, q, s, qt, st) -> None:
    """cast_mx_kernel: the row casts into ``q``/``s`` and/or the column casts into ``qt``/``st``."""
    if _skip(x) or (q is None and qt is None):
        return
    m, n = x.shape
    _kernel(cast_mx_kernel)[(triton.cdiv(m, 32), triton.cdiv(n, MX_TILE_N))](
        x,
        *_row_col_outputs(q, s, qt, st),
        *_dims(x),
        EMAX=_MX_EMAX[fp8_dtype],
        RCEIL=rceil,
        ROW=q is not None,
        COL=qt is not None,
        BLOCK_N=MX_TILE_N,
        num_warps=4,
        **_fp8_args(fp8_dtype),
    )
