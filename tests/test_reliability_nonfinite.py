"""Reliability table 2: NaN/inf injected into a step is skipped, for every precision.

Rows: ``<precision>-<site>-<value>``: precision in fp32, bf16, fp16 and every FP8 recipe; site
``activation`` (a forward hook poisons a hidden activation: the FP8 layer after it sees a NaN
input amax in forward and a NaN grad_output amax in backward), ``gradient`` (one gradient entry
poisoned after backward) or ``loss`` (the loss itself; ``loss + inf`` has finite gradients, so
only the loss check catches it); value nan or inf.

Each row: two clean steps, the poisoned step, one clean step. The poisoned step must be
skipped (weights bit-identical before and after it), counted, the weights and every FP8
scaling buffer finite afterwards, and the next clean step must update the weights again.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lowprec import Accelerator
from lowprec.errors import NonFiniteError
from lowprec.fp8.recipes import RECIPE_NAMES
from lowprec.kwargs import NativeRecipeKwargs

PRECISIONS = ["fp32", "bf16", "fp16"] + [f"fp8-{r}" for r in RECIPE_NAMES]
SITES = ["activation", "gradient", "loss"]
VALUES = {"nan": float("nan"), "inf": float("inf")}
DIM = 128  # blockwise tiles are 128 wide


def _accelerator(precision: str, **kw) -> Accelerator:
    if precision.startswith("fp8-"):
        return Accelerator(mixed_precision="fp8", kwargs_handlers=[NativeRecipeKwargs(recipe=precision[4:])], **kw)
    return Accelerator(mixed_precision={"fp32": "no"}.get(precision, precision), **kw)


def _setup(precision: str, **kw):
    torch.manual_seed(0)
    acc = _accelerator(precision, **kw)
    # first and last Linear stay high precision (the engine's default); the middle two run FP8
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(DIM, DIM), nn.ReLU())][:-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt, x, site=None, value=None):
    inner = acc.unwrap_model(model)
    hook = None
    if site == "activation":

        def poison(_m, _i, out):
            out = out.clone()
            out[0, 0] = value
            return out

        hook = inner[0].register_forward_hook(poison)
    try:
        loss = model(x).float().pow(2).mean()
        if site == "loss":
            loss = loss + value
        acc.backward(loss)
        if site == "gradient":
            next(p for p in inner.parameters() if p.grad is not None).grad.view(-1)[0] = value
        opt.step()
        opt.zero_grad()
    finally:
        if hook is not None:
            hook.remove()
    return acc.optimizer_step_was_skipped


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _fp8_buffers(model) -> dict[str, torch.Tensor]:
    return {
        n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith(("fp8_amax_history", "fp8_scale"))
    }


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_poisoned_step_is_skipped(precision, site, value):
    acc, model, opt = _setup(precision)
    torch.manual_seed(1)
    xs = [torch.randn(32, DIM) for _ in range(4)]
    assert not _step(acc, model, opt, xs[0]) and not _step(acc, model, opt, xs[1])
    before = _weights(model)
    assert _step(acc, model, opt, xs[2], site, VALUES[value]), "the poisoned step was not skipped"
    after = _weights(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step changed the weights"
    assert acc.skipped_steps == 1
    assert not _step(acc, model, opt, xs[3]), "the clean step after it was skipped"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, b.detach()) for a, b in zip(after, model.parameters())), "no update after the skip"
    buffers = _fp8_buffers(acc.unwrap_model(model))
    assert bool(buffers) == precision.startswith("fp8-delayed")
    for name, b in buffers.items():
        assert torch.isfinite(b).all(), f"{name} holds NaN/inf after the skipped step"


def test_each_skip_is_logged_once_with_its_step(caplog):
    acc, model, opt = _setup("bf16")
    x = torch.randn(32, DIM)
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        _step(acc, model, opt, x)
        _step(acc, model, opt, x, "loss", float("nan"))
    lines = [r.getMessage() for r in caplog.records if "step skipped" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("lowprec: optimizer step 2: ")


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8-delayed"])
def test_consecutive_skips_stop_the_run(precision, tmp_path):
    acc, model, opt = _setup(precision, max_consecutive_skipped_steps=2)
    x = torch.randn(32, DIM)
    _step(acc, model, opt, x)
    acc.save_state(str(tmp_path / "good"))
    _step(acc, model, opt, x, "loss", float("nan"))
    _step(acc, model, opt, x)  # a good step resets the count
    _step(acc, model, opt, x, "loss", float("nan"))
    with pytest.raises(NonFiniteError, match="2 consecutive optimizer steps"):
        _step(acc, model, opt, x, "loss", float("nan"))
    assert acc.skipped_steps == 3


def test_switched_off_the_weights_go_nan_and_are_never_saved(tmp_path):
    acc, model, opt = _setup("bf16", skip_nonfinite_steps=False)
    x = torch.randn(32, DIM)
    assert not _step(acc, model, opt, x, "gradient", float("nan"))
    assert not torch.isfinite(next(model.parameters())).all()
    with pytest.raises(NonFiniteError, match="not finite"):
        acc.save_state(str(tmp_path / "ckpt"))
    with pytest.raises(NonFiniteError, match="not finite"):
        acc.save_model(model, str(tmp_path / "export"))
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "export").exists()


@pytest.mark.parametrize("precision, extra", [("bf16", 1), ("fp16", 0)])
def test_the_check_adds_at_most_one_host_read_per_step(precision, extra, monkeypatch):
    """The guard's decision is one ``.item()`` per optimizer step (GradScaler makes the same one
    in ``scaler.step``); under fp16 the loss flag rides on the scaler's check: nothing added."""
    counts = {}
    for enabled in (False, True):
        acc, model, opt = _setup(precision, skip_nonfinite_steps=enabled)
        x = torch.randn(32, DIM)
        _step(acc, model, opt, x)  # warm-up (lazy optimizer state)
        n = 0
        real_item = torch.Tensor.item

        def item(self, _real=real_item):
            nonlocal n
            n += 1
            return _real(self)

        monkeypatch.setattr(torch.Tensor, "item", item)
        for _ in range(3):
            _step(acc, model, opt, x)
        monkeypatch.undo()
        counts[enabled] = n
    assert counts[True] - counts[False] == 3 * extra


# ----------------------------------------------------------------------------- the trainer
def test_trainer_diverging_run_stops_with_exit_3_and_saves_nothing_nonfinite(tmp_path, capsys):
    """learning_rate 1e30: the weights blow up after step 1; every later step is skipped, the
    run stops after 3 in a row (exit 3, one line naming the last good checkpoint and how to
    continue), metrics.jsonl counts the skips, and neither a checkpoint nor the exported model
    holds a NaN."""
    import json
    import os

    from safetensors.torch import load_file

    from lowprec.cli.main import main

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tiny.yaml")
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            tiny,
            "--learning_rate",
            "1e30",
            "--max_steps",
            "8",
            "--save_steps",
            "2",
            "--eval_steps",
            "null",
            "--output_dir",
            str(out),
            "--use_tensorboard",
            "false",
            "--quiet",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3
    assert err[-1].startswith("lowprec: stopped: 3 consecutive optimizer steps") and "Traceback" not in "".join(err)
    assert f"last good checkpoint: {out}" in err[-1] and "--resume_from_checkpoint auto" in err[-1]
    skips = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"skip"' in line]
    assert [r["step"] for r in skips] == [2, 3, 4]
    assert len([line for line in err if "step skipped" in line]) == 3  # logged once each
    assert not (out / "model.safetensors").exists() or all(
        torch.isfinite(t.float()).all() for t in load_file(str(out / "model.safetensors")).values()
    )
    for ckpt in out.glob("checkpoint-*"):
        for name, t in load_file(str(ckpt / "model_0.safetensors")).items():
            assert not t.is_floating_point() or torch.isfinite(t.float()).all(), (ckpt.name, name)


def test_two_process_fsdp2_run_stops_every_rank_with_exit_3_and_one_line(tmp_path):
    """The same divergence under `lowprec train --num_processes 2` (torchrun, gloo) with FSDP2:
    the shards decide together (an all-reduced flag), each skip is logged once (not once per
    rank), every rank stops at the same step with exit 3, and the run ends in one lowprec line
    naming the last good checkpoint and the 2-process command that continues; torchrun's
    failed-rank line and traceback do not appear."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    env.update(PYTHONPATH=os.path.join(root, "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowprec.cli.main",
            "train",
            os.path.join(root, "examples", "tiny.yaml"),
            "--num_processes",
            "2",
            "--fsdp_version",
            "2",
            "--learning_rate",
            "1e30",
            "--max_steps",
            "6",
            "--save_steps",
            "2",
            "--warmup_steps",
            "0",
            "--sequence_len",
            "16",
            "--micro_batch_size",
            "2",
            "--dataset_max_bytes",
            "20000",
            "--eval_steps",
            "null",
            "--use_tensorboard",
            "false",
            "--output_dir",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    ours = [line for line in proc.stderr.splitlines() if line.startswith("lowprec")]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert [line.split(":")[1] for line in ours] == [
        " optimizer step 2",
        " optimizer step 3",
        " optimizer step 4",
        " stopped",
    ], ours
    assert "3 consecutive optimizer steps" in ours[-1] and f"last good checkpoint: {out}/checkpoint-2" in ours[-1]
    assert ours[-1].endswith("--num_processes 2 --resume_from_checkpoint auto")
    # the worker that torchrun saw first ended with 3, not a signal (the others exit 3 on SIGTERM
    # too): the launcher exits with that worker's code (returncode 3 above; a signal would not be 3),
    # and torchrun's own "failed (exitcode: N)" log line is no longer printed beside the one line
    assert "exitcode:" not in proc.stderr
