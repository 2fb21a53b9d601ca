"""lowprec.Accelerator on one process: precision modes, prepare, accumulation, clipping,
checkpoints and resume. Bug numbers are those of the known Accelerate FP8 bugs each test names in its docstring.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lowprec.fp8 as fp8
from lowprec import Accelerator
from lowprec.state import Decision, fp8_hardware_check
from lowprec.utils import AutocastKwargs, GradScalerKwargs, NativeRecipeKwargs, TERecipeKwargs, set_seed

ENV = [
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_FP8_BACKEND",
    "LOWPREC_FP8_RECIPE",
    "LOWPREC_FP8_FALLBACK",
    "WORLD_SIZE",
    "RANK",
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def mlp(dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 8),
    )


def loader(n: int = 96, batch_size: int = 8, shuffle: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, :8] * 2).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


def step(acc, model, opt, batch, sched=None) -> float:
    x, y = batch
    with acc.accumulate(model):
        loss = nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return loss.item()


# --------------------------------------------------------------------------- construction
def test_mixed_precision_argument_env_default(monkeypatch):
    assert Accelerator().mixed_precision == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "BF16")
    acc = Accelerator()
    assert (
        acc.mixed_precision == "bf16" and "ACCELERATE_MIXED_PRECISION" in acc.state.decisions["mixed_precision"].reason
    )
    assert Accelerator(mixed_precision="no").mixed_precision == "no"
    with pytest.raises(ValueError, match="no, fp16, bf16, fp8"):
        Accelerator(mixed_precision="fp4")


def test_both_handler_spellings_and_unknown_argument():
    # bug 17: the docs spell it kwarg_handlers
    acc = Accelerator(mixed_precision="fp8", kwarg_handlers=[NativeRecipeKwargs(recipe="rowwise")])
    assert acc.fp8_enabled and acc.fp8_backend == "NATIVE" and acc.backend.recipe.scaling == "rowwise"
    with pytest.raises(TypeError, match="did you mean 'mixed_precision'"):
        Accelerator(mixed_precison="fp8")


def test_handler_conflicts_are_errors():
    with pytest.raises(ValueError, match="two FP8 recipes"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(), NativeRecipeKwargs()])
    with pytest.raises(ValueError, match="two GradScalerKwargs"):
        Accelerator(kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs()])
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        Accelerator(mixed_precision="bf16", kwargs_handlers=[TERecipeKwargs()])


def test_hardware_gate(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="fp8_fallback='bf16'") as err:
        fp8_hardware_check(cuda, None)
    assert "8.0" in str(err.value) and "mixed_precision='bf16'" in str(err.value)
    assert fp8_hardware_check(cuda, "bf16").value == "bf16"
    assert fp8_hardware_check(cuda, "emulate").value == "fp8-emulate"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert fp8_hardware_check(cuda, None).value == "fp8"
    assert fp8_hardware_check(torch.device("cpu"), None).value == "fp8"


def test_fp8_fallback_bf16_does_not_convert(monkeypatch):
    # bug 11: Accelerate falls back to fp16 but still converts the model
    monkeypatch.setattr("lowprec.state.fp8_hardware_check", lambda d, f: Decision("bf16", "test: old GPU"))
    acc = Accelerator(mixed_precision="fp8", fp8_fallback="bf16", kwargs_handlers=[TERecipeKwargs()])
    model = acc.prepare(mlp())
    assert acc.mixed_precision == "bf16" and not acc.fp8_enabled and acc.scaler is None
    assert not fp8.has_fp8_layers(model)
    with pytest.raises(ValueError, match="fp8_fallback"):
        Accelerator(mixed_precision="fp8", fp8_fallback="fp16")


# --------------------------------------------------------------------------- precision
def interior_dtypes(model):
    seen = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, i, o: seen.append((o.dtype, fp8.fp8_enabled())))
    return seen


@pytest.mark.parametrize("mp, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp8", torch.bfloat16)])
def test_interior_dtype_and_fp32_output(mp, dtype):
    # bug 14: fp16 on CPU really autocasts (Accelerate silently ran fp32)
    acc = Accelerator(mixed_precision=mp)
    model = acc.prepare(mlp())
    seen = interior_dtypes(model)
    out = model(torch.randn(4, 32))
    assert out.dtype == torch.float32
    assert {d for d, _ in seen} == {dtype}
    # converted layers are the FP8 switch (outside an ``autocast(enabled=False)`` region they run FP8)
    assert fp8.has_fp8_layers(model) == (mp == "fp8")
    if mp == "fp8":
        assert {on for _, on in seen} == {True}
    assert (acc.scaler is not None) == (mp == "fp16")


def test_fp8_region_off_in_eval_unless_asked():
    for during_eval in (False, True):
        acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(use_autocast_during_eval=during_eval)])
        model = acc.prepare(mlp())
        model.eval()
        hits = []
        layer = next(m for m in model.modules() if isinstance(m, fp8.Float8Linear))
        layer.register_forward_hook(
            lambda mod, i, o, hits=hits: hits.append(mod.recipe.use_during_eval and fp8.fp8_enabled())
        )
        model(torch.randn(4, 32))
        assert hits == [during_eval]


def test_accelerator_autocast_is_bf16_under_fp8_and_can_be_disabled():
    # bug 13: under fp8 the region is bf16, never the device default (fp16)
    acc = Accelerator(mixed_precision="fp8")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with acc.autocast():
        assert (a @ b).dtype == torch.bfloat16 and fp8.fp8_enabled()
        with acc.autocast(AutocastKwargs(enabled=False)):
            assert (a @ b).dtype == torch.float32 and fp8.fp8_enabled()  # inner fp8 state kept by design


def test_fp8_keeps_optimizer_params_and_trains():
    set_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accelerator(mixed_precision="fp8")
    model, opt, dl = acc.prepare(model, opt, loader())
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    layers = [m for m in model.modules() if isinstance(m, fp8.Float8Linear)]
    before = [m.weight.detach().clone() for m in layers]
    losses = [step(acc, model, opt, b) for _ in range(3) for b in dl]
    assert all(not torch.equal(b, m.weight) for b, m in zip(before, layers))
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])


# --------------------------------------------------------------------------- prepare
def test_prepare_any_order_and_several_calls():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    acc = Accelerator(mixed_precision="fp8")
    dl, sched2, opt2 = acc.prepare(loader(), sched, opt)
    model2 = acc.prepare(model)
    assert fp8.has_fp8_layers(model2)
    assert {id(p) for g in opt2.param_groups for p in g["params"]} == {id(p) for p in model2.parameters()}
    assert type(dl).__name__ == "DataLoaderShard" and type(sched2).__name__ == "AcceleratedScheduler"
    assert acc.prepare(model2) is model2  # preparing twice is harmless


def test_gradient_accumulation_matches_big_batch():
    set_seed(1)
    base = mlp()
    ref = mlp()
    ref.load_state_dict(base.state_dict())
    acc = Accelerator(gradient_accumulation_steps=2)
    model, opt, dl = acc.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), loader(n=16, batch_size=4))
    batches = list(loader(n=16, batch_size=4))
    syncs = []
    for b in dl:
        with acc.accumulate(model):
            loss = nn.functional.cross_entropy(model(b[0]), b[1])
            acc.backward(loss)
            syncs.append(acc.sync_gradients)
            opt.step()
            opt.zero_grad()
    assert syncs == [False, True, False, True]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in (0, 2):
        x = torch.cat([batches[i][0], batches[i + 1][0]])
        y = torch.cat([batches[i][1], batches[i + 1][1]])
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_accumulation_syncs_at_end_of_dataloader():
    acc = Accelerator(gradient_accumulation_steps=4)
    model, dl = acc.prepare(mlp(), loader(n=24, batch_size=4))
    syncs = []
    for _ in dl:
        with acc.accumulate(model):
            syncs.append(acc.sync_gradients)
    assert syncs == [False, False, False, True, False, True]


def test_fp16_clip_unscales_and_skipped_step():
    set_seed(2)
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    x, y = next(iter(loader()))
    acc.backward(nn.functional.cross_entropy(model(x), y))
    scaled = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    norm = acc.clip_grad_norm_(model.parameters(), 1e9)
    torch.testing.assert_close(norm, scaled / 1024.0, rtol=1e-4, atol=0)
    opt.step()
    sched.step()
    assert not acc.optimizer_step_was_skipped and sched.get_last_lr() == [0.05]
    opt.zero_grad()
    acc.backward(nn.functional.cross_entropy(model(x), y))
    next(model.parameters()).grad[0, 0] = float("inf")
    before = next(model.parameters()).detach().clone()
    opt.step()
    sched.step()
    assert acc.optimizer_step_was_skipped and sched.get_last_lr() == [0.05]
    assert torch.equal(before, next(model.parameters())) and acc.scaler.get_scale() == 512.0


def test_clip_on_a_micro_step_returns_the_partial_norm_and_clips_nothing(caplog):
    """A script printing ``clip_grad_norm_(...).item()`` inside accumulate() got None on micro-steps:
    the norm of the partial gradients comes back (unscaled, gradients untouched), said once in
    the log; the clip itself happens at the accumulation boundary."""
    set_seed(2)
    acc = Accelerator(
        mixed_precision="fp16", gradient_accumulation_steps=2, kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)]
    )
    model, opt = acc.prepare(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1))
    x, y = next(iter(loader()))
    grads = lambda: torch.cat([p.grad.flatten() for p in model.parameters()])  # noqa: E731
    with caplog.at_level("INFO", logger="lowprec"):
        for micro in range(2):
            with acc.accumulate(model):
                acc.backward(nn.functional.cross_entropy(model(x), y))
                before = grads().clone()
                norm = acc.clip_grad_norm_(model.parameters(), 1e-3)
                if micro == 0:
                    torch.testing.assert_close(norm, before.norm() / 1024.0, rtol=1e-4, atol=0)
                    assert torch.equal(grads(), before)  # not clipped, not unscaled
    assert norm.item() > 1e-3 and grads().norm().item() <= 1e-3 * 1.01  # the boundary clips
    assert sum("at the accumulation boundary" in r.getMessage() for r in caplog.records) == 1


# --------------------------------------------------------------------------- checkpoints
def train_run(tmp_path, mp, safe, save_at=None, resume_from=None, steps=8):
    set_seed(5)
    model = mlp(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.7)
    kw = [TERecipeKwargs(amax_history_len=4)] if mp == "fp8" else []
    acc = Accelerator(mixed_precision=mp, kwargs_handlers=kw)
    model, opt, dl, sched = acc.prepare(model, opt, loader(n=40, batch_size=4, shuffle=True), sched)
    done = 0
    if resume_from is not None:
        acc.load_state(resume_from)
        done = save_at
    losses = []
    while done < steps:
        for b in dl:
            losses.append(step(acc, model, opt, b, sched))
            done += 1
            if save_at is not None and resume_from is None and done == save_at:
                acc.save_state(str(tmp_path / "ckpt"), safe_serialization=safe)
            if done == steps:
                break
    return losses, acc, model


@pytest.mark.parametrize("mp, safe", [("fp8", True), ("fp8", False), ("fp16", True), ("no", False)])
def test_resume_gives_identical_losses(tmp_path, mp, safe):
    full, _, model_full = train_run(tmp_path, mp, safe, save_at=13, steps=16)  # crosses an epoch (10 batches)
    resumed, acc, model = train_run(tmp_path, mp, safe, save_at=13, resume_from=str(tmp_path / "ckpt"), steps=16)
    assert resumed == full[13:]
    for (k, a), b in zip(model_full.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    files = set(os.listdir(tmp_path / "ckpt"))
    assert ("model_0.safetensors" in files) == safe and ("pytorch_model_0.bin" in files) == (not safe)
    assert ("optimizer_0.safetensors" in files) == safe and ("optimizer_0.bin" in files) == (not safe)
    assert {"scheduler_0.safetensors", "dataloader_0.json", "random_states_0.safetensors"} <= files
    assert ("scaler.safetensors" in files) == (mp == "fp16")
    if mp == "fp8":  # delayed-scaling state is part of the checkpoint
        layer = next(m for m in model.modules() if isinstance(m, fp8.Float8Linear))
        assert any(k.startswith("fp8_") for k in layer.state_dict())


def test_save_state_is_atomic_and_replaces(tmp_path):
    acc = Accelerator(mixed_precision="fp8")
    acc.prepare(mlp())
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    acc.save_state(str(target))
    assert "stale.txt" not in os.listdir(target)
    assert [p for p in os.listdir(tmp_path) if p != "ckpt"] == []


def test_load_state_refuses_other_precision(tmp_path):
    acc = Accelerator(mixed_precision="fp8")
    acc.prepare(mlp())
    acc.save_state(str(tmp_path / "c"))
    other = Accelerator(mixed_precision="bf16")
    other.prepare(mlp())
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        other.load_state(str(tmp_path / "c"))


def test_resume_with_another_amax_history_len_names_the_setting(tmp_path):
    """A checkpoint of TERecipeKwargs() loaded with amax_history_len=16 was torch's size-mismatch
    text for one buffer and "written by another script or model?"; now one line names the setting."""
    from lowprec.errors import CheckpointError

    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(amax_history_len=8)])
    acc.prepare(mlp())
    acc.save_state(str(tmp_path / "c"))
    other = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(amax_history_len=16)])
    other.prepare(mlp())
    with pytest.raises(CheckpointError) as err:
        other.load_state(str(tmp_path / "c"))
    msg = str(err.value)
    assert "\n" not in msg and "are 8 long" in msg and "amax_history_len is 16" in msg
    assert "resume with amax_history_len=8" in msg


@pytest.mark.parametrize("safe", [True, False])
def test_save_model_loads_into_unconverted_model(tmp_path, safe):
    set_seed(4)
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(amax_history_len=4)])
    model = acc.prepare(mlp())
    model(torch.randn(4, 32)).sum().backward()
    acc.save_model(model, str(tmp_path / "m"), safe_serialization=safe)
    plain = mlp()
    from lowprec.checkpoint.state import load_tensors

    name = "model.safetensors" if safe else "pytorch_model.bin"
    plain.load_state_dict(load_tensors(str(tmp_path / "m" / name)))  # strict: no FP8 keys left
    inner = acc.unwrap_model(model, keep_fp32_wrapper=False)
    fp8.unconvert(inner)
    x = torch.randn(4, 32)
    torch.testing.assert_close(plain(x), inner(x))


def test_get_state_dict_is_the_plain_weights_save_model_writes(tmp_path):
    """``save_pretrained(dir, state_dict=acc.get_state_dict(model))`` carried the delayed recipe's
    ``fp8_amax_history_*`` / ``fp8_scale_*`` / ``fp8_step*`` buffers, which the unconverted model
    reports as unexpected keys; save_state still keeps them (its own files)."""
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(amax_history_len=4)])
    model = acc.prepare(mlp())
    model(torch.randn(4, 32)).sum().backward()
    sd = acc.get_state_dict(model)
    assert set(sd) == set(mlp().state_dict())
    mlp().load_state_dict(sd)  # strict
    acc.save_state(str(tmp_path / "c"))
    from lowprec.checkpoint.state import load_tensors

    assert any("fp8_amax_history" in k for k in load_tensors(str(tmp_path / "c" / "model_0.safetensors")))


def test_unwrap_removes_wrapper_and_pickles():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(mlp())
    assert model(torch.randn(2, 32)).dtype == torch.float32
    inner = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert "forward" not in inner.__dict__
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert inner(torch.randn(2, 32)).dtype == torch.bfloat16
    assert isinstance(pickle.loads(pickle.dumps(inner)), nn.Sequential)


def test_gather_and_reduce_single_process():
    acc = Accelerator()
    t = torch.arange(4.0)
    assert torch.equal(acc.gather(t), t) and torch.equal(acc.reduce(t, "mean"), t)
    model, dl = acc.prepare(mlp(), loader(n=20, batch_size=8))
    got = [acc.gather_for_metrics(y) for _, y in dl]
    assert sum(len(g) for g in got) == 20


def test_safetensors_writer_handles_tied_views_and_transposes(tmp_path):
    from lowprec.checkpoint.state import load_tensors, save_tensors

    w = torch.randn(4, 4)
    sd = {"a": w, "tied": w, "view": w[1:], "t": w.t(), "empty": torch.empty(0)}
    save_tensors(sd, str(tmp_path / "x.safetensors"), True)
    back = load_tensors(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    assert back["tied"] is back["a"]  # stored once, restored as one tensor


def test_explicit_gradient_accumulation_steps_beat_the_environment(monkeypatch):
    from lowprec import Accelerator

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "8")
    assert Accelerator(cpu=True, gradient_accumulation_steps=4).gradient_accumulation_steps == 4
    assert Accelerator(cpu=True).gradient_accumulation_steps == 8
