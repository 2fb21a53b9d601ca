"""Float8Linear with the block-scaled recipes (mxfp8, nvfp4): SQNR of the output and of every
gradient against float64 on fresh random data, torchao's MX emulation on the same data, and the
recipe's paths (convert, report, telemetry, checkpoints, Accelerator)."""

import pytest
import torch
from torch import nn

from lowprec import fp8
from lowprec.fp8.modules.linear import Float8Linear
from lowprec.fp8.cast.mx import quantize_mx

SHAPES = [(64, 128, 96), (37, 100, 50)]  # (M, K, N); the second is ragged for 32- and 16-blocks
# Measured (tests below, seeds 0-1): mxfp8 28.3-28.6 dB on every GEMM (scale rounding rceil;
# floor 27.4); nvfp4 output 16.6, grad_input 14.9 (stochastic rounding), grad_weight 15.5.
MIN_SQNR = {"mxfp8": (26.0, 26.0, 26.0), "nvfp4": (15.0, 13.5, 14.0)}


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x.double()).pow(2).sum())).item()


def _data(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * k**-0.5
    dy = torch.randn(m, n, generator=g, dtype=torch.float64)
    return x, w, dy


def _run(recipe, x, w, dy):
    lin = nn.Linear(x.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.float().clone()
    layer = Float8Linear.from_linear(lin, recipe)
    xx = x.float().clone().requires_grad_()
    with fp8.autocast():
        y = layer(xx)
    y.backward(dy.float())
    return y, xx.grad, layer.weight.grad


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape,seed", [(SHAPES[0], 0), (SHAPES[1], 1)])
def test_sqnr_of_output_and_every_gradient_against_float64(name, shape, seed):
    x, w, dy = _data(*shape, seed)
    y, gx, gw = _run(fp8.Recipe.from_name(name), x, w, dy)
    got = (sqnr(x @ w.t(), y), sqnr(dy @ w, gx), sqnr(dy.t() @ x, gw))
    assert all(g >= lo for g, lo in zip(got, MIN_SQNR[name])), got


def _torchao_mx(t: torch.Tensor, mode) -> torch.Tensor:
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    scale, data = to_mx(t.float().contiguous(), torch.float8_e4m3fn, 32, mode)
    return to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)


def test_mxfp8_at_least_torchao_mx_emulation_on_the_same_data():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x, w, dy = _data(*SHAPES[0], 2)
    refs = (x @ w.t(), dy @ w, dy.t() @ x)
    operands = ((x, w), (dy, w.t()), (dy.t(), x.t()))  # each GEMM's (A, B^T), contracting the last dim
    ours_default = [sqnr(r, o) for r, o in zip(refs, _run(fp8.Recipe.from_name("mxfp8"), x, w, dy))]
    for mode, ours_name in ((ScaleCalculationMode.FLOOR, "floor"), (ScaleCalculationMode.RCEIL, "rceil")):
        theirs = [sqnr(r, _torchao_mx(a, mode) @ _torchao_mx(b, mode).t()) for r, (a, b) in zip(refs, operands)]
        # like for like: torchao's emulation is a float32 matmul, so is ours with gemm="emulate"
        # (the default CPU path, a bf16 GEMM, is ours_default)
        same = fp8.Recipe.from_name("mxfp8", scale_rounding=ours_name, gemm="emulate")
        ours = [sqnr(r, o) for r, o in zip(refs, _run(same, x, w, dy))]
        # the same quantized numbers as torchao (bit for bit) ...
        for a, _ in operands:
            assert torch.equal(_torchao_mx(a, mode), quantize_mx(a.float(), rounding=ours_name).dequantize())
        # ... so the same SQNR up to float32 summation order, and the default (rceil) at least torchao's default (floor)
        assert all(o >= t - 0.01 for o, t in zip(ours, theirs)), (mode, ours, theirs)
        if mode is ScaleCalculationMode.FLOOR:
            assert all(o >= t for o, t in zip(ours_default, theirs)), (ours_default, theirs)


def test_override_linear_precision_and_hybrid_format():
    x, w, dy = _data(*SHAPES[1], 3)
    _, _, gw = _run(fp8.Recipe.from_name("mxfp8", override_linear_precision=(False, False, True)), x, w, dy)
    assert torch.allclose(gw.double(), dy.t() @ x, rtol=1e-4, atol=1e-4)  # wgrad in high precision
    r = fp8.Recipe.from_name("mxfp8", fp8_format="HYBRID")
    assert "e5m2/1x32" in r.describe() and sqnr(dy @ w, _run(r, x, w, dy)[1]) > 22
    with pytest.raises(ValueError, match="nvfp4 holds E2M1"):
        fp8.Recipe.from_name("nvfp4", fp8_format="HYBRID")
    with pytest.raises(ValueError, match="scale_rounding"):
        fp8.Recipe.from_name("mxfp8", scale_rounding="nearest")


def _model(n_layers=7):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(n_layers)])


def test_convert_report_and_high_precision_layers():
    model = _model()
    report = fp8.convert(model, "nvfp4")
    # default rules skip the first and last Linear; nvfp4 keeps the last 15% of the other 5 (1) in hp
    assert [n for n, *_ in report.converted] == ["1", "2", "3", "4"]
    assert (
        "5",
        "the nvfp4 recipe keeps the last 15% of its Linear layers in high precision (high_precision_last)",
    ) in report.skipped
    assert "e2m1/16x16" in str(report) and "bf16 GEMM over exact bf16 nvfp4 operands" in report.gemm
    assert [int(model[i].fp8_sr_state[0]) for i in range(1, 5)] == [0, 1, 2, 3]  # one stream per layer
    assert fp8.convert(_model(), fp8.Recipe.from_name("nvfp4", high_precision_last=0.0)).num_converted == 5
    with pytest.raises(ValueError, match="no speed model for the mxfp8 recipe on H100"):
        fp8.predict_speedup(4096, 4096, 4096, "mxfp8", "h100")  # no MX datapath: no made-up figure


def _train(model, steps, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        with fp8.autocast():
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_nvfp4_stochastic_rounding_is_reproducible_and_resumes_from_a_checkpoint(tmp_path):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    a, b = _model(), _model()
    fp8.convert(a, "nvfp4"), fp8.convert(b, "nvfp4")
    full = _train(a, 3, x)
    assert full == _train(b, 2, x) + _train(b, 1, x)  # same seed: same noise, step by step
    sd = b.state_dict()
    assert "1.fp8_sr_state" in sd and "1.fp8_sr_state" not in fp8.plain_state_dict(sd)
    c = _model()
    fp8.convert(c, "nvfp4")
    c.load_state_dict(_model().state_dict())  # a plain checkpoint loads into a converted model
    c.load_state_dict(sd)
    torch.save(c.state_dict(), tmp_path / "c.pt")
    c.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    assert _train(c, 1, x) == _train(b, 1, x)  # resumed: the same stream positions as the original
    other = _model()
    fp8.convert(other, fp8.Recipe.from_name("nvfp4", seed=1))
    assert _train(other, 3, x) != full


def test_block_telemetry_counts_saturation_and_underflow():
    x = torch.randn(4, 64)
    x[0, 0] = 500.0  # floor: its block's amax mantissa (500 = 1.95 * 2**8) is above 1.75: clipped
    x[1, 32:] *= 1e-30  # nvfp4: a block far below the tensor's amax has an E4M3 scale of 0: flushed
    for name, rounding, saturated, underflow in (("mxfp8", "floor", 1 / 256, 0.0), ("mxfp8", "rceil", 0.0, 0.0)):
        layer = Float8Linear.from_linear(nn.Linear(64, 32), fp8.Recipe.from_name(name, scale_rounding=rounding))
        model = nn.Sequential(layer)
        fp8.enable_telemetry(model)
        with fp8.autocast():
            model(x.clone().requires_grad_()).sum().backward()
        t = fp8.telemetry(model)["0"]
        assert t["input"]["saturated"] == pytest.approx(saturated) and t["input"]["underflow"] == underflow
        assert t["input"]["amax"] == 500.0 and t["grad_output"]["amax"] == 1.0
    layer = Float8Linear.from_linear(nn.Linear(64, 32), fp8.Recipe.from_name("nvfp4"))
    model = nn.Sequential(layer)
    fp8.enable_telemetry(model)
    with fp8.autocast():
        model(x.clone().requires_grad_()).sum().backward()
    assert fp8.telemetry(model)["0"]["input"]["underflow"] >= 32 / 256


def test_accelerator_runs_the_te_switches_on_the_native_engine():
    from lowprec import Accelerator
    from lowprec.utils import TERecipeKwargs

    for switch, name in (("use_mxfp8_block_scaling", "mxfp8"), ("use_nvfp4_block_scaling", "nvfp4")):
        acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(**{switch: True})])
        model = acc.prepare(_model(3))
        assert isinstance(model[1], Float8Linear) and model[1].recipe.scaling == name
        with acc.autocast():
            loss = model(torch.randn(8, 32)).square().mean()
        acc.backward(loss)
        assert model[1].weight.grad is not None and torch.isfinite(model[1].weight.grad).all()


def test_nvfp4_training_hands_bucketize_contiguous_inputs(monkeypatch):
    """The round-to-nearest E2M1 encoding bucketized a strided tensor (the weight's transposed
    tiles): torch copied it and raised a UserWarning ("input value tensor is non-contiguous") in
    every nvfp4 user's first step."""
    seen = []
    real = torch.bucketize

    def spy(values, *args, **kwargs):
        seen.append(values.is_contiguous())
        return real(values, *args, **kwargs)

    monkeypatch.setattr(torch, "bucketize", spy)
    layer = Float8Linear.from_linear(nn.Linear(64, 48), fp8.Recipe.from_name("nvfp4"))
    layer(torch.randn(32, 64, requires_grad=True)).sum().backward()
    assert seen and all(seen)
