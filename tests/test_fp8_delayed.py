"""Delayed scaling: the scale at each step, walked by hand."""

import math

import pytest
import torch
from torch import nn

import lowprec.fp8 as fp8
from lowprec.fp8.cast.scaling import amax_to_scale

E4 = fp8.E4M3


def _walk(amaxes, **fields):
    """Feed a sequence of amaxes through delayed_scale_step; return the scale used at each step."""
    recipe = fp8.Recipe.from_name("delayed", **fields)
    hist = torch.zeros(recipe.amax_history_len)
    scale = torch.ones(())
    used = []
    for step, a in enumerate(amaxes):
        s, hist, scale = fp8.delayed_scale_step(hist, scale, torch.tensor(step), torch.tensor(float(a)), E4, recipe)
        used.append(s.item())
    return used


def S(a, margin=0):
    return 448.0 / a / 2**margin


def test_first_step_uses_current_amax_then_history_max():
    used = _walk([2.0, 8.0, 1.0, 1.0, 1.0], amax_history_len=3, amax_compute_algo="max")
    # step 0: no history -> current amax (2); step t uses max of amaxes at steps t-3..t-1
    assert used == pytest.approx([S(2), S(2), S(8), S(8), S(8)])
    used = _walk([2.0, 8.0, 1.0, 1.0, 1.0, 1.0], amax_history_len=3, amax_compute_algo="max")
    assert used[5] == pytest.approx(S(1))  # the 8 has left the 3-step window


def test_most_recent():
    used = _walk([2.0, 8.0, 1.0, 4.0], amax_history_len=16, amax_compute_algo="most_recent")
    assert used == pytest.approx([S(2), S(2), S(8), S(1)])


def test_margin():
    used = _walk([2.0, 4.0], margin=3)
    assert used == pytest.approx([S(2, 3), S(2, 3)])


def test_interval():
    # refreshed after steps 1, 3, 5 (every 2nd); in between the previous scale is kept
    used = _walk([1.0, 2.0, 4.0, 8.0, 16.0, 32.0], interval=2, amax_compute_algo="most_recent")
    assert used == pytest.approx([S(1), S(1), S(2), S(2), S(8), S(8)])


def test_non_finite_amax_does_not_poison_the_history():
    used = _walk([2.0, float("nan"), float("inf"), 1.0, 1.0], amax_history_len=2)
    # a non-finite step casts with a NaN scale (its output carries the NaN on every GEMM path);
    # it is not recorded: the window still holds 2.0 afterwards
    assert math.isnan(used[1]) and math.isnan(used[2])
    assert used[3] == pytest.approx(S(2))


def test_zero_inputs_keep_bootstrapping():
    used = _walk([0.0, 0.0, 3.0, 1.0], amax_history_len=4)
    assert used[2] == pytest.approx(S(3))  # still no history at step 2: current amax
    assert used[3] == pytest.approx(S(3))


def _layer(name, **kw):
    torch.manual_seed(0)
    return fp8.Float8Linear.from_linear(nn.Linear(64, 64), fp8.Recipe.from_name(name, **kw))


def _saturated_fraction(layer, x):
    fp8.enable_telemetry(layer)
    with fp8.autocast():
        layer(x)
    return fp8.telemetry(layer)[""]["input"]["saturated"]


def test_sudden_1000x_jump_saturates_with_delayed_not_tensorwise():
    torch.manual_seed(1)
    calm = [torch.randn(32, 64) for _ in range(4)]
    spike = torch.randn(32, 64) * 1000
    delayed, tensorwise = _layer("delayed", amax_history_len=4), _layer("tensorwise")
    for x in calm:
        _saturated_fraction(delayed, x)
    assert _saturated_fraction(delayed, spike) > 0.5
    assert _saturated_fraction(tensorwise, spike) == 0.0
    # and the history catches up: next step's scale accounts for the spike
    assert _saturated_fraction(delayed, spike) == 0.0


def test_layer_state_walks_like_the_pure_function():
    # "max" named: the recipe default is "most_recent" (Accelerate's documented default, issue 11)
    layer = _layer("delayed", amax_history_len=8, amax_compute_algo="max")
    xs = [torch.randn(16, 64) * s for s in (1.0, 3.0, 0.5)]
    for x in xs:
        x.requires_grad_()
        with fp8.autocast():
            layer(x).sum().backward()
    hist = layer.fp8_amax_history_input
    assert hist[:3].tolist() == pytest.approx([x.abs().max().item() for x in reversed(xs)])
    assert layer.fp8_scale_input.item() == pytest.approx(amax_to_scale(hist.max(), E4).item())
    assert int(layer.fp8_step) == 3 and int(layer.fp8_step_grad) == 3
    # dY = ones: gradient amax 1.0 recorded each step, E5M2 scale 57344
    assert layer.fp8_amax_history_grad_output[:3].tolist() == [1.0, 1.0, 1.0]
    assert layer.fp8_scale_grad_output.item() == pytest.approx(57344.0)


def test_cpu_casts_skip_the_guard_passes_only_where_nothing_can_saturate(seed, monkeypatch):
    """On CPU the delayed update reads each operand's amax; when amax * scale is within the
    format, the cast skips its inf and clamp passes (same bits). A stale scale that saturates
    keeps both passes, so overflowing values still saturate to the format's max."""
    import lowprec.fp8.kinds.tensorwise as tensorwise

    marks = []
    real = tensorwise.quantize_tensorwise

    def spy(x, dtype, scale=None, **kw):
        if scale is not None:
            marks.append(kw.get("unsaturated", False))
        out = real(x, dtype, scale, **kw)
        if scale is not None:  # bit for bit the guarded cast
            ref = real(x, dtype, scale, **{**kw, "unsaturated": False, "finite": False})
            assert torch.equal(out.data.view(torch.uint8), ref.data.view(torch.uint8))
        return out

    monkeypatch.setattr(tensorwise, "quantize_tensorwise", spy)
    lin = fp8.Float8Linear.from_linear(nn.Linear(32, 16), fp8.Recipe.from_name("delayed", amax_history_len=4))
    x = torch.randn(8, 32)
    for scale_up in (1.0, 1.0, 1000.0):  # the last input is 1000x what the history scaled for
        marks.clear()
        xi = (x * scale_up).requires_grad_()
        lin(xi).sum().backward()
        if scale_up == 1.0:
            assert marks and all(marks), marks  # history built from the same range: nothing saturates
        else:
            assert marks.count(False) >= 1  # the input's cast keeps its guard passes
    unmarked = torch.tensor(1.0)
    assert not getattr(unmarked, tensorwise.UNSATURATED, False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_to_dtype_keeps_the_scaling_state_float32(dtype):
    """``model.to(dtype)`` / ``.half()`` after conversion cast the amax histories and scales too:
    in float16 the gradient scale of small gradients (above 65504) became inf and the input
    gradient all zeros. The state stays float32: casting after conversion equals casting before."""

    def run(cast_after: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        if not cast_after:
            model = model.to(dtype)
        fp8.convert(model, "delayed", skip_first_last=False)
        if cast_after:
            model = model.half() if dtype == torch.float16 else model.to(dtype)
        assert all(b.dtype != dtype for b in model.buffers())
        grads = []
        for _ in range(3):
            x = (torch.randn(32, 64) * 1e-3).to(dtype).requires_grad_()
            model(x).backward((torch.randn(32, 64) * 1e-4).to(dtype))
            grads.append(x.grad)
        return torch.stack(grads), model[1].fp8_scale_grad_output

    got, scale = run(cast_after=True)
    want, _ = run(cast_after=False)
    assert torch.isfinite(scale) and scale > 65504  # past float16's range: kept as float32
    assert got.abs().sum() > 0 and torch.equal(got, want)


def test_module_to_device_and_meta_still_move_the_state():
    layer = fp8.Float8Linear(32, 32, device="meta", recipe="delayed")
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert layer.fp8_amax_history_input.device.type == "cpu" and layer.fp8_scale_input.dtype == torch.float32
    layer.half()
    assert layer.weight.dtype == torch.float16 and layer.fp8_amax_history_input.dtype == torch.float32
