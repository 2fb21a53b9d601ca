"""The FP8 guard over mixture-of-experts projections (transformers' Mixtral, built from a config):
each grouped expert projection is a watched layer (``...experts.fp8_gate_up_proj``), judged by its
worst routed expert's statistics; ``act`` moves the whole projection (all its experts' GEMMs) to
high precision, and a checkpoint's moves restore it."""

import copy
import json

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (dev extra)")

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.fp8.observe.guard import HealthMonitor  # noqa: E402
from lowprec.fp8.observe.telemetry import grouped_telemetry  # noqa: E402
from tests.tiny_moe import build, moe_block  # noqa: E402

GATE_UP = "experts.fp8_gate_up_proj"


def _block(seed=0, **kw):
    block = moe_block(build("mixtral", seed))
    fp8.convert(block, "tensorwise", skip_first_last=False, **kw)
    return block


def _outlier(x, scale=2.0**20):
    """One token far above the rest: the expert group it joins underflows under one scale."""
    x = x.clone()
    x[0, 0] *= scale
    return x


def _steps(block, monitor, xs, first=1):
    events = []
    for step, x in enumerate(xs, first):
        monitor.arm(step)
        fp8.enable_telemetry(block)
        block(x).float().sum().backward()  # dY all ones: the gradient carries no outlier
        tele = fp8.telemetry(block)
        fp8.disable_telemetry(block)
        events += [r for r in monitor.check(step, tele) if r["kind"] == "fp8_guard"]
    return events


def test_expert_projections_are_health_rows_from_their_worst_routed_expert(seed):
    block = _block(seed)
    x = torch.randn(2, 16, 64)
    fp8.enable_telemetry(block)
    block(x).sum().backward()
    rows = grouped_telemetry(block)
    assert set(rows) == {GATE_UP, "experts.fp8_down_proj"}
    stats = fp8.expert_telemetry(block)["experts"]
    ran = [e for e, t in enumerate(stats["tokens"]) if t]
    for op in ("input", "weight", "grad_output"):
        per = stats["gate_up_proj"][op]
        assert rows[GATE_UP][op]["underflow"] == pytest.approx(max(per["underflow"][e] for e in ran))
        assert rows[GATE_UP][op]["amax"] > 0
    monitor = HealthMonitor(block, "warn", 1, 10**9)
    assert _steps(block, monitor, [x]) == []  # healthy data: no event


def test_act_moves_an_unhealthy_projection_whole_and_only_it(seed):
    block = _block(seed)
    monitor = HealthMonitor(block, "act", 1, 10**9)
    x = torch.randn(2, 16, 64)
    events = _steps(block, monitor, [_outlier(x)])
    assert [(e["layer"], e["signal"], e["moved"]) for e in events] == [(GATE_UP, "input.underflow", True)]
    experts = block.experts
    assert experts.fp8_gate_up_proj.high_precision and not experts.fp8_down_proj.high_precision
    # the moved projection now computes what a projection kept in high precision computes
    kept = _block(seed, skip_patterns=("gate_up_proj",))
    assert not hasattr(kept.experts, "fp8_gate_up_proj")
    assert torch.equal(block(x), kept(x))


def test_the_gemm_scope_moves_all_three_gemms_of_a_projection(seed):
    block = _block(seed)
    monitor = HealthMonitor(block, "act", 1, 10**9, scope="gemm")
    events = _steps(block, monitor, [_outlier(torch.randn(2, 16, 64))])
    assert [(e["layer"], tuple(e["gemms"])) for e in events] == [(GATE_UP, ("fprop", "dgrad", "wgrad"))]
    assert block.experts.fp8_gate_up_proj.gemm_precision() == dict.fromkeys(("fprop", "dgrad", "wgrad"), True)


def test_warn_moves_nothing_and_a_checkpoint_restores_the_moves(seed):
    block = _block(seed)
    warn = HealthMonitor(block, "warn", 1, 10**9)
    assert [e["layer"] for e in _steps(block, warn, [_outlier(torch.randn(2, 16, 64))])] == [GATE_UP]
    assert not block.experts.fp8_gate_up_proj.high_precision
    act = HealthMonitor(block, "act", 1, 10**9)
    _steps(block, act, [_outlier(torch.randn(2, 16, 64))])
    state = json.loads(json.dumps(act.state_dict()))
    fresh = copy.deepcopy(_block(seed))
    HealthMonitor(fresh, "act", 1, 10**9).load_state_dict(state)
    assert fresh.experts.fp8_gate_up_proj.high_precision and not fresh.experts.fp8_down_proj.high_precision


def _steps_with_rows(block, monitor, xs, first=1):
    """As _steps, keeping the health rows of the gate_up projection too."""
    events, rows = [], []
    for step, x in enumerate(xs, first):
        monitor.arm(step)
        fp8.enable_telemetry(block)
        block(x).float().sum().backward()
        tele = fp8.telemetry(block)
        fp8.disable_telemetry(block)
        for r in monitor.check(step, tele):
            if r["kind"] == "fp8_guard":
                events.append(r)
            else:
                rows.append(r["layers"].get(GATE_UP))
    return events, rows


def test_a_moved_projection_is_measured_on_the_side_and_moves_back(seed):
    """``recover_after``: a moved expert projection runs in high precision, and at each check its
    experts' would-be FP8 casts (x_e, W_e, dY_e per expert holding tokens) are measured on the
    side, the row its worst expert's (``side_cast``); while the outlier stays it stays moved, and
    after ``recover_after`` healthy checks in a row it moves back to FP8 and computes what a fresh
    FP8 block computes. (With gate_up in bf16 the outlier reaches down_proj's input, which FP8 had
    flushed: down_proj moves at step 2 and back at step 4 too.)"""
    block = _block(seed)
    monitor = HealthMonitor(block, "act", 1, 10**9, recover_after=2)
    x = torch.randn(2, 16, 64)
    events, rows = _steps_with_rows(block, monitor, [_outlier(x), _outlier(x), x, x])
    gate_up = block.experts.fp8_gate_up_proj
    assert not rows[0].get("side_cast")  # step 1: it ran FP8 (its own telemetry)
    assert all(r["side_cast"] for r in rows[1:])  # steps 2-4: moved, measured on the side
    assert rows[1]["input"]["underflow"] > 0.5  # the outlier still there: still unhealthy
    assert rows[2]["input"]["underflow"] == 0 and rows[3]["input"]["underflow"] == 0
    assert rows[3]["grad_output"]["headroom_bits"] is not None
    moves = [(e["layer"], e["step"], e.get("direction")) for e in events]
    down = "experts.fp8_down_proj"
    assert moves == [(GATE_UP, 1, None), (down, 2, None), (GATE_UP, 4, "to_fp8"), (down, 4, "to_fp8")], moves
    assert not gate_up.high_precision and not block.experts.fp8_down_proj.high_precision
    assert torch.equal(block(x), _block(seed)(x))  # FP8 again, fresh state: a converted block's output


def test_without_recover_after_nothing_is_measured_on_the_side(seed):
    block = _block(seed)
    monitor = HealthMonitor(block, "act", 1, 10**9)
    x = torch.randn(2, 16, 64)
    events, rows = _steps_with_rows(block, monitor, [_outlier(x), x, x])
    assert block.experts.fp8_gate_up_proj.high_precision  # moved, stays moved
    assert not any(r.get("side_cast") for r in rows)
    assert "_lowprec_side_probe" not in block.experts.fp8_gate_up_proj.__dict__


def _accelerated(tmp_path, **fields):
    """Mixtral through lowprec's Accelerator with a guard that moves every watched layer at its
    first check (any underflow, even none, crosses a threshold of -1)."""
    from lowprec import Accelerator
    from lowprec.kwargs import NativeRecipeKwargs

    torch.manual_seed(0)
    handler = NativeRecipeKwargs(
        recipe="tensorwise", fp8_guard="act", fp8_guard_patience=1, fp8_health_every=1,
        fp8_guard_thresholds={"underflow": -1.0}, **fields,
    )  # fmt: skip
    acc = Accelerator(mixed_precision="fp8", cpu=True, project_dir=str(tmp_path), kwargs_handlers=[handler])
    model = build("mixtral")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    return acc, model, opt


def _step(acc, model, opt):
    ids = torch.randint(0, 128, (2, 16))
    acc.backward(model(ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()


def _projections(model):
    return {n: m for n, m in model.named_modules() if n.endswith(("fp8_gate_up_proj", "fp8_down_proj"))}


def test_the_accelerator_watches_a_model_whose_only_fp8_layers_are_experts(tmp_path, caplog):
    """Attention kept in bf16 (skip_patterns), the experts in FP8: the Accelerator said 'the model
    has no FP8 layer (every Linear was kept in high precision); nothing is watched' and never
    checked the experts (lowprec train watched them)."""
    skip = ("lm_head", "router", "gate", "self_attn")
    with caplog.at_level("WARNING", logger="lowprec"):
        acc, model, opt = _accelerated(tmp_path, skip_patterns=skip)
    inner = acc.unwrap_model(model)
    assert not any(isinstance(m, fp8.Float8Linear) for m in inner.modules())
    assert "nothing is watched" not in caplog.text
    _step(acc, model, opt)
    health = acc.fp8_health(model)
    assert health is not None and sorted(health.monitor.moved_layers()) == sorted(_projections(inner))
    assert all(g.high_precision for g in _projections(inner).values())


def test_load_state_puts_expert_projections_moved_since_back_in_fp8(tmp_path):
    """load_state of a checkpoint saved before a move reset the moved Linear layers only: the
    expert projections the guard moved since stayed in bf16, unlike the checkpoint's run."""
    acc, model, opt = _accelerated(tmp_path)
    acc.save_state(str(tmp_path / "before"))
    _step(acc, model, opt)
    projections = _projections(acc.unwrap_model(model))
    assert len(projections) == 4 and all(g.high_precision for g in projections.values())
    acc.load_state(str(tmp_path / "before"))
    assert not any(g.high_precision for g in projections.values())
    assert acc.fp8_health(model).monitor.moved_layers() == []
