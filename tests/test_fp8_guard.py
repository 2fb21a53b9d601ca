"""FP8 health signals and the guard (issue 27): the pure signals, the guard's episodes and moves,
and ``lowprec train`` with ``fp8_guard: act`` (records, conversion report, resume keeps moves)."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
import yaml
from torch import nn

import lowprec.fp8 as fp8
from lowprec.cli.main import main
from lowprec.fp8.observe.guard import Guard, HealthMonitor, Thresholds
from lowprec.fp8.observe.health import HealthProbe, headroom_bits, max_to_rms, signals, sqnr_db
from lowprec.train.config import load_config, parse_config
from lowprec.train.metrics import read_metrics
from lowprec.train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")


def test_pure_signals():
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    assert sqnr_db(x, x) == math.inf
    noisy = x + 0.01 * torch.randn_like(x)
    assert 35 < sqnr_db(x, noisy) < 45  # noise 1% of the signal's rms: 40 dB
    y = torch.ones(100)
    assert max_to_rms(y) == pytest.approx(1.0)
    y[3] = 100.0  # one outlier: max 100, rms ~ 10
    assert max_to_rms(y) == pytest.approx(100 / math.sqrt((99 + 100**2) / 100))
    assert max_to_rms(torch.zeros(4)) == 0.0
    assert headroom_bits(2.0, 448.0 / 8.0, 448.0) == pytest.approx(2.0)  # scaled amax 112 = 448 / 4
    assert headroom_bits(0.0, 1.0, 448.0) is None  # not cast yet


def _model(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16))
    fp8.convert(m, recipe="tensorwise", skip_first_last=False)
    return m


def _step(m, x, probe=None):
    fp8.enable_telemetry(m)
    if probe is not None:
        probe.arm(outliers=True, sqnr=True)
    m(x).float().pow(2).mean().backward()
    tele = fp8.telemetry(m)
    fp8.disable_telemetry(m)
    return tele


def test_probe_readings_and_signals_and_the_probe_changes_nothing():
    x = torch.randn(16, 32, requires_grad=True)
    a, b = _model(), _model()
    probe = HealthProbe(b)
    _step(a, x)
    tele = _step(b, x, probe)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad)  # the probe's hooks read, never write
    health = signals(tele, probe.layers, probe.take(), None)
    assert set(health) == {"0", "1", "2"}
    row = health["1"]
    assert 20 < row["sqnr_db"] < 45  # E4M3 x E4M3 GEMM vs float32
    assert row["max_to_rms"] > 1
    assert row["input"]["headroom_bits"] == 0.0  # tensorwise: the scaled amax sits at the max
    assert row["input"]["underflow_trend"] == 0.0  # first check: no trend
    later = signals(
        tele, probe.layers, {}, {"1": {"input": {"saturated": 0.0, "underflow": row["input"]["underflow"] - 0.25}}}
    )
    assert later["1"]["input"]["underflow_trend"] == pytest.approx(0.25)
    assert later["1"]["sqnr_db"] is None  # not sampled this step


def test_guard_patience_episodes_warn_once_and_act_moves(caplog):
    m = _model()
    bad = {"input": {"underflow": 0.5}}
    ok = {"input": {"underflow": 0.0}}
    g = Guard(m, mode="warn", thresholds=Thresholds(patience=2))
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        assert g.check(1, {"1": bad}) == []  # 1 of 2
        (ev,) = g.check(2, {"1": bad})
        assert (ev.layer, ev.signal, ev.value, ev.step, ev.moved) == ("1", "input.underflow", 0.5, 2, False)
        assert g.check(3, {"1": bad}) == []  # same episode: logged once
        g.check(4, {"1": ok})  # episode over
        g.check(5, {"1": bad})
        assert [e.step for e in g.check(6, {"1": bad})] == [6]
    assert [r.getMessage().split(": ")[2] for r in caplog.records] == ["1", "1"]
    assert "input.underflow = 0.5 " in caplog.records[0].getMessage()
    assert not dict(m.named_modules())["1"].high_precision  # warn never moves

    g = Guard(m, mode="act", thresholds=Thresholds(patience=1, sqnr_db=20))
    (ev,) = g.check(7, {"1": {"sqnr_db": 12.0}, "2": {"sqnr_db": 30.0}})
    assert ev.moved and ev.signal == "sqnr_db"
    layers = dict(m.named_modules())
    assert layers["1"].high_precision and not layers["2"].high_precision
    assert g.moves() == [{"layer": "1", "signal": "sqnr_db", "value": 12.0, "step": 7, "moved": True}]
    with pytest.raises(ValueError, match="'nope'"):
        Guard(_model(), mode="act").restore([{"layer": "nope"}])


def test_a_moved_layer_is_exactly_a_plain_linear():
    m = _model()
    layer = dict(m.named_modules())["1"]
    x = torch.randn(8, 64)
    fp8_out = layer(x)
    layer.high_precision = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moved = layer(x)
        plain = nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(moved, plain) and not torch.equal(layer(x), fp8_out)


def _outlier_on(layer: nn.Module, channel: int = 3, bits: int = 20):
    """One input channel of ``layer`` times 2**bits in the forward (its gradient untouched): the
    other channels of that GEMM's input flush to zero under tensorwise FP8."""

    def pre(module, args):
        x = args[0]
        m = torch.ones(x.shape[-1], dtype=x.dtype)
        m[channel] = 2.0**bits
        return (x + (x * (m - 1)).detach(),)

    return layer.register_forward_pre_hook(pre)


def test_the_side_probe_measures_a_moved_layer_as_its_fp8_casts():
    """A moved layer casts nothing: its telemetry is stale. ``HealthProbe(side=True)`` measures the
    casts its recipe would make: for the same x and W, exactly what telemetry reports in FP8;
    the step's values are unchanged."""
    x = torch.randn(16, 32)
    m, plain = _model(), _model()
    hook = _outlier_on(m[0])
    _outlier_on(plain[0])
    side, stale = HealthProbe(m, side=True), HealthProbe(m)
    fp8_row = signals(_step(m, x, side), side.layers, side.take(), None)["0"]
    assert fp8_row["input"]["underflow"] > 0.5 and "side_cast" not in fp8_row  # an FP8 layer: telemetry
    m[0].high_precision = plain[0].high_precision = True
    m.zero_grad()
    side_row = signals(_step(m, x, side), side.layers, side.take(), None)["0"]
    _step(plain, x)
    assert side_row["side_cast"] is True
    for op in ("input", "weight"):  # the same cast of the same tensors
        assert side_row[op] == fp8_row[op], op
    assert side_row["grad_output"]["headroom_bits"] == 0.0  # dY cast tensorwise: its amax at the max
    assert side_row["sqnr_db"] == pytest.approx(fp8_row["sqnr_db"], abs=0.5)  # the FP8 GEMM's, not bf16's
    for pa, pb in zip(m.parameters(), plain.parameters()):
        assert torch.equal(pa.grad, pb.grad)  # the side casts read, never write
    # the outlier gone: the side casts see it at once, the stale telemetry never does
    hook.remove()
    stale.arm(outliers=True)
    tele = _step(m, x, side)
    assert signals(tele, side.layers, side.take(), None)["0"]["input"]["underflow"] < 0.02
    assert signals(tele, stale.layers, stale.take(), None)["0"]["input"]["underflow"] > 0.5


def _side(underflow=0.0, sqnr=None):
    return {"input": {"underflow": underflow}, "sqnr_db": sqnr, "side_cast": True}


def test_act_moves_a_layer_back_after_exactly_m_healthy_checks(caplog):
    m = _model()
    layer = dict(m.named_modules())["1"]
    bad, ok = {"input": {"underflow": 0.5}}, {"input": {"underflow": 0.0}}
    g = Guard(m, mode="act", thresholds=Thresholds(patience=2, recover_after=3))
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        g.check(1, {"1": bad})
        (moved,) = g.check(2, {"1": bad})
        assert moved.moved and layer.high_precision
        assert g.check(3, {"1": ok}) == []  # no side_cast: stale telemetry is not judged
        assert g.check(4, {"1": _side()}) == [] and g.check(5, {"1": _side()}) == []  # 2 of 3
        assert g.check(6, {"1": _side(0.3)}) == []  # unhealthy on the side: back to 0
        assert g.check(7, {"1": _side()}) == [] and g.check(8, {"1": _side()}) == []
        assert layer.high_precision
        (back,) = g.check(9, {"1": _side()})  # the 3rd healthy check in a row
    assert (back.layer, back.step, back.moved, back.direction, back.checks) == ("1", 9, True, "to_fp8", 3)
    assert not layer.high_precision
    assert "moved back to FP8 at step 9: 3 healthy checks" in caplog.records[-1].getMessage()
    assert g.moves() == [
        {"layer": "1", "signal": "input.underflow", "value": 0.5, "step": 2, "moved": True},
        {
            "layer": "1",
            "signal": "input.underflow",
            "value": 0.5,
            "step": 9,
            "moved": True,
            "direction": "to_fp8",
            "checks": 3,
        },
    ]
    # an FP8 layer again: watched as any, and moved again after patience
    g.check(10, {"1": bad})
    (again,) = g.check(11, {"1": bad})
    assert again.moved and again.direction == "to_bf16" and layer.high_precision
    assert HealthMonitor(m, "act", 2, 1, recover_after=3).moved_layers() == []  # a fresh monitor: nothing moved


def test_a_layer_moved_for_its_sqnr_counts_only_the_sampled_checks():
    m = _model()
    g = Guard(m, mode="act", thresholds=Thresholds(patience=1, recover_after=2))
    g.check(1, {"2": {"sqnr_db": 5.0}})
    for step in (2, 3, 4):  # healthy, but the SQNR was not sampled: nothing counts
        assert g.check(step, {"2": _side()}) == []
    assert g.check(5, {"2": _side(sqnr=30.0)}) == [] and g.check(6, {"2": _side()}) == []
    (back,) = g.check(7, {"2": _side(sqnr=31.0)})
    assert back.direction == "to_fp8" and back.signal == "sqnr_db" and not m[2].high_precision


def test_recover_after_none_never_moves_back():
    m = _model()
    g = Guard(m, mode="act", thresholds=Thresholds(patience=1))
    g.check(1, {"0": {"input": {"saturated": 0.5}}})
    for step in range(2, 30):
        assert g.check(step, {"0": _side()}) == []
    assert m[0].high_precision and len(g.moves()) == 1 and g.healthy == {}
    monitor = HealthMonitor(m, "act", 3, 1)
    assert not monitor.probe.side  # no side casts: the rows are what they were before move-backs
    with pytest.raises(ValueError, match="recover_after must be >= 1"):
        Thresholds(recover_after=0)
    with pytest.raises(ValueError, match="only the act mode"):
        Guard(m, mode="warn", thresholds=Thresholds(recover_after=2))


def _monitor_steps(m, monitor, steps, x):
    events = []
    for step in steps:
        monitor.arm(step)
        tele = _step(m, x)
        events += [r for r in monitor.check(step, tele) if r["kind"] == "fp8_guard"]
    return events


def test_monitor_moves_back_on_side_signals_and_a_checkpoint_keeps_the_final_states():
    """HealthMonitor on real steps: an outlier channel moves layer 2 to bf16 (patience 1); while
    it lasts the side casts stay unhealthy; gone, the layer moves back after exactly M = 2
    checks. Its state (JSON, as FP8Callback writes it) loaded into a fresh model and monitor
    gives every layer the state it had, before and after the move back."""
    import json

    m = _model()
    x = torch.randn(16, 32)
    hook = _outlier_on(m[2])
    monitor = HealthMonitor(m, "act", 1, 1, recover_after=2)
    events = _monitor_steps(m, monitor, [1, 2, 3], x)
    assert [(e["layer"], e["step"], e.get("direction")) for e in events] == [("2", 1, None)]
    moved_state = json.loads(json.dumps(monitor.state_dict()))
    hook.remove()
    events = _monitor_steps(m, monitor, [4, 5, 6], x)
    assert [(e["layer"], e["step"], e.get("direction")) for e in events] == [("2", 5, "to_fp8")]
    assert not m[2].high_precision and monitor.moved_layers() == []
    final_state = json.loads(json.dumps(monitor.state_dict()))
    for state, expect in ((moved_state, [False, False, True]), (final_state, [False, False, False])):
        fresh = _model(seed=1)
        again = HealthMonitor(fresh, "act", 1, 1, recover_after=2)
        fresh[2].high_precision = not expect[2]  # whatever it was, the checkpoint decides
        again.load_state_dict(state)
        assert [layer.high_precision for layer in fresh] == expect
        assert again.moves() == state["moved"] and again.guard.healthy == state["healthy"]
    # resumed while moved, with one healthy check counted: one more moves it back
    fresh = _model()
    again = HealthMonitor(fresh, "act", 1, 1, recover_after=2)
    again.load_state_dict({**moved_state, "healthy": {"2": 1}})
    assert [(e["step"], e.get("direction")) for e in _monitor_steps(fresh, again, [4], x)] == [(4, "to_fp8")]


def test_a_move_back_resets_the_layers_scaling_state():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16))
    fp8.convert(m, recipe="delayed", skip_first_last=False)
    m(torch.randn(8, 32)).sum().backward()
    assert m[1].fp8_amax_history_input.abs().sum() > 0
    g = Guard(m, mode="act", thresholds=Thresholds(patience=1, recover_after=1))
    g.check(1, {"1": {"input": {"underflow": 0.5}}})
    g.check(2, {"1": _side()})
    assert not m[1].high_precision
    assert m[1].fp8_amax_history_input.abs().sum() == 0 and m[1].fp8_amax_history_weight.abs().sum() == 0
    assert m[0].fp8_amax_history_input.abs().sum() > 0  # the other layer's state is its own


@pytest.mark.parametrize(
    "data,expected",
    [
        ({"fp8_guard": True}, "fp8_guard: true is ambiguous; use fp8_guard: warn"),
        ({"fp8": False, "fp8_guard": "act"}, "fp8_guard: act watches FP8 layers but fp8 is false; set fp8: true"),
        (
            {"fp8_guard": "act", "fp8_guard_thresholds": {"underflw": 0.1}},
            "fp8_guard_thresholds.underflw: unknown signal (did you mean 'underflow'",
        ),
        (
            {"fp8_guard": "act", "fp8_guard_patience": 0},
            "fp8_guard_patience: Input should be greater than or equal to 1",
        ),
        (
            {"fp8_guard": "warn", "fp8_health": False},
            "fp8_guard: warn reads the health signals that fp8_health: false turns off",
        ),
        (
            {"fp8_guard": "act", "fp8_guard_recover_after": 0},
            "fp8_guard_recover_after: Input should be greater than or equal to 1",
        ),
        (
            {"fp8_guard": "act", "fp8_guard_recover_after": "3"},
            "fp8_guard_recover_after: Input should be a valid integer",
        ),
        (
            {"fp8_guard": "warn", "fp8_guard_recover_after": 3},
            "fp8_guard_recover_after: 3 moves layers back to FP8, but fp8_guard: warn moves none; set fp8_guard: act",
        ),
        (
            {"fp8_guard": "act", "fp8_guard_scope": "gemms"},
            "fp8_guard_scope: gemms is not a guard scope; use fp8_guard_scope: layer (move the whole layer) or "
            "fp8_guard_scope: gemm",
        ),
        (
            {"fp8_guard": "warn", "fp8_guard_scope": "gemm"},
            "fp8_guard_scope: gemm says which GEMMs act moves, but fp8_guard: warn moves none; set fp8_guard: act",
        ),
        (  # a moved layer would still be handed FP8-rounded weights
            {"fp8_guard": "act", "fsdp_version": 2, "fp8_enable_fsdp_float8_all_gather": True},
            "fp8_guard: act moves layers to bf16, but fp8_enable_fsdp_float8_all_gather: true gives every layer its "
            "weight all-gathered in FP8",
        ),
    ],
)
def test_bad_guard_keys_are_one_line_exit_2(tmp_path, capsys, data, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"fp8": True, **data}))
    assert main(["train", str(path)]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lowprec: error: ") and expected in lines[0], lines


def test_act_with_fp8_all_gather_is_refused_on_the_accelerate_api_too():
    from lowprec.fp8_kwargs import NativeRecipeKwargs

    with pytest.raises(
        ValueError,
        match=r"^NativeRecipeKwargs: fp8_guard='act' moves layers to bf16, but "
        r"enable_fsdp_float8_all_gather=True .* set fp8_guard='warn' or drop enable_fsdp_float8_all_gather$",
    ):
        NativeRecipeKwargs(fp8_guard="act", enable_fsdp_float8_all_gather=True)
    assert NativeRecipeKwargs(fp8_guard="warn", enable_fsdp_float8_all_gather=True).fp8_guard == "warn"


def test_guard_off_spelling():
    assert parse_config({"fp8": True, "fp8_guard": False}).fp8_guard == "off"  # YAML's bare off
    cfg = parse_config({"fp8": True})
    assert cfg.fp8_guard == "off" and not cfg.fp8_health_on
    assert parse_config({"fp8": True, "fp8_guard": "warn"}).fp8_health_on


def test_robust_z_and_the_detector():
    from lowprec.train.spikes import SpikeDetector, robust_z

    assert robust_z(3.0, [1.0, 2.0, 3.0]) == pytest.approx(1 / 1.4826)  # median 2, MAD 1
    assert robust_z(5.0, [2.0, 2.0]) == math.inf and robust_z(2.0, [2.0, 2.0]) == 0.0
    d = SpikeDetector(window=5, zscore=6.0)
    assert [d.observe(v) for v in (3.0, 3.1, 2.9, 3.0, 3.05)] == [None] * 5  # filling the window
    z, med = d.observe(9.0)
    assert med == 3.0 and z > 6
    assert 9.0 not in d.losses and d.observe(3.02) is None  # a spike stays out of the window


def test_loss_spike_act_rolls_back_skips_the_batches_then_stops(tmp_path, monkeypatch, capsys):
    """A spike forced at step 6 (the detector patched: real spikes are not reproducible in 8 steps):
    act restores checkpoint-4 and trains steps 5-6 again on the batches after the spike's; the
    next spike, past loss_spike_max_rollbacks: 1, stops the run with exit code 3 in one line."""
    from lowprec.train import spikes

    calls = {"n": 0}

    def observe(self, loss):
        calls["n"] += 1
        return (50.0, 2.0) if calls["n"] in (6, 9) else None  # step 6, then step 7 after the rollback

    monkeypatch.setattr(spikes.SpikeDetector, "observe", observe)
    seen = []
    cfg = load_config(
        TINY,
        {
            "loss_spike": "act",
            "loss_spike_max_rollbacks": 1,
            "save_steps": 4,
            "eval_steps": None,
            "val_set_size": 0.0,
            "use_tensorboard": False,
            "output_dir": str(tmp_path / "run"),
        },
    )
    from lowprec.errors import NonFiniteError

    with pytest.raises(
        NonFiniteError, match=r"loss spike at step 7: .* after 1 rollback\(s\) \(loss_spike_max_rollbacks: 1\)"
    ):
        train(cfg, on_log=seen.append)
    steps = [r["step"] for r in seen]
    assert steps == [1, 2, 3, 4, 5, 5, 6]  # step 6 spiked (not logged); 5 again after the rollback, then 6
    first, again = {r["step"]: r["loss"] for r in seen[:5]}, {r["step"]: r["loss"] for r in seen[5:]}
    assert first[5] != again[5]  # other batches: the spike's were skipped
    recs = read_metrics(str(tmp_path / "run"))
    (spike,) = [r for r in recs if r["kind"] == "loss_spike" and r["rolled_back_to"] is not None]
    assert (spike["step"], spike["rolled_back_to"]) == (6, 4)
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]  # the first 5-6 cut


def _guard_rank(rank: int, port: int, out: str) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    m = _model()
    g = Guard(m, mode="act", thresholds=Thresholds(patience=2))
    bad = {"input": {"underflow": 0.5}}
    ok = {"input": {"underflow": 0.0}}
    seen = []
    for step in (1, 2, 3):  # only rank 1's data makes layer "1" unhealthy
        health = {"0": ok, "1": bad if rank == 1 else ok, "2": ok}
        seen.append([e.to_dict() for e in g.check(step, health)])
    layers = dict(m.named_modules())
    rep = {"events": seen, "moves": g.moves(), "high_precision": [layers[n].high_precision for n in ("0", "1", "2")]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rep, f)
    dist.destroy_process_group()


def test_guard_decisions_are_the_same_on_every_process(tmp_path):
    """Each process reads its own data: a layer that crosses on one rank only is warned about and
    moved on every rank at the same step (else the replicas would compute differently)."""
    import json

    from tests.torchrun_util import free_port, spawn_ranks

    done = lambda: all((tmp_path / f"rank{r}.json").exists() for r in range(2))  # noqa: E731
    spawn_ranks(_guard_rank, (free_port(), str(tmp_path)), 2, done, port_arg=0)
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reps[0] == reps[1]
    moved = {"layer": "1", "signal": "input.underflow", "value": 0.5, "step": 2, "moved": True}
    assert reps[0]["events"] == [[], [moved], []] and reps[0]["moves"] == [moved]
    assert reps[0]["high_precision"] == [False, True, False]


def test_health_and_guard_records_reach_tensorboard(tmp_path):
    """metrics.jsonl's fp8_health rows become TensorBoard scalars (fp8_health/<layer>/<signal>,
    per operand where the signal is), None and inf left out; guard events become text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lowprec.train.metrics import MetricsWriter

    layer = "model.layers.1.mlp.down_proj"
    row = {"input": {"underflow": 0.12, "saturated": 0.0}, "max_to_rms": 250.0, "sqnr_db": None, "kurtosis": math.inf}
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=True, append=False)
    writer.write({"kind": "fp8_health", "step": 10, "layers": {layer: row}})
    event = {"layer": layer, "signal": "input.underflow", "value": 0.12, "step": 10, "moved": True}
    writer.write({"kind": "fp8_guard", **event})
    writer.close()
    ev = EventAccumulator(str(tmp_path / "runs"), size_guidance={"tensors": 0})
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    assert tags == {f"fp8_health/{layer}/{k}" for k in ("input/underflow", "input/saturated", "max_to_rms")}, tags
    assert [round(e.value, 4) for e in ev.Scalars(f"fp8_health/{layer}/input/underflow")] == [0.12]
    texts = ev.Tags()["tensors"]
    assert any("fp8_guard" in t for t in texts), texts
