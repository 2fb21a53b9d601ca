"""lowprec.fp8.kernels without triton: run-time selection, the torch path, the quantize hook.

The kernels themselves are checked in test_fp8_kernels_interpret.py (Triton's CPU
interpreter, skipped where triton is absent) and test_fp8_kernels_gpu.py (``-m gpu``).
"""

import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

from lowprec.fp8 import E4M3, E5M2, kernels
from lowprec.fp8.kernels import reference, select
from lowprec.fp8.cast.quantize import quantize_axiswise, quantize_tensorwise, saturated_cast
from lowprec.fp8.cast.scaling import amax_to_scale

FP8 = [E4M3, E5M2]
# ``lowprec.fp8.cast.quantize`` the attribute is the function; the module is needed here
quantize_mod = importlib.import_module("lowprec.fp8.cast.quantize")


@pytest.fixture
def no_triton(monkeypatch):
    """Pretend triton is not installed (whatever this machine has)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    monkeypatch.setattr(select, "TRITON_IMPORTABLE", select._find_triton())
    monkeypatch.delenv(select.DISABLE_ENV, raising=False)
    monkeypatch.setenv(select.ENABLE_ENV, "1")


@pytest.fixture
def fake_triton(monkeypatch):
    """Pretend triton is installed and the first-use self-check passed on cuda:0 and cuda:1."""
    from lowprec.fp8.kernels import selfcheck

    monkeypatch.setattr(select, "TRITON_IMPORTABLE", True)
    monkeypatch.setattr(selfcheck, "_RESULT", {})
    monkeypatch.setattr(selfcheck, "_FAILED_DEVICES", set())
    monkeypatch.delenv(select.DISABLE_ENV, raising=False)
    monkeypatch.delenv(select.ENABLE_ENV, raising=False)


def test_importing_the_engine_does_not_import_triton():
    code = "import sys, lowprec.fp8, lowprec.fp8.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_cpu_never_selects_triton(fake_triton):
    assert not kernels.available("cpu")
    assert not kernels.available(torch.device("cpu"))


def test_cuda_selects_triton_only_when_importable_and_not_disabled(fake_triton, monkeypatch):
    assert kernels.available("cuda")
    assert kernels.available(torch.device("cuda", 1))
    for value in ("1", "true", "YES", " on "):
        monkeypatch.setenv(select.DISABLE_ENV, value)
        assert not kernels.available("cuda"), value
    for value in ("0", "", "no"):
        monkeypatch.setenv(select.DISABLE_ENV, value)
        assert kernels.available("cuda"), value


def test_triton_kernels_are_on_by_default_and_can_be_turned_off(fake_triton, monkeypatch):
    assert kernels.available("cuda")
    monkeypatch.setenv(select.ENABLE_ENV, "1")
    assert kernels.available("cuda")
    for value in ("0", "false", "off"):
        monkeypatch.setenv(select.ENABLE_ENV, value)
        assert not kernels.available("cuda"), value


def _fake_check(monkeypatch, results):
    """A self-check whose ops are the torch path and whose runs return ``results`` in turn."""
    from lowprec.fp8.kernels import selfcheck

    monkeypatch.setattr(select, "TRITON_IMPORTABLE", True)
    monkeypatch.setattr(selfcheck, "_RESULT", {})
    monkeypatch.setattr(selfcheck, "_FAILED_DEVICES", set())
    monkeypatch.delenv(select.DISABLE_ENV, raising=False)
    runs = iter(results)
    asked = []
    monkeypatch.setattr(
        selfcheck, "run_checks", lambda ops, ref, dev, cls, names: asked.append((cls, names)) or next(runs)
    )
    two_pass = []
    fake_ops = types.SimpleNamespace(set_two_pass=lambda cls, name, on: two_pass.append((cls, name, on)))
    monkeypatch.setitem(sys.modules, "lowprec.fp8.kernels.ops", fake_ops)  # no triton import needed
    monkeypatch.setattr(kernels, "ops", fake_ops, raising=False)
    return two_pass, asked


BF16_DIV = (torch.bfloat16, True, True)


def test_a_failed_self_check_turns_off_that_op_for_that_input_class(monkeypatch, caplog):
    """An op that differs (and has no two-pass form) takes the torch path for inputs of the
    probed class; another op, or another class, is checked on its own first use."""
    _, asked = _fake_check(monkeypatch, [{"cast_amax": ["bfloat16 256x512 float8_e4m3fn"]}, {}, {}])
    x = torch.empty(32, 64, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="lowprec.fp8"):
        assert not kernels.available("cuda", "cast_amax", x) and not kernels.available("cuda:0", "cast_amax", x)
        assert kernels.available("cuda", "cast_transpose_amax", x) and kernels.available("cuda")
        assert kernels.available("cuda", "cast_amax", torch.empty(32, 64))  # float32: checked apart, agreed
    f32 = (torch.float32, True, True)
    assert asked == [((BF16_DIV,), ("cast_amax",)), ((BF16_DIV,), ("cast_transpose_amax",)), ((f32,), ("cast_amax",))]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "cast_amax" in lines[0] and "uses the torch path" in lines[0] and "bfloat16 256x512" in lines[0]


def test_a_one_pass_failure_is_retried_as_two_passes(monkeypatch, caplog):
    """cast_transpose_amax differs in one pass, agrees in two: it stays on, as two passes;
    cast_block_1d differs both ways: torch path."""
    results = [{"cast_transpose_amax": ["x"]}, {}, {"cast_block_1d": ["y"]}, {"cast_block_1d": ["y"]}]
    two_pass, _ = _fake_check(monkeypatch, results)
    x = torch.empty(32, 64, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="lowprec.fp8"):
        assert kernels.available("cuda", "cast_transpose_amax", x)
        assert not kernels.available("cuda", "cast_block_1d", x)
    assert two_pass == [
        (BF16_DIV, "cast_transpose_amax", True),
        (BF16_DIV, "cast_transpose_amax", True),
        (BF16_DIV, "cast_block_1d", True),
        (BF16_DIV, "cast_block_1d", False),
    ]
    first, second = [r.getMessage() for r in caplog.records]
    assert "cast_transpose_amax" in first and "runs as two passes" in first
    assert "cast_block_1d" in second and "uses the torch path" in second


def test_inputs_the_kernels_do_not_take_go_to_the_torch_path_unchecked(monkeypatch):
    _, classes = _fake_check(monkeypatch, [])
    assert not kernels.available("cuda", "cast_amax", torch.empty(4, 4, dtype=torch.float64))
    assert not kernels.available("cuda", "cast_amax", torch.empty(2, 4, 4, dtype=torch.bfloat16))
    assert classes == []


def test_a_self_check_that_cannot_run_turns_every_op_off(monkeypatch, caplog):
    """On CPU-only torch the check cannot launch a kernel: the dispatch says no, once, and logs why."""
    from lowprec.fp8.kernels import selfcheck

    monkeypatch.setattr(select, "TRITON_IMPORTABLE", True)
    monkeypatch.setattr(selfcheck, "_RESULT", {})
    monkeypatch.setattr(selfcheck, "_FAILED_DEVICES", set())
    monkeypatch.delenv(select.DISABLE_ENV, raising=False)
    broken = types.SimpleNamespace()  # no kernels: the check raises
    monkeypatch.setitem(sys.modules, "lowprec.fp8.kernels.ops", broken)
    monkeypatch.setattr(kernels, "ops", broken, raising=False)
    x = torch.empty(32, 64, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="lowprec.fp8"):
        assert not kernels.available("cuda:0", "cast_amax", x)
        assert not kernels.available("cuda") and not kernels.available("cuda:0", "cast_amax", x)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "self-check failed" in lines[0]


def test_self_check_compares_bits_and_nan_positions():
    from lowprec.fp8.kernels import selfcheck

    x = torch.tensor([1.0, float("nan"), -0.0])
    assert selfcheck._same(x, x.clone())
    assert not selfcheck._same(x, torch.tensor([1.0, float("nan"), 0.0]))  # -0.0 vs +0.0
    assert not selfcheck._same(x, torch.tensor([1.0, 2.0, -0.0]))
    assert selfcheck.run_checks(reference, reference, torch.device("cpu")) == {}


def test_cuda_falls_back_when_triton_is_absent(no_triton):
    assert not select.triton_importable()
    assert not kernels.available("cuda")


def test_dispatch_takes_the_torch_path_when_unavailable(no_triton, monkeypatch, seed):
    def boom():
        raise AssertionError("the Triton ops were imported")

    monkeypatch.setattr(kernels, "_ops", boom)
    x = torch.randn(33, 70) * 40
    s = torch.tensor(3.0)
    q, qt, a = kernels.cast_transpose_amax(x, s, E4M3)
    assert torch.equal(q.view(torch.uint8), saturated_cast(x * s, E4M3).view(torch.uint8))
    q2, a2 = kernels.cast_amax(x, s, E4M3)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(a2, a)
    qr, sr = kernels.cast_rowwise(x, E4M3)
    assert qr.shape == x.shape and sr.shape == (33, 1)


def test_dispatch_takes_the_triton_path_when_available(monkeypatch, seed):
    """With ``available`` true the public functions call the ops (here a recording stand-in)."""
    calls = []

    class FakeOps:
        def cast_transpose_amax(self, x, s, d):
            calls.append("ct")
            return reference.cast_transpose_amax(x, s, d)

        def cast_amax(self, x, s, d):
            calls.append("c")
            return reference.cast_amax(x, s, d)

        def cast_rowwise(self, x, d, p):
            calls.append("r")
            return reference.cast_rowwise(x, d, p)

    monkeypatch.setattr(kernels, "available", lambda device, op=None, x=None: True)
    monkeypatch.setattr(kernels, "_ops", lambda: FakeOps())
    x = torch.randn(8, 16)
    kernels.cast_transpose_amax(x, torch.tensor(1.0), E4M3)
    kernels.cast_amax(x, torch.tensor(1.0), E4M3)
    kernels.cast_rowwise(x, E4M3)
    assert calls == ["ct", "c", "r"]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_reference_cast_transpose_amax(dtype, in_dtype, seed):
    x = (torch.randn(45, 77) * 100).to(in_dtype)
    s = torch.tensor(7.5)
    q, qt, a = reference.cast_transpose_amax(x, s, dtype)
    assert q.dtype == qt.dtype == dtype and qt.shape == (77, 45) and qt.is_contiguous()
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t())
    expect = quantize_tensorwise(x, dtype, s).data
    assert torch.equal(q.view(torch.uint8), expect.view(torch.uint8))
    assert a.dtype == torch.float32 and a.dim() == 0
    assert a.item() == x.float().abs().max().item()


def test_reference_nan_and_inf_rules(seed):
    x = torch.randn(16, 16)
    x[2, 3], x[4, 5], x[6, 7] = float("nan"), float("inf"), -float("inf")
    q, qt, a = reference.cast_transpose_amax(x, torch.tensor(2.0), E4M3)
    bad = ~torch.isfinite(x)
    assert torch.isnan(q.float()[bad]).all() and torch.isfinite(q.float()[~bad]).all()
    assert torch.isnan(a)
    x[2, 3] = 1.0
    assert torch.isinf(reference.cast_amax(x, torch.tensor(2.0), E4M3)[1])


@pytest.mark.parametrize("power_of_2", [True, False])
def test_reference_rowwise_is_quantize_axiswise(power_of_2, seed):
    x = torch.randn(31, 50) * torch.logspace(-3, 3, 31)[:, None]
    q, s = reference.cast_rowwise(x, E4M3, power_of_2)
    expect = quantize_axiswise(x, E4M3, 1, power_of_2=power_of_2)
    assert torch.equal(q.view(torch.uint8), expect.data.view(torch.uint8))
    assert torch.equal(s, expect.scale)


def test_quantize_hook_routes_tensorwise_and_rowwise_casts(monkeypatch, seed):
    """Force the hook on (CPU tensors, the reference standing in for the kernels): the
    results must be those of the torch path, and only eligible calls may be routed."""
    routed = []
    real_amax, real_row = kernels.cast_amax, kernels.cast_rowwise
    monkeypatch.setattr(quantize_mod, "_fused_cast", lambda x, scale=None: True)
    monkeypatch.setattr(kernels, "cast_amax", lambda *a: routed.append("t") or real_amax(*a))
    monkeypatch.setattr(kernels, "cast_rowwise", lambda *a: routed.append("r") or real_row(*a))
    x = torch.randn(40, 24) * 9
    s = amax_to_scale(x.abs().amax(), E4M3)
    q = quantize_tensorwise(x, E4M3, s)
    assert torch.equal(q.data.view(torch.uint8), saturated_cast(x * s, E4M3).view(torch.uint8))
    assert q.scale is s and q.granularity == "tensor"
    r = quantize_axiswise(x, E5M2, 1)
    monkeypatch.undo()
    ref = quantize_axiswise(x, E5M2, 1)
    assert torch.equal(r.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(r.scale, ref.scale)
    assert r.granularity == "axis" and routed == ["t", "r"]


def test_quantize_hook_is_off_on_cpu_and_for_ineligible_tensors(fake_triton):
    assert not quantize_mod._fused_cast(torch.randn(4, 4))  # CPU
    assert not quantize_mod._fused_cast(torch.randn(4, 4), torch.tensor(1.0))


def test_dispatch_compiles_without_graph_breaks(no_triton, seed):
    """The selection is constant-folded by Dynamo (``assume_constant_result``)."""
    torch._dynamo.reset()

    def f(x, s):
        q, qt, a = kernels.cast_transpose_amax(x, s, E4M3)
        return q.float().sum() + qt.float().sum() + a

    x, s = torch.randn(24, 40), torch.tensor(4.0)
    got = torch.compile(f, fullgraph=True, backend="eager")(x, s)
    assert torch.equal(got, f(x, s))


def _cast_benchmark():
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "cast.py")
    spec = importlib.util.spec_from_file_location("lowprec_bench_cast", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour of the benchmark")
def test_cast_benchmark_on_cpu(tmp_path, capsys):
    """Without a GPU: one clear line and exit 2; with --tiny, a smoke run of the torch path
    whose results equal the reference (times are not checked)."""
    import json

    bench = _cast_benchmark()
    assert bench.main(["--out", str(tmp_path / "no.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out and not (tmp_path / "no.json").exists()
    out = tmp_path / "cast.json"
    assert bench.main(["--tiny", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    casts = [r for r in data["results"] if r["op"] != "copy"]
    copies = [r for r in data["results"] if r["op"] == "copy"]
    assert data["triton"] is False and {r["impl"] for r in casts} == {"torch_eager"}
    assert len(casts) == 6 and all(r["exact"] and r["ms"] > 0 for r in casts)
    # the measured copy bandwidth each cast is compared with: one row per shape
    assert copies and all(r["impl"] == "torch copy_" and r["ms"] > 0 for r in copies)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_float8_linear_cast_transpose_path_is_identical(monkeypatch, recipe, seed):
    """Float8Linear with the one-pass cast+transpose for its input and for dY (forced on, on
    CPU, with the torch path standing in for the kernel): same outputs and gradients, bit for
    bit, and the FP8 input kept for backward is column-major (no transpose copy in backward)."""
    import lowprec.fp8 as fp8

    base = torch.nn.Linear(64, 48)
    x = torch.randn(4, 32, 64)

    def run(fused):
        calls = []
        if fused:

            class Spy:  # the torch path standing in for the Triton ops, recording each call
                def __getattr__(self, name):
                    calls.append(name)
                    return getattr(reference, name)

            monkeypatch.setattr(kernels, "available", lambda device, op=None, x=None: True)
            monkeypatch.setattr(kernels, "_ops", lambda: Spy())
        linear_mod = importlib.import_module("lowprec.fp8.modules.linear_fn")
        real_mm = linear_mod.scaled_mm
        layouts = []  # wgrad GEMM: (A row-major, B column-major), i.e. nothing to copy

        def spy_mm(a, b, out_dtype, **kw):
            if tuple(a.shape) == (48, 128):  # dY^T (N, M) x x (M, K): the weight gradient
                layouts.append((a.data.is_contiguous(), b.data.t().is_contiguous()))
            return real_mm(a, b, out_dtype, **kw)

        monkeypatch.setattr(linear_mod, "scaled_mm", spy_mm)
        lin = fp8.Float8Linear.from_linear(torch.nn.Linear(64, 48), fp8.Recipe.from_name(recipe))
        lin.load_state_dict(base.state_dict(), strict=False)
        saved = []

        def pack(t):
            if t.dtype in (E4M3, E5M2):
                saved.append(t)
            return t

        outs = []
        for _ in range(3):
            xi = x.clone().requires_grad_()
            with fp8.autocast(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = lin(xi)
            y.square().mean().backward()
            outs += [y.detach(), xi.grad, lin.weight.grad.clone()]
            lin.weight.grad = None
        outs += [b.clone() for b in lin.buffers()]  # delayed: histories, scales, step counters
        monkeypatch.undo()
        return outs, saved, calls, layouts

    fused, saved_f, calls, layouts_f = run(True)
    plain, saved_p, _, layouts_p = run(False)
    assert layouts_f == [(True, True)] * 3 and layouts_p == [(False, False)] * 3
    if recipe == "rowwise":  # x and dY: both axis casts in one pass (amax_cols first), 3 steps
        assert calls.count("cast_rowwise_dual") == 6 and calls.count("amax_cols") == 6
    else:  # x and W in forward, dY in backward, 3 steps
        assert calls.count("cast_transpose_amax") == 9
    if recipe == "delayed":  # the casts' own amaxes feed the history: no separate amax pass
        assert "amax" not in calls and calls.count("recast_if_changed") == 9
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    x_f = [t for t in saved_f if t.shape == (128, 64)]
    x_p = [t for t in saved_p if t.shape == (128, 64)]
    assert len(x_f) == len(x_p) == 3
    assert all(t.t().is_contiguous() and not t.is_contiguous() for t in x_f)
    assert all(t.is_contiguous() for t in x_p)
