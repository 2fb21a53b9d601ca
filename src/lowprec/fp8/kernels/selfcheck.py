"""First use on a real GPU: the Triton kernels against the torch path, once per device.

The kernels are checked bit-exact in Triton's interpreter (CI) and compiled to sm_89/sm_90
cubins (CI), but neither runs the hardware. So the first time an op meets an input of a new
*class* on a device, :func:`passed` runs that op on a small probe of the class (both FP8
formats) and compares with :mod:`lowprec.fp8.kernels.reference` bit for bit. A class is what the
compiled code specialises on: the input dtype and whether each dimension is a multiple of 16
(Triton vectorises loads and stores then). The probe has the class's dtype and divisibility, so
it runs the binaries the real call will (little compilation is added), and it holds the awkward
values (saturating, subnormal, ties, zeros of both signs, a NaN, an inf, rows 12 decades apart).

The verdict is per class and op. An op whose one-pass form differs is tried again as two
passes, one store each (:data:`TWO_PASS_OPS`, ``ops.set_two_pass``): on the first H200 run
(Triton 3.6, its bundled ptxas) the transposed 8-bit store of a kernel that also stores the
plain layout came out wrong for float32 input with 16-divisible shapes (NaN in training), a
known ptxas fault (triton-lang/triton#11111) that spares a kernel with the transposed store
alone. An op that still differs takes the torch path for that class on that device; a check
that raises turns the kernels off on the device. One log line per decision.
"""

from __future__ import annotations

import logging

import torch
from lowprec.fp8.kernels import reference as ref
from lowprec.fp8.kernels.classes import INPUT_DTYPES, input_class
from lowprec.fp8.cast.nvfp4 import sr_key, tensor_scales
from lowprec.fp8.cast.scaling import amax_to_scale

__all__ = ["passed", "run_checks", "input_class", "TWO_PASS_OPS", "OPS", "CLASSES"]

logger = logging.getLogger("lowprec.fp8")
# ops with a plain and a transposed store, which can run as two launches of one store each
TWO_PASS_OPS = frozenset(
    {
        "cast_transpose_amax",
        "recast_if_changed",
        "cast_rowwise_dual",
        "cast_rowwise_into",
        "cast_block_1d",
        "cast_block_2d",
        "cast_mx",
        "cast_nvfp4",
        "cast_nvfp4_dual",
    }
)
# (device index, class, op) -> whether the op runs on the GPU for that class there
_RESULT: dict[tuple, bool] = {}
_FAILED_DEVICES: set[int] = set()  # a check raised there: the kernels cannot run at all
_DELAYED = ("delayed",)  # the class of delayed_scale_update (a 1-D float32 history)
CLASSES = (
    (torch.bfloat16, False, False),
    (torch.bfloat16, True, True),
    (torch.float32, True, True),
    (torch.float32, False, False),
    (torch.float16, True, True),
)


# The probes' rows x columns: for 16-divisible dims, and for ragged ones. 256 x 512 is the probe
# that caught the ptxas fault on the H200 (whole tiles of every kernel: 64 x 64, 32 x 128,
# 16 x 64, 128 x 128 blocks, the rowwise kernel's 512-column chunk); the interpreter tests check
# the same logic on a smaller one (tests/triton_interpret.py), since there each program instance
# costs Python time and no hardware fault can show.
PROBE_DIVISIBLE = (256, 512)
PROBE_RAGGED = (67, 130)


def _probe_shape(cls: tuple) -> tuple[int, int]:
    """Rows and columns of the probe of ``cls``: multiples of 16 where the class has them."""
    _, div_m, div_n = cls
    return (PROBE_DIVISIBLE[0] if div_m else PROBE_RAGGED[0]), (PROBE_DIVISIBLE[1] if div_n else PROBE_RAGGED[1])


def _describe(cls: tuple) -> str:
    if cls == _DELAYED:
        return "the delayed-scaling update"
    rows, cols = _probe_shape(cls)
    return f"{str(cls[0]).replace('torch.', '')} {rows}x{cols}"


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
    dtype = cls[0]
    rows, cols = _probe_shape(cls)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, cols, generator=g)
    half = rows // 2
    x[:half] *= torch.exp2(torch.empty(half, cols).uniform_(-12, 12, generator=g))
    x[half:] *= torch.logspace(-6, 6, rows - half)[:, None]
    x[0, :4] = torch.tensor([0.0, -0.0, 1.0625, -17.0])  # zeros, E4M3 ties
    x[1, 0] = 1e6  # saturates
    x[half + 3], x[half + 5, 7], x[half + 8, cols - 3] = 0.0, float("nan"), float("inf")
    return x.to(device=device, dtype=dtype)


# What each op's check runs, on ``m`` (the Triton ops or the torch path: same names and
# signatures): ``(x, fp8 dtype, scale, column scales) -> outputs``; two forms for per-row scales.
_CALLS = {
    "cast_transpose_amax": lambda m, x, d, s, c: m.cast_transpose_amax(x, s, d),
    "cast_amax": lambda m, x, d, s, c: m.cast_amax(x, s, d),
    "cast_rowwise": lambda m, x, d, s, c: (*m.cast_rowwise(x, d, True), *m.cast_rowwise(x, d, False)),
    "cast_rowwise_dual": lambda m, x, d, s, c: m.cast_rowwise_dual(x, c, d, True),
    "cast_cols_t": lambda m, x, d, s, c: (m.cast_cols_t(x, c, d),),
    "cast_rowwise_into": lambda m, x, d, s, c: _into(m, x, d, c),
    "cast_block_1d": lambda m, x, d, s, c: m.cast_block_1d(x, d, 128, True, True, True),
    "cast_block_2d": lambda m, x, d, s, c: m.cast_block_2d(x, d, 128, False, True, True),
    "cast_mx": lambda m, x, d, s, c: (*m.cast_mx(x, d, True, True, True), *m.cast_mx(x, d, False, True, False)),
    "cast_nvfp4": lambda m, x, d, s, c: _nvfp4(m, x),
    "cast_nvfp4_rht": lambda m, x, d, s, c: _nvfp4_rht(m, x),
    "cast_nvfp4_dual": lambda m, x, d, s, c: _nvfp4_dual(m, x),
    "amax": lambda m, x, d, s, c: (m.amax(x),),
    "amax_cols": lambda m, x, d, s, c: (m.amax_cols(x),),
}
_NO_FP8_DTYPE = ("amax", "amax_cols", "cast_nvfp4", "cast_nvfp4_rht", "cast_nvfp4_dual")


def _nvfp4(m, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``cast_nvfp4``: 1x16 blocks (round to nearest, and stochastic with a 64-bit seed's stream)
    and 16x16 tiles (both layouts) of the probe, and of the probe with its NaN and inf zeroed (a
    non-finite amax makes every scale NaN); the 1x16 casts of a transposed view of it too (the
    weight-gradient operands are read through their strides: another compiled variant)."""
    out: list[torch.Tensor] = []
    for t in (x, torch.nan_to_num(x, nan=0.0, posinf=0.0)):
        s = tensor_scales(ref.amax(t).float())[0]
        out += [*m.cast_nvfp4(t, s, False, True, False), *m.cast_nvfp4(t, s, True, True, True)]
        tt = t.t().contiguous().t()  # the same values, column-major
        for v in (t, tt):
            out += m.cast_nvfp4(v, s, False, True, False, sr_key(0x9E3779B97F4A7C15))[:2]
        out += m.cast_nvfp4(tt, s, False, True, False)[:2]
    return tuple(out)


def _into(m, x: torch.Tensor, dtype: torch.dtype, cols: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``cast_rowwise_into`` as the grouped path calls it: both casts, then each alone, into
    slices of larger buffers that start one row in (the rows around them are compared too)."""
    rows, n = x.shape
    out: list[torch.Tensor] = []
    for row, col in ((True, True), (True, False), (False, True)):
        buf = torch.zeros(rows + 2, n, dtype=torch.uint8, device=x.device)
        buf_t = torch.zeros(n + 2, rows, dtype=torch.uint8, device=x.device)
        q, qt = buf[1 : rows + 1] if row else buf[:0], buf_t[1 : n + 1] if col else buf_t[:0]
        out += [m.cast_rowwise_into(x, cols, dtype, True, q, qt), buf, buf_t]
    return tuple(out)


def _nvfp4_rht(m, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``rht_amax`` and ``cast_nvfp4_rht`` (round to nearest and stochastic) of the probe, with and
    without its NaN and inf."""
    out: list[torch.Tensor] = []
    bits = 0b1011001110001101  # a mix of signs
    for t in (x, torch.nan_to_num(x, nan=0.0, posinf=0.0)):
        a = m.rht_amax(t, bits)
        s = tensor_scales(ref.rht_amax(t, bits))[0]
        out += [a, *m.cast_nvfp4_rht(t, s, bits), *m.cast_nvfp4_rht(t, s, bits, sr_key(0x9E3779B97F4A7C15))]
    return tuple(out)


def _nvfp4_dual(m, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``nvfp4_dual_amax`` and ``cast_nvfp4_dual`` (both round to nearest, both stochastic with two
    streams, one of each) of the probe, with and without its NaN and inf, and of a column-major view."""
    out: list[torch.Tensor] = []
    bits = 0b0110100111010010
    k0, k1 = sr_key(0x9E3779B97F4A7C15), sr_key(12345)
    for t in (x, torch.nan_to_num(x, nan=0.0, posinf=0.0)):
        s = tensor_scales(ref.nvfp4_dual_amax(t, bits))[0]
        out.append(m.nvfp4_dual_amax(t, bits))
        for keys in ((-1, -1), (k0, k1), (k0, -1), (-1, k1)):
            out += m.cast_nvfp4_dual(t, s, bits, *keys)
    tt = x.t().contiguous().t()  # the same values, column-major: another compiled variant
    out += m.cast_nvfp4_dual(tt, tensor_scales(ref.nvfp4_dual_amax(tt, bits))[0], bits, k0, k1)
    return tuple(out)


OPS = (*_CALLS, "recast_if_changed")  # the ops checked per input class


def _check_recast(ops, ref, x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Delayed scaling's in-place re-cast: a no-op (same scale), then a real one."""
    for used in (scale, scale * 2):
        got = tuple(t.clone() for t in ref.cast_transpose_amax(x, scale, torch.float8_e4m3fn)[:2])
        want = tuple(t.clone() for t in got)
        ops.recast_if_changed(x, used, scale, *got)
        ref.recast_if_changed(x, used, scale, *want)
        if not all(_same(a, b) for a, b in zip(got, want)):
            return False
    return True


def run_checks(ops, ref, device: torch.device, classes=CLASSES, names=OPS) -> dict[str, list[str]]:
    """The fused ops (``ops``) among ``names`` that disagree with the torch path (``ref``) on the
    probes of ``classes`` (input classes, or ``_DELAYED``): ``{op name: [where it differed]}``."""
    bad: dict[str, list[str]] = {}
    for cls in classes:
        if cls == _DELAYED:
            if not _delayed_agrees(ops, ref, device):
                bad.setdefault("delayed_scale_update", []).append("a 16-entry history")
            continue
        where, x = _describe(cls), _probe(cls, device)
        scale = torch.tensor(448.0 / 64.0, device=device)
        xf = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0)  # finite column scales
        cols = amax_to_scale(ref.amax_cols(xf), torch.float8_e4m3fn, power_of_2=True)
        for name in names:
            if name == "recast_if_changed":
                if not _check_recast(ops, ref, x, scale):
                    bad.setdefault(name, []).append(where)
                continue
            dtypes = (None,) if name in _NO_FP8_DTYPE else (torch.float8_e4m3fn, torch.float8_e5m2)
            for dtype in dtypes:
                got, want = (_CALLS[name](m, x, dtype, scale, cols) for m in (ops, ref))
                if not all(_same(a, b) for a, b in zip(got, want)):
                    label = where if dtype is None else f"{where} {str(dtype).replace('torch.', '')}"
                    bad.setdefault(name, []).append(label)
    return bad


def _delayed_agrees(ops, ref, device: torch.device) -> bool:
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
            return False
    return True


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
    if x is not None and (x.dim() != 2 or x.dtype not in INPUT_DTYPES):
        return False  # the kernels take 2-D bf16/fp16/fp32 only: the torch path
    cls = None if op is None else (_DELAYED if x is None else input_class(x))
    return _passed(device, op, cls)


def _passed(device: torch.device, op: str | None, cls: tuple | None) -> bool:
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    if op is None or cls is None or index in _FAILED_DEVICES:
        return index not in _FAILED_DEVICES
    key = (index, cls, op)
    if key not in _RESULT:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False  # no check inside a CUDA graph capture: the torch path, decided later
        _RESULT[key] = _check(torch.device("cuda", index), cls, op)
    return _RESULT[key]


_passed._dynamo_marked_constant = True  # type: ignore[attr-defined]  # what assume_constant_result sets


def _check(device: torch.device, cls: tuple, op: str) -> bool:
    """Check ``op`` on a probe of ``cls``; retry as two passes where it can; log once. Whether
    the op stays on the GPU for that class (one pass or two)."""
    sync_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from lowprec.fp8.kernels import ops  # imports triton: the check runs on a GPU only

        if sync_mode:  # the comparisons read results on the host, once per check: allowed
            torch.cuda.set_sync_debug_mode(0)
        # real tensors even when Dynamo asks at trace time (``_passed`` is a marked constant)
        with torch.no_grad(), unset_fake_temporarily():
            names = (op,)
            bad = run_checks(ops, ref, device, (cls,), names)
            two_pass = bool(bad) and op in TWO_PASS_OPS
            if two_pass:
                ops.set_two_pass(cls, op, True)
                two_pass = not run_checks(ops, ref, device, (cls,), names)
                ops.set_two_pass(cls, op, two_pass)
    except Exception as e:  # noqa: BLE001 - any failure means "do not use the kernels here"
        _FAILED_DEVICES.add(device.index)
        logger.warning(
            "lowprec: fused FP8 Triton casts off on %s (self-check failed: %s: %s); using the torch path",
            device,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        return False
    finally:
        if sync_mode:
            torch.cuda.set_sync_debug_mode(sync_mode)
    if bad:
        logger.warning(
            "lowprec: fused FP8 Triton cast %s on %s for %s input %s (its one-pass kernel differs from the "
            "torch path: %s)",
            op,
            device,
            _describe(cls),
            "runs as two passes (one store each)" if two_pass else "uses the torch path",
            ", ".join(bad[op][:3]),
        )
    return not bad or two_pass
