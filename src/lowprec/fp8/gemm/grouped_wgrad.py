"""The grouped expert weight gradient on lowprec's Triton kernel: every expert's ``dY_e^T @ x_e`` in one launch.

grad_weight of a grouped expert weight (E, N, K) is E small GEMMs contracting over each expert's
token rows. Where this kernel runs (:func:`run_into`) they are one launch
(:mod:`lowprec.fp8.kernels.triton_grouped_wgrad`) writing the float32 gradient in place, each
element once (an expert without tokens gets its zeros from the kernel); elsewhere one
:func:`~lowprec.fp8.gemm.dispatch.scaled_mm` per expert (E launches; for row scales torch's
``_scaled_mm`` writes bf16, copied into the float32 gradient).

What ``run_into(dy, x, out)`` hands the kernel: each group's casts where they were written (the
kernel reads them through a table of addresses and strides: no concatenation, no transposed
copy; the layouts of both the fused casts, ``(N, c_e)`` contiguous viewed transposed, and the
torch casts, ``(c_e, N)`` row-major), the dequantization scales stacked ((E,) per group for
tensor scales, (E, N) / (E, K) per column for the rowwise recipe's casts along the tokens).
Operands it takes: tensor or column scales (one per column of dY_e and of x_e), E4M3 or E5M2
(tensorwise's dY is E5M2), one granularity and one dtype per operand across the experts. Block
scales (the blockwise recipe: ``b x 1`` tiles along each group's tokens, starting at its first
row, so a tile never crosses a group) run the kernel's block mode (:func:`block_supported`,
:func:`block_mm_into`): one contraction step per scale tile, each group's tile scales stacked
(``(T, N)`` and ``(T, K)``, one concatenation of the small scale tensors and one reciprocal each).

Accuracy: the same exact FP8 products as the per-expert GEMM summed in float32 in another order
(``K * eps32 * (|A| @ |B|)``, ``cpu.py``'s bound, with the contraction length c_e), the scales
as an epilogue on the float32 accumulator, one rounding to float32; checked under the Triton
interpreter in CI (``tests/test_grouped_wgrad_interpret.py``), its cubins compiled for
sm_89/sm_90/sm_100 there (``tests/test_fp8_kernels_compile.py``). On hardware the first-use
self-check allows ``2**-7 * max |ref|`` (:func:`~lowprec.fp8.kernels.select.emulation_gap`).
**Not yet run on a GPU** (no device in the session that wrote it): ``tests/test_gpu_fp8.py``
compares it with the loop on the next GPU run (``benchmarks/gpu/run.sh``).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from lowprec.fp8.gemm.capability import cuda_capability, is_cuda
from lowprec.fp8.kernels.select import checked_once, emulation_gap, self_check_verdict, triton_allowed
from lowprec.fp8.cast.quantize import Float8Data, quantize

__all__ = [
    "KERNEL",
    "supported",
    "block_supported",
    "takes_granularities",
    "may_run",
    "ready",
    "mm_into",
    "block_mm_into",
    "run_into",
    "self_check",
    "probe",
    "block_probe",
    "loop_reference",
]

logger = logging.getLogger("lowprec.fp8")

KERNEL = "lowprec Triton grouped grad_weight GEMM"
_CHECKED: dict[int | None, bool] = {}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_LOGGED: set[tuple[str, str]] = set()


def _column_scaled(g: Float8Data) -> bool:
    """One scale for the group (tensor) or one per column of its (c_e, cols) data (axis)."""
    if g.granularity == "tensor":
        return g.scale.dim() == 0
    return g.granularity == "axis" and g.scale.dim() == 2 and g.scale.shape[0] == 1


def supported(dy: Sequence[Optional[Float8Data]], x: Sequence[Optional[Float8Data]]) -> bool:
    """Operands the kernel takes (see the module docstring): each live group's dY (c_e, N) and x
    (c_e, K) FP8, tensor- or column-scaled, one granularity and FP8 dtype per operand."""
    live = [(d, g) for d, g in zip(dy, x) if d is not None and g is not None]
    return (
        bool(live)
        and len(dy) == len(x)
        and all(t.data.dtype in _FP8 and t.data.dim() == 2 and _column_scaled(t) for pair in live for t in pair)
        and len({d.data.dtype for d, _ in live}) == 1
        and len({g.data.dtype for _, g in live}) == 1
        and len({d.granularity for d, _ in live}) == 1
        and len({g.granularity for _, g in live}) == 1
    )


def _token_tiles(g: Float8Data) -> bool:
    """Cast in ``b x 1`` tiles along the group's tokens (dim 0) with b in 32/64/128: scales
    (ceil(c_e / b), cols)."""
    b = g.block[0] if g.granularity == "block" and g.block else 0
    return g.block == (b, 1) and b in (32, 64, 128) and g.scale.shape == (-(-g.data.shape[0] // b), g.data.shape[1])


def block_supported(dy: Sequence[Optional[Float8Data]], x: Sequence[Optional[Float8Data]]) -> bool:
    """Operands the kernel's block mode takes: each live group's dY (c_e, N) and x (c_e, K) FP8,
    cast in ``b x 1`` tiles along its tokens (one b for all), one FP8 dtype per operand."""
    live = [(d, g) for d, g in zip(dy, x) if d is not None and g is not None]
    return (
        bool(live)
        and len(dy) == len(x)
        and all(t.data.dtype in _FP8 and t.data.dim() == 2 and _token_tiles(t) for pair in live for t in pair)
        and len({t.block for pair in live for t in pair}) == 1
        and len({d.data.dtype for d, _ in live}) == 1
        and len({g.data.dtype for _, g in live}) == 1
    )


def takes_granularities(specs) -> bool:
    """Whether operands cast as ``specs`` (a recipe's grad_weight ``OperandCast`` pair) are of the
    granularities the kernel takes (tensor, axis; 1-D block tiles); for reports, nothing runs."""
    return all(s.granularity in ("tensor", "axis") or (s.granularity == "block" and not s.block_2d) for s in specs)


def may_run(device: torch.device) -> bool:
    """Whether the kernel could run on ``device`` (for reports: no kernel runs, no check)."""
    return is_cuda(device) and cuda_capability(device) >= (8, 9) and triton_allowed()


def ready(device: torch.device) -> bool:
    """Whether the weight gradients may run on the kernel on ``device`` (checks the device once)."""
    return may_run(device) and self_check(device)


def _stack_inv(groups: Sequence[Optional[Float8Data]], like: Float8Data) -> torch.Tensor:
    """The dequantization scales stacked, (E,) or (E, cols) (from (1, cols) column scales); an
    empty group's are ones (never applied to anything but its zeros)."""
    ones = torch.ones_like(like.scale)
    inv = torch.stack([ones if g is None else g.scale for g in groups]).reciprocal().to(torch.float32)
    return inv if inv.dim() == 1 else inv.flatten(1)


def _gemm_ops():
    from lowprec.fp8.kernels import gemm_ops  # imports triton: only reached where the kernels run

    return gemm_ops


def mm_into(dy: Sequence[Optional[Float8Data]], x: Sequence[Optional[Float8Data]], out: torch.Tensor) -> None:
    """``out[e] = dequant(dy[e])^T @ dequant(x[e])`` for every expert, in one launch, into the
    float32 ``out`` (E, N, K); ``None`` groups (no tokens) get zeros. ``supported(dy, x)`` must hold."""
    gemm_ops = _gemm_ops()
    d0 = next(d for d in dy if d is not None)
    x0 = next(g for g in x if g is not None)
    gemm_ops.grouped_wgrad_scaled_mm(_data(dy, d0), _data(x, x0), _stack_inv(dy, d0), _stack_inv(x, x0), out)


def block_mm_into(dy: Sequence[Optional[Float8Data]], x: Sequence[Optional[Float8Data]], out: torch.Tensor) -> None:
    """As :func:`mm_into` for block scales along the tokens (``block_supported(dy, x)`` must hold):
    the groups' tile scales stacked in group order, one reciprocal each."""
    gemm_ops = _gemm_ops()
    live_dy = [d for d in dy if d is not None]
    live_x = [g for g in x if g is not None]
    d0, x0 = live_dy[0], live_x[0]
    sa = torch.cat([d.scale for d in live_dy]).reciprocal().to(torch.float32)
    sb = torch.cat([g.scale for g in live_x]).reciprocal().to(torch.float32)
    rows = d0.block[0] if d0.block else 0  # block_supported: (rows, 1) tiles
    gemm_ops.grouped_block_wgrad_scaled_mm(_data(dy, d0), _data(x, x0), sa, sb, rows, out)


def _data(groups: Sequence[Optional[Float8Data]], like: Float8Data) -> list[torch.Tensor]:
    """Each group's FP8 data; an expert without tokens gets no rows."""
    empty = like.data.new_empty(0, like.data.shape[1])
    return [empty if g is None else g.data for g in groups]


def run_into(
    dy: Sequence[Optional[Float8Data]], x: Sequence[Optional[Float8Data]], out: torch.Tensor, device: torch.device
) -> bool:
    """Every expert's weight gradient written into ``out`` by the kernel where it takes these
    operands and runs on ``device`` (True), else nothing done (False: the caller's per-expert
    loop); the choice, and why the kernel did not run, logged once per device and choice."""
    block = block_supported(dy, x)
    if not (block or supported(dy, x)):
        choice, why = "loop", "operands it does not take (row or square scales, or mixed formats across the experts)"
    elif not may_run(device):
        choice, why = "loop", "it runs on CUDA sm_89+ with triton only"
    elif not self_check(device):
        choice, why = "loop", "it failed its self-check"
    else:
        choice, why = "triton", "one launch for all experts, float32 written in place"
    key = (str(device), choice)
    if key not in _LOGGED:
        _LOGGED.add(key)
        if choice == "triton":
            logger.info("lowprec.fp8: grouped expert grad_weight on %s: %s, %s", device, KERNEL, why)
        else:
            logger.warning(
                "lowprec.fp8: grouped expert grad_weight on %s: one scaled GEMM per expert (the %s: %s)",
                device,
                KERNEL,
                why,
            )
    if choice == "triton":
        (block_mm_into if block else mm_into)(dy, x, out)
    return choice == "triton"


def self_check(device: torch.device) -> bool:
    """Once per device: does the kernel compile, run and agree with the float32 emulation?"""
    return checked_once(_CHECKED, device, _check)


def probe(device: torch.device, row_scales: bool, dy_e5m2: bool, n: int = 136, k: int = 160):
    """A small grouped weight-gradient problem on ``device``: ragged groups (one empty, one over
    a row step, none a multiple of 16), N and K not multiples of the tiles; tensor scales with an
    E5M2 dY (tensorwise) or column scales (rowwise). ``(dY groups, x groups)``, cast along the
    tokens as the recipes cast them for grad_weight."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    gran = "axis" if row_scales else "tensor"
    dy_dtype = torch.float8_e5m2 if dy_e5m2 else torch.float8_e4m3fn
    dy: list[Optional[Float8Data]] = []
    x: list[Optional[Float8Data]] = []
    for c in (70, 0, 3, 129):
        if not c:
            dy.append(None)
            x.append(None)
            continue
        dy.append(quantize(torch.randn(c, n, generator=gen).to(device), dy_dtype, gran, dim=0))
        x.append(quantize((torch.randn(c, k, generator=gen) * 3).to(device), torch.float8_e4m3fn, gran, dim=0))
    return dy, x


def loop_reference(dy: Sequence[Optional[Float8Data]], x: Sequence[Optional[Float8Data]], n: int, k: int):
    """The weight gradients from dequantized operands in float32 (the emulation), (E, N, K)."""
    device = next(d.data.device for d in dy if d is not None)
    out = torch.zeros(len(dy), n, k, device=device)
    for e, (d, g) in enumerate(zip(dy, x)):
        if d is not None and g is not None:
            out[e] = d.dequantize().t() @ g.dequantize()
    return out


def block_probe(device: torch.device, n: int = 136, k: int = 160, block: int = 128):
    """As :func:`probe` for the blockwise recipe's grad_weight casts: E4M3 ``block x 1`` tiles
    along each group's tokens, power-of-two scales; one group across a tile edge."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    dy: list[Optional[Float8Data]] = []
    x: list[Optional[Float8Data]] = []
    for c in (70, 0, 3, 129):
        parts = [(torch.randn(c, cols, generator=gen) * s).to(device) for cols, s in ((n, 1), (k, 3))] if c else []
        cast = [quantize(t, torch.float8_e4m3fn, "block", block=(block, 1), power_of_2=True) for t in parts]
        dy.append(cast[0] if c else None)
        x.append(cast[1] if c else None)
    return dy, x


def _check(device: torch.device, n: int = 136, k: int = 160) -> bool:
    problems = [
        (f"{'column' if rows else 'per-tensor'} scales", probe(device, rows, e5m2, n, k), mm_into)
        for rows, e5m2 in ((False, True), (True, False))
    ]
    problems.append(("block scales", block_probe(device, n, k), block_mm_into))

    def cases() -> str:
        for label, (dy, x), run in problems:
            out = torch.full((len(dy), n, k), float("nan"), device=device)  # every element must be written
            run(dy, x, out)
            gap = emulation_gap(out, loop_reference(dy, x, n, k))
            if gap or out.isnan().any():
                return f"{gap or 'elements left unwritten'} ({label})"
        return ""

    return self_check_verdict(device, KERNEL, "grouped expert grad_weight", "runs one scaled GEMM per expert", cases)
