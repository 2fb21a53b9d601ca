"""apply_opt_level: O1 FP8-held gradients, O2 optimizer rebuild, user errors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from lowprec.fp8.cast.quantize import quantize_tensorwise
from lowprec.optim import FP8AdamW, apply_opt_level, clip_grad_norm_, fp8_grad, materialize_grads


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8))


def _fp32_grads(model, xs):
    ref = _model()
    ref.load_state_dict(model.state_dict())
    for x in xs:
        ref(x).pow(2).mean().backward()
    return [p.grad.clone() for p in ref.parameters()]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_o1_holds_weight_gradients_in_fp8_and_accumulates():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = apply_opt_level(model, opt, "O1")
    xs = [torch.randn(32, 16), torch.randn(32, 16)]
    ref = _fp32_grads(model, xs)
    for x in xs:  # two micro-batches
        model(x).pow(2).mean().backward()
    for p, r in zip(model.parameters(), ref):
        assert p.grad is None  # the high-precision gradient is gone
        held = fp8_grad(p)
        assert held.data.dtype == torch.float8_e4m3fn and held.data.shape == p.shape
        # E4M3: 3 mantissa bits, half-ulp 2^-4 relative, two roundings with accumulation
        assert _rel(held.dequantize(), r) < 2 * 2**-4


def test_o1_with_any_optimizer_steps_on_the_dequantized_gradient():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    model, opt = apply_opt_level(model, torch.optim.SGD(model.parameters(), lr=0.5), "O1")
    model(torch.randn(8, 16)).pow(2).mean().backward()
    held = [fp8_grad(p).dequantize() for p in model.parameters()]
    opt.step()
    for p, b, g in zip(model.parameters(), before, held):
        torch.testing.assert_close(p.detach(), b - 0.5 * g)
        assert fp8_grad(p) is None  # consumed by the step


def test_o1_round_trip_mode_keeps_grad_visible():
    model = _model()
    x = torch.randn(32, 16)
    ref = _fp32_grads(model, [x])
    model, opt = apply_opt_level(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", hold_grads=False)
    model(x).pow(2).mean().backward()
    for p, r in zip(model.parameters(), ref):
        assert fp8_grad(p) is None and p.grad.dtype == torch.float32
        assert 0 < _rel(p.grad, r) < 2**-4  # rounded through E4M3, not untouched
        # values already lie on the FP8 grid: a second round trip changes nothing
        again = quantize_tensorwise(p.grad, torch.float8_e4m3fn).dequantize()
        torch.testing.assert_close(again, p.grad, rtol=1e-6, atol=0)


def test_clip_grad_norm_on_fp8_gradients():
    model = _model()
    model, opt = apply_opt_level(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1")
    (model(torch.randn(8, 16)).pow(2).mean() * 1e4).backward()
    params = list(model.parameters())
    norm = clip_grad_norm_(params, 1.0)
    assert norm > 10.0
    materialize_grads(params)
    total = torch.cat([p.grad.flatten() for p in params]).norm()
    assert total.item() == pytest.approx(1.0, rel=1e-4)


def test_o2_rebuilds_adamw_with_same_params_and_groups():
    model = _model()
    ids = [id(p) for p in model.parameters()]
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1e-2, "name": "first"},
            {"params": model[2].parameters(), "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.8, 0.95),
        eps=1e-6,
        weight_decay=0.1,
    )
    model2, opt2 = apply_opt_level(model, opt, "O2")
    assert model2 is model and [id(p) for p in model2.parameters()] == ids
    assert isinstance(opt2, FP8AdamW) and isinstance(opt2, torch.optim.Optimizer)
    g0, g1 = opt2.param_groups
    assert (g0["lr"], g0["name"], g0["betas"], g0["eps"], g0["weight_decay"], g0["adamw"]) == (
        1e-2,
        "first",
        (0.8, 0.95),
        1e-6,
        0.1,
        True,
    )
    assert (g1["lr"], g1["weight_decay"]) == (1e-3, 0.0)
    assert [id(p) for g in opt2.param_groups for p in g["params"]] == ids


def test_o2_keeps_moments_of_an_optimizer_that_already_stepped():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    m_ref = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    _, opt2 = apply_opt_level(model, opt, "O2")
    assert opt2.param_groups[0]["adamw"] is False  # Adam semantics kept
    from lowprec.optim.moments import decode_exp_avg

    for p, m in zip(model.parameters(), m_ref):
        st = opt2.state[p]
        assert st["step"].item() == 1.0
        assert _rel(decode_exp_avg(st["exp_avg"], st["exp_avg_scale"], opt2.block_size), m) < 0.07


def test_applying_twice_does_not_quantize_twice():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = apply_opt_level(model, opt, "O1")
    model, opt = apply_opt_level(model, opt, "O2")
    model(torch.randn(4, 16)).sum().backward()
    assert all(fp8_grad(p) is not None and p.grad is None for p in model.parameters())
    assert len(model.lowprec_fp8_grads.handles) == len(list(model.parameters()))


@pytest.mark.parametrize(
    "make, level, words",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "O2", ["SGD", "Adam", "O1"]),
        (lambda ps: torch.optim.Adam(ps, amsgrad=True), "O2", ["amsgrad=False"]),
        (lambda ps: torch.optim.AdamW(ps), "O3", ["O3", "'O1' or 'O2'"]),
        (lambda ps: torch.optim.AdamW(ps), "fp8", ["'O1' or 'O2'"]),
    ],
)
def test_user_errors_name_the_problem_and_the_fix(make, level, words):
    model = _model()
    with pytest.raises(ValueError) as e:
        apply_opt_level(model, make(model.parameters()), level)
    for w in words:
        assert w in str(e.value)


def test_to_fp8_adamw_encodes_moments_with_the_parameters_block_segments():
    """A converted optimizer decodes its moments with the segment layout it steps with."""
    import torch

    from lowprec.optim import FP8AdamW, set_block_segments, to_fp8_adamw
    from lowprec.optim.moments import decode_exp_avg

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300))
    set_block_segments(p, [100, 200])
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.cat([torch.randn(100) * 1e3, torch.randn(200) * 1e-2])
    opt.step()
    m = opt.state[p]["exp_avg"].clone()
    fp8_opt = to_fp8_adamw(opt)
    assert isinstance(fp8_opt, FP8AdamW)
    st = fp8_opt.state[p]
    got = decode_exp_avg(st["exp_avg"], st["exp_avg_scale"], fp8_opt.block_size, segments=[100, 200])
    rel = ((got - m).norm() / m.norm()).item()
    small = ((got[100:] - m[100:]).norm() / m[100:].norm()).item()
    assert rel < 0.1 and small < 0.1, (rel, small)


def test_o1_zero_grad_drops_held_fp8_gradients():
    """backward; zero_grad; backward; step must apply one gradient, not two."""
    import torch

    from lowprec.optim import apply_opt_level
    from lowprec.optim.fp8_grads import fp8_grad

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = apply_opt_level(model, opt, "O1")
    x = torch.randn(4, 16)
    model(x).sum().backward()
    once = fp8_grad(model.weight).dequantize().clone()
    opt.zero_grad()
    assert fp8_grad(model.weight) is None
    model(x).sum().backward()
    assert torch.allclose(fp8_grad(model.weight).dequantize(), once)


def _schedulers(opt):
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[3])


@pytest.mark.parametrize("make", [_schedulers, lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1e-2, total_steps=8)])
def test_o2_scheduler_built_before_the_rebuild_drives_the_new_optimizer(make):
    """A scheduler built on the Adam that O2 replaces must schedule the FP8AdamW that steps:
    the same learning rates (and OneCycle's betas) and weights as one built after the call,
    without torch's "scheduler before optimizer" warning; the replaced Adam refuses to step."""
    runs = []
    for before in (True, False):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = make(opt) if before else None
        model, new = apply_opt_level(model, opt, "O2")
        sched = sched or make(new)
        lrs = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in range(6):
                model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
                new.step()
                new.zero_grad()
                sched.step()
                lrs.append((new.param_groups[0]["lr"], new.param_groups[0]["betas"]))
        runs.append((lrs, [p.detach().clone() for p in model.parameters()]))
        if before:
            assert not opt.state  # its fp32 moments are freed (the scheduler keeps it alive)
            with pytest.raises(RuntimeError, match="replaced by lowprec.optim.FP8AdamW"):
                opt.step()
    (lrs_before, w_before), (lrs_after, w_after) = runs
    assert lrs_before == lrs_after and len({lr for lr, _ in lrs_after}) > 1
    assert all(torch.equal(a, b) for a, b in zip(w_before, w_after))
