"""Resume with changed settings (issue 28 item 5): per key, refused in one line (exit 2, the key,
its saved and new value, the fix) or continued with one "changed X from A to B on resume" line
and the new value in effect. The table is resume_check.RULES; every row of it is exercised."""

from __future__ import annotations

import os
import shutil

import pytest

from lowprec.train.metrics import read_metrics
from lowprec.train.resume_check import APPLY, NOTE, REFUSE, RULES
from lowprec.train.trainer import lr_lambda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
# tiny.yaml: fp8 tensorwise, adamw, learning_rate 3e-3, warmup 2 (clamped to 1 in a 2-step run),
# cosine, micro_batch_size 4, sequence_len 32, seed 7
BASE = [
    "--max_steps",
    "2",
    "--save_steps",
    "2",
    "--eval_steps",
    "null",
    "--val_set_size",
    "0",
    "--use_tensorboard",
    "false",
    "--quiet",
]

# (key, flag value, saved value as printed, new value as printed)
REFUSED = [
    ("optimizer", "sgd", "adamw_torch", "sgd"),
    ("fp8_recipe", "rowwise", "tensorwise", "rowwise"),
    ("precision", None, "fp8", None),  # --fp8 false: bf16 or fp32, as bf16: auto finds the CPU
    ("fp8_filter", "[o_proj]", "[]", '["o_proj"]'),
    ("base_model", "builtin:llama-small", "builtin:llama-tiny", "builtin:llama-small"),
    ("micro_batch_size", "2", "4", "2"),
    ("sequence_len", "16", "32", "16"),
    ("seed", "8", "7", "8"),
    ("datasets", "CORPUS", None, None),  # a local text file (written by the test)
    ("val_set_size", "0.2", None, None),
    ("dataset_max_bytes", "50000", None, None),
    ("train_on_inputs", "true", "false", "true"),
    ("pad_to_sequence_len", "true", None, None),
    ("chat_template", "chatml", None, None),
    ("eot_tokens", "[x]", None, None),
]
# (key, flags, saved value as printed, new value as printed)
APPLIED = [
    ("learning_rate", ["--learning_rate", "0.01"], "0.003", "0.01"),
    ("weight_decay", ["--weight_decay", "0.1"], "0.0", "0.1"),
    ("adam_beta1", ["--adam_beta1", "0.8"], "0.9", "0.8"),
    ("adam_beta2", ["--adam_beta2", "0.99"], "0.95", "0.99"),
    ("total_steps", ["--max_steps", "4"], "2", "4"),
    ("warmup_steps", ["--warmup_steps", "0"], "1", "0"),
    ("lr_scheduler", ["--lr_scheduler", "linear"], "cosine", "linear"),
    ("gradient_accumulation_steps", ["--gradient_accumulation_steps", "2"], "1", "2"),
    ("max_grad_norm", ["--max_grad_norm", "0.5"], "1.0", "0.5"),
]
# noted, not refused: the same run on other arithmetic (test_other_arithmetic_is_noted_once)
NOTED = {"torch", "cpu_fp8_gemm", "bf16"}
# the LoRA keys need a Hugging Face base model: their rows live with the adapter tests' models
NOT_HERE = {
    "model",
    "adapter",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "lora_target_linear",
    "lora_modules_to_save",
    # a Hugging Face tokenizer's settings (the built-in byte tokenizer has no template or added tokens),
    # and packing, which needs typed local datasets (the built-in corpus is plain text)
    "chat_template_jinja",
    "sample_packing",
    "special_tokens",
    "tokens",
}


def test_every_rule_has_a_row():
    rows = {k for k, *_ in REFUSED} | {k for k, *_ in APPLIED}
    assert rows | NOT_HERE | NOTED == set(RULES)
    assert all(RULES[k][0] == REFUSE for k, *_ in REFUSED) and all(RULES[k][0] == APPLY for k, *_ in APPLIED)
    assert all(RULES[k][0] == NOTE for k in NOTED)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from lowprec.cli.main import main

    out = tmp_path_factory.mktemp("first")
    assert main(["train", TINY, *BASE, "--output_dir", str(out)]) == 0
    return out / "checkpoint-2"


def _resume(checkpoint, tmp_path, flags):
    from lowprec.cli.main import main

    out = tmp_path / "run"
    shutil.copytree(checkpoint, out / "checkpoint-2")
    rc = main(
        ["train", TINY, *BASE, "--max_steps", "3", *flags, "--output_dir", str(out), "--resume_from_checkpoint", "auto"]
    )
    return rc, out


@pytest.mark.parametrize("key,value,old,new", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_change_that_makes_the_checkpoint_meaningless_is_refused(checkpoint, tmp_path, capsys, key, value, old, new):
    if value == "CORPUS":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("".join(open(os.path.join(ROOT, "README.md")).read() for _ in range(4)))
        value = f"[{corpus}]"
    flags = ["--fp8", "false"] if key == "precision" else [f"--{key}", value]
    rc, out = _resume(checkpoint, tmp_path, flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err, err
    line = err[-1]
    assert line.startswith(f"lowprec: error: resume_from_checkpoint: {out / 'checkpoint-2'} was trained with {key}"), (
        line
    )
    if old is not None:
        assert f"{key}: {old} (now {new if new is not None else ''}" in line, line
    assert RULES[key][1] in line and "set it back to continue that run, or start a fresh one" in line
    assert not any("Traceback" in x for x in err)
    assert read_metrics(str(out)) == []  # refused before anything ran


@pytest.mark.parametrize("key,flags,old,new", APPLIED, ids=[r[0] for r in APPLIED])
def test_a_legitimate_change_is_applied_and_logged_once(checkpoint, tmp_path, capsys, key, flags, old, new):
    rc, out = _resume(checkpoint, tmp_path, flags)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert err.count(f"lowprec: changed {key} from {old} to {new} on resume ({RULES[key][1]})") == 1, err
    assert "bit for bit" not in err  # same machine, same kernel: nothing to note
    recs = read_metrics(str(out), "train")
    last = max(r["step"] for r in recs)
    assert [r["step"] for r in recs] == list(range(3, last + 1))
    step3 = recs[0]
    # the new value is in effect at the first resumed step (not the checkpoint's)
    if key in ("learning_rate", "total_steps", "warmup_steps", "lr_scheduler"):
        lr = float(flags[1]) if key == "learning_rate" else 3e-3
        total = 4 if key == "total_steps" else 3
        warmup = 0 if key == "warmup_steps" else min(2, total - 1)
        kind = "linear" if key == "lr_scheduler" else "cosine"
        assert step3["lr"] == pytest.approx(lr * lr_lambda(2, warmup, total, kind), rel=1e-12)
    if key == "gradient_accumulation_steps":
        first = read_metrics(str(checkpoint.parent), "train")[-1]
        assert step3["tokens"] - first["tokens"] == 2 * 4 * 32  # two micro-batches of 4 x 32


def test_another_cpu_fp8_gemm_kernel_on_resume_is_noted_once(checkpoint, tmp_path, capsys, monkeypatch):
    """The kernel a checkpoint was trained with (the machine's kept probe verdict) is recorded;
    resuming under the other one continues, with one line saying the bits will differ."""
    from lowprec.fp8.gemm import cpu as cpu_gemm
    from lowprec.train.resume_check import saved_settings

    settings = [saved_settings(str(checkpoint), i) for i in range(len(list(checkpoint.glob("custom_checkpoint_*"))))]
    (saved,) = [s["cpu_fp8_gemm"] for s in settings if s is not None]
    assert saved == cpu_gemm.cpu_gemm_choice().path
    other = "upcast" if saved == "scaled_mm" else "scaled_mm"
    monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, other)
    rc, out = _resume(checkpoint, tmp_path, [])
    err = capsys.readouterr().err
    assert rc == 0, err
    line = (
        f"lowprec: resuming with cpu_fp8_gemm {other}, the checkpoint was written with {saved}: the run "
        f"continues, but not bit for bit as the uninterrupted one ({RULES['cpu_fp8_gemm'][1]})"
    )
    assert err.count(line) == 1, err
    assert [r["step"] for r in read_metrics(str(out), "train")] == [3]


def test_other_arithmetic_is_noted_once_and_never_hides_a_refusal(caplog):
    from lowprec.train.resume_check import check_resume

    saved = {"torch": "2.12.0+cpu", "cpu_fp8_gemm": "upcast", "optimizer": "adamw_torch", "learning_rate": 1e-3}
    now = {"torch": "2.13.0+cpu", "cpu_fp8_gemm": "upcast", "optimizer": "adamw_torch", "learning_rate": 2e-3}
    with caplog.at_level("WARNING", logger="lowprec"):
        assert check_resume(saved, now, "ck") == {"learning_rate": (1e-3, 2e-3)}
    notes = [r.getMessage() for r in caplog.records if "bit for bit" in r.getMessage()]
    assert notes == [
        "lowprec: resuming with torch 2.13.0+cpu, the checkpoint was written with 2.12.0+cpu: the run "
        f"continues, but not bit for bit as the uninterrupted one ({RULES['torch'][1]})"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="lowprec"), pytest.raises(ValueError, match="optimizer: adamw_torch"):
        check_resume(saved, {**now, "optimizer": "sgd"}, "ck")
    assert not [r for r in caplog.records if "bit for bit" in r.getMessage()]  # refused: nothing continues


def test_apply_changes_puts_the_new_values_into_the_restored_optimizer_schedule_and_accumulation():
    """What load_state restored (the checkpoint's groups, base rates, accumulation counter) is
    replaced by the config's: the optimizer's values would otherwise silently win."""
    from types import SimpleNamespace

    import torch

    from lowprec.train.config import load_config
    from lowprec.train.resume_check import apply_changes
    from lowprec.train.trainer import build_optimizer, build_scheduler

    old = load_config(TINY, {"max_steps": 10})
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(old, model)
    sched = build_scheduler(old, opt, 10)
    for _ in range(4):  # as restored at step 4: groups and schedule of the old config
        opt.step()
        sched.step()
    new = load_config(
        TINY,
        {
            "max_steps": 10,
            "learning_rate": 0.01,
            "weight_decay": 0.1,
            "adam_beta1": 0.8,
            "gradient_accumulation_steps": 3,
        },
    )
    run = SimpleNamespace(
        cfg=new,
        acc=SimpleNamespace(step=4),
        state=SimpleNamespace(step=4),
        optimizer=opt,
        scheduler=SimpleNamespace(scheduler=sched),
    )
    keys = ("learning_rate", "weight_decay", "adam_beta1", "gradient_accumulation_steps")
    apply_changes(run, {k: (getattr(old, k), getattr(new, k)) for k in keys}, main=False)
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    assert all(g["betas"] == (0.8, old.adam_beta2) for g in opt.param_groups)
    expected = 0.01 * lr_lambda(4, min(old.warmup_steps, 9), 10, old.lr_scheduler)
    assert [g["lr"] for g in opt.param_groups] == [expected, expected] == sched.get_last_lr()
    sched.step()  # the schedule goes on from the new peak rate
    assert opt.param_groups[0]["lr"] == pytest.approx(
        0.01 * lr_lambda(5, min(old.warmup_steps, 9), 10, old.lr_scheduler)
    )
    assert run.acc.step == 12  # 4 optimizer steps of 3 micro-batches: the next sync after 3 more
