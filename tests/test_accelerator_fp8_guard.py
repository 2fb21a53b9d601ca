"""The FP8 guard in a script on the Accelerate API (issue 27): ``NativeRecipeKwargs(fp8_guard=...)``.

The injected outlier is benchmarks/fp8_guard_repro.py's (``inject``: one input channel of
``model.layers.1.mlp.down_proj`` grows to 2**bits, that weight column shrinks by the same factor,
so the model computes the same function and only that layer's FP8 GEMM suffers), on the
built-in llama-tiny, trained through ``lowprec.Accelerator`` with random tokens.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch

import lowprec.fp8 as fp8
from lowprec import Accelerator
from lowprec.kwargs import AORecipeKwargs, MSAMPRecipeKwargs, NativeRecipeKwargs, TERecipeKwargs
from lowprec.train.model import LlamaConfig, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from fp8_guard_repro import LAYER, inject  # noqa: E402

# the outlier reaches 2**30 by step 4; checks every 2 optimizer steps, 2 in a row: the layer's
# episode starts at step 4
GUARD = dict(fp8_guard_patience=2, fp8_health_every=2, fp8_health_sqnr_every=2)


def _batch(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 256, (2, 32), generator=g)
    return {"input_ids": ids, "labels": ids}


def _prepare(tmp_path=None, accumulate: int = 1, **fields):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_name("llama-tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = Accelerator(
        mixed_precision="fp8",
        cpu=True,
        gradient_accumulation_steps=accumulate,
        project_dir=None if tmp_path is None else str(tmp_path),
        kwargs_handlers=[NativeRecipeKwargs(recipe="tensorwise", **fields)],
    )
    model, opt = acc.prepare(model, opt)
    state = {"step": 0}
    inject(acc.unwrap_model(model), state, bits=30.0, steps=4)
    return acc, model, opt, state


def _train(acc, model, opt, state, steps, start=0, save_at=None, path=None):
    """Optimizer steps ``start+1 .. steps``; per step its loss and the layers in bf16 after it."""
    out = []
    for step in range(start + 1, steps + 1):
        state["step"] = step
        loss = model(**_batch(step)).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), _moved(acc, model)))
        if step == save_at:
            acc.save_state(path)
    return out


def _moved(acc, model) -> list[str]:
    inner = acc.unwrap_model(model)
    return [n for n, m in inner.named_modules() if isinstance(m, fp8.Float8Linear) and m.high_precision]


def _guard_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "fp8_guard:" in r.getMessage()]


def test_act_moves_the_injected_layer_and_only_it(caplog):
    acc, model, opt, state = _prepare(fp8_guard="act", **GUARD)
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        seen = _train(acc, model, opt, state, 8)
    assert [moved for _, moved in seen] == [[]] * 3 + [[LAYER]] * 5  # moved after step 4's check
    (line,) = _guard_lines(caplog)
    assert line.startswith(f"lowprec: fp8_guard: {LAYER}: moved to high precision (bf16) at step 4: input.")
    health = acc.fp8_health(model)
    assert health.steps == 8
    assert health.monitor.moved_layers() == [LAYER]
    assert [r["kind"] for r in health.records] == ["fp8_health"]  # step 8's check: no new event
    assert LAYER in health.records[0]["layers"] and health.records[0]["step"] == 8


def test_warn_logs_the_layer_and_moves_nothing(caplog):
    acc, model, opt, state = _prepare(fp8_guard="warn", **GUARD)
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        seen = _train(acc, model, opt, state, 6)
    assert all(moved == [] for _, moved in seen)
    (line,) = _guard_lines(caplog)  # once per episode
    assert f"fp8_guard: {LAYER}: FP8 numerics unhealthy at step 4: input." in line
    assert acc.fp8_health(model).monitor.guard.events[0]["layer"] == LAYER


def _grads_after(steps: int, **fields):
    acc, model, opt, state = _prepare(**fields)
    losses = [loss for loss, _ in _train(acc, model, opt, state, steps - 1)]
    state["step"] = steps
    loss = model(**_batch(steps)).loss
    acc.backward(loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return acc, losses + [loss.item()], grads, dict(model.named_parameters())


def test_off_is_bit_identical_to_a_run_without_the_fields():
    base_acc, base_losses, base_grads, base_params = _grads_after(4)
    for fields in ({"fp8_guard": "off"}, {"fp8_guard": False, "fp8_guard_patience": 5}):
        acc, losses, grads, params = _grads_after(4, **fields)
        assert acc.fp8_health(next(iter(acc._models))) is None  # nothing attached
        assert losses == base_losses
        assert grads.keys() == base_grads.keys()
        assert all(torch.equal(grads[k], base_grads[k]) for k in grads)
        assert all(torch.equal(params[k], base_params[k]) for k in params)
    # fp8_health alone records signals and changes no value either
    acc, losses, grads, _ = _grads_after(4, fp8_health=True, fp8_health_every=1)
    assert acc.fp8_health(acc._models[0]).monitor.guard is None and losses == base_losses
    assert all(torch.equal(grads[k], base_grads[k]) for k in grads)


def test_save_and_load_state_keep_the_move_and_resume_exactly(tmp_path, caplog):
    path = str(tmp_path / "ckpt")
    acc, model, opt, state = _prepare(fp8_guard="act", **GUARD)
    full = _train(acc, model, opt, state, 10, save_at=6, path=path)
    saved = json.loads(open(os.path.join(path, "fp8_health_0.json")).read())
    assert saved["steps"] == 6 and [m["layer"] for m in saved["monitor"]["moved"]] == [LAYER]

    acc2, model2, opt2, state2 = _prepare(fp8_guard="act", **GUARD)
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        acc2.load_state(path)
    assert _moved(acc2, model2) == [LAYER]  # before any step: the checkpoint's move
    assert any("stay moved: " + LAYER in line for line in _guard_lines(caplog))
    resumed = _train(acc2, model2, opt2, state2, 10, start=6)
    assert resumed == full[6:]  # losses bit for bit, and the same layers in bf16 at every step
    a, b = (x.fp8_health(m).monitor.state_dict() for x, m in ((acc, model), (acc2, model2)))
    # the same guard state; only the moved layer's telemetry differs: it is stale (the layer casts
    # nothing) and not checkpointed (a non-persistent buffer), so its last reading is not compared
    stale = a["previous"].pop(LAYER), b["previous"].pop(LAYER)
    assert a == b and stale[0]["max_to_rms"] == stale[1]["max_to_rms"]

    # the move is kept even when the resumed script runs without the guard
    acc3, model3, opt3, state3 = _prepare()
    acc3.load_state(path)
    assert _moved(acc3, model3) == [LAYER]
    assert _train(acc3, model3, opt3, state3, 10, start=6) == full[6:]  # no check moved anything since


def test_accumulation_micro_steps_and_skipped_steps_are_not_checks():
    acc, model, opt, state = _prepare(accumulate=2, fp8_health=True, fp8_health_every=1)
    health = acc.fp8_health(model)
    checked = []
    for micro in range(1, 7):  # 3 optimizer steps
        with acc.accumulate(model):
            loss = model(**_batch(micro)).loss
            if micro == 4:  # the second optimizer step's loss is not finite: skipped
                loss = loss * float("nan")
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        checked.append(health.records[0]["step"] if health.records else None)
    assert health.steps == 2  # steps 1 and 3 ran; the skipped one is not a step
    assert checked == [None, 1, 1, 1, 1, 2]


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"fp8_guard": True}, "fp8_guard=True is ambiguous; use fp8_guard='warn' (log) or fp8_guard='act'"),
        ({"fp8_guard": "ack"}, "fp8_guard='ack' is not a guard mode; use off, warn, act"),
        ({"fp8_guard_patience": 0}, "fp8_guard_patience=0 is not an integer >= 1"),
        ({"fp8_health_every": 2.5}, "fp8_health_every=2.5 is not an integer >= 1"),
        ({"fp8_health_sqnr_every": True}, "fp8_health_sqnr_every=True is not an integer >= 1"),
        ({"fp8_guard": "act", "fp8_guard_recover_after": 0}, "fp8_guard_recover_after=0 is not an integer >= 1"),
        (
            {"fp8_guard": "warn", "fp8_guard_recover_after": 3},
            "fp8_guard_recover_after=3 moves layers back to FP8, but fp8_guard='warn' moves none; set fp8_guard='act'",
        ),
        (
            {"fp8_guard": "act", "fp8_guard_thresholds": {"underflw": 0.1}},
            "fp8_guard_thresholds.underflw: unknown signal (did you mean 'underflow'?)",
        ),
        ({"fp8_guard_thresholds": {"sqnr_db": float("nan")}}, "fp8_guard_thresholds.sqnr_db: expected a finite number"),
        (
            {"fp8_guard": "warn", "fp8_health": False},
            "fp8_guard='warn' reads the health signals that fp8_health=False turns off",
        ),
        ({"fp8_health": "yes"}, "fp8_health='yes' is not True, False or None"),
    ],
)
def test_bad_values_are_one_clear_error_naming_the_field(fields, expected):
    with pytest.raises(ValueError) as err:
        NativeRecipeKwargs(**fields)
    text = str(err.value)
    assert text.startswith("NativeRecipeKwargs: ") and expected in text and "\n" not in text, text


@pytest.mark.parametrize("cls", [TERecipeKwargs, AORecipeKwargs, MSAMPRecipeKwargs])
def test_other_backends_refuse_the_guard_in_one_line(cls):
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\(fp8_health=\.\.\.\): the FP8 guard and health signals"):
        cls(fp8_health=True)
    assert cls() is not None  # without the fields: as before


WORKER = """
import json, os, sys
import torch
from torch import nn
import lowprec.fp8 as fp8
from lowprec import Accelerator
from lowprec.kwargs import NativeRecipeKwargs

out = sys.argv[1]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 16))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
acc = Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[NativeRecipeKwargs(
    recipe="tensorwise", skip_first_last=False, fp8_guard="act", fp8_guard_patience=2, fp8_health_every=1)])
model, opt = acc.prepare(model, opt)
inner = acc.unwrap_model(model)

def outlier(module, args):  # only rank 1's data: one input channel of layer 2 at 2**20
    x = args[0]
    if rank != 1:
        return None
    m = torch.ones(x.shape[-1], dtype=x.dtype)
    m[3] = 2.0 ** 20
    return (x + (x * (m - 1)).detach(),)

inner[2].register_forward_pre_hook(outlier)
moved = []
for step in range(1, 5):
    g = torch.Generator().manual_seed(10 * step + rank)
    loss = model(torch.randn(8, 32, generator=g)).float().pow(2).mean() * 1e-6
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    moved.append([n for n, m in inner.named_modules() if isinstance(m, fp8.Float8Linear) and m.high_precision])
rep = {"moved": moved, "moves": acc.fp8_health(model).monitor.moves()}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(rep, f)
acc.end_training()
"""


def test_two_processes_move_the_same_layer_at_the_same_step(tmp_path):
    """Only rank 1 sees the outlier: the crossing is agreed (one all_gather_object per check),
    so both ranks move layer 2 after step 2, and DDP's replicas keep computing alike."""
    from tests.torchrun_util import run_ranks

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")]))
    run_ranks(str(script), [str(tmp_path)], 2, env, lambda: all((tmp_path / f"rank{r}.json").exists() for r in (0, 1)))
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reps[0] == reps[1]
    assert reps[0]["moved"] == [[], ["2"], ["2"], ["2"]]
    assert [m["layer"] for m in reps[0]["moves"]] == ["2"]
