"""First use on a real GPU: the Triton kernels against the torch path, once per device.

The kernels are checked bit-exact in Triton's interpreter (CI) and compiled to sm_89/sm_90
cubins (CI), but neither runs the hardware. So before the dispatch first picks them on a
device, :func:`passed` runs every fused op once on a small tensor holding the awkward values
(saturating, subnormal, ties, zeros of both signs, a NaN row) and compares with
:mod:`lowprec.fp8.kernels.reference` bit for bit. A mismatch or an exception turns the
kernels off for the process on that device, with one log line saying why; the torch path
then runs (same results, more bytes). Costs a few small kernel launches, once.
"""

from __future__ import annotations

import logging

import torch
from lowprec.fp8.kernels import reference as ref
from lowprec.fp8.scaling import amax_to_scale

__all__ = ["passed", "run_checks"]

logger = logging.getLogger("lowprec.fp8")
_RESULT: dict[int, bool] = {}


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


def _probe(device: torch.device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(67, 130, generator=g) * torch.exp2(torch.empty(67, 130).uniform_(-12, 12, generator=g))
    x[0, :4] = torch.tensor([0.0, -0.0, 1.0625, -17.0])  # zeros, E4M3 ties
    x[1, 0] = 1e6  # saturates
    return x.to(device=device, dtype=torch.bfloat16)


def run_checks(ops, ref, device: torch.device) -> list[str]:
    """Names of the fused ops (``ops``) that disagree with the torch path (``ref``) on the probe tensor."""

    x = _probe(device)
    scale = torch.tensor(448.0 / 64.0, device=device)
    cols = amax_to_scale(ref.amax_cols(x), torch.float8_e4m3fn, power_of_2=True)
    bad = []
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        pairs = {
            "cast_transpose_amax": (ops.cast_transpose_amax(x, scale, dtype), ref.cast_transpose_amax(x, scale, dtype)),
            "cast_amax": (ops.cast_amax(x, scale, dtype), ref.cast_amax(x, scale, dtype)),
            "cast_rowwise": (ops.cast_rowwise(x, dtype, True), ref.cast_rowwise(x, dtype, True)),
            "cast_rowwise_dual": (
                ops.cast_rowwise_dual(x, cols, dtype, True),
                ref.cast_rowwise_dual(x, cols, dtype, True),
            ),
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
        for name, (got, want) in pairs.items():
            if not all(_same(a, b) for a, b in zip(got, want)):
                bad.append(f"{name}({str(dtype).replace('torch.', '')})")
    for used in (scale, scale * 2):  # delayed scaling's re-cast: a no-op, then a real one
        got = ops.cast_transpose_amax(x, scale, torch.float8_e4m3fn)[:2]
        want = tuple(t.clone() for t in got)
        ops.recast_if_changed(x, used, scale, *got)
        ref.recast_if_changed(x, used, scale, *want)
        if not all(_same(a, b) for a, b in zip(got, want)):
            bad.append("recast_if_changed")
    for hist in (
        torch.zeros(16, device=device),
        torch.rand(16, generator=torch.Generator(device="cpu").manual_seed(1)).to(device),
    ):
        args = (torch.tensor(6, device=device), ops.amax(x), torch.float8_e4m3fn, 0, False, 1, True)
        h1, s1, h2, s2 = hist.clone(), scale.clone(), hist.clone(), scale.clone()
        got, want = ops.delayed_scale_update(h1, s1, *args), ref.delayed_scale_update(h2, s2, *args)
        if not all(_same(a, b) for a, b in zip((*got, h1, s1), (*want, h2, s2))):
            bad.append("delayed_scale_update")
    xn = x.clone()
    xn[5, 7] = float("nan")
    for name, got, want in (
        ("amax", ops.amax(x), ref.amax(x)),
        ("amax(NaN)", ops.amax(xn), ref.amax(xn)),
        ("amax_cols", ops.amax_cols(xn), ref.amax_cols(xn)),
    ):
        if not _same(got, want):
            bad.append(name)
    return bad


def passed(device: torch.device) -> bool:
    """Whether the kernels agreed with the torch path on ``device`` (checked on first call).

    Under ``torch.compile`` the answer is taken at trace time and baked into the graph
    (``assume_constant_result``): the check itself runs eagerly, once, never inside a graph.
    """
    if torch.compiler.is_compiling():
        return _passed_constant()(device)
    return _passed(device)


def _passed(device: torch.device) -> bool:
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    if index not in _RESULT:
        _RESULT[index] = _check(torch.device("cuda", index))
    return _RESULT[index]


_CONSTANT: list = []


def _passed_constant():
    if not _CONSTANT:
        _CONSTANT.append(torch.compiler.assume_constant_result(_passed))
    return _CONSTANT[0]


def _check(device: torch.device) -> bool:
    try:
        from lowprec.fp8.kernels import ops

        with torch.no_grad():
            bad = run_checks(ops, ref, device)
    except Exception as e:  # noqa: BLE001 - any failure means "do not use the kernels here"
        logger.warning(
            "lowprec: fused FP8 Triton casts off on %s (self-check failed: %s: %s); using the torch path",
            device,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        return False
    if bad:
        logger.warning(
            "lowprec: fused FP8 Triton casts off on %s (differ from the torch path: %s); using the torch path",
            device,
            ", ".join(bad),
        )
        return False
    return True
