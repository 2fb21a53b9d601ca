"""A skipped step leaves the FP8 scaling state as it found it; amax spikes are warned and counted.

A non-finite loss is known only after the forward has recorded its (finite) input and weight
amaxes, and a non-finite gradient after the backward has recorded the finite grad_output amaxes
of the layers the NaN did not reach. The step is skipped, so all of that must be undone: every
history, scale and step counter bit-identical to its value before the step, and the next
accepted step equal, bit for bit on CPU, to that of a run that never saw the bad batch. Both
through ``Accelerator`` and through ``lowprec train``; fresh random data each time.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from lowprec import Accelerator
from lowprec import fp8 as fp8_engine
from lowprec.kwargs import NativeRecipeKwargs

DIM = 64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = ("fp8_amax_history", "fp8_scale", "fp8_step", "fp8_sr_state")  # what a checkpoint keeps


def _setup(recipe: str = "delayed", accumulate: int = 1, **fields):
    torch.manual_seed(0)
    acc = Accelerator(
        mixed_precision="fp8",
        gradient_accumulation_steps=accumulate,
        kwargs_handlers=[NativeRecipeKwargs(recipe=recipe, overrides=fields)],
    )
    # the first and last Linear stay high precision (the engine's default): two FP8 layers
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(DIM, DIM), nn.ReLU())][:-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _state(model) -> dict[str, torch.Tensor]:
    out = {n: b.detach().clone() for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith(STATE)}
    assert out, "no FP8 scaling state to check"
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _step(acc, model, opt, xs, site=None):
    """One optimizer step over the micro-batches ``xs``; ``site`` poisons the last one."""
    for i, x in enumerate(xs):
        with acc.accumulate(model):
            loss = model(x).float().pow(2).mean()
            last = i == len(xs) - 1
            if last and site == "loss":
                loss = loss + float("nan")  # the forward ran on finite data: finite amaxes recorded
            acc.backward(loss)
            if last and site == "gradient":
                next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
            opt.step()
            opt.zero_grad()
    return acc.optimizer_step_was_skipped


@pytest.mark.parametrize(
    "recipe, accumulate, fields",
    [
        ("delayed", 1, {}),
        ("delayed", 2, {"amax_compute_algo": "max", "amax_history_len": 4}),
        ("delayed", 1, {"interval": 2}),
        ("nvfp4", 1, {}),  # its stochastic-rounding stream position is state too
    ],
)
@pytest.mark.parametrize("site", ["loss", "gradient"])
def test_a_skipped_step_leaves_the_fp8_state_bitwise_and_the_next_step_as_if_never_seen(
    recipe, accumulate, fields, site
):
    torch.manual_seed(11)
    batches = [[torch.randn(16, DIM) for _ in range(accumulate)] for _ in range(5)]
    acc, model, opt = _setup(recipe, accumulate, **fields)
    for xs in batches[:2]:
        assert not _step(acc, model, opt, xs)
    before = _state(model)
    assert _step(acc, model, opt, batches[2], site), "the poisoned step was not skipped"
    assert _same(_state(model), before), "the skipped step changed the FP8 scaling state"
    for xs in batches[3:]:
        assert not _step(acc, model, opt, xs)

    ref_acc, ref_model, ref_opt = _setup(recipe, accumulate, **fields)  # never sees batches[2]
    for xs in batches[:2] + batches[3:]:
        assert not _step(ref_acc, ref_model, ref_opt, xs)
    assert _same(_state(model), _state(ref_model))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_state_loaded_between_steps_is_what_a_later_skip_keeps(tmp_path):
    """A checkpoint loaded after some steps: a skip right after it restores the loaded state,
    not the one the copy held before the load."""
    torch.manual_seed(12)
    xs = [[torch.randn(16, DIM)] for _ in range(4)]
    acc, model, opt = _setup()
    _step(acc, model, opt, xs[0])
    acc.save_state(str(tmp_path / "ckpt"))
    saved = _state(model)
    _step(acc, model, opt, xs[1])
    acc.load_state(str(tmp_path / "ckpt"))
    assert _same(_state(model), saved)
    assert _step(acc, model, opt, xs[2], "loss")
    assert _same(_state(model), saved)


def _spike(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 0] = 1e30  # finite; the FP8 layer after the first (high-precision) Linear sees ~1e29
    return x


def test_an_amax_spike_is_warned_once_per_layer_and_counted(caplog):
    torch.manual_seed(13)
    xs = [torch.randn(16, DIM) for _ in range(7)]
    acc, model, opt = _setup("delayed", amax_compute_algo="max", amax_history_len=8)
    inner = acc.unwrap_model(model)
    for x in xs[:3]:
        assert not _step(acc, model, opt, [x])
    counts = lambda: {k: {op: v[op]["amax_spikes"] for op in v} for k, v in fp8_engine.telemetry(inner).items()}  # noqa: E731
    assert all(n == 0 for ops in counts().values() for n in ops.values())
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        assert _step(acc, model, opt, [_spike(xs[3])], "loss")  # spiked, then skipped: discarded, not counted
        assert counts()["2"]["input"] == 0
        assert not _step(acc, model, opt, [_spike(xs[4])])  # the delayed scale clips it: the step runs
        assert not _step(acc, model, opt, [xs[5]])
        assert not _step(acc, model, opt, [_spike(xs[6])])  # the history already holds 1e29: no spike
    got = counts()
    assert got["2"] == {"input": 1, "weight": 0, "grad_output": 0}
    for layer in ("2", "4"):  # the spike may reach the second FP8 layer too: warned exactly when counted
        warned = [r.getMessage() for r in caplog.records if f"FP8 {layer} " in r.getMessage()]
        assert len(warned) == (1 if any(got[layer].values()) else 0), warned
    warned = next(r.getMessage() for r in caplog.records if "FP8 2 input: amax " in r.getMessage())
    amax, before = (float(warned.split(k)[1].split()[0]) for k in ("input: amax ", "history maximum of "))
    assert amax > 2**10 * before and "amax_history_len steps" in warned
    history = inner[2].fp8_amax_history_input
    assert history.amax() > 1e28  # the spike is in the history: the scale is pinned by it


def test_trainer_skipped_step_leaves_the_fp8_state_and_the_run_as_if_the_batch_never_came(monkeypatch):
    """``lowprec train``: a batch of fresh random tokens is slipped into the stream at step 3
    and its loss made NaN after a full forward. The FP8 state at the next forward equals the
    state at that forward's start, and every later logged loss and the final weights equal
    those of a run without that batch."""
    from lowprec.train import data as train_data
    from lowprec.train import model as train_model
    from lowprec.train.config import load_config
    from lowprec.train.trainer import train

    bad_at = 2  # 0-based index of the optimizer step that gets the extra batch
    calls, seen = [0], {}
    real_forward = train_model.LlamaForCausalLM.forward
    real_forever = train_data.ShardedEpochs.forever
    gen = torch.Generator().manual_seed(14)

    def forward(self, *args, **kwargs):
        if not self.training:
            return real_forward(self, *args, **kwargs)
        n = calls[0]
        calls[0] += 1
        if n in (bad_at, bad_at + 1):
            seen[n] = _state(self)
        out = real_forward(self, *args, **kwargs)
        return out._replace(loss=out.loss + float("nan")) if n == bad_at and poison[0] else out

    def forever(self):
        for i, batch in enumerate(real_forever(self)):
            if i == bad_at and poison[0]:
                ids = torch.randint(0, 256, batch["input_ids"].shape, generator=gen)
                yield {"input_ids": ids, "labels": ids.clone()}
            yield batch

    poison = [True]
    monkeypatch.setattr(train_model.LlamaForCausalLM, "forward", forward)
    monkeypatch.setattr(train_data.ShardedEpochs, "forever", forever)
    base = {
        "fp8_recipe": {"name": "delayed", "amax_compute_algo": "max", "amax_history_len": 4},
        "eval_steps": None,
        "save_steps": None,
        "logging_steps": 1,
        "use_tensorboard": False,
        "progress_bar": False,
        "warmup_steps": 0,
        "lr_scheduler": "constant",
    }
    tiny = os.path.join(ROOT, "examples", "tiny.yaml")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        bad = train(load_config(tiny, {**base, "max_steps": 7, "output_dir": os.path.join(d, "bad")}))
        assert _same(seen[bad_at], seen[bad_at + 1]), "the skipped step changed the FP8 scaling state"
        poison[0], calls[0] = False, 0
        ref = train(load_config(tiny, {**base, "max_steps": 6, "output_dir": os.path.join(d, "ref")}))
        from safetensors.torch import load_file

        bad_w = load_file(os.path.join(d, "bad", "model.safetensors"))
        ref_w = load_file(os.path.join(d, "ref", "model.safetensors"))
    bad_losses, ref_losses = dict(bad.train_losses), dict(ref.train_losses)
    assert bad_losses[bad_at + 1] != bad_losses[bad_at + 1]  # the NaN step, logged as such
    # after the skipped step the bad run is one step behind the reference, loss for loss
    assert [bad_losses[s + 1] for s in range(bad_at + 1, 7)] == [ref_losses[s] for s in range(bad_at + 1, 7)]
    assert bad_w.keys() == ref_w.keys() and all(torch.equal(bad_w[k], ref_w[k]) for k in bad_w)
