"""Run-time choice between the Triton kernels and the torch path.

The Triton path runs only on CUDA tensors, only when ``triton`` can be imported, never when
``LOWPREC_DISABLE_TRITON=1`` (or ``LOWPREC_TRITON_KERNELS=0``), and only on a device where the
one-time self-check against the torch path passed (:mod:`lowprec.fp8.kernels.selfcheck`; a
failure is logged once and the torch path runs). On by default: the kernels are
bit-exact against the torch path in Triton's interpreter (CI) and compile to sm_89/sm_90
cubins (CI); the self-check covers the hardware neither of those runs. Inside
``fp8.trace_as`` the trace decides instead. Nothing here imports triton: ``importlib.util.find_spec``
answers whether it *could* be imported, so ``import lowprec.fp8`` stays torch-only and works
where triton is absent (CPU CI).

Under ``torch.compile`` both checks trace without a graph break: the importability is
decided once, at import, into a module constant (``find_spec`` does not import the package),
and Dynamo reads ``os.environ`` as a guarded constant. (``torch.compiler.assume_constant_result``
would do as well, but applying it imports torch._dynamo, which imports triton.)
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch
from lowprec.fp8.gemm.capability import is_cuda, traced, triton_findable, triton_override
from lowprec.fp8.kernels import selfcheck

__all__ = [
    "DISABLE_ENV",
    "ENABLE_ENV",
    "available",
    "triton_importable",
    "disabled_by_env",
    "enabled_by_env",
    "triton_allowed",
    "checked_once",
    "self_check_verdict",
]

logger = logging.getLogger("lowprec.fp8")

DISABLE_ENV = "LOWPREC_DISABLE_TRITON"
ENABLE_ENV = "LOWPREC_TRITON_KERNELS"
_TRUE = ("1", "true", "yes", "on")


_find_triton = triton_findable  # asked once, below; tests ask again with find_spec patched

TRITON_IMPORTABLE = _find_triton()


def triton_importable() -> bool:
    """Whether ``import triton`` would succeed (decided once, without importing it)."""
    return TRITON_IMPORTABLE


def disabled_by_env() -> bool:
    """``LOWPREC_DISABLE_TRITON=1`` (or true/yes/on) forces the torch path everywhere."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE


def enabled_by_env() -> bool:
    """False only when ``LOWPREC_TRITON_KERNELS`` is set to 0/false/no/off (the kernels are on
    by default; the variable was the opt-in before they were)."""
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def triton_allowed() -> bool:
    """Whether lowprec's Triton GEMMs may run (a trace decides for itself; else triton
    importable and not switched off by the environment). The device and its self-check are the
    caller's (``block_gemm_triton.runs``, ``grouped_triton.ready``)."""
    override = triton_override()  # fp8.trace_as decides for a trace
    if override is not None:
        return override
    return triton_importable() and enabled_by_env() and not disabled_by_env()


def checked_once(results: dict, device: torch.device, check: Callable[[torch.device], bool]) -> bool:
    """``check(device)`` run once per device index, its verdict kept in ``results`` (a Triton
    GEMM's first-use self-check); inside ``fp8.trace_as`` nothing runs and the answer is yes."""
    if traced():  # decisions only, nothing runs
        return True
    if device.index not in results:
        results[device.index] = check(device)
    return results[device.index]


def self_check_verdict(device: torch.device, kernel: str, what: str, instead: str, cases: Callable[[], str]) -> bool:
    """A Triton GEMM's first-use self-check: ``cases()`` runs its problems on ``device`` and returns
    ``""`` or what differed; an exception fails it too. A failure is logged once, with what runs
    instead (``"{what} on {device} {instead}"``, e.g. "grouped expert GEMMs on cuda:0 run one
    scaled GEMM per expert")."""
    try:
        why = cases()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use the kernel on this device
        why = f"{type(exc).__name__}: {exc}"[:200]
    if why:
        logger.warning("lowprec.fp8: %s on %s %s: the %s failed its self-check: %s", what, device, instead, kernel, why)
    return not why


def emulation_gap(got: torch.Tensor, ref: torch.Tensor) -> str:
    """A GEMM kernel's self-check rule: ``""`` when its float32 output is within 2^-7 * max|ref| of
    the float32 emulation ``ref`` (float32 accumulation in another order, the bf16 output rounding
    the kernel may apply), else what was measured."""
    err = (got - ref).abs().max().item()
    bound = 2.0**-7 * ref.abs().max().item()
    return "" if err <= bound else f"max |kernel - emulation| {err:.3g} > {bound:.3g}"


def available(device: torch.device | str, op: str | None = None, x: torch.Tensor | None = None) -> bool:
    """True where the fused Triton casts run: a CUDA device, triton importable, not disabled,
    and the self-check passed there: for ``op`` (one of the ops in :mod:`.ops`) on inputs of
    ``x``'s class when given (the verdict is per op and input class), else no check has failed
    to run on the device.

    CPU tensors always take the torch path (the Triton interpreter is for tests only).
    """

    if not is_cuda(torch.device(device)):
        return False

    traced = triton_override()  # fp8.trace_as(triton=...) decides for a trace
    if traced is not None:
        return traced
    if not (triton_importable() and enabled_by_env() and not disabled_by_env()):
        return False

    return selfcheck.passed(torch.device(device), op, x)
