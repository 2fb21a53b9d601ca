"""FP8 where fine-tuning already happens: a converted model trains in FP8 with no
``fp8.autocast`` (a plain loop, ``transformers.Trainer``), under HF gradient checkpointing
(``use_reentrant`` both ways, bit-identical to the uncheckpointed run), with peft LoRA, and
``save_pretrained`` writes weights that load with no unexpected keys (issue 24)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")

import lowprec.fp8.modules.linear_fn as fp8_linear  # noqa: E402
import lowprec.fp8.modules.mx_linear as fp8_mx_linear  # noqa: E402
from lowprec import fp8  # noqa: E402
from lowprec.integrations.transformers import FP8Callback, enable_fp8, fp8_state_keys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class GemmCount:
    """Counts the low-precision GEMMs Float8Linear runs: its calls of ``scaled_mm`` (per-tensor,
    rowwise, blockwise recipes) and of ``mx_mm`` (mxfp8, nvfp4)."""

    def __enter__(self):
        self.n = 0
        self._patches = [
            mock.patch.object(mod, name, self._counting(getattr(mod, name)))
            for mod, name in ((fp8_linear, "scaled_mm"), (fp8_mx_linear, "mx_mm"))
        ]
        for p in self._patches:
            p.__enter__()
        return self

    def _counting(self, real):
        def counting(*args, **kwargs):
            self.n += 1
            return real(*args, **kwargs)

        return counting

    def __exit__(self, *exc):
        for p in reversed(self._patches):
            p.__exit__(*exc)


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (4, 32), generator=g)


def steps(model, n: int = 2) -> list[float]:
    """A plain loop: no fp8.autocast, no torch.autocast; SGD so the steps are exact to compare."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(n):
        ids = batch(i)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_converted_model_trains_in_fp8_in_a_plain_loop_and_autocast_false_turns_it_off():
    ref = steps(tiny_llama())
    model = tiny_llama()
    enable_fp8(model)
    with GemmCount() as count:
        losses = steps(model)
    assert count.n == 2 * 3 * 13  # 2 steps x 3 GEMMs x 13 converted Linears
    assert losses != ref
    off = tiny_llama()
    enable_fp8(off)
    with GemmCount() as count, fp8.autocast(enabled=False):
        assert steps(off) == ref  # disabled: exactly the unconverted model
    assert count.n == 0


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "nvfp4"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_matches_the_uncheckpointed_run(recipe, reentrant):
    """transformers' checkpointing (no context_fn from us): the recompute, run in backward,
    replays the first forward's FP8 decision, delayed scales and nvfp4 rounding stream; weights and scaling state end
    bit-identical to the uncheckpointed run, and the FP8 GEMMs ran."""
    plain = tiny_llama()
    enable_fp8(plain, recipe)
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    plain.train()
    ckpt.train()
    ref = steps(plain, 3)
    with GemmCount() as count:
        got = steps(ckpt, 3)
    assert got == ref
    assert count.n > 3 * 3 * len(fp8_state_layers(ckpt))  # the recomputed forwards run their GEMM again
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        assert torch.equal(a, b), name  # weights, amax histories, scales, step counters


def fp8_state_layers(model):
    return [m for m in model.modules() if isinstance(m, fp8.Float8Linear)]


def test_save_pretrained_writes_plain_weights_that_load_with_no_unexpected_keys(tmp_path):
    model = tiny_llama()
    enable_fp8(model, "delayed")
    steps(model, 1)
    state = fp8_state_keys(model)
    assert len(state) == 13 * 8 and state <= set(model.state_dict())  # the FP8 state is there in torch's state dict
    model.save_pretrained(tmp_path)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["unexpected_keys"] == set() or not info["unexpected_keys"]
    assert not info["missing_keys"]
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_peft_lora_trains_fp8_base_layers_with_checkpointing_and_merges_to_plain_weights(tmp_path):
    peft = pytest.importorskip("peft", reason="needs peft (dev extra)")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    report = enable_fp8(model, "delayed")
    assert any("lora_A" in name for name, _ in report.skipped)  # adapters stay in high precision
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    before = {k: v.clone() for k, v in model.named_parameters() if "lora_B" in k}
    with GemmCount() as count:
        steps(model, 2)
    assert count.n > 0
    assert any(not torch.equal(v, dict(model.named_parameters())[k]) for k, v in before.items())
    merged = model.merge_and_unload()
    merged.save_pretrained(tmp_path)
    _, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]


def _trainer(model, tmp_path, callbacks, **kw):
    from torch.utils.data import Dataset

    class Data(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = batch(i)[0]
            return {"input_ids": ids, "labels": ids}

    kw = {"max_steps": 4, "logging_steps": 2, "save_strategy": "no", **kw}
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=4, report_to=[], disable_tqdm=True, use_cpu=True, **kw
    )
    return transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=callbacks)


@pytest.mark.parametrize("checkpointing", [None, True, False])
def test_trainer_runs_fp8_and_logs_it(tmp_path, checkpointing):
    model = tiny_llama()
    enable_fp8(model, "delayed")
    kw = (
        {}
        if checkpointing is None
        else {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": checkpointing}}
    )
    trainer = _trainer(model, tmp_path, [FP8Callback()], **kw)
    with GemmCount() as count:
        trainer.train()
    assert count.n > 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["fp8_linear_calls"] > 0 and h["hp_linear_calls"] == 0 for h in logs)
    assert all(0 <= h["fp8_saturated_max"] <= 1 and 0 <= h["fp8_underflow_max"] <= 1 for h in logs)
    from lowprec.integrations.transformers import fp8_counts

    first = fp8_counts(trainer)
    assert first["hp_linear_calls"] == 0
    if checkpointing is None:
        assert first["fp8_linear_calls"] == 4 * 13  # 4 steps x 13 converted Linears
    else:  # the recompute runs forwards again (non-reentrant stops once the saved tensors are back)
        assert 4 * 13 < first["fp8_linear_calls"] <= 2 * 4 * 13
    trainer.train()  # a second train(): counts start again
    assert fp8_counts(trainer) == first


def test_fp8_callback_refuses_a_model_with_no_fp8_layers(tmp_path):
    trainer = _trainer(tiny_llama(), tmp_path, [FP8Callback()])
    with pytest.raises(ValueError, match="no FP8 layers.*enable_fp8"):
        trainer.train()


def test_fp8_callback_says_when_trainer_asked_fsdp_but_runs_ddp(caplog):
    """Accelerate turns Trainer's ``fsdp=`` on only on accelerators: on CPU it runs DDP, silently."""
    from types import SimpleNamespace

    model = tiny_llama()
    enable_fp8(model)
    state = transformers.TrainerState()
    with caplog.at_level("WARNING", logger="lowprec"):
        FP8Callback().on_train_begin(SimpleNamespace(fsdp=["full_shard"], world_size=2), state, None, model=model)
        FP8Callback().on_train_begin(SimpleNamespace(fsdp=[], world_size=2), state, None, model=model)
    assert [r.message for r in caplog.records if "asked for FSDP" in r.message and "runs DDP" in r.message] != []
    assert "LowprecAcceleratorMixin" in caplog.records[0].message  # the fix: FSDP2 on lowprec's Accelerator
    assert len(caplog.records) == 1


def test_enable_fp8_refuses_a_conversion_that_converts_nothing():
    with pytest.raises(ValueError, match="full precision"):
        enable_fp8(tiny_llama(), module_filter=lambda m, fqn: False)


def _run_example(name: str, *args: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "hf", name), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_trainer_example_trains_fp8_close_to_bf16_and_reloads():
    r = _run_example("trainer_fp8.py")
    assert r["fp8_linear_calls"] > 0 and r["hp_linear_calls"] == 0
    assert r["loss_fp8"] != r["loss_bf16"]  # FP8 ran ...
    assert r["rel_diff"] < 0.01  # ... and stays close to bf16 (measured: ~0.2%)
    assert r["unexpected_keys"] == [] and r["missing_keys"] == [] and r["weights_equal"]


def test_trl_sft_example_trains_fp8_under_its_default_gradient_checkpointing():
    pytest.importorskip("trl", reason="needs trl")
    pytest.importorskip("datasets", reason="needs datasets")
    r = _run_example("trl_sft_fp8.py")
    assert r["fp8_linear_calls"] > 0 and r["hp_linear_calls"] == 0
    assert r["loss_fp8"] != r["loss_bf16"] and r["rel_diff"] < 0.01  # measured: ~0.25%
    assert r["unexpected_keys"] == [] and r["missing_keys"] == [] and r["weights_equal"]


def test_trl_dpo_example_trains_fp8_close_to_bf16():
    """DPO's loss starts at log 2 (policy == reference) and decays towards 0, so the difference is
    measured against log 2: relative to a loss near 0 it would grow without bound."""
    import math

    pytest.importorskip("trl", reason="needs trl")
    pytest.importorskip("datasets", reason="needs datasets")
    r = _run_example("trl_dpo_fp8.py")
    assert r["fp8_linear_calls"] > 0 and r["hp_linear_calls"] == 0
    assert abs(r["loss_first"] - math.log(2)) < 1e-3
    assert r["loss_fp8"] < 0.5 * math.log(2) and r["accuracy_fp8"] >= 0.9  # it learned the preferences
    assert r["loss_fp8"] != r["loss_bf16"]  # FP8 ran ...
    # ... and stays close: measured 0.34% of log 2 on a 2-core AMD EPYC, 0.79% on a 2-core Intel
    # Xeon (the two CPUs' bf16 GEMMs round differently, and 20 steps amplify it); a wrong scale or
    # format moves it by far more
    assert abs(r["loss_fp8"] - r["loss_bf16"]) / math.log(2) < 0.02
    assert r["unexpected_keys"] == [] and r["missing_keys"] == [] and r["weights_equal"]


def _grpo(tmp_path, recipe):
    """TRL's GRPOTrainer, offline: the tiny Llama and byte tokenizer of examples/make_tiny_llama.py,
    prompts from the bundled notes, a toy reward (the share of vowels in the completion)."""
    import importlib.util

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location(
        "make_tiny_llama", os.path.join(ROOT, "examples", "make_tiny_llama.py")
    )
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    tokenizer = maker.make_tokenizer()
    model = maker.make_model(tokenizer, hidden=64, layers=2, seed=0)
    callbacks = []
    if recipe:
        enable_fp8(model, recipe)
        callbacks.append(FP8Callback())
    with open(os.path.join(ROOT, "examples", "data", "notes.jsonl"), encoding="utf-8") as f:
        prompts = Dataset.from_list([{"prompt": json.loads(line)["text"][:24]} for line in f])

    def vowels(completions, **kwargs):
        return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]

    cfg = GRPOConfig(
        str(tmp_path / (recipe or "bf16")),
        max_steps=4,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=vowels,
        args=cfg,
        train_dataset=prompts,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


def test_trl_grpo_trains_fp8_offline_with_a_toy_reward(tmp_path):
    """GRPOTrainer with its defaults (gradient checkpointing, bf16, no reference model at beta=0):
    every training-mode Linear call ran in FP8, sampling included (conversion is the switch).
    With one optimisation pass per generation GRPO's logged loss is the advantages' alone (the
    policy ratio is exactly 1), whatever the numerics: the policy's entropy is what shows FP8."""
    from lowprec.integrations.transformers import fp8_counts

    pytest.importorskip("trl", reason="needs trl")
    pytest.importorskip("datasets", reason="needs datasets")
    ref = [h["entropy"] for h in _grpo(tmp_path, None).state.log_history if "entropy" in h]
    trainer = _grpo(tmp_path, "tensorwise")
    got = [h["entropy"] for h in trainer.state.log_history if "entropy" in h]
    counts = fp8_counts(trainer)
    assert counts["fp8_linear_calls"] > 0 and counts["hp_linear_calls"] == 0
    assert len(got) == len(ref) == 4 and got != ref
    assert all(abs(a - b) / b < 1e-3 for a, b in zip(got, ref))  # measured: below 0.003%


def _resumable(model, out, **kw):
    """A Trainer whose runs can be compared step by step: AdamW (so the optimizer state matters
    too), logging every step, a checkpoint every 2 steps."""
    return _trainer(
        model,
        out,
        [FP8Callback(telemetry=False)],
        **{"max_steps": 5, "logging_steps": 1, "save_strategy": "steps", "save_steps": 2, "learning_rate": 1e-2, **kw},
    )


def _losses(trainer):
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_resume_from_a_trainer_checkpoint_restores_fp8_state_and_continues_as_the_uninterrupted_run(tmp_path, caplog):
    """delayed scaling (amax histories, scales, step counters) + O2's FP8AdamW, resumed from
    Trainer's own checkpoint-2: steps 3-5 give exactly the uninterrupted run's losses. Without
    the FP8 state file (the control) they differ and the resume says why, once."""
    from lowprec.integrations.transformers import FP8_STATE_FILE, apply_opt_level

    def run(resume=None):
        model = tiny_llama()
        enable_fp8(model, "delayed")
        trainer = _resumable(model, tmp_path)
        apply_opt_level(trainer, "O2")
        trainer.train(resume_from_checkpoint=resume)
        return _losses(trainer)

    full = run()
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / FP8_STATE_FILE.format(rank=0)).is_file()
    resumed = run(str(ckpt))  # its log history holds the checkpoint's steps 1-2 too
    assert sorted(resumed) == [1, 2, 3, 4, 5] and resumed == full
    (ckpt / FP8_STATE_FILE.format(rank=0)).unlink()
    with caplog.at_level("WARNING", logger="lowprec"):
        afresh = run(str(ckpt))
    assert afresh[3] != full[3]  # the histories matter: the control fails without them
    assert [r.message for r in caplog.records if "without FP8 scaling state" in r.message] != []
    # a tampered state file: one line naming it, nothing unpickled (the file is safetensors)
    from lowprec.checkpoint.serialization import CheckpointError

    (ckpt / FP8_STATE_FILE.format(rank=0)).write_bytes(b"\x80\x04cos\nsystem\n")
    with pytest.raises(CheckpointError, match=f"checkpoint file {ckpt / FP8_STATE_FILE.format(rank=0)} cannot be read"):
        run(str(ckpt))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_opt_levels_under_trainer_train_in_fp8_and_stay_close_to_adamw(tmp_path, level):
    from lowprec.integrations.transformers import apply_opt_level
    from lowprec.optim import FP8AdamW

    def run(opt_level):
        model = tiny_llama()
        enable_fp8(model, "tensorwise")
        trainer = _trainer(model, tmp_path, [FP8Callback(telemetry=False)], logging_steps=1, learning_rate=1e-2)
        if opt_level:
            apply_opt_level(trainer, opt_level)
        trainer.train()
        return _losses(trainer), trainer

    ref, _ = run(None)
    got, trainer = run(level)
    assert (type(trainer.optimizer.optimizer) is FP8AdamW) == (level == "O2")  # Trainer kept ours
    assert got != ref  # FP8 gradients (and O2's FP8 moments) changed the steps ...
    assert all(abs(got[s] - ref[s]) / ref[s] < 0.02 for s in ref)  # ... and stay close (measured below 0.1%)


def test_apply_opt_level_refuses_what_it_cannot_do(tmp_path):
    from lowprec.integrations.transformers import apply_opt_level

    trainer = _trainer(tiny_llama(), tmp_path, [], optim="sgd")
    with pytest.raises(ValueError, match="needs torch.optim.Adam.*optim='adamw_torch'"):
        apply_opt_level(trainer, "O2")
    with pytest.raises(ValueError, match="'O3' is not supported"):
        apply_opt_level(trainer, "O3")


def test_trainer_on_two_processes_through_lowprec_launch_fp8_o2_and_resume(tmp_path):
    """One 2-process launch (``lowprec launch --cpu``, torchrun underneath, DDP on gloo) of the
    Trainer example, delayed scaling + O2: every rank ran all its Linear calls in FP8 and
    all-reduced its gradients in FP8, the loss stays close to bf16, and a run resumed from
    Trainer's checkpoint (each rank's FP8 state restored) repeats the uninterrupted losses."""
    from tests.torchrun_util import free_port, run_torchrun

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        LOWPREC_CONFIG_HOME=str(tmp_path / "no-config"),
        HF_HUB_OFFLINE="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "lowprec.cli.main",
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        os.path.join(ROOT, "examples", "hf", "trainer_fp8.py"),
        "--steps",
        "5",
        "--recipe",
        "delayed",
        "--opt_level",
        "O2",
        "--resume_check",
        "--output_dir",
        str(tmp_path),
    ]
    proc = run_torchrun(cmd, lambda p: '"world_size": 2' in p.stdout, env=env, timeout=300, cwd=ROOT)
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert r["fp8_linear_calls_per_rank"] == [5 * 13, 5 * 13]  # 5 steps x 13 converted Linears, each rank
    assert r["hp_linear_calls_per_rank"] == [0, 0]
    assert r["fp8_allreduce_calls_per_rank"] == [5, 5]  # one gradient bucket per step, in FP8
    under = r["fp8_underflow_max_per_rank"]  # step 5's telemetry: every rank logs the worst of both
    assert under[0] == under[1] and 0 < under[0] < 1
    assert r["loss_fp8"] != r["loss_bf16"] and r["rel_diff"] < 0.01  # measured: 0.1-0.3%
    assert r["resume_steps"] == [3, 4, 5] and r["resume_max_abs_diff"] == 0.0
    assert r["unexpected_keys"] == [] and r["missing_keys"] == [] and r["weights_equal"]


def test_fp8_callback_guard_moves_layers_under_trainer_and_a_resume_keeps_them(tmp_path, caplog):
    """``FP8Callback(guard="act")``: lowprec train's fp8_guard under Trainer. Thresholds that every
    layer crosses (underflow > -1) and patience 1: the first logging step moves all 13 layers to
    bf16, the next steps run them in high precision, and Trainer's checkpoint carries the moves
    into a resumed run. ``warn`` logs the same episodes and moves nothing."""
    import logging

    every = {"underflow": -1.0}
    model = tiny_llama()
    enable_fp8(model, "tensorwise")
    cb = FP8Callback(guard="act", guard_patience=1, guard_thresholds=every)
    trainer = _trainer(model, tmp_path, [cb], save_strategy="steps", save_steps=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["fp8_guard_moved_layers"] for h in logs] == [13, 13]
    assert logs[0]["fp8_linear_calls"] > 0 and logs[1]["fp8_linear_calls"] == 0 and logs[1]["hp_linear_calls"] > 0
    assert all(m.high_precision for m in model.modules() if isinstance(m, fp8.Float8Linear))

    fresh = tiny_llama()
    enable_fp8(fresh, "tensorwise")
    again = _trainer(fresh, tmp_path, [FP8Callback(guard="act", guard_patience=3)], save_strategy="no")
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    last = [h for h in again.state.log_history if "loss" in h][-1]  # the history holds step 2's log too
    assert (
        last["step"] == 4 and last["fp8_linear_calls"] == 0 and last["fp8_guard_moved_layers"] == 13
    )  # the checkpoint's moves

    model = tiny_llama()
    enable_fp8(model, "tensorwise")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        _trainer(
            model, tmp_path / "warn", [FP8Callback(guard="warn", guard_patience=1, guard_thresholds=every)]
        ).train()
    lines = [r.getMessage() for r in caplog.records if "fp8_guard" in r.getMessage()]
    assert len(lines) == 13 and all("FP8 numerics unhealthy at step 2" in ln for ln in lines)  # once per episode
    assert not any(m.high_precision for m in model.modules() if isinstance(m, fp8.Float8Linear))


def test_fp8_callback_guard_arguments_are_checked():
    with pytest.raises(ValueError, match="guard='on'.*off, warn, act"):
        FP8Callback(guard="on")
    with pytest.raises(ValueError, match="keep telemetry=True"):
        FP8Callback(telemetry=False, guard="warn")
    with pytest.raises(ValueError, match=r"unknown \['sqnr'\]"):
        FP8Callback(guard="act", guard_thresholds={"sqnr": 10.0})
    with pytest.raises(ValueError, match="guard_recover_after=.*use guard='act', not 'warn'"):
        FP8Callback(guard="warn", guard_recover_after=2)
    with pytest.raises(ValueError, match="recover_after must be >= 1"):
        FP8Callback(guard="act", guard_recover_after=0)


def test_fp8_callback_guard_recover_after_reaches_the_guard():
    """``guard_recover_after``: the callback's guard moves layers back, its probe measures moved
    layers on the side; left out, neither (a moved layer stays in bf16)."""
    from lowprec.fp8.observe.guard import HealthMonitor

    model = tiny_llama()
    enable_fp8(model, "tensorwise")
    for cb, m, side in (
        (FP8Callback(guard="act", guard_recover_after=2), 2, True),
        (FP8Callback(guard="act"), None, False),
    ):
        monitor = HealthMonitor(model, cb.guard_mode, *cb._health_args)
        assert monitor.guard.thresholds.recover_after == m and monitor.probe.side is side
