"""FP8 GEMMs on CPU: an exact upcast to bf16 and a bf16 GEMM, unless torch's own kernel is faster.

Why not ``torch._scaled_mm`` on CPU: its speed depends on the processor. On a Xeon with
AVX512 + AMX it ran at ~0.2 GFLOP/s (4.1 s for 512x256x704 against 1.5 ms in bf16); on this
project's AMD EPYC (AVX512-BF16, no AMX) 2.9 ms against 0.5 ms for the bf16 GEMM. A trainer whose
speed depends on which CPU it landed on is a trap, so the CPU path is the GEMM an FP8 GEMM *is*:

* Every E4M3 and E5M2 value is a bf16 value (bf16 has 8 exponent and 7 mantissa bits; E4M3
  needs 4 + 3, E5M2 5 + 2, and their subnormals are normal bf16 numbers). Upcasting the FP8
  operands to bf16 is exact.
* The bf16 GEMM (oneDNN; AMX or AVX512-BF16 where the CPU has them) multiplies exactly and
  accumulates in float32, then rounds the output to bf16 once.
* Scales are applied to the output: ``out * (1/scale_a) * (1/scale_b)`` in float32 arithmetic,
  per tensor (as the GEMM's ``alpha``, on the float32 accumulator) or per row/column. Block scales (which vary along the contraction dim) cannot
  factor out of the sum: they are folded into the bf16 operands instead, which is exact when
  they are powers of two (the blockwise recipe's default); other block scales take the float32
  emulation.

Bound against the float32 emulation (dequantize + fp32 matmul, ``gemm.py``): the products are
the same exact numbers, summed in another order (each a float32 rounding), plus the bf16
rounding of the output (relative 2**-9) and one float32 rounding per non-power-of-two scale
multiply. ``tests/test_fp8_cpu_gemm.py`` checks ``|upcast - emulate| <= 2**-8 * |emulate| +
k * eps32 * sum|a||b|``.

The upcast works on the bits: torch's own FP8 -> bf16 conversion runs at ~2 ns/element on
CPU (4.3 ms for 2048x1024, more than the 2048x1024x1024 bf16 GEMM it would feed); three integer
ops and one exact multiply take 0.3 ms. The sign/exponent/mantissa bits of an FP8 byte shifted
into bf16 position give the value times ``2**(bf16_bias - fp8_bias)`` for normal and subnormal
values alike; multiplying by the power of two back is exact. NaN/inf bytes are not decoded as
such, which is safe because every cast in ``quantize.py`` that writes a NaN/inf byte also makes
that slice's scale non-finite (see ``scaling.py``; delayed scaling does the same in
``delayed_scale_step``), and the scale reaches the output.

``torch._scaled_mm`` still runs on CPU where a one-time probe measures it clearly faster than
the upcast path, or where the user forces it with ``LOWPREC_CPU_FP8_GEMM=scaled_mm``.
``LOWPREC_CPU_FP8_GEMM=upcast`` skips the probe.

The probe runs once per machine, not once per process: its verdict is kept in
``~/.cache/lowprec/cpu_fp8_gemm-<key>.json`` (``$LOWPREC_CACHE_HOME``), keyed by torch version,
architecture and CPU model, and the first process to write it wins. The two kernels sum in
different orders, so two processes that timed the probe under different load (a resumed run
and the run it resumes, the ranks of one job) would otherwise compute different bits; with the
verdict kept, every process on a machine runs the same kernel until the file is deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lowprec.durable import cache_home, temp_suffix
from lowprec.fp8.modules import shared_cast
from lowprec.fp8.cast.host_scale import f32, reciprocal32
from lowprec.fp8.cast.quantize import Float8Data, expand_blocks

__all__ = [
    "CPU_GEMM_ENV",
    "CpuGemmChoice",
    "upcast_to_bf16",
    "upcast_mm",
    "cpu_gemm_choice",
    "cpu_gemm_path",
    "cpu_scaled_mm_exists",
    "reset_cpu_gemm_choice",
    "kept_probe",
    "machine_key",
]

logger = logging.getLogger("lowprec.fp8")

CPU_GEMM_ENV = "LOWPREC_CPU_FP8_GEMM"
CPU_GEMM_CHOICES = ("auto", "upcast", "scaled_mm")


def _upcast_constants(dtype: torch.dtype) -> tuple[int, int, float]:
    """(left shift into bf16 position, mask keeping sign + exponent + mantissa, 2**(127 - fp8
    bias)). Literals, not a module-level table: a float read from a global becomes a graph input
    under ``torch.compile(dynamic=True)``, which Dynamo cannot lift out of a traced
    autograd.Function (see ``formats.fp8_max``)."""
    if dtype == torch.float8_e4m3fn:
        return 4, 0x87F0 - 0x10000, 2.0**120
    if dtype == torch.float8_e5m2:
        return 5, 0x8FE0 - 0x10000, 2.0**112
    raise ValueError(f"{dtype} is not an FP8 dtype (E4M3 or E5M2)")


_SHIFTS = {n: torch.tensor([n], dtype=torch.int16) for n in (4, 5)}

# addmm's ``input`` with beta=0: read for its dtype and broadcast shape only, never written
_ZERO_BF16 = torch.zeros((), dtype=torch.bfloat16)


def upcast_to_bf16(data: torch.Tensor) -> torch.Tensor:
    """The exact bf16 value of every finite FP8 element (any layout; a new tensor).

    int8 -> int16 sign-extends, so after the shift the sign bit sits in bit 15 and the bits
    between it and the exponent are ones for negative values: the mask clears them.
    """
    shift, mask, mult = _upcast_constants(data.dtype)
    # int8 << int16[1]: promoted to int16 (sign-extended) and shifted in one op
    bits = torch.bitwise_left_shift(data.view(torch.int8), _SHIFTS[shift])
    bits.bitwise_and_(mask)
    return bits.view(torch.bfloat16).mul_(mult)


def _dequant_blocks_bf16(q: Float8Data) -> torch.Tensor:
    """``data / scale`` in bf16 for power-of-two block scales (exact): broadcast over tiles."""
    x = upcast_to_bf16(q.data)
    inv = q.scale.reciprocal()
    rows, cols = x.shape
    br, bc = q.tiles
    if rows % br == 0 and cols % bc == 0:  # splitting a dim is always a view, any layout
        tiles = x.reshape(rows // br, br, cols // bc, bc)
        tiles.mul_(inv[:, None, :, None])
        return x
    return x.mul_(expand_blocks(inv, q.tiles, x.shape))


def upcast_mm(a: Float8Data, b: Float8Data, out_dtype: torch.dtype) -> torch.Tensor | None:
    """``dequant(a) @ dequant(b)`` as a bf16 GEMM over exactly upcast operands (see module doc).

    Returns ``None`` when the scales are block scales that are not powers of two (the caller
    emulates in float32 then).
    """
    if "block" in (a.granularity, b.granularity):
        if not (a.pow2_scale and b.pow2_scale):
            return None
        av = _dequant_blocks_bf16(a) if a.granularity == "block" else _scaled_bf16(a)
        bv = _dequant_blocks_bf16(b) if b.granularity == "block" else _scaled_bf16(b)
        out = torch.mm(av, bv)
        return out if out.dtype == out_dtype else out.to(out_dtype)  # as gemm.as_dtype
    av, bv = _cached_upcast(a), _cached_upcast(b)
    if a.scale.dim() == 0 and b.scale.dim() == 0 and not torch.compiler.is_compiling():
        # the scale as the GEMM's alpha: applied to the float32 accumulator, one rounding of
        # the output, no extra pass (a host read of a CPU scalar is no device sync). The float32
        # reciprocals and their product in Python floats (host_scale.py): the same bits as
        # torch's scalar ops, without a dispatch each.
        alpha = f32(reciprocal32(a.scale.item()) * reciprocal32(b.scale.item()))
        out = torch.addmm(_ZERO_BF16, av, bv, beta=0, alpha=alpha)
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
    inv_a, inv_b = a.scale.reciprocal(), b.scale.reciprocal()
    out = torch.mm(av, bv)
    # the unscaled sums can pass float16's range (65504) where the scaled output does not: a
    # float16 output is scaled in float32 first, then rounded once
    work = torch.float32 if out_dtype == torch.float16 else out_dtype
    if work != torch.bfloat16:
        out = out.to(work)
    if torch.compiler.is_compiling():  # out of place: a traced result must be one op's (gemm.as_dtype)
        scaled = out * (inv_a * inv_b) if inv_a.dim() == 0 and inv_b.dim() == 0 else out * inv_a * inv_b
        return scaled if scaled.dtype == out_dtype else scaled.to(out_dtype)
    if inv_a.dim() == 0 and inv_b.dim() == 0:
        out.mul_(inv_a * inv_b)
    else:
        out.mul_(inv_a).mul_(inv_b)  # (M, 1) then (1, N): broadcast in place
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _cached_upcast(q: Float8Data) -> torch.Tensor:
    """``upcast_to_bf16(q.data)``, kept on ``q`` so a cast that feeds two GEMMs is upcast once."""
    if torch.compiler.is_compiling():
        return upcast_to_bf16(q.data)
    if q.bf16_cache is None and _in_backward():  # an input saved by q/k/v: upcast once for all three
        shared_cast.shared_upcast(q, upcast_to_bf16)
    if q.bf16_cache is None:
        q.bf16_cache = upcast_to_bf16(q.data)
    return q.bf16_cache


def _in_backward() -> bool:
    """Inside an autograd backward (where saved operands are read), not a forward."""
    node = getattr(torch._C, "_current_autograd_node", None)
    return node is not None and node() is not None


def _scaled_bf16(q: Float8Data) -> torch.Tensor:
    """A per-tensor/per-axis operand next to a block-scaled one: fold its power-of-two scale."""
    return upcast_to_bf16(q.data).mul_(q.scale.reciprocal())


# --------------------------------------------------------------------------- the one-time probe
def _parse_version(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


# parsed once at import: a plain value, not an lru_cache, which Dynamo warns about (a
# "silent incorrectness" UserWarning) each time a compiled FP8 GEMM traces through it
_TORCH_VERSION = _parse_version(torch.__version__)


def torch_version() -> tuple[int, int]:
    return _TORCH_VERSION


def cpu_scaled_mm_exists() -> bool:
    """Whether this torch has an FP8 ``torch._scaled_mm`` CPU kernel (2.8+); not whether it is fast."""
    return hasattr(torch, "_scaled_mm") and torch_version() >= (2, 8)


@dataclass(frozen=True)
class CpuGemmChoice:
    """Which kernel runs FP8 GEMMs on this CPU, and why (the sentence logged and shown by
    ``lowprec env``, ``lowprec config`` and the trainer)."""

    path: str  # "upcast" | "scaled_mm"
    reason: str

    def describe(self) -> str:
        what = {
            "upcast": "exact FP8->bf16 upcast + bf16 GEMM (fp32 accumulation), scales on the output",
            "scaled_mm": "torch._scaled_mm",
        }[self.path]
        return f"{self.path} ({what}): {self.reason}"


_CHOICE: dict[str, CpuGemmChoice] = {}
# torch._scaled_mm must beat the upcast path by this factor to be chosen: close calls keep the
# upcast, so that two processes on one machine do not pick different kernels on timing noise.
PROBE_MARGIN = 1.5
PROBE_SHAPE = (128, 256, 256)


def _time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _probe(timer=_time_once) -> CpuGemmChoice:
    m, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).t()
    one = torch.ones((), dtype=torch.float32)
    qa, qb = Float8Data(a, one), Float8Data(b, one)

    def native():
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    def upcast():
        upcast_mm(qa, qb, torch.bfloat16)

    try:
        t_native = [timer(native)]  # the first call also warms up; a 500x-slow kernel shows at once
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        return CpuGemmChoice("upcast", f"torch._scaled_mm failed on this CPU ({type(exc).__name__})")
    t_up = [timer(upcast), timer(upcast)]
    if t_native[0] < PROBE_MARGIN * min(t_up) * 4:  # not obviously slower: measure properly
        for _ in range(3):
            t_native.append(timer(native))
            t_up.append(timer(upcast))
    tn, tu = min(t_native), min(t_up)
    shape = "x".join(map(str, PROBE_SHAPE))
    measured = f"probe {shape}: torch._scaled_mm {tn * 1e3:.2f} ms, upcast {tu * 1e3:.2f} ms"
    if tn * PROBE_MARGIN < tu:
        return CpuGemmChoice("scaled_mm", f"{measured} (torch's kernel is {tu / tn:.1f}x faster here)")
    return CpuGemmChoice("upcast", f"{measured} (torch._scaled_mm is {tn / tu:.1f}x slower here)")


def cpu_gemm_choice() -> CpuGemmChoice:
    """The CPU FP8 GEMM kernel for this process: ``LOWPREC_CPU_FP8_GEMM`` or a one-time probe
    (cached, logged once)."""
    forced = os.environ.get(CPU_GEMM_ENV, "auto").strip().lower() or "auto"
    if forced not in CPU_GEMM_CHOICES:
        raise ValueError(f"{CPU_GEMM_ENV}={forced!r}; use one of {', '.join(CPU_GEMM_CHOICES)}")
    cached = _CHOICE.get(forced)
    if cached is not None:
        return cached
    has_native = cpu_scaled_mm_exists()
    if forced == "upcast":
        choice = CpuGemmChoice("upcast", f"{CPU_GEMM_ENV}=upcast")
    elif forced == "scaled_mm":
        if not has_native:
            raise ValueError(
                f"{CPU_GEMM_ENV}=scaled_mm, but torch {torch.__version__} has no CPU torch._scaled_mm; "
                f"unset it or use {CPU_GEMM_ENV}=upcast"
            )
        choice = CpuGemmChoice("scaled_mm", f"{CPU_GEMM_ENV}=scaled_mm")
    elif not has_native:
        choice = CpuGemmChoice("upcast", f"torch {torch.__version__} has no CPU torch._scaled_mm")
    else:
        choice = kept_probe()
    _CHOICE[forced] = choice
    logger.info("lowprec.fp8: CPU FP8 GEMMs: %s", choice.describe())
    return choice


def cpu_gemm_path() -> str:
    """``cpu_gemm_choice().path``: what the GEMM dispatch reads. Under ``torch.compile`` Dynamo
    calls it for real while it traces and takes the result as a constant: the first choice in a
    process reads the kept verdict (or probes), writes it and logs, none of which traces (a
    ``Float8Linear`` compiled before it ever ran eagerly failed under ``fullgraph=True`` and
    broke its graph otherwise). The choice is fixed for the process, so the constant holds."""
    return cpu_gemm_choice().path


# what torch.compiler.assume_constant_result sets, set here without importing torch._dynamo
# (``import lowprec.fp8`` does not load it)
cpu_gemm_path._dynamo_marked_constant = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- kept per machine
def machine_key() -> str:
    """What the probe's verdict depends on: torch version, architecture, CPU model."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"torch {torch.__version__}; {platform.machine()}; {model}"


def probe_file(key: str) -> Path:
    return cache_home() / f"cpu_fp8_gemm-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_kept(path: Path, key: str) -> CpuGemmChoice | None:
    """The verdict kept in ``path`` for ``key``; None when absent, unreadable or for another key."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw["key"] == key and raw["path"] in ("upcast", "scaled_mm") and isinstance(raw["reason"], str):
            return CpuGemmChoice(raw["path"], f"{raw['reason']}; measured {raw['measured']}, kept in {path}")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("lowprec.fp8: measuring the CPU FP8 GEMMs again: %s is unreadable (%s)", path, exc)
    return None


def kept_probe(probe=None) -> CpuGemmChoice:
    """This machine's verdict: the kept one, else a fresh probe kept for every later process.

    First writer wins: the verdict is written to a private temporary and hard-linked into place,
    which fails when another process got there first; that process's verdict is then used. A
    cache that cannot be written costs a probe per process and is logged.
    """
    key = machine_key()
    path = probe_file(key)
    kept = _read_kept(path, key)
    if kept is not None:
        return kept
    choice = (probe or _probe)()
    record = {"key": key, "path": choice.path, "reason": choice.reason, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    tmp = path.with_name(f".tmp-{temp_suffix()}-{path.name}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        try:
            os.link(tmp, path)
        except FileExistsError:
            winner = _read_kept(path, key)
            if winner is not None:
                return winner
            os.replace(tmp, path)  # the existing file was unreadable: ours replaces it
        except OSError:  # no hard links on this file system: last writer wins
            os.replace(tmp, path)
    except OSError as exc:
        logger.warning(
            "lowprec.fp8: cannot keep the CPU FP8 GEMM probe in %s (%s); each process measures anew", path, exc
        )
        return choice
    finally:
        if tmp.is_file():
            tmp.unlink()
    return CpuGemmChoice(choice.path, f"{choice.reason}; kept in {path}")


def reset_cpu_gemm_choice() -> None:
    """Forget the cached choice (tests; after changing ``LOWPREC_CPU_FP8_GEMM``)."""
    _CHOICE.clear()
