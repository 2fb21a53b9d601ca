"""First use on a real GPU: the Triton kernels against the torch path, once per device.

The kernels are checked bit-exact in Triton's interpreter (CI) and compiled to sm_89/sm_90
cubins (CI), but neither runs the hardware. So before the dispatch first picks them on a
device, :func:`passed` runs every fused op on small probe tensors and compares with
:mod:`lowprec.fp8.kernels.reference` bit for bit. The probes cover what the compiled code
specialises on: bfloat16 and float32 inputs (a float32 master weight is cast from float32),
ragged and 16-divisible shapes (Triton vectorises loads and stores on the latter), and the
awkward values (saturating, subnormal, ties, zeros of both signs, a NaN, an inf, rows 12
decades apart).

The verdict is per op. An op whose one-pass form differs is tried again as two passes, one
store each (:data:`TWO_PASS_OPS`; ``ops.set_two_pass``): on the first H200 run (Triton 3.6,
its bundled ptxas) the transposed 8-bit store of a kernel that also stores the plain layout
came out wrong for 16-divisible shapes, a known ptxas fault (triton-lang/triton#11111) that
does not touch a kernel with the transposed store alone. An op that still differs, or raises,
takes the torch path on that device. One log line says which ops run how. Costs a few small
kernel launches and their compilations, once per process (Triton caches the binaries on disk).
"""

from __future__ import annotations

import logging

import torch
from lowprec.fp8.kernels import reference as ref
from lowprec.fp8.scaling import amax_to_scale

__all__ = ["passed", "run_checks", "TWO_PASS_OPS", "ALL"]

logger = logging.getLogger("lowprec.fp8")
ALL = "*"  # in a device's set of ops off: every op (the check itself could not run)
# ops with a plain and a transposed store, which can run as two launches of one store each
TWO_PASS_OPS = frozenset(
    {"cast_transpose_amax", "recast_if_changed", "cast_rowwise_dual", "cast_block_1d", "cast_block_2d"}
)
_RESULT: dict[int, frozenset[str]] = {}  # device index -> the ops that take the torch path there


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits; NaNs compare by position (FP8 and float32 NaNs have several codes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    fa, fb = a.float(), b.float()
    nan = torch.isnan(fb)
    if not torch.equal(torch.isnan(fa), nan):
        return False
    bits = torch.uint8 if a.element_size() == 1 else torch.int32
    return torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


def _probes(device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """(name, 2-D tensor) pairs: ragged bf16, 16-divisible bf16 and float32, and rows of very
    different magnitude (with a zero row, a NaN and an inf) for the per-row scales."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def awkward(rows: int, cols: int) -> torch.Tensor:
        x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.empty(rows, cols).uniform_(-12, 12, generator=g))
        x[0, :4] = torch.tensor([0.0, -0.0, 1.0625, -17.0])  # zeros, E4M3 ties
        x[1, 0] = 1e6  # saturates
        return x

    rows = torch.randn(96, 520, generator=g) * torch.logspace(-6, 6, 96)[:, None]
    rows[3], rows[5, 7], rows[8, 400] = 0.0, float("nan"), float("inf")
    out = [
        ("bf16 67x130", awkward(67, 130).to(torch.bfloat16)),
        ("bf16 256x512", awkward(256, 512).to(torch.bfloat16)),
        ("fp32 256x512", awkward(256, 512)),
        ("bf16 rows 96x520", rows.to(torch.bfloat16)),
    ]
    return [(name, x.to(device)) for name, x in out]


def _op_pairs(ops, ref, x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, cols: torch.Tensor) -> dict:
    return {
        "cast_transpose_amax": (ops.cast_transpose_amax(x, scale, dtype), ref.cast_transpose_amax(x, scale, dtype)),
        "cast_amax": (ops.cast_amax(x, scale, dtype), ref.cast_amax(x, scale, dtype)),
        "cast_rowwise": (ops.cast_rowwise(x, dtype, True), ref.cast_rowwise(x, dtype, True)),
        "cast_rowwise(exact scales)": (ops.cast_rowwise(x, dtype, False), ref.cast_rowwise(x, dtype, False)),
        "cast_rowwise_dual": (ops.cast_rowwise_dual(x, cols, dtype, True), ref.cast_rowwise_dual(x, cols, dtype, True)),
        "cast_cols_t": ((ops.cast_cols_t(x, cols, dtype),), (ref.cast_cols_t(x, cols, dtype),)),
        "cast_block_1d": (
            ops.cast_block_1d(x, dtype, 128, True, True, True),
            ref.cast_block_1d(x, dtype, 128, True, True, True),
        ),
        "cast_block_2d": (
            ops.cast_block_2d(x, dtype, 128, False, True, True),
            ref.cast_block_2d(x, dtype, 128, False, True, True),
        ),
    }


def _op_name(check: str) -> str:
    return check.split("(")[0]


def run_checks(ops, ref, device: torch.device) -> dict[str, list[str]]:
    """The fused ops (``ops``) that disagree with the torch path (``ref``) on the probes:
    ``{op name: [where it differed]}``; empty when every op agrees."""
    bad: dict[str, list[str]] = {}

    def note(check: str, where: str) -> None:
        bad.setdefault(_op_name(check), []).append(f"{check} on {where}")

    for where, x in _probes(device):
        scale = torch.tensor(448.0 / 64.0, device=device)
        xf = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0)  # finite column scales
        cols = amax_to_scale(ref.amax_cols(xf), torch.float8_e4m3fn, power_of_2=True)
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            for check, (got, want) in _op_pairs(ops, ref, x, dtype, scale, cols).items():
                if not all(_same(a, b) for a, b in zip(got, want)):
                    note(check, f"{where} {str(dtype).replace('torch.', '')}")
        for used in (scale, scale * 2):  # delayed scaling's re-cast: a no-op, then a real one
            got = tuple(t.clone() for t in ref.cast_transpose_amax(x, scale, torch.float8_e4m3fn)[:2])
            want = tuple(t.clone() for t in got)
            ops.recast_if_changed(x, used, scale, *got)
            ref.recast_if_changed(x, used, scale, *want)
            if not all(_same(a, b) for a, b in zip(got, want)):
                note("recast_if_changed", where)
        for name, got, want in (
            ("amax", ops.amax(x), ref.amax(x)),
            ("amax_cols", ops.amax_cols(x), ref.amax_cols(x)),
        ):
            if not _same(got, want):
                note(name, where)
    x = _probes(device)[0][1]
    scale = torch.tensor(448.0 / 64.0, device=device)
    for hist in (
        torch.zeros(16, device=device),
        torch.rand(16, generator=torch.Generator(device="cpu").manual_seed(1)).to(device),
    ):
        args = (torch.tensor(6, device=device), ops.amax(x), torch.float8_e4m3fn, 0, False, 1, True)
        h1, s1, h2, s2 = hist.clone(), scale.clone(), hist.clone(), scale.clone()
        got, want = ops.delayed_scale_update(h1, s1, *args), ref.delayed_scale_update(h2, s2, *args)
        if not all(_same(a, b) for a, b in zip((*got, h1, s1), (*want, h2, s2))):
            note("delayed_scale_update", "a 16-entry history")
    return bad


def passed(device: torch.device, op: str | None = None) -> bool:
    """Whether the kernels run on ``device``: ``op`` agreed with the torch path there (checked
    on the first call for the device), or, with no ``op``, whether the check could run at all.

    Under ``torch.compile`` the answer is taken at trace time and baked into the graph
    (:func:`_passed` is marked a constant, as ``torch.compiler.assume_constant_result`` marks
    it; applying that function itself would import ``torch._dynamo`` here, and calling it while
    tracing is refused by Dynamo in torch 2.11): the check runs eagerly, never inside a graph.
    """
    return _passed(device, op)


def _passed(device: torch.device, op: str | None = None) -> bool:
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    if index not in _RESULT:
        _RESULT[index] = _check(torch.device("cuda", index))
    off = _RESULT[index]
    return ALL not in off and (op is None or op not in off)


_passed._dynamo_marked_constant = True  # what torch.compiler.assume_constant_result sets


def _check(device: torch.device) -> frozenset[str]:
    """Run the checks, retry the failing two-pass-able ops as two passes, log once; returns the
    ops to keep off on ``device`` (``{ALL}`` when the check itself failed)."""
    try:
        from lowprec.fp8.kernels import ops

        ops.set_two_pass(())
        with torch.no_grad():
            bad = run_checks(ops, ref, device)
            two_pass = set(bad) & TWO_PASS_OPS
            if two_pass:
                ops.set_two_pass(two_pass)
                still = run_checks(ops, ref, device)
                two_pass -= set(still)
                ops.set_two_pass(two_pass)
    except Exception as e:  # noqa: BLE001 - any failure means "do not use the kernels here"
        logger.warning(
            "lowprec: fused FP8 Triton casts off on %s (self-check failed: %s: %s); using the torch path",
            device,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        return frozenset({ALL})
    off = frozenset(set(bad) - two_pass)
    if bad:
        parts = []
        if two_pass:
            parts.append(f"{', '.join(sorted(two_pass))} run as two passes (one store each)")
        if off:
            parts.append(f"{', '.join(sorted(off))} use the torch path")
        detail = "; ".join(f"{op}: {', '.join(where[:3])}" for op, where in sorted(bad.items()))
        logger.warning(
            "lowprec: fused FP8 Triton casts on %s: %s (their one-pass kernels differ from the torch path: %s)",
            device,
            "; ".join(parts),
            detail,
        )
    return off
