"""The CPU FP8 GEMM: exact bf16 upcast, bf16 GEMM, scales on the output; the one-time probe.

Nothing here depends on which CPU runs it: results are compared with the float32 emulation
within the documented bound (tests/conftest.py::assert_within_gemm_bound), and the probe's
decision is tested with injected timings.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

import lowprec.fp8 as fp8
from lowprec.fp8.gemm import cpu as cpu_gemm
from lowprec.fp8.gemm.dispatch import gemm_path
from tests.conftest import assert_within_gemm_bound, sqnr

CPU = torch.device("cpu")
ALL_BYTES = torch.arange(256, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_upcast_is_exact_for_every_finite_fp8_value(dtype):
    values = ALL_BYTES.view(dtype)
    ref = values.to(torch.float32)
    finite = torch.isfinite(ref)
    got = cpu_gemm.upcast_to_bf16(values)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float()[finite], ref[finite])
    # signed zeros keep their sign (a -0 byte is -0.0, not +0.0)
    assert torch.equal(torch.signbit(got.float()[finite]), torch.signbit(ref[finite]))


def test_upcast_keeps_any_layout(seed):
    q = fp8.quantize(torch.randn(24, 40), fp8.E4M3, "tensor").data.t()
    got = cpu_gemm.upcast_to_bf16(q)
    assert got.shape == q.shape
    assert torch.equal(got.float(), q.float())


def _operands(gran, m, k, n, b_dtype, pow2=True):
    x, w = torch.randn(m, k) * 3, torch.randn(n, k) / 5
    if gran == "block":
        a = fp8.quantize(x, fp8.E4M3, "block", block=(1, 32), power_of_2=pow2)
        b = fp8.quantize(w, b_dtype, "block", block=(32, 32), power_of_2=pow2).t()
    else:
        a = fp8.quantize(x, fp8.E4M3, gran, dim=1)
        b = fp8.quantize(w, b_dtype, gran, dim=1).t()
    return x, w, a, b


@pytest.mark.parametrize("gran", ["tensor", "axis", "block"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128, 48), (33, 80, 17), (1, 32, 16), (70, 96, 45)])
@pytest.mark.parametrize("b_dtype", [fp8.E4M3, fp8.E5M2])
def test_upcast_matches_emulation_within_the_bound(seed, gran, out_dtype, shape, b_dtype):
    m, k, n = shape
    x, w, a, b = _operands(gran, m, k, n, b_dtype)
    got = fp8.scaled_mm(a, b, out_dtype, path="upcast")
    ref = fp8.scaled_mm(a, b, out_dtype, path="emulate")
    assert got.dtype == out_dtype and got.shape == (m, n)
    assert_within_gemm_bound(got, ref, a, b, output_roundings=1)
    assert sqnr(x.double() @ w.double().t(), got) > 20


def test_mixed_tensor_and_axis_operands(seed):
    a = fp8.quantize(torch.randn(32, 64), fp8.E4M3, "axis", dim=1)
    b = fp8.quantize(torch.randn(64, 48), fp8.E5M2, "tensor")
    got = fp8.scaled_mm(a, b, torch.float32, path="upcast")
    assert_within_gemm_bound(got, a.dequantize() @ b.dequantize(), a, b, output_roundings=1)


def test_block_scales_not_powers_of_two_are_emulated_and_logged_once(seed, caplog):
    _, _, a, b = _operands("block", 16, 64, 32, fp8.E4M3, pow2=False)
    from lowprec.fp8.gemm import dispatch as gemm

    gemm._LOGGED.discard("block")
    with caplog.at_level(logging.WARNING, logger="lowprec.fp8"):
        got = fp8.scaled_mm(a, b, torch.float32, path="upcast")
        fp8.scaled_mm(a, b, torch.float32, path="upcast")
    assert torch.equal(got, fp8.scaled_mm(a, b, torch.float32, path="emulate"))
    assert sum("not powers of two" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("gran", ["tensor", "axis", "block"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_gives_non_finite_output(seed, gran, bad):
    # the upcast does not decode NaN bytes: the non-finite scale must carry it to the output
    x, w, _, _ = _operands(gran, 32, 64, 16, fp8.E4M3)
    x[3, 5] = bad
    if gran == "block":
        a = fp8.quantize(x, fp8.E4M3, "block", block=(1, 32))
        b = fp8.quantize(w, fp8.E4M3, "block", block=(32, 32)).t()
    else:
        a = fp8.quantize(x, fp8.E4M3, gran, dim=1)
        b = fp8.quantize(w, fp8.E4M3, gran, dim=1).t()
    out = fp8.scaled_mm(a, b, torch.bfloat16, path="upcast")
    assert not torch.isfinite(out[3]).any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_delayed_scaling_casts_a_non_finite_tensor_with_a_nan_scale(bad):
    recipe = fp8.Recipe.from_name("delayed")
    hist = torch.tensor([2.0] + [0.0] * 15)  # a finite history: the scale would come from it
    x = torch.randn(8, 32)
    x[1, 1] = bad
    amax_now = x.abs().amax()
    used, new_hist, _ = fp8.delayed_scale_step(hist, torch.tensor(100.0), torch.tensor(3), amax_now, fp8.E4M3, recipe)
    assert torch.isnan(used)
    assert torch.equal(new_hist, hist)  # the history keeps the non-finite amax out


def test_linear_layers_run_the_upcast_path_and_train(seed, monkeypatch):
    monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "upcast")
    cpu_gemm.reset_cpu_gemm_choice()
    try:
        for name in ("tensorwise", "delayed", "rowwise", "blockwise"):
            lin = torch.nn.Linear(64, 48)
            ref = torch.nn.Linear(64, 48)
            ref.load_state_dict(lin.state_dict())
            recipe = fp8.Recipe.from_name(name, block_size=32) if name == "blockwise" else fp8.Recipe.from_name(name)
            layer = fp8.Float8Linear.from_linear(lin, recipe)
            x = torch.randn(4, 10, 64, requires_grad=True)
            x_ref = x.detach().clone().double().requires_grad_()
            with fp8.autocast():
                y = layer(x)
            y.backward(torch.ones_like(y))
            y_ref = torch.nn.functional.linear(x_ref, ref.weight.double(), ref.bias.double())
            y_ref.backward(torch.ones_like(y_ref))
            assert sqnr(y_ref, y) > 25, name
            assert sqnr(x_ref.grad, x.grad) > 20, name
            assert sqnr(ref.weight.grad, lin.weight.grad) > 20, name
    finally:
        cpu_gemm.reset_cpu_gemm_choice()


# --------------------------------------------------------------------------- the probe
def _fake_timer(native_s, upcast_s):
    """A timer that reports fixed durations per kernel (which kernel: told by the closure name)."""

    def timer(fn):
        return native_s if fn.__name__ == "native" else upcast_s

    return timer


@pytest.mark.parametrize(
    "native_s, upcast_s, expected",
    [
        (4.1, 0.0015, "upcast"),  # the 500x-slow AMX Xeon case
        (0.0029, 0.0005, "upcast"),
        (0.0009, 0.0010, "upcast"),  # a close call keeps the upcast: no flip-flopping on noise
        (0.0002, 0.0010, "scaled_mm"),  # clearly faster: use torch's kernel
    ],
)
def test_probe_picks_the_faster_kernel_with_a_margin(native_s, upcast_s, expected):
    choice = cpu_gemm._probe(timer=_fake_timer(native_s, upcast_s))
    assert choice.path == expected
    assert "probe" in choice.reason and "ms" in choice.reason


def test_probe_treats_a_failing_kernel_as_absent():
    def timer(fn):
        if fn.__name__ == "native":
            raise RuntimeError("no kernel")
        return 0.001

    assert cpu_gemm._probe(timer=timer).path == "upcast"


def test_choice_is_cached_and_logged_once(monkeypatch, caplog, tmp_path):
    monkeypatch.delenv(cpu_gemm.CPU_GEMM_ENV, raising=False)
    monkeypatch.setenv("LOWPREC_CACHE_HOME", str(tmp_path))
    cpu_gemm.reset_cpu_gemm_choice()
    calls = []
    monkeypatch.setattr(cpu_gemm, "_probe", lambda: calls.append(1) or cpu_gemm.CpuGemmChoice("upcast", "probe x"))
    try:
        with caplog.at_level(logging.INFO, logger="lowprec.fp8"):
            first = cpu_gemm.cpu_gemm_choice()
            second = cpu_gemm.cpu_gemm_choice()
        assert first is second and calls == [1]
        assert sum("CPU FP8 GEMMs" in r.message for r in caplog.records) == 1
    finally:
        cpu_gemm.reset_cpu_gemm_choice()


def _verdict(path):
    return lambda: cpu_gemm.CpuGemmChoice(path, f"probe 1x1x1: said {path}")


def test_probe_verdict_is_kept_per_machine_first_writer_wins(monkeypatch, tmp_path):
    """Processes that would time the probe differently (load) still run one kernel: the first
    verdict written is every later process's, until the file is deleted."""
    monkeypatch.setenv("LOWPREC_CACHE_HOME", str(tmp_path / "cache"))
    first = cpu_gemm.kept_probe(_verdict("scaled_mm"))
    assert first.path == "scaled_mm" and "kept in" in first.reason
    calls = []
    later = cpu_gemm.kept_probe(lambda: calls.append(1) or _verdict("upcast")())
    assert later.path == "scaled_mm" and calls == [] and "measured 20" in later.reason
    files = list((tmp_path / "cache").iterdir())
    assert [f.name for f in files] == [cpu_gemm.probe_file(cpu_gemm.machine_key()).name]  # no temporaries left
    # another torch version (or CPU) is another key, measured anew
    monkeypatch.setattr(cpu_gemm.torch, "__version__", "9.9.9")
    assert cpu_gemm.kept_probe(_verdict("upcast")).path == "upcast"
    files[0].unlink()
    monkeypatch.undo()
    monkeypatch.setenv("LOWPREC_CACHE_HOME", str(tmp_path / "cache"))
    assert cpu_gemm.kept_probe(_verdict("upcast")).path == "upcast"  # deleted: measured again


def test_probe_verdict_written_by_a_racing_process_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWPREC_CACHE_HOME", str(tmp_path))
    path = cpu_gemm.probe_file(cpu_gemm.machine_key())

    def probe_while_another_process_writes():
        other = {"key": cpu_gemm.machine_key(), "path": "upcast", "reason": "probe: other", "measured": "2026-01-01"}
        path.write_text(json.dumps(other))
        return _verdict("scaled_mm")()

    assert cpu_gemm.kept_probe(probe_while_another_process_writes).path == "upcast"
    assert json.loads(path.read_text())["path"] == "upcast"


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"key": "another machine", "path": "upcast", "reason": "", "measured": ""}',
        '{"path": "fastest"}',
        "[]",
    ],
)
def test_damaged_or_foreign_probe_file_is_measured_again(monkeypatch, tmp_path, content, caplog):
    monkeypatch.setenv("LOWPREC_CACHE_HOME", str(tmp_path))
    path = cpu_gemm.probe_file(cpu_gemm.machine_key())
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="lowprec.fp8"):
        assert cpu_gemm.kept_probe(_verdict("scaled_mm")).path == "scaled_mm"
    assert json.loads(path.read_text())["path"] == "scaled_mm"
    if content != '{"key": "another machine", "path": "upcast", "reason": "", "measured": ""}':
        assert any("unreadable" in r.message and str(path) in r.message for r in caplog.records)


def test_probe_verdict_that_cannot_be_kept_is_logged_and_used(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("LOWPREC_CACHE_HOME", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="lowprec.fp8"):
        assert cpu_gemm.kept_probe(_verdict("scaled_mm")).path == "scaled_mm"
    assert any("cannot keep the CPU FP8 GEMM probe" in r.message for r in caplog.records)


def test_environment_forces_a_kernel(monkeypatch):
    monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "upcast")
    cpu_gemm.reset_cpu_gemm_choice()
    try:
        assert cpu_gemm.cpu_gemm_choice().path == "upcast"
        a = fp8.quantize(torch.randn(8, 32), fp8.E4M3, "tensor")
        assert gemm_path("auto", CPU, a, a.t()) == "upcast"
        if cpu_gemm.cpu_scaled_mm_exists():
            monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "scaled_mm")
            assert cpu_gemm.cpu_gemm_choice().path == "scaled_mm"
            assert gemm_path("auto", CPU, a, a.t()) == "scaled_mm"
        monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "fastest")
        with pytest.raises(ValueError, match="LOWPREC_CPU_FP8_GEMM='fastest'; use one of auto, upcast, scaled_mm"):
            cpu_gemm.cpu_gemm_choice()
    finally:
        cpu_gemm.reset_cpu_gemm_choice()


def test_upcast_is_refused_off_cpu():
    a = fp8.quantize(torch.randn(8, 32, device="meta"), fp8.E4M3, "tensor", scale=torch.ones((), device="meta"))
    with pytest.raises(RuntimeError, match="gemm='upcast' is the CPU path"):
        gemm_path("upcast", torch.device("meta"), a, a.t())
