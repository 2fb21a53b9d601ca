"""An FP8 autograd.Function's result is made by one op only: the cause of compiled FP8's zero gradients.

Dynamo (torch 2.11) returns a traced autograd.Function's intermediates as outputs beside its
result. When the last op of the forward hands back a tensor it was given (an identity ``.to``,
an in-place op), the result and that intermediate are one tensor in two output slots; autograd
keeps the later slot, and the backward receives a zero gradient for the result. On the H200
every compiled FP8 layer's gradients were exactly zero for that reason (the GEMM's
``out.to(out_dtype)`` with ``out`` already in ``out_dtype``); torch 2.13 on CPU does not show it,
so this test checks the cause itself: under a TorchFunctionMode (which sees the calls Dynamo
traces), no op other than the one that made the result may return it.

Every FP8 autograd.Function of the engine, every recipe, each GEMM path this machine runs, and
the CUDA branch of the native GEMM (padding, slicing) with the device test patched.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import lowprec.fp8 as fp8
from lowprec.fp8.gemm import dispatch as gemm_mod


class _Producers(TorchFunctionMode):
    """Counts, per tensor, the calls that returned it (kept alive so ids are not reused)."""

    active: _Producers | None = None

    def __init__(self):
        super().__init__()
        self.by: dict[int, list[str]] = {}
        self.keep: list[torch.Tensor] = []

    def __enter__(self):
        _Producers.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        _Producers.active = None
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.by.setdefault(id(t), []).append(getattr(func, "__name__", str(func)))
                self.keep.append(t)
        return out


def _fp8_functions():
    from lowprec.fp8.modules.activations import _RMSNormFn, _SwiGLUFn
    from lowprec.fp8.modules.fp8_base import _BaseFn
    from lowprec.fp8.modules.grouped_fn import GroupedScaledFn
    from lowprec.fp8.modules.linear_fn import Float8LinearFn
    from lowprec.fp8.modules.mx_linear import _MXLinearFn

    return (Float8LinearFn, _MXLinearFn, _BaseFn, GroupedScaledFn, _SwiGLUFn, _RMSNormFn)


@pytest.fixture
def results(monkeypatch):
    # the code Dynamo traces: branches taken only outside a compile (a CPU GEMM's scale as its
    # alpha, in-place scaling) are not what a compiled graph holds
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    """The tensors the engine's autograd.Functions' forwards return, with the calls that had
    returned each when the forward ended (what the caller does with it later is not the
    Function's graph)."""
    got: list[tuple[str, torch.Tensor, list[str]]] = []
    for fn in _fp8_functions():
        orig = fn.forward

        def forward(ctx, *args, _orig=orig, _name=fn.__name__):
            out = _orig(ctx, *args)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    mode = _Producers.active
                    got.append((_name, t, list(mode.by.get(id(t), [])) if mode is not None else []))
            return out

        monkeypatch.setattr(fn, "forward", staticmethod(forward))
    return got


def _check(got):
    assert got, "no FP8 autograd.Function ran"
    for name, _t, calls in got:
        assert len(calls) == 1, f"{name}'s result was returned by {len(calls)} calls: {calls}"


cpu = torch.device("cpu")


def _cases():
    """(recipe, GEMM path, CUDA branch): each path this machine runs, for the recipes whose
    GEMM it is; the microscaling kinds have one GEMM of their own."""
    paths = ["auto", "emulate", "upcast"]
    if gemm_mod.native_scaled_mm_available(cpu):
        paths.append("scaled_mm")
    for recipe in fp8.RECIPE_NAMES:
        if recipe in ("mxfp8", "nvfp4"):
            yield recipe, "auto", False
            continue
        block = recipe == "blockwise"
        for path in paths:
            if path == "scaled_mm" and block and not gemm_mod.native_scaled_mm_available(cpu, "block"):
                continue
            yield recipe, path, False
            if path == "scaled_mm" and not block:  # the native GEMM's CUDA branch: padding, slicing
                yield recipe, path, True


@pytest.mark.parametrize("recipe,path,cuda_branch", list(_cases()))
def test_linear_result_is_made_once(recipe, path, cuda_branch, results, monkeypatch, seed):
    if cuda_branch:
        monkeypatch.setattr(gemm_mod, "is_cuda", lambda device: True)
    rec = fp8.Recipe.from_name(recipe)
    if recipe not in ("mxfp8", "nvfp4"):
        rec = rec.replace(gemm=path)
    layer = fp8.Float8Linear.from_linear(torch.nn.Linear(96, 40), rec)  # 40, 96: pads to 16s on CUDA
    x = torch.randn(24, 96, requires_grad=True)
    mode = _Producers()
    for autocast in (False, True):
        results.clear()
        with mode, fp8.autocast(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        _check(results)
        y.float().sum().backward()


@pytest.mark.parametrize("recipe", fp8.RECIPE_NAMES)
def test_grouped_base_and_activation_results_are_made_once(recipe, results, seed):
    from lowprec.fp8.modules.activations import rms_norm, swiglu
    from lowprec.fp8.modules.fp8_base import Float8BaseLinear
    from lowprec.fp8.modules.grouped import Float8GroupedGemm

    rec = fp8.Recipe.from_name(recipe)
    mode = _Producers()
    q = (torch.randn(64, 128) * 8).to(torch.float8_e4m3fn)
    base = Float8BaseLinear(q, torch.full((1, 1), 0.125), block=128)
    counts = (40, 0, 56, 32)
    x, w = torch.randn(128, 64, requires_grad=True), torch.randn(4, 32, 64, requires_grad=True)
    with mode, fp8.autocast():
        base(torch.randn(16, 128, requires_grad=True))
        Float8GroupedGemm(len(counts), rec)(x, w, counts, rec, torch.float32)
        swiglu(torch.randn(8, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True))
        rms_norm(torch.randn(8, 16, requires_grad=True), torch.ones(16, requires_grad=True), 1e-6)
    names = {r[0] for r in results}
    assert {"_BaseFn", "_SwiGLUFn", "_RMSNormFn"} <= names, names
    _check(results)
