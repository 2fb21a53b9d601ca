"""Reliability table 2b: the non-finite guard inside DeepSpeed ZeRO engines (issue 10).

DeepSpeed runs its own optimizer step; lowprec's ``DeepSpeedOptimizer`` wrapper counts each
accumulation boundary DeepSpeed refused (``engine.was_step_applied()``), logs it and stops after
``max_consecutive_skipped_steps``; ``Accelerator.backward`` turns a non-finite loss into NaN
gradients so that ``loss + inf`` (finite gradients) is refused as well. Under ZeRO-3 the
parameters are empty placeholders outside forward: the save-time check reads each process's
partition (``ds_tensor``), so a NaN model is still never saved.

One process, in-process, DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``), tiny models.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

from lowprec import Accelerator
from lowprec.errors import NonFiniteError
from lowprec.group_lifetime import forget_deepspeed_groups
from lowprec.utils import DeepSpeedPlugin

DIM = 32


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_process_group():
    """Overrides conftest's per-test teardown: DeepSpeed caches a clone of the world group
    (``deepspeed.utils.groups``), so its engines need one process group for the whole module;
    it is destroyed once, after the last test here."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
        forget_deepspeed_groups()


def _setup(stage: int, precision: str, zero: Optional[dict] = None, **kw):
    torch.manual_seed(0)
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": stage, **(zero or {})}})
    acc = Accelerator(mixed_precision=precision, deepspeed_plugin=plugin, **kw)
    # four Linear layers: the middle two run FP8 under fp8 (first and last stay high precision)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(DIM, DIM), nn.ReLU())][:-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _weights(model) -> list[torch.Tensor]:
    """This process's copy of every parameter (its partition under ZeRO-3)."""
    return [getattr(p, "ds_tensor", p).detach().float().clone() for p in model.parameters()]


def _step(acc, model, opt, poison: str = "") -> bool:
    x = torch.randn(4, DIM, dtype=torch.bfloat16)
    loss = model(x).float().pow(2).mean()
    if poison == "nan":  # NaN gradients
        loss = loss * float("nan")
    elif poison == "loss+inf":  # finite gradients, non-finite loss
        loss = loss + float("inf")
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return acc.optimizer_step_was_skipped


@pytest.mark.parametrize("stage, precision", [(2, "bf16"), (2, "fp8"), (3, "bf16"), (3, "fp8")])
def test_poisoned_steps_are_skipped_counted_and_stop_the_run(ds_env, stage, precision, caplog):
    acc, model, opt = _setup(stage, precision, max_consecutive_skipped_steps=3)
    assert type(opt.optimizer).__name__ == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")
    assert not _step(acc, model, opt)
    for poison in ("nan", "loss+inf"):
        before = _weights(model)
        assert _step(acc, model, opt, poison), poison
        assert all(torch.equal(a, b) for a, b in zip(before, _weights(model))), f"{poison}: weights changed"
    before = _weights(model)
    assert not _step(acc, model, opt)  # a clean step updates again and resets the run of skips
    after = _weights(model)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.isfinite(w).all() for w in after)
    assert acc.skipped_steps == 2 and acc.nonfinite.optimizer_steps == 4
    skips = [r.getMessage() for r in caplog.records if "step skipped" in r.getMessage()]
    assert len(skips) == 2 and "optimizer step 2:" in skips[0] and "optimizer step 3:" in skips[1]
    if precision == "fp8":
        bufs = [b for n, b in model.named_buffers() if "fp8" in n]
        assert bufs and all(torch.isfinite(b).all() for b in bufs)
    _step(acc, model, opt, "nan")
    _step(acc, model, opt, "loss+inf")
    with pytest.raises(NonFiniteError, match="3 consecutive optimizer steps"):
        _step(acc, model, opt, "nan")
    assert all(torch.isfinite(w).all() for w in _weights(model))


def test_accumulation_counts_boundaries_only(ds_env):
    """With 2 micro-batches per step, a NaN micro-batch poisons its optimizer step, counted once."""
    acc, model, opt = _setup(2, "bf16", gradient_accumulation_steps=2)
    for poison in ("nan", "", "", ""):
        _step(acc, model, opt, poison)
    assert acc.skipped_steps == 1 and acc.nonfinite.optimizer_steps == 2 and not acc.optimizer_step_was_skipped


def test_zero3_never_saves_a_nonfinite_model(ds_env, tmp_path):
    # persistence threshold 0: every parameter is partitioned (small ones are kept whole otherwise)
    acc, model, opt = _setup(3, "bf16", zero={"stage3_param_persistence_threshold": 0})
    _step(acc, model, opt)
    assert all(p.numel() == 0 for p in model.parameters())  # placeholders: the old check saw nothing
    acc.nonfinite.check_model(model, "clean")  # finite partitions pass
    with torch.no_grad():
        list(model.parameters())[2].ds_tensor.view(-1)[0] = float("nan")
    for save in (
        lambda: acc.save_state(str(tmp_path / "ckpt")),
        lambda: acc.save_model(model, str(tmp_path / "export")),
    ):
        with pytest.raises(NonFiniteError, match=r"module\.2\.weight holds NaN/inf"):
            save()
    assert not any(tmp_path.iterdir())


def test_a_config_that_switches_deepspeeds_check_off_is_an_error(ds_env):
    acc = Accelerator(
        mixed_precision="bf16",
        deepspeed_plugin=DeepSpeedPlugin(
            hf_ds_config={"bf16": {"check_grad_overflow": False}, "zero_optimization": {"stage": 2}}
        ),
    )
    model = nn.Linear(DIM, DIM)
    with pytest.raises(ValueError, match="bf16.check_grad_overflow=false.*skip_nonfinite_steps=False"):
        acc.prepare(model, torch.optim.AdamW(model.parameters()))


def test_a_zero3_checkpoint_loaded_without_deepspeed_is_one_line(ds_env, tmp_path):
    """load_state of a ZeRO-3 checkpoint into an Accelerator without DeepSpeed said
    'checkpoint file .../model_0.safetensors is missing; the checkpoint is incomplete' on each
    rank; it now says the checkpoint was saved under DeepSpeed and how to resume it. A
    checkpoint saved without DeepSpeed loaded under it is named the same way."""
    from lowprec.errors import CheckpointError

    acc, model, opt = _setup(3, "bf16")
    _step(acc, model, opt)
    acc.save_state(str(tmp_path / "zero3"))
    plain = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(DIM, DIM), nn.ReLU())][:-1])
    net, popt = plain.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    with pytest.raises(
        CheckpointError, match=r"zero3 was saved under DeepSpeed \(.*deepspeed_0/.*\): resume it with.*\(ZeRO stage 3\)"
    ):
        plain.load_state(str(tmp_path / "zero3"))
    plain.save_state(str(tmp_path / "plain"))
    with pytest.raises(CheckpointError, match=r"plain was saved without DeepSpeed .*: resume it without DeepSpeed$"):
        acc.load_state(str(tmp_path / "plain"))


def test_a_checkpoint_of_another_zero_stage_is_one_line(ds_env, tmp_path):
    """A ZeRO-3 checkpoint loaded under ZeRO-2 (or the reverse) stopped in DeepSpeed with a bare
    ``AssertionError``; now one line naming both stages. Stages 1 and 2 share one file format and
    load each other's checkpoints. A checkpoint without lowprec's record of the stage (an older
    one) is recognised by DeepSpeed's file names."""
    import json

    from lowprec.errors import CheckpointError

    for saved, other in ((3, 2), (2, 3)):
        acc, model, opt = _setup(saved, "bf16")
        _step(acc, model, opt)
        acc.save_state(str(tmp_path / f"z{saved}"))
        acc2, _, _ = _setup(other, "bf16")
        with pytest.raises(
            CheckpointError,
            match=rf"saved under DeepSpeed ZeRO stage {saved}, whose files DeepSpeed ZeRO stage {other} cannot",
        ):
            acc2.load_state(str(tmp_path / f"z{saved}"))
    meta_path = tmp_path / "z2" / "lowprec_state.json"
    meta = json.loads(meta_path.read_text())
    assert meta["deepspeed_zero_stages"] == [2]
    meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "deepspeed_zero_stages"}))
    with pytest.raises(CheckpointError, match=r"ZeRO stage 1 or 2, whose files DeepSpeed ZeRO stage 3 cannot"):
        acc2.load_state(str(tmp_path / "z2"))  # acc2 runs ZeRO-3
    acc1, model1, opt1 = _setup(1, "bf16")
    acc1.load_state(str(tmp_path / "z2"))  # 2 -> 1 loads
    before = _weights(model1)
    assert not _step(acc1, model1, opt1)  # stepped
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(model1)))
