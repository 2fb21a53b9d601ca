"""fp8_guard_scope: gemm (issue 27): act moves only the GEMMs that read the unhealthy operand
(x -> fprop, wgrad; W -> fprop, dgrad; dY -> dgrad, wgrad; SQNR -> fprop), per layer, recorded
with the GEMMs, restored on resume and moved back exactly."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn

import lowprec.fp8 as fp8
from lowprec.cli.main import main
from lowprec.fp8.observe.guard import Guard, HealthMonitor, Thresholds
from lowprec.fp8_kwargs import NativeRecipeKwargs
from lowprec.guard_moves import gemms_of_signal, moved_gemms, moved_layers
from lowprec.train.config import load_config, parse_config
from lowprec.train.metrics import read_metrics
from lowprec.train.trainer import train

from test_fp8_guard import TINY, _outlier_on, _step  # noqa: E402
from test_fp8_guard_runs import ACT, REPRO_LAYER, _repro  # noqa: E402

ALL_FP8 = {"fprop": False, "dgrad": False, "wgrad": False}


def _model(seed=0, recipe="tensorwise"):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16))
    fp8.convert(m, recipe=recipe, skip_first_last=False)
    return m


def test_the_signal_to_gemm_mapping():
    assert gemms_of_signal("input.underflow") == gemms_of_signal("input.max_to_rms") == ("fprop", "wgrad")
    assert gemms_of_signal("weight.saturated") == ("fprop", "dgrad")
    assert gemms_of_signal("grad_output.underflow") == gemms_of_signal("grad_output.saturated") == ("dgrad", "wgrad")
    assert gemms_of_signal("sqnr_db") == ("fprop",)
    # a move without "gemms" (scope layer, or a checkpoint from before scopes) is the whole layer
    moves = [
        {"layer": "a", "signal": "sqnr_db", "value": 1.0, "step": 1, "moved": True},
        {
            "layer": "b",
            "signal": "grad_output.underflow",
            "value": 0.5,
            "step": 2,
            "moved": True,
            "gemms": ["dgrad", "wgrad"],
        },
        {"layer": "b", "signal": "input.underflow", "value": 0.5, "step": 3, "moved": True, "gemms": ["fprop"]},
    ]
    assert moved_gemms(moves) == {"a": ("fprop", "dgrad", "wgrad"), "b": ("fprop", "dgrad", "wgrad")}
    back = {"layer": "b", "signal": "grad_output.underflow", "value": 0.5, "step": 4, "moved": True}
    back.update(direction="to_fp8", checks=2, gemms=["dgrad", "wgrad"])
    assert moved_gemms([*moves, back]) == {"a": ("fprop", "dgrad", "wgrad"), "b": ("fprop",)}
    assert moved_layers([*moves, back]) == ["a", "b"]


def test_a_per_gemm_move_runs_the_other_gemms_in_fp8_exactly():
    """dgrad and wgrad moved (a dY signal): the forward is bit for bit the FP8 layer's, the two
    backward GEMMs are the high-precision ones; the shared recipe is not changed."""
    m, ref = _model(), _model()
    layer, fp8_layer = m[1], ref[1]
    recipe_before = layer.recipe
    layer.set_high_precision_gemms(["dgrad", "wgrad"])
    assert layer.gemm_precision() == {"fprop": False, "dgrad": True, "wgrad": True}
    assert layer.recipe is recipe_before and recipe_before.override_linear_precision == (False, False, False)
    assert fp8_layer.gemm_precision() == ALL_FP8
    x = torch.randn(8, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa), fp8_layer(xb)
    assert torch.equal(ya, yb)  # fprop: the pure FP8 GEMM
    assert not torch.equal(ya, nn.functional.linear(x, layer.weight, layer.bias))
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    # dgrad and wgrad: float32 GEMMs (no autocast on CPU), not the FP8 layer's
    assert torch.allclose(xa.grad, dy @ layer.weight.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(layer.weight.grad, dy.t() @ x, rtol=1e-5, atol=1e-6)
    assert not torch.equal(xa.grad, xb.grad) and not torch.equal(layer.weight.grad, fp8_layer.weight.grad)

    # fprop and wgrad moved (an x signal): dgrad is the FP8 layer's, bit for bit
    m2, ref2 = _model(), _model()
    m2[1].set_high_precision_gemms(["fprop", "wgrad"])
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = m2[1](xa), ref2[1](xb)
    assert torch.allclose(ya, nn.functional.linear(x, m2[1].weight, m2[1].bias), rtol=1e-5, atol=1e-6)
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(xa.grad, xb.grad)  # dgrad: the pure FP8 GEMM
    assert torch.allclose(m2[1].weight.grad, dy.t() @ x, rtol=1e-5, atol=1e-6)
    m2[1].set_high_precision_gemms(())
    assert m2[1].gemm_precision() == ALL_FP8 and m2[1].high_precision_gemms == ()
    with pytest.raises(ValueError, match="unknown GEMM"):
        m2[1].set_high_precision_gemms(["bprop"])


def _side(**ops):
    row = {op: {"underflow": v} for op, v in ops.items()}
    return {**row, "side_cast": True}


def test_gemm_scope_moves_the_operands_gemms_adds_more_and_moves_them_back(caplog):
    import logging

    m = _model()
    layer = m[1]
    bad_dy = {"grad_output": {"underflow": 0.5}}
    g = Guard(m, mode="act", thresholds=Thresholds(patience=2, recover_after=2), scope="gemm")
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        assert g.check(1, {"1": bad_dy}) == []
        (ev,) = g.check(2, {"1": bad_dy})
    assert ev.gemms == ("dgrad", "wgrad") and not layer.high_precision
    assert layer.gemm_precision() == {"fprop": False, "dgrad": True, "wgrad": True}
    assert "moved dgrad, wgrad to high precision (bf16)" in caplog.records[-1].getMessage()
    assert g.moves()[-1]["gemms"] == ["dgrad", "wgrad"]
    # dY's signal is stale now (nothing casts dY): no new episode, nothing else moves
    for step in (3, 4, 5):
        assert g.check(step, {"1": bad_dy}) == []
    # x crosses too: its GEMMs still in FP8 (fprop) move; wgrad already had
    bad_x = {"input": {"underflow": 0.4}, "grad_output": {"underflow": 0.5}}
    g.check(6, {"1": bad_x})
    (ev2,) = g.check(7, {"1": bad_x})
    assert ev2.signal == "input.underflow" and ev2.gemms == ("fprop",)
    assert layer.gemm_precision() == {"fprop": True, "dgrad": True, "wgrad": True}
    # measured on the side: healthy twice in a row moves every moved GEMM back
    assert g.check(8, {"1": _side(input=0.0, grad_output=0.0)}) == []
    assert g.check(9, {"1": _side(input=0.0, grad_output=0.3)}) == []  # unhealthy: count back to 0
    assert g.check(10, {"1": _side(input=0.0, grad_output=0.0)}) == []
    (back,) = g.check(11, {"1": _side(input=0.0, grad_output=0.0)})
    assert back.direction == "to_fp8" and back.gemms == ("fprop", "dgrad", "wgrad") and back.checks == 2
    assert (back.signal, back.value) == ("grad_output.underflow", 0.5)  # the first move it undoes
    assert layer.gemm_precision() == ALL_FP8 and g.moves()[-1]["gemms"] == ["fprop", "dgrad", "wgrad"]
    assert moved_layers(g.moves()) == []
    assert m[0].gemm_precision() == m[2].gemm_precision() == ALL_FP8  # other layers untouched


def test_gemm_scope_sqnr_moves_fprop_and_a_move_back_restores_only_the_moved_gemms():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16))
    # rowwise_with_gw_hp: wgrad in high precision by the recipe; the guard's move is fprop only
    fp8.convert(m, recipe="rowwise_with_gw_hp", skip_first_last=False)
    g = Guard(m, mode="act", thresholds=Thresholds(patience=1, recover_after=1), scope="gemm")
    (ev,) = g.check(1, {"1": {"sqnr_db": 5.0}})
    assert ev.gemms == ("fprop",) and m[1].gemm_precision() == {"fprop": True, "dgrad": False, "wgrad": True}
    assert g.check(2, {"1": _side(input=0.0)}) == []  # the SQNR not sampled: nothing counts
    (back,) = g.check(3, {"1": {**_side(input=0.0), "sqnr_db": 30.0}})
    assert back.gemms == ("fprop",)
    assert m[1].gemm_precision() == {"fprop": False, "dgrad": False, "wgrad": True}  # the recipe's own stays
    # an x signal: fprop and wgrad read x, but wgrad is in high precision already: fprop moves
    g = Guard(m, mode="act", thresholds=Thresholds(patience=1), scope="gemm")
    (ev,) = g.check(4, {"0": {"input": {"saturated": 0.5}}})
    assert ev.gemms == ("fprop",) and m[0].high_precision_gemms == ("fprop",)
    assert g.check(5, {"0": {"input": {"saturated": 0.5}}}) == []  # nothing of x's left in FP8


def test_checkpoint_restores_per_gemm_moves_and_old_checkpoints_mean_the_whole_layer():
    m = _model()
    x = torch.randn(16, 32)
    hook = _outlier_on(m[2])
    monitor = HealthMonitor(m, "act", 1, 1, scope="gemm")
    monitor.arm(1)
    events = [r for r in monitor.check(1, _step(m, x)) if r["kind"] == "fp8_guard"]
    hook.remove()
    assert [(e["layer"], e["gemms"]) for e in events] == [("2", ["fprop", "wgrad"])]
    state = json.loads(json.dumps(monitor.state_dict()))
    fresh = _model(seed=1)
    fresh[1].set_high_precision_gemms(["fprop"])  # whatever a layer had, the checkpoint decides
    fresh[1].set_high_precision_gemms(())
    HealthMonitor(fresh, "act", 1, 1, scope="gemm").load_state_dict(state)
    assert [layer.gemm_precision() for layer in fresh] == [
        ALL_FP8,
        ALL_FP8,
        {"fprop": True, "dgrad": False, "wgrad": True},
    ]
    assert not fresh[2].high_precision
    # a checkpoint from before scopes (no "gemms"): the whole layer, under either scope
    old = {**state, "moved": [{k: v for k, v in mv.items() if k != "gemms"} for mv in state["moved"]]}
    for scope in ("layer", "gemm"):
        again = _model()
        HealthMonitor(again, "act", 1, 1, scope=scope).load_state_dict(old)
        assert again[2].high_precision and not again[1].high_precision


def test_layer_scope_records_no_gemms_and_moves_the_whole_layer():
    m = _model()
    g = Guard(m, mode="act", thresholds=Thresholds(patience=1))
    (ev,) = g.check(1, {"1": {"grad_output": {"underflow": 0.5}}})
    assert ev.gemms == () and "gemms" not in ev.to_dict() and m[1].high_precision
    assert m[1].high_precision_gemms == ()
    assert m[1].gemm_precision() == {"fprop": True, "dgrad": True, "wgrad": True}


def test_scope_on_the_accelerator_and_the_trainer_defaults():
    assert parse_config({"fp8": True}).fp8_guard_scope == "layer"
    assert parse_config({"fp8": True, "fp8_guard": "act", "fp8_guard_scope": "gemm"}).fp8_guard_scope == "gemm"
    assert NativeRecipeKwargs(fp8_guard="act", fp8_guard_scope="gemm").fp8_guard_scope == "gemm"
    with pytest.raises(ValueError, match=r"NativeRecipeKwargs: fp8_guard_scope='GEMM' is not a guard scope"):
        NativeRecipeKwargs(fp8_guard="act", fp8_guard_scope="GEMM")
    with pytest.raises(ValueError, match=r"fp8_guard_scope='gemm' says which GEMMs act moves, but fp8_guard='off'"):
        NativeRecipeKwargs(fp8_guard_scope="gemm")
    with pytest.raises(ValueError, match="guard scope must be layer or gemm"):
        Guard(_model(), mode="act", scope="op")


def test_fp8_callback_takes_the_scope():
    pytest.importorskip("transformers")
    from lowprec.integrations.transformers import FP8Callback

    assert FP8Callback(guard="act", guard_scope="gemm")._health_args[-1] == "gemm"
    with pytest.raises(ValueError, match=r"FP8Callback\(guard_scope='x'\)"):
        FP8Callback(guard="act", guard_scope="x")
    with pytest.raises(ValueError, match=r"FP8Callback\(guard_scope='gemm'\) says what act moves"):
        FP8Callback(guard="warn", guard_scope="gemm")


def test_reproducer_under_gemm_scope_moves_fprop_and_wgrad_of_the_injected_layer_only(tmp_path):
    """The injected outlier is in down_proj's input x: act (scope gemm) moves that layer's fprop
    and wgrad, its dgrad stays FP8, no other layer moves anything."""
    args = ["--steps", "8", "--check", "2", "--variants", "act", "--bits", "30", "--patience", "2"]
    run = _repro(tmp_path, *args, "--scope", "gemm")["act"]["1"]
    assert [(e["layer"], e["signal"].split(".")[0], e["gemms"]) for e in run["events"]] == [
        (REPRO_LAYER, "input", ["fprop", "wgrad"])
    ]
    assert run["gemm_precision"] == {REPRO_LAYER: {"fprop": True, "dgrad": False, "wgrad": True}}
    layer = run["gemm_precision"]  # scope layer, the same run: the whole layer
    whole = _repro(tmp_path, *args)["act"]["1"]
    assert "gemms" not in whole["events"][0] and whole["gemm_precision"] == {
        REPRO_LAYER: {"fprop": True, "dgrad": True, "wgrad": True}
    }
    assert set(layer) == set(whole["gemm_precision"])


def test_reproducer_under_gemm_scope_moves_the_gemms_back_once_the_outlier_fades(tmp_path):
    """As test_fp8_guard_runs' fade run (move at step 4, side casts healthy from step 12, M = 2),
    per GEMM: fprop and wgrad move, and the move back at step 14 restores exactly those two; the
    run ends with every GEMM of every layer in FP8."""
    args = ["--steps", "24", "--check", "2", "--variants", "act", "--bits", "30", "--patience", "2"]
    run = _repro(tmp_path, *args, "--grow", "0.25", "--fade", "0.3", "--recover-after", "2", "--scope", "gemm")
    run = run["act"]["1"]
    assert [(e["step"], e.get("direction"), e["gemms"]) for e in run["events"]] == [
        (4, None, ["fprop", "wgrad"]),
        (14, "to_fp8", ["fprop", "wgrad"]),
    ]
    assert run["moved_back"] == [[REPRO_LAYER, 14]] and run["gemm_precision"] == {}
    side = sorted(h["step"] for h in run["health"] if h["side_cast"])
    assert side == [6, 8, 10, 12, 14]  # measured on the side while its GEMMs were moved


def test_gemm_scope_run_resumes_bit_exactly_after_a_per_gemm_move(tmp_path):
    """lowprec train, fp8_guard_scope: gemm with the max-to-rms threshold of 4 (an x signal: fprop
    and wgrad move): the records and conversion report carry the GEMMs; a run resumed from step 4
    continues bit for bit (a GEMM in the wrong precision would change the losses)."""
    from safetensors.torch import load_file

    cfg = {**ACT, "fp8_guard_scope": "gemm"}
    ref = train(load_config(TINY, {**cfg, "output_dir": str(tmp_path / "ref")}))
    out = ref.output_dir
    moves = read_metrics(out, "fp8_guard")
    assert moves and all(r["gemms"] == ["fprop", "wgrad"] and r["signal"] == "input.max_to_rms" for r in moves)
    report = open(os.path.join(out, "fp8_conversion.txt")).read()
    assert all(f"step {r['step']}: {r['layer']}  fprop, wgrad (" in report for r in moves)
    assert "per GEMM, in bf16 at the end: " in report
    assert main(["report", out, "--layers", "3"]) == 0
    html = open(os.path.join(out, "health_report.html")).read()
    assert "moved to bf16 (fprop, wgrad)" in html
    assert [r for r in moves if r["step"] <= 4], moves
    res_dir = tmp_path / "res"
    shutil.copytree(os.path.join(out, "checkpoint-4"), res_dir / "checkpoint-4")
    res = train(load_config(TINY, {**cfg, "output_dir": str(res_dir), "resume_from_checkpoint": "auto"}))
    assert dict(res.train_losses) == {s: v for s, v in ref.train_losses if s > 4}
    a, b = load_file(os.path.join(out, "model.safetensors")), load_file(str(res_dir / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_metrics(str(res_dir), "fp8_guard") == [r for r in moves if r["step"] > 4]
    # the same run under scope layer moved whole layers: the GEMM choice is what differs
    whole = train(load_config(TINY, {**ACT, "output_dir": str(tmp_path / "whole")}))
    assert [(r["layer"], r["step"]) for r in read_metrics(whole.output_dir, "fp8_guard")] == [
        (r["layer"], r["step"]) for r in moves
    ]
    assert dict(whole.train_losses) != dict(ref.train_losses)
