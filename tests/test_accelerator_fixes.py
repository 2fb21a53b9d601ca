"""Regression tests for reviewer-found Accelerator bugs (one test per bug)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowprec import Accelerator
from lowprec.kwargs import GradientAccumulationPlugin
from lowprec.utils import set_seed

from tests.test_accelerator import ENV, clean  # noqa: F401  (autouse: no stray launch variables)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def loader(n: int, batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 16, generator=g)
    return DataLoader(TensorDataset(x, (x[:, :4]).argmax(1)), batch_size=batch_size)


class CountingSGD(torch.optim.SGD):
    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def test_sync_each_batch_keeps_the_accumulation_boundary():
    set_seed(0)
    plugin = GradientAccumulationPlugin(num_steps=4, sync_each_batch=True)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    base = mlp()
    inner = CountingSGD(base.parameters(), lr=0.1)
    model, opt, dl = acc.prepare(base, inner, loader(32, 4))
    entered = []
    acc.no_sync = lambda m: entered.append(m) or contextlib.nullcontext()  # sync_each_batch: never used
    syncs = []
    for x, y in dl:
        with acc.accumulate(model):
            acc.backward(nn.functional.cross_entropy(model(x), y))
            syncs.append(acc.sync_gradients)
            opt.step()
            opt.zero_grad()
    assert syncs == [False, False, False, True] * 2
    assert inner.steps == 2
    assert entered == []


def _shard(loader_, rank, world):
    from lowprec.utils.data_loader import DataLoaderShard, GradientState

    return DataLoaderShard.wrap(
        loader_, rank=rank, world_size=world, device=None, seed=0, gradient_state=GradientState()
    )


def test_one_process_keeps_the_short_last_batch():
    ds = TensorDataset(torch.arange(10))
    acc = Accelerator()
    dl = acc.prepare(DataLoader(ds, batch_size=4))
    got = [b[0].tolist() for b in dl]
    assert got == [b[0].tolist() for b in DataLoader(ds, batch_size=4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert acc.gather_for_metrics(torch.tensor([8, 9])).tolist() == [8, 9]


def test_padding_keeps_custom_batch_boundaries_and_remainder():
    ds = TensorDataset(torch.arange(9))
    custom = [[0, 1, 2], [3], [4, 5, 6, 7, 8]]  # uneven custom batch sampler
    loaders = [_shard(DataLoader(ds, batch_sampler=custom), r, 2) for r in range(2)]
    mine = [loaders[r]._local_batches() for r in range(2)]
    assert mine[0] == ([[0, 1, 2], [4, 5, 6, 7, 8]], 5)
    assert mine[1] == ([[3], [0, 1, 2]], 5)  # a whole batch, not a re-chunked index list
    # a plain sampler over 2 processes still fills the short last batch (equal shapes for gather),
    # and a missing batch takes the indices that follow, as Accelerate's BatchSamplerShard
    plain = [_shard(DataLoader(TensorDataset(torch.arange(10)), batch_size=4), r, 2)._local_batches() for r in range(2)]
    assert plain == [([[0, 1, 2, 3], [8, 9, 0, 1]], 2), ([[4, 5, 6, 7], [2, 3, 4, 5]], 2)]


def _trained(tmp_path):
    set_seed(3)
    acc = Accelerator()
    base = mlp()
    model, opt = acc.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1))
    return acc, model, opt


def _train_step(acc, model, opt):
    x = torch.randn(8, 16)
    acc.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_a_per_rank_buffer_of_another_shape_is_one_error(tmp_path, monkeypatch):
    """FSDP2 checkpoints hold each process's buffers in a file of its own; an earlier version put
    the experts' FP8 state there as the rank's slice, which on another process count has another
    shape: one line naming the file and the count that saved it, not a broadcast copy."""
    import json

    from safetensors.torch import save_file

    from lowprec.checkpoint import state
    from lowprec.errors import CheckpointError

    acc, model, opt = _trained(tmp_path)
    acc.unwrap_model(model).register_buffer("amax_history", torch.ones(4, 8))  # 8 experts' state
    out = acc.save_state(str(tmp_path / "ck"))
    save_file({"amax_history": torch.ones(4, 4)}, str(tmp_path / "ck" / "buffers_0_rank0.safetensors"))
    meta_path = tmp_path / "ck" / "lowprec_state.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "num_processes": 2}))
    monkeypatch.setattr(state, "_per_rank_buffers", lambda m: True)
    with pytest.raises(
        CheckpointError,
        match=r"buffers_0_rank0.safetensors holds amax_history of shape \(4, 4\), this model's is \(4, 8\) .* on 2 processes$",
    ):
        acc.load_state(out)


def test_load_state_on_another_num_processes_and_warns_on_missing_rng(tmp_path, caplog):
    """A full-state checkpoint (the whole model and optimizer state) saved by 4 processes loads
    on 1, with one line about the random states it takes."""
    import json

    from lowprec.logs import _LOGGED

    _LOGGED.clear()
    acc, model, opt = _trained(tmp_path)
    out = acc.save_state(str(tmp_path / "ck"))
    saved = _weights(model)
    meta_path = tmp_path / "ck" / "lowprec_state.json"
    meta = json.loads(meta_path.read_text())
    meta["num_processes"] = 4
    meta_path.write_text(json.dumps(meta))
    caplog.set_level("WARNING", logger="lowprec")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.load_state(out)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), saved))
    assert any("resumed on 1 processes from a checkpoint of 4" in r.getMessage() for r in caplog.records)
    meta["num_processes"] = 1
    meta_path.write_text(json.dumps(meta))
    (tmp_path / "ck" / "random_states_0.safetensors").unlink()
    acc.load_state(out)
    acc.load_state(out)
    hits = [r for r in caplog.records if "random_states_0.safetensors is missing" in r.getMessage()]
    assert len(hits) == 1


def test_interrupted_save_keeps_the_old_checkpoint_and_leaves_no_temp(tmp_path, monkeypatch):
    import lowprec.checkpoint.state as ckpt

    acc, model, opt = _trained(tmp_path)
    target = str(tmp_path / "ck")
    _train_step(acc, model, opt)
    acc.save_state(target)
    saved = _weights(model)
    _train_step(acc, model, opt)
    assert not all(torch.equal(a, b) for a, b in zip(saved, _weights(model)))

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    with monkeypatch.context() as m:
        m.setattr(ckpt, "save_optimizer", boom)
        with pytest.raises(OSError, match="simulated"):
            acc.save_state(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    acc.load_state(target)
    assert all(torch.equal(a, b) for a, b in zip(saved, _weights(model)))

    # a hard crash (no except clause ran) leaves siblings: the next save removes them
    (tmp_path / "ck.tmp-99999").mkdir()
    (tmp_path / "ck.old-99998").mkdir()
    acc.save_state(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]

    # a crash between moving the old checkpoint aside and the new one in: load finds the old one
    (tmp_path / "ck").rename(tmp_path / "ck.old-12345")
    _train_step(acc, model, opt)
    acc.load_state(target)
    assert all(torch.equal(a, b) for a, b in zip(saved, _weights(model)))
    acc.save_state(target)  # and the next save puts it back under the real name first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # expected when not tied
@pytest.mark.parametrize("with_optimizer,adjust", [(True, True), (True, False), (False, True)])
def test_scheduler_stepping_options(with_optimizer, adjust):
    set_seed(4)
    plugin = GradientAccumulationPlugin(num_steps=2, adjust_scheduler=adjust)
    acc = Accelerator(gradient_accumulation_plugin=plugin, step_scheduler_with_optimizer=with_optimizer)
    base = mlp()
    opt = torch.optim.SGD(base.parameters(), lr=0.8)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched, dl = acc.prepare(base, opt, sched, loader(16, 4))
    for x, y in dl:
        with acc.accumulate(model):
            acc.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
    real_steps = 4 if not with_optimizer else 2
    assert sched.get_last_lr() == [0.8 * 0.5**real_steps]
    # torch counts the constructor's call too; adjust_scheduler also counts skipped micro-steps
    assert sched.scheduler._step_count == 1 + (4 if (adjust or not with_optimizer) else 2)


def test_rng_types_warns_and_device_placement_list_is_used(caplog):
    caplog.set_level("WARNING", logger="lowprec")
    acc = Accelerator(rng_types=["generator"])
    assert any("rng_types" in r.getMessage() for r in caplog.records)
    a, b = loader(8, 4), loader(8, 4)
    dl_a, dl_b = acc.prepare(a, b, device_placement=[False, True])
    assert dl_a.device is None and dl_b.device == acc.device
    with pytest.raises(ValueError, match="device_placement"):
        acc.prepare(loader(8, 4), device_placement=[True, False])


def test_free_memory_drops_every_reference(tmp_path):
    import gc
    import weakref

    acc = Accelerator()
    base = mlp()
    model, opt = acc.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1))

    class Counter:
        n = 5

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    counter = Counter()
    acc.register_for_checkpointing(counter)
    probe = weakref.ref(base[0].weight)
    model, opt = acc.free_memory(model, opt)
    del base
    gc.collect()
    assert [model, opt] == [None, None]
    assert acc._param_maps == [] and acc._optimizer_models == {} and acc._ds_engine is None
    assert probe() is None
    # registered objects stay registered, as under Accelerate: still saved and restored
    acc.prepare(mlp())
    acc.save_state(tmp_path / "ckpt")
    counter.n = 0
    acc.load_state(tmp_path / "ckpt")
    assert counter.n == 5


@pytest.mark.parametrize("use_during_eval", [True, False])
def test_contextual_fp8_autocast_use_during_eval_runs_fp8_in_eval(use_during_eval):
    import copy

    import lowprec.fp8 as fp8
    from lowprec.utils.fp8 import contextual_fp8_autocast

    set_seed(6)
    plain = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    model = copy.deepcopy(plain)
    fp8.convert(model, skip_first_last=False, skip_patterns=())
    assert fp8.has_fp8_layers(model)
    model.forward = contextual_fp8_autocast(model.forward, None, use_during_eval).__get__(model)
    model.eval()
    plain.eval()
    x = torch.randn(8, 32)
    with torch.no_grad():
        out, ref = model(x), plain(x)
    if use_during_eval:
        err = (out - ref).abs().max().item()
        assert 1e-4 < err < 0.2 * ref.abs().max().item()  # FP8 rounding: close, not equal
    else:
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("split", [False, True])  # one prepare call; optimizer and scheduler before the model
def test_msamp_o2_scheduler_drives_the_fp8_optimizer(split, recwarn):
    from lowprec.utils import MSAMPRecipeKwargs

    set_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)],
        milestones=[1],
    )
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[MSAMPRecipeKwargs(opt_level="O2")])
    if split:
        opt, sched = acc.prepare(opt, sched)
        model = acc.prepare(model)
    else:
        model, opt, sched = acc.prepare(model, opt, sched)
    assert type(opt.optimizer).__name__ == "FP8AdamW"
    x = torch.randn(8, 16)
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        acc.backward(model(x).float().pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
        moved = max((p - b).abs().max().item() for p, b in zip(model.parameters(), before))
        assert (moved > 0) == (step == 0), step  # lr 0 from the second step: nothing moves
        assert [g["lr"] for g in opt.param_groups] == sched.get_last_lr()
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]


def test_replaced_optimizer_wrapper_still_pickles():
    import pickle

    from lowprec.utils.optimizer import AcceleratedOptimizer

    params = list(mlp().parameters())
    wrapped = AcceleratedOptimizer(torch.optim.AdamW(params), None, None)
    wrapped.replace_optimizer(torch.optim.SGD(params, lr=0.1))
    assert type(pickle.loads(pickle.dumps(wrapped)).optimizer) is torch.optim.SGD


def test_save_pretrained_after_prepare_writes_weights_only(tmp_path):
    """Accelerate's saving idiom, ``unwrap_model(model).save_pretrained(dir)``, on a model a
    delayed-scaling recipe converted: no FP8 scaling state in the files (it loads with no
    unexpected keys), while save_state still keeps that state."""
    transformers = pytest.importorskip("transformers")
    from lowprec.utils import TERecipeKwargs

    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    set_seed(0)
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(amax_history_len=4)])
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(0, 64, (2, 8))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    acc.unwrap_model(model).save_pretrained(tmp_path / "hf", save_function=acc.save)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    history = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items() if "amax_history" in k}
    assert history and all(v.abs().sum() > 0 for v in history.values())
    acc.save_state(tmp_path / "state")
    for k in history:
        acc.unwrap_model(model).state_dict()[k].zero_()
    acc.load_state(tmp_path / "state")
    after = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(after[k], v) for k, v in history.items())
