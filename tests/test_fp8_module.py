"""Float8Linear and convert(): drop-in behaviour, conversion rules, checkpoints, compile."""

import copy

import pytest
import torch
from torch import nn

import lowprec.fp8 as fp8
from tests.conftest import sqnr


class Block(nn.Module):
    def __init__(self, d=64, ffn=128):
        super().__init__()
        self.q_proj = nn.Linear(d, d)
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        x = x + self.q_proj(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Net(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.router = nn.Linear(d, 16)
        self.lm_head = nn.Linear(d, 32)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.lm_head(h) + self.router(h).sum(-1, keepdim=True)


def test_default_filter_and_report(seed):
    net = Net()
    report = fp8.convert(net, "tensorwise")
    converted = {n for n, *_ in report.converted}
    assert converted == {f"blocks.{i}.{p}" for i in range(2) for p in ("q_proj", "gate_proj", "up_proj", "down_proj")}
    reasons = dict(report.skipped)
    assert reasons["embed"] == "first Linear"
    assert reasons["lm_head"] == "last Linear"
    assert "router" in reasons["router"]
    text = str(report)
    assert "8 Linear layer(s) converted" in text and "skip  router" in text
    # how FP8 is switched on: by the conversion, off in a disabled region (issue 24)
    assert "wherever they run" in report.summary() and "fp8.autocast(enabled=False)" in text
    assert fp8.has_fp8_layers(net)


def test_odd_middle_layer_does_not_stop_siblings(seed):
    net = nn.Sequential(
        nn.Linear(32, 64), nn.Linear(64, 40), nn.Linear(40, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 16)
    )
    report = fp8.convert(net)
    assert [n for n, *_ in report.converted] == ["3", "4"]
    assert "not multiples of 16" in dict(report.skipped)["1"]


def test_patterns_match_components_and_globs(seed):
    net = Net()
    report = fp8.convert(net, skip_patterns=("gate", "blocks.1.*"), skip_first_last=False)
    converted = {n for n, *_ in report.converted}
    assert "blocks.0.gate_proj" in converted  # 'gate' does not match 'gate_proj'
    assert not any(n.startswith("blocks.1.") for n in converted)
    assert "embed" in converted and "router" in converted


def test_custom_filter(seed):
    net = Net()
    report = fp8.convert(net, module_filter=lambda m, fqn: fqn.endswith("up_proj"))
    assert sorted(n for n, *_ in report.converted) == ["blocks.0.up_proj", "blocks.1.up_proj"]


def test_same_parameters_and_optimizer_keeps_training(seed):
    net = Net()
    params_before = {n: p for n, p in net.named_parameters()}
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    report = fp8.convert(net, "delayed")
    assert {n: p for n, p in net.named_parameters()} == params_before  # same objects, same names
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    snapshot = {n: net.get_submodule(n).weight.detach().clone() for n, *_ in report.converted}
    with fp8.autocast():
        net(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    for name in snapshot:
        w = net.get_submodule(name).weight
        assert id(w) in in_opt
        assert not torch.equal(w, snapshot[name]), name


def test_unconvert_restores_identical_weights_and_outputs(seed):
    net = Net()
    x = torch.randn(4, 16)
    before = net(x)
    sd = copy.deepcopy(net.state_dict())
    fp8.convert(net, "delayed")
    with fp8.autocast():
        net(x)
    assert fp8.unconvert(net) == 8
    assert not fp8.has_fp8_layers(net)
    assert all(type(m) is nn.Linear for m in net.modules() if isinstance(m, nn.Linear))
    for k, v in net.state_dict().items():
        assert torch.equal(v, sd[k])
    assert torch.equal(net(x), before)


def test_converting_again_keeps_the_same_recipe_and_refuses_another():
    net = Net()
    first = fp8.convert(net, "tensorwise")
    again = fp8.convert(net, "tensorwise")
    assert not again.converted and len(again.already) == len(first.converted) > 0
    assert again.skipped == first.skipped  # the same layers kept in high precision, no more
    assert f"{len(first.converted)} already FP8" in again.summary()
    with pytest.raises(ValueError, match="already FP8 with the tensorwise recipe.*unconvert"):
        fp8.convert(net, "rowwise")
    assert all(m.recipe.name == "tensorwise" for m in net.modules() if isinstance(m, fp8.Float8Linear))
    fp8.unconvert(net)
    assert len(fp8.convert(net, "rowwise").converted) == len(first.converted)


def test_conversion_is_the_switch_autocast_disables_and_eval_is_high_precision(seed):
    net = Net()
    x = torch.randn(4, 16)
    ref = net(x)
    fp8.convert(net, "tensorwise")
    plain = net(x)  # no fp8.autocast() anywhere: converted layers run FP8 (torchao's convention)
    assert not torch.equal(plain, ref)
    with fp8.autocast():
        assert torch.equal(net(x), plain)  # an enabled region changes nothing
        with fp8.autocast(enabled=False):
            assert torch.equal(net(x), ref)  # a disabled region: plain Linear
        net.eval()
        eval_out = net(x)
    assert torch.equal(eval_out, ref)  # eval: high precision by default
    assert torch.equal(net(x), ref)  # also outside every region
    fp8.convert(net2 := Net(), fp8.Recipe.from_name("tensorwise", use_during_eval=True))
    net2.load_state_dict(net.state_dict())
    net2.eval()
    assert not torch.equal(net2(x), ref)


def test_autocast_nesting_and_reentry(seed):
    ctx = fp8.autocast()
    assert fp8.fp8_enabled()  # outside every region: FP8 is on (conversion is the switch)
    with fp8.autocast(enabled=False):
        assert not fp8.fp8_enabled()
        with ctx:
            assert fp8.fp8_enabled()
            with fp8.autocast(enabled=False):
                assert not fp8.fp8_enabled()
                with ctx:  # the same object, re-entered
                    assert fp8.fp8_enabled()
                assert not fp8.fp8_enabled()
            assert fp8.fp8_enabled()
        assert not fp8.fp8_enabled()
    assert fp8.fp8_enabled()


def test_autocast_recipe_override(seed):
    lin = nn.Linear(256, 64)  # K > 128, so 1x128 tiles differ from whole rows
    layer = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("tensorwise"))
    # the first 128 columns 1e4x smaller than the rest: a whole-row scale pushes them into
    # E4M3's subnormals, their own 1x128 tile scale does not (power-of-two scales alone change
    # nothing else: scaling by 2**k does not move an FP8 rounding)
    x = torch.randn(8, 256) * torch.cat([torch.full((128,), 1e-3), torch.full((128,), 10.0)])
    with fp8.autocast():
        a = layer(x)
    with fp8.autocast(recipe=fp8.Recipe.from_name("rowwise")):
        b = layer(x)
    with fp8.autocast(), fp8.autocast(recipe=fp8.Recipe.from_name("blockwise")):
        c = layer(x)
    assert not torch.equal(a, b) and not torch.equal(b, c)
    with pytest.raises(ValueError, match="convert the model with a delayed recipe"):
        with fp8.autocast(recipe=fp8.Recipe.from_name("delayed")):
            layer(x)


def test_frozen_weights(seed):
    lin = nn.Linear(64, 32)
    lin.weight.requires_grad_(False)
    layer = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("rowwise"))
    x = torch.randn(8, 64, requires_grad=True)
    with fp8.autocast():
        layer(x).sum().backward()
    assert lin.weight.grad is None and x.grad is not None and lin.bias.grad is not None


def test_state_dict_round_trip_and_plain_model(seed):
    net = Net()
    fp8.convert(net, fp8.Recipe.from_name("delayed", amax_history_len=8))
    with fp8.autocast():
        for _ in range(3):
            net(torch.randn(4, 16)).sum().backward()
    sd = net.state_dict()
    assert "blocks.0.q_proj.fp8_amax_history_input" in sd
    # converted -> converted: scaling state continues exactly
    other = Net()
    fp8.convert(other, fp8.Recipe.from_name("delayed", amax_history_len=8))
    other.load_state_dict(sd)
    for k, v in other.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # converted -> plain, via the helper; plain -> converted, directly (fresh scaling state)
    plain = Net()
    plain.load_state_dict(fp8.plain_state_dict(net))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        Net().load_state_dict(sd)
    again = Net()
    fp8.convert(again, "delayed")
    again.load_state_dict(plain.state_dict())
    assert int(again.blocks[0].q_proj.fp8_step) == 0


def test_nan_input_propagates_to_outputs_and_grads(seed):
    for name in fp8.RECIPE_NAMES:
        layer = fp8.Float8Linear.from_linear(nn.Linear(64, 32), fp8.Recipe.from_name(name))
        x = torch.randn(8, 64)
        x[2, 3] = float("nan")
        x.requires_grad_()
        with fp8.autocast():
            y = layer(x)
        assert torch.isnan(y).any(), name
        y.sum().backward()
        assert torch.isnan(layer.weight.grad).any(), name


@pytest.mark.parametrize("name", ["delayed", "tensorwise", "rowwise", "blockwise"])
def test_compile_fullgraph_matches_eager(seed, name):
    torch._dynamo.reset()
    lin = nn.Linear(64, 48)
    eager = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name(name))
    compiled_layer = fp8.Float8Linear.from_linear(copy.deepcopy(lin), fp8.Recipe.from_name(name))
    compiled = torch.compile(compiled_layer, fullgraph=True)  # fails on any graph break
    w64 = lin.weight.detach().double()
    b64 = lin.bias.detach().double()
    for _ in range(2):
        x = torch.randn(2, 16, 64)
        x64 = x.double().requires_grad_()
        y64 = torch.nn.functional.linear(x64, w64.requires_grad_(), b64)
        y64.pow(2).sum().backward()
        ref = (y64.detach(), x64.grad, w64.grad)
        w64.grad = None
        w64 = w64.detach()
        outs = []
        for m, layer in ((eager, eager), (compiled, compiled_layer)):
            xi = x.clone().requires_grad_()
            with fp8.autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(xi)
            y.float().pow(2).sum().backward()
            outs.append((y.float(), xi.grad, layer.weight.grad.clone()))
            layer.weight.grad = None
        # Inductor skips intermediate bf16 roundings and may round x * scale one ulp apart,
        # flipping an FP8 rounding here and there, and a flipped output moves dY = 2y (and so
        # its cast) in backward. So: the forward output agrees well above FP8 noise (~28 dB),
        # and every compiled result is as accurate against float64 as the eager one.
        assert sqnr(outs[0][0], outs[1][0]) > 35
        for r, e, c in zip(ref, *outs):
            assert sqnr(r, c) > sqnr(r, e) - 1.5 and sqnr(r, c) > 22
    if name == "delayed":
        # the history is written in compiled backward too; its values are amaxes of dY = 2y, and
        # y may differ by a bf16 ulp (the eager CPU GEMM rounds its output once, Inductor's twice)
        he, hc = eager.fp8_amax_history_grad_output, compiled_layer.fp8_amax_history_grad_output
        assert torch.equal(he == 0, hc == 0) and (he[:2] > 0).all()
        assert torch.allclose(he, hc, rtol=2.0**-6, atol=0)


@pytest.mark.parametrize("opt_in", [False, True])
def test_compiled_fp8_layers_run_eagerly_when_asked(seed, monkeypatch, caplog, opt_in):
    """By default torch.compile traces the FP8 GEMMs (no break; fullgraph works);
    LOWPREC_COMPILE_FP8=0 leaves each FP8 layer's GEMMs to its eager code, one graph break per
    layer, logged once, with the eager results."""
    from torch._dynamo.utils import counters

    from lowprec.fp8.gemm import compile_guard

    monkeypatch.setattr(compile_guard, "_LOGGED", set())
    if opt_in:
        monkeypatch.delenv(compile_guard.ENV, raising=False)
    else:
        monkeypatch.setenv(compile_guard.ENV, "0")
    torch._dynamo.reset()
    counters.clear()
    net = Net()
    fp8.convert(net, "tensorwise")
    twin = copy.deepcopy(net)
    x = torch.randn(4, 16)

    def run(model):
        with fp8.autocast():
            y = model(x)
        y.square().mean().backward()
        return y.detach(), [p.grad.clone() for p in model.parameters()]

    want = run(net)
    with caplog.at_level("WARNING", logger="lowprec.fp8"):
        got = run(torch.compile(twin, backend="eager", fullgraph=opt_in))
        run(torch.compile(twin, backend="eager", fullgraph=opt_in))  # a second call logs nothing more
    breaks = sum(counters["graph_break"].values())
    logged = [r for r in caplog.records if "run eagerly" in r.getMessage()]
    if opt_in:
        assert breaks == 0 and not logged
    else:
        assert breaks >= 1 and len(logged) == 1 and compile_guard.ENV in logged[0].getMessage()
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert sqnr(want[0], got[0]) > 30


def test_a_compiled_fp8_base_layer_runs_its_gemms_eagerly_when_asked(seed, monkeypatch):
    """The frozen FP8 base layer (LoRA on an FP8 checkpoint) follows the same switch."""
    from torch._dynamo.utils import counters

    from lowprec.fp8.gemm import compile_guard
    from lowprec.fp8.modules.fp8_base import Float8BaseLinear

    monkeypatch.setattr(compile_guard, "_LOGGED", set())
    monkeypatch.setenv(compile_guard.ENV, "0")
    torch._dynamo.reset()
    counters.clear()
    q = (torch.randn(64, 128) * 8).to(torch.float8_e4m3fn)
    layer = Float8BaseLinear(q, torch.full((1, 1), 0.125), block=128)
    x = torch.randn(4, 128, requires_grad=True)
    with fp8.autocast():
        want = layer(x)
        got = torch.compile(layer, backend="eager")(x)
    assert sum(counters["graph_break"].values()) >= 1 and torch.equal(got, want)
    got.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_telemetry_reports_every_operand(seed):
    net = Net()
    fp8.convert(net, "tensorwise")
    fp8.enable_telemetry(net)
    with fp8.autocast():
        net(torch.randn(4, 16)).sum().backward()
    stats = fp8.telemetry(net)
    assert set(stats) == {f"blocks.{i}.{p}" for i in range(2) for p in ("q_proj", "gate_proj", "up_proj", "down_proj")}
    for layer in stats.values():
        for op in ("input", "weight", "grad_output"):
            assert layer[op]["amax"] > 0 and layer[op]["scale"] > 0
            assert 0 <= layer[op]["saturated"] <= 1 and 0 <= layer[op]["underflow"] <= 1


def _cast_stats_direct(x, q):
    """The telemetry definitions written out directly (the expression cast_stats replaced)."""
    from lowprec.fp8.cast.formats import saturation_threshold
    from lowprec.fp8.cast.quantize import expand_blocks

    full = expand_blocks(q.scale, q.block, x.shape) if q.granularity == "block" else q.scale
    x32 = x.detach().to(torch.float32)
    saturated = ((x32 * full).abs() > saturation_threshold(q.data.dtype)).float().mean()
    underflow = ((x32 != 0) & (q.data.to(torch.float32) == 0)).float().mean()
    return torch.stack([x32.abs().amax(), q.scale.amin().to(torch.float32), saturated, underflow])


def test_cast_stats_equal_the_direct_expressions(seed):
    from lowprec.fp8.modules.cast_state import cast_stats
    from lowprec.fp8.cast.quantize import quantize

    for trial in range(40):
        rows, cols = (int(v) for v in torch.randint(1, 200, (2,)))
        # values spanning 16 decades, so that casts underflow; exact zeros, -0.0, inf, NaN
        x = torch.randn(rows, cols) * torch.logspace(-12, 4, cols)[torch.randperm(cols)]
        x[torch.rand(rows, cols) < 0.1] = 0.0
        x[torch.rand(rows, cols) < 0.05] = -0.0
        if trial % 4 == 1:
            x[0, 0] = float("inf")
        if trial % 4 == 2:
            x[-1, -1] = float("nan")
        x = x.to((torch.bfloat16, torch.float32, torch.float16)[trial % 3])
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            for gran, kw in (("tensor", {}), ("axis", {"dim": 1}), ("axis", {"dim": 0}), ("block", {"block": (1, 32)})):
                q = quantize(x, dtype, gran, **kw)
                if trial % 5 == 0:  # a scale 8x too large: saturated values to count
                    q.scale = q.scale * 8
                got, want = cast_stats(x, q), _cast_stats_direct(x, q)
                assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)), (trial, dtype, gran, got, want)


def test_resume_from_state_dict_continues_exactly(seed):
    """Delayed scaling state travels in state_dict: 3 + 3 resumed steps == 6 straight steps."""
    data = [torch.randn(8, 16) * (1 + i) for i in range(6)]

    def make():
        torch.manual_seed(7)
        net = Net()
        fp8.convert(net, fp8.Recipe.from_name("delayed", amax_history_len=4))
        return net, torch.optim.AdamW(net.parameters(), lr=1e-2)

    def steps(net, opt, xs):
        out = []
        for x in xs:
            with fp8.autocast():
                loss = net(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    net, opt = make()
    straight = steps(net, opt, data)
    net, opt = make()
    first = steps(net, opt, data[:3])
    ckpt = copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict()})
    net2, opt2 = make()
    net2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert first + steps(net2, opt2, data[3:]) == straight


def test_current_scaling_never_reports_saturation(seed):
    # amax * scale can land one float32 ulp above 448; that is rounding, not clipping.
    for name in ("tensorwise", "rowwise", "blockwise"):
        layer = fp8.Float8Linear.from_linear(nn.Linear(128, 64), fp8.Recipe.from_name(name))
        fp8.enable_telemetry(layer)
        for _ in range(5):
            x = (torch.randn(32, 128) * torch.rand(1) * 100).requires_grad_()
            with fp8.autocast():
                layer(x).sum().backward()
            for op, stats in fp8.telemetry(layer)[""].items():
                assert stats["saturated"] == 0.0, (name, op, stats)


def test_emulation_fallback_is_logged(seed, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="lowprec.fp8"):
        fp8.convert(Net(), fp8.Recipe.from_name("blockwise", power_of_2_scales=False))
    assert any("emulated" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowprec.fp8"):
        fp8.convert(Net(), fp8.Recipe.from_name("tensorwise", gemm="emulate"))  # asked for: no warning
    assert not caplog.records


def test_autocast_eval_override(seed):
    net = Net()
    x = torch.randn(4, 16)
    ref = net(x)
    fp8.convert(net, "tensorwise")
    net.eval()
    with fp8.autocast(use_during_eval=True):
        assert not torch.equal(net(x), ref)
        with fp8.autocast(use_during_eval=False):
            assert torch.equal(net(x), ref)
    with fp8.autocast():
        assert torch.equal(net(x), ref)  # back to the recipe's own choice


def test_empty_batch_passes_through(seed):
    for name in fp8.RECIPE_NAMES:
        layer = fp8.Float8Linear.from_linear(nn.Linear(32, 16), fp8.Recipe.from_name(name))
        x = torch.randn(0, 32, requires_grad=True)
        with fp8.autocast():
            y = layer(x)
        y.sum().backward()
        assert y.shape == (0, 16) and x.grad.shape == (0, 32)


def test_delayed_honours_power_of_2_scales(seed):
    import math

    layer = fp8.Float8Linear.from_linear(nn.Linear(32, 32), fp8.Recipe.from_name("delayed", power_of_2_scales=True))
    for _ in range(3):
        with fp8.autocast():
            layer(torch.randn(4, 32) * 3).sum().backward()
    for o in ("input", "weight", "grad_output"):
        assert math.frexp(getattr(layer, f"fp8_scale_{o}").item())[0] == 0.5, o


def test_meta_init_then_reset_gives_clean_scaling_state():
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]).to("meta")
    report = fp8.convert(net, "delayed")
    assert "run time" in report.gemm
    net.to_empty(device="cpu")
    for m in net.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    mid = net[1]
    assert mid.fp8_amax_history_input.abs().sum() == 0 and mid.fp8_scale_input.item() == 1.0
    assert int(mid.fp8_step) == 0


def test_hooks_survive_conversion_both_ways(seed):
    lin = nn.Linear(32, 32)
    lin.register_forward_hook(lambda m, args, kwargs, out: out * 2, with_kwargs=True)
    lin.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    x = torch.randn(4, 32)
    want = lin(x)
    layer = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("tensorwise"))
    with fp8.autocast(enabled=False):  # high precision, to compare with the plain Linear
        assert torch.equal(layer(x), want)
    assert torch.equal(layer.to_linear()(x), want)


@pytest.mark.parametrize("name", list(fp8.RECIPE_NAMES))
def test_checkpointed_blocks_match_plain_ones_exactly(seed, name):
    """fp8.checkpoint: backward (called outside the FP8 region) recomputes in FP8 with the
    first forward's scales; gradients and delayed-scaling state equal the uncheckpointed run."""
    torch.manual_seed(3)
    plain = Net()
    fp8.convert(plain, fp8.Recipe.from_name(name))
    ckpt = copy.deepcopy(plain)
    x = torch.randn(8, 16)

    def run(net, use_ckpt):
        with fp8.autocast():
            h = net.embed(x)
            for b in net.blocks:
                h = fp8.checkpoint(b, h) if use_ckpt else b(h)
            loss = net.lm_head(h).pow(2).mean()
        loss.backward()  # outside the region, as in a usual loop
        return loss

    for _ in range(2):
        assert torch.equal(run(plain, False), run(ckpt, True))
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        if n.startswith("router"):  # unused in run()
            continue
        assert torch.equal(a.grad, b.grad), n
    for (n, a), b in zip(plain.named_buffers(), ckpt.buffers()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "mxfp8"])
def test_bad_inputs_raise_nn_linears_errors(seed, name):
    """nn.Linear refuses an integer input and a wrong last dim; the FP8 path computed an integer
    input anyway (a wrong Long result) and reported a wrong width from deep inside scaled_mm."""
    layer = fp8.Float8Linear(32, 16, recipe=name)
    plain = nn.Linear(32, 16)
    for x in (torch.ones(4, 32, dtype=torch.long), torch.randn(4, 31)):
        with pytest.raises(RuntimeError) as ours:
            layer(x)
        with pytest.raises(RuntimeError) as theirs:
            plain(x)
        assert str(ours.value) == str(theirs.value)


def test_recipe_names_and_wrong_types():
    """A recipe name works wherever a Recipe does (``convert`` took one, ``Float8Linear`` failed
    with an AttributeError on it); any other type is one TypeError naming the call."""
    assert fp8.Float8Linear(32, 32, recipe="delayed").recipe.name == "delayed"
    assert fp8.Float8Linear.from_linear(nn.Linear(32, 32), "rowwise").recipe.name == "rowwise"
    assert fp8.autocast(recipe="delayed").recipe == fp8.Recipe.from_name("delayed")  # was a TypeError
    for call in (
        lambda: fp8.autocast(recipe=3),
        lambda: fp8.convert(Net(), recipe=3),
        lambda: fp8.Float8Linear(32, 32, recipe=3),
        lambda: fp8.Float8Linear.from_linear(nn.Linear(32, 32), 3),
    ):
        with pytest.raises(TypeError, match="recipe must be a lowprec.fp8.Recipe or a recipe name"):
            call()


def test_converting_nothing_is_logged(caplog):
    """A model none of whose layers can convert ran in high precision with no word unless the
    report was printed; now one warning names the reasons. Converting something says nothing."""
    odd = nn.Sequential(nn.Linear(30, 50), nn.Linear(50, 50), nn.Linear(50, 10))
    with caplog.at_level("WARNING", logger="lowprec.fp8"):
        fp8.convert(odd, "tensorwise")
    said = [r.getMessage() for r in caplog.records if "converted no layer" in r.getMessage()]
    assert len(said) == 1 and "not multiples of 16" in said[0] and "high precision" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="lowprec.fp8"):
        fp8.convert(Net(), "tensorwise")
        fp8.convert(nn.Sequential(nn.Linear(30, 50)), "tensorwise", warn_if_none=False)  # the caller says so
    assert not [r for r in caplog.records if "converted no layer" in r.getMessage()]


def test_a_recipe_field_the_recipe_does_not_read_is_a_warning():
    """``Recipe.from_name("tensorwise", amax_history_len=16)`` was accepted without a word (only
    delayed scaling reads a history); NativeRecipeKwargs warned and the trainer refused it."""
    with pytest.warns(UserWarning, match="tensorwise recipe does not read amax_history_len"):
        fp8.Recipe.from_name("tensorwise", amax_history_len=16)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8.Recipe.from_name("delayed", amax_history_len=16)
        fp8.Recipe.from_name("tensorwise", use_during_eval=True)
