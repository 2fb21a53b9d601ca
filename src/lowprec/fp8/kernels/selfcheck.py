"""First use on a real GPU: the Triton kernels against the torch path, once per device.

The kernels are checked bit-exact in Triton's interpreter (CI) and compiled to sm_89/sm_90
cubins (CI), but neither runs the hardware. So the first time an input of a new *class* meets
the kernels on a device, :func:`passed` runs every fused op on a small probe of that class and
compares with :mod:`lowprec.fp8.kernels.reference` bit for bit. A class is what the compiled
code specialises on: the input dtype and whether each dimension is a multiple of 16 (Triton
vectorises loads and stores then). The probe has the class's dtype and divisibility, so it
runs the very binaries the real call will (no compilation is wasted), and it holds the awkward
values (saturating, subnormal, ties, zeros of both signs, a NaN, an inf, rows 12 decades apart).

The verdict is per class and op. An op whose one-pass form differs is tried again as two
passes, one store each (:data:`TWO_PASS_OPS`, ``ops.set_two_pass``): on the first H200 run
(Triton 3.6, its bundled ptxas) the transposed 8-bit store of a kernel that also stores the
plain layout came out wrong for float32 input with 16-divisible shapes (NaN in training), a
known ptxas fault (triton-lang/triton#11111) that spares a kernel with the transposed store
alone. An op that still differs, or a check that raises, takes the torch path for that class
on that device. One log line per class says which ops run how.
"""

from __future__ import annotations

import logging

import torch
from lowprec.fp8.kernels import reference as ref
from lowprec.fp8.kernels.classes import input_class
from lowprec.fp8.scaling import amax_to_scale

__all__ = ["passed", "run_checks", "input_class", "TWO_PASS_OPS", "ALL", "CLASSES"]

logger = logging.getLogger("lowprec.fp8")
ALL = "*"  # in a class's set of ops off: every op (the check itself could not run)
# ops with a plain and a transposed store, which can run as two launches of one store each
TWO_PASS_OPS = frozenset(
    {"cast_transpose_amax", "recast_if_changed", "cast_rowwise_dual", "cast_block_1d", "cast_block_2d"}
)
# (device index, class) -> the ops that take the torch path for that class there
_RESULT: dict[tuple, frozenset[str]] = {}
_FAILED_DEVICES: set[int] = set()  # a check raised there: the kernels cannot run at all
_DELAYED = ("delayed",)
_INPUT_DTYPES = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
)  # the class of delayed_scale_update (a 1-D float32 history)
CLASSES = (
    (torch.bfloat16, False, False),
    (torch.bfloat16, True, True),
    (torch.float32, True, True),
    (torch.float32, False, False),
    (torch.float16, True, True),
)


def _describe(cls: tuple) -> str:
    if cls == _DELAYED:
        return "the delayed-scaling update"
    dtype, div_m, div_n = cls
    return f"{str(dtype).replace('torch.', '')} {'256' if div_m else '67'}x{'512' if div_n else '130'}"


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


def _probe(cls: tuple, device: torch.device) -> torch.Tensor:
    """A 2-D tensor of class ``cls``: the top half awkward values over 24 binades, the bottom
    half rows 12 decades apart (a zero row, a NaN, an inf) for the per-row scales."""
    dtype, div_m, div_n = cls
    rows, cols = (256 if div_m else 67), (512 if div_n else 130)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, cols, generator=g)
    half = rows // 2
    x[:half] *= torch.exp2(torch.empty(half, cols).uniform_(-12, 12, generator=g))
    x[half:] *= torch.logspace(-6, 6, rows - half)[:, None]
    x[0, :4] = torch.tensor([0.0, -0.0, 1.0625, -17.0])  # zeros, E4M3 ties
    x[1, 0] = 1e6  # saturates
    x[half + 3], x[half + 5, 7], x[half + 8, cols - 3] = 0.0, float("nan"), float("inf")
    return x.to(device=device, dtype=dtype)


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


def run_checks(ops, ref, device: torch.device, classes=CLASSES) -> dict[str, list[str]]:
    """The fused ops (``ops``) that disagree with the torch path (``ref``) on the probes of
    ``classes`` (input classes, or ``_DELAYED``): ``{op name: [where it differed]}``."""
    bad: dict[str, list[str]] = {}

    def note(check: str, where: str) -> None:
        bad.setdefault(_op_name(check), []).append(f"{check} on {where}")

    for cls in classes:
        if cls == _DELAYED:
            _check_delayed(ops, ref, device, note)
            continue
        where, x = _describe(cls), _probe(cls, device)
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
    return bad


def _check_delayed(ops, ref, device: torch.device, note) -> None:
    scale = torch.tensor(448.0 / 64.0, device=device)
    amax_now = torch.tensor(3.5, device=device)
    for hist in (
        torch.zeros(16, device=device),
        torch.rand(16, generator=torch.Generator(device="cpu").manual_seed(1)).to(device),
    ):
        args = (torch.tensor(6, device=device), amax_now, torch.float8_e4m3fn, 0, False, 1, True)
        h1, s1, h2, s2 = hist.clone(), scale.clone(), hist.clone(), scale.clone()
        got, want = ops.delayed_scale_update(h1, s1, *args), ref.delayed_scale_update(h2, s2, *args)
        if not all(_same(a, b) for a, b in zip((*got, h1, s1), (*want, h2, s2))):
            note("delayed_scale_update", "a 16-entry history")


def passed(device: torch.device, op: str | None = None, x: torch.Tensor | None = None) -> bool:
    """Whether the kernels run on ``device``: with ``op`` and its input ``x``, whether ``op``
    agreed with the torch path on a probe of ``x``'s class there (checked on the class's first
    call); with ``op`` alone (``delayed_scale_update``) its own check; with neither, whether the
    kernels can run there at all (no check has failed to run).

    Under ``torch.compile`` the answer is taken at trace time and baked into the graph
    (:func:`_passed` is marked a constant, as ``torch.compiler.assume_constant_result`` marks
    it; applying that function itself would import ``torch._dynamo`` here, and calling it while
    tracing is refused by Dynamo in torch 2.11): the check runs eagerly, never inside a graph.
    """
    if x is not None and (x.dim() != 2 or x.dtype not in _INPUT_DTYPES):
        return False  # the kernels take 2-D bf16/fp16/fp32 only: the torch path
    cls = None if op is None else (_DELAYED if x is None else input_class(x))
    return _passed(device, op, cls)


def _passed(device: torch.device, op: str | None, cls: tuple | None) -> bool:
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    if op is None or cls is None:
        return index not in _FAILED_DEVICES
    key = (index, cls)
    if key not in _RESULT:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False  # no check inside a CUDA graph capture: the torch path, decided later
        _RESULT[key] = _check(torch.device("cuda", index), cls)
    off = _RESULT[key]
    return ALL not in off and op not in off


_passed._dynamo_marked_constant = True  # type: ignore[attr-defined]  # what assume_constant_result sets


def _check(device: torch.device, cls: tuple) -> frozenset[str]:
    """Run the checks for ``cls``, retry its failing two-pass-able ops as two passes, log once;
    returns the ops to keep off for ``cls`` on ``device`` (``{ALL}`` when the check raised)."""
    sync_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    try:
        from lowprec.fp8.kernels import ops

        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if sync_mode:  # the comparisons read results on the host, once per class: allowed
            torch.cuda.set_sync_debug_mode(0)
        # real tensors even when Dynamo asks at trace time (``_passed`` is a marked constant)
        with torch.no_grad(), unset_fake_temporarily():
            bad = run_checks(ops, ref, device, (cls,))
            two_pass = set(bad) & TWO_PASS_OPS
            if two_pass:
                ops.set_two_pass(cls, two_pass)
                still = run_checks(ops, ref, device, (cls,))
                two_pass -= set(still)
                ops.set_two_pass(cls, two_pass)
    except Exception as e:  # noqa: BLE001 - any failure means "do not use the kernels here"
        _FAILED_DEVICES.add(device.index)
        logger.warning(
            "lowprec: fused FP8 Triton casts off on %s (self-check failed: %s: %s); using the torch path",
            device,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        return frozenset({ALL})
    finally:
        if sync_mode:
            torch.cuda.set_sync_debug_mode(sync_mode)
    off = frozenset(set(bad) - two_pass)
    if bad:
        parts = []
        if two_pass:
            parts.append(f"{', '.join(sorted(two_pass))} run as two passes (one store each)")
        if off:
            parts.append(f"{', '.join(sorted(off))} use the torch path")
        detail = "; ".join(f"{op}: {', '.join(where[:3])}" for op, where in sorted(bad.items()))
        logger.warning(
            "lowprec: fused FP8 Triton casts on %s for %s input: %s (their one-pass kernels differ from "
            "the torch path: %s)",
            device,
            _describe(cls),
            "; ".join(parts),
            detail,
        )
    return off
