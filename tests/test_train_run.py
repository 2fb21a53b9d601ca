"""Training runs: every example runs a few steps; `lowprec train` end to end in a subprocess and
its outputs; the exported model; gradient accumulation and DDP against single-process math."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.torchrun_util import run_torchrun
import torch
import yaml

from lowprec.train.config import load_config
from lowprec.train.metrics import read_metrics
from lowprec.train.trainer import lr_lambda, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml")))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
FAST = {
    "sequence_len": 32,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "dataset_max_bytes": 100_000,
    "eval_batches": 1,
    "eval_steps": None,
    "warmup_steps": 0,
    "progress_bar": False,
    "use_tensorboard": False,
    "saves_per_epoch": None,  # save_steps / eval_steps / warmup_steps below win
    "evals_per_epoch": None,
    "warmup_ratio": None,
}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_every_example_runs_a_few_steps(tmp_path, path):
    raw = yaml.safe_load(open(path))
    typed = any(isinstance(d, dict) and d.get("type") not in (None, "completion") for d in raw.get("datasets") or [])
    # instruction / chat rows need room for their prompt: 256 tokens, not 32
    fast = {**FAST, "sequence_len": 256} if typed else FAST
    cfg = load_config(path, {**fast, "max_steps": 2, "save_steps": 1, "output_dir": str(tmp_path)})
    result = train(cfg)
    assert result.steps == 2
    assert result.final_train_loss is not None and 3.0 < result.final_train_loss < 6.5  # ln(272) = 5.6
    assert os.path.isfile(tmp_path / "model.safetensors") and os.path.isdir(tmp_path / "checkpoint-1")


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    """`lowprec train examples/tiny.yaml` in a real process (8 steps, FP8, checkpoints)."""
    out = tmp_path_factory.mktemp("e2e")
    cmd = [
        sys.executable,
        "-m",
        "lowprec.cli.main",
        "train",
        TINY,
        "--output_dir",
        str(out),
        "--save_steps",
        "2",
        "--save_total_limit",
        "2",
        "--use_tensorboard",
        "true",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_e2e_outputs(e2e_run):
    out, proc = e2e_run
    for name in (
        "metrics.jsonl",
        "loss.png",
        "fp8_report.png",
        "model.safetensors",
        "config.json",
        "resolved_config.yaml",
        "summary.json",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert any((out / "runs").iterdir())  # TensorBoard events
    # checkpoints every 2 steps and at the final step, last 2 kept, no temporary dirs left
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-6", "checkpoint-8"]
    assert "lowprec train: 8 steps (fp8)" in proc.stdout


def test_e2e_console_says_each_setting_once(e2e_run):
    """Issue 13: one FP8 conversion line (the table goes to a file), each setting logged once."""
    out, proc = e2e_run
    lines = proc.stderr.splitlines()
    for key in ("device", "mixed_precision", "distributed_type", "total_steps"):
        assert sum(f"lowprec: {key} = " in line for line in lines) == 1, key
    conversion = [line for line in lines if "FP8 conversion" in line]
    assert len(conversion) == 1 and "converted" in conversion[0], conversion
    assert not any(line.lstrip().startswith("fp8   model.layers") for line in lines)
    table = (out / "fp8_conversion.txt").read_text()
    assert table.count("    fp8   model.layers.") >= 8 and "skip  lm_head" in table


def test_e2e_metrics_and_decisions(e2e_run):
    out, proc = e2e_run
    train_recs = read_metrics(str(out), "train")
    assert [r["step"] for r in train_recs] == list(range(1, 9))
    losses = [r["loss"] for r in train_recs]
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3  # learning, clearly
    # lr follows warmup (2 steps) then cosine to 0
    lrs = [r["lr"] for r in train_recs]
    assert lrs == pytest.approx([3e-3 * lr_lambda(s, 2, 8, "cosine") for s in range(8)])
    assert all(r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 0 for r in train_recs)
    evals = read_metrics(str(out), "eval")
    assert [r["step"] for r in evals] == [4, 8]
    resolved = (out / "resolved_config.yaml").read_text()
    assert "bf16:" in resolved and "reason:" in resolved and "total_steps" in resolved
    assert "lowprec: bf16 = True (bf16: auto on CPU" in proc.stderr  # each auto logged with its reason


def test_e2e_fp8_telemetry(e2e_run):
    out, _ = e2e_run
    recs = read_metrics(str(out), "fp8")
    assert [r["step"] for r in recs] == list(range(1, 9))  # every logging step
    layers = recs[-1]["layers"]
    assert "model.layers.1.mlp.up_proj" in layers and "lm_head" not in layers
    for ops in layers.values():
        assert set(ops) == {"input", "weight", "grad_output"}
        for stats in ops.values():
            assert stats["amax"] > 0 and stats["scale"] > 0
            assert 0 <= stats["saturated"] <= 1 and 0 <= stats["underflow"] <= 1
            # tensorwise: scale = E4M3/E5M2 max / amax
            assert stats["scale"] * stats["amax"] in (pytest.approx(448.0, rel=1e-3), pytest.approx(57344.0, rel=1e-3))


def test_exported_model_is_bf16_and_loads_into_the_plain_model(e2e_run):
    from safetensors.torch import load_file

    from lowprec.train.data import TokenBatches, build_datasets
    from lowprec.train.outputs import load_exported_model

    out, _ = e2e_run
    sd = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in sd.values() if t.is_floating_point())
    assert not any("fp8" in k or "amax" in k or "scale" in k for k in sd)
    model = load_exported_model(str(out)).eval()  # strict load into LlamaForCausalLM
    assert not any("Float8" in type(m).__name__ for m in model.modules())
    # the exported weights reproduce the run's last validation loss (eval ran in bf16 autocast)
    cfg = load_config(TINY)
    _, val = build_datasets(
        "builtin:stdlib",
        seq_len=cfg.sequence_len,
        max_bytes=cfg.dataset_max_bytes,
        val_fraction=cfg.val_set_size,
        seed=cfg.seed,
    )
    loader = TokenBatches(val, cfg.micro_batch_size, cfg.sequence_len, seed=cfg.seed, shuffle=False)
    with torch.no_grad():
        losses = [model(**b).loss.item() for b, _ in zip(loader, range(cfg.eval_batches))]
    final_eval = read_metrics(str(out), "eval")[-1]["loss"]
    assert sum(losses) / len(losses) == pytest.approx(final_eval, rel=0.01)


def test_gradient_accumulation_matches_a_larger_batch(tmp_path):
    base = {**FAST, "fp8": False, "bf16": False, "max_steps": 4, "logging_steps": 1, "save_steps": None}
    a = train(
        load_config(
            TINY, {**base, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "a")}
        )
    )
    b = train(
        load_config(
            TINY, {**base, "micro_batch_size": 4, "gradient_accumulation_steps": 1, "output_dir": str(tmp_path / "b")}
        )
    )
    la, lb = [x for _, x in a.train_losses], [x for _, x in b.train_losses]
    assert la == pytest.approx(lb, rel=1e-5)
    assert la[-1] < la[0]


def test_bf16_full_trains_pure_bf16(tmp_path):
    cfg = load_config(TINY, {**FAST, "fp8": False, "bf16": "full", "max_steps": 3, "output_dir": str(tmp_path)})
    result = train(cfg)
    assert result.precision == "bf16-full"
    assert "weights_dtype:\n    value: bfloat16" in (tmp_path / "resolved_config.yaml").read_text()
    assert 3.0 < result.final_train_loss < 6.5


def test_ddp_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    """`--num_processes 2` relaunches under torchrun (gloo). Rank r takes blocks r, r+2, ... of
    the epoch order, so 2 ranks x 2 sequences see the same 4 sequences as 1 process x 4."""
    common = [
        "--fp8",
        "false",
        "--bf16",
        "false",
        "--max_steps",
        "3",
        "--warmup_steps",
        "0",
        "--sequence_len",
        "32",
        "--dataset_max_bytes",
        "100000",
        "--eval_batches",
        "1",
        "--quiet",
    ]
    ddp = tmp_path / "ddp"
    run_torchrun(
        [
            sys.executable,
            "-m",
            "lowprec.cli.main",
            "train",
            TINY,
            "--num_processes",
            "2",
            "--micro_batch_size",
            "2",
            "--output_dir",
            str(ddp),
            *common,
        ],
        lambda p: (ddp / "summary.json").exists(),
        env=_env(),
        timeout=300,
    )
    single = train(
        load_config(
            TINY,
            {
                **FAST,
                "fp8": False,
                "bf16": False,
                "max_steps": 3,
                "logging_steps": 1,
                "micro_batch_size": 4,
                "output_dir": str(tmp_path / "one"),
            },
        )
    )
    ddp_losses = [r["loss"] for r in read_metrics(str(ddp), "train")]
    assert ddp_losses == pytest.approx([x for _, x in single.train_losses], rel=1e-5)
    assert json.loads((ddp / "summary.json").read_text())["steps"] == 3


def test_fp8_filter_keeps_matching_layers_in_high_precision(tmp_path):
    cfg = load_config(
        TINY,
        {
            **FAST,
            "max_steps": 1,
            "logging_steps": 1,
            "output_dir": str(tmp_path),
            "fp8_filter": ["o_proj", "model.layers.0.*"],
        },
    )
    train(cfg)
    layers = set(read_metrics(str(tmp_path), "fp8")[0]["layers"])
    assert layers and not any(n.endswith("o_proj") or n.startswith("model.layers.0.") for n in layers)
    assert "model.layers.1.self_attn.q_proj" in layers and "model.layers.3.mlp.down_proj" in layers
    # 27 converted by default (28 block Linears + lm_head, less the first and last); the filter
    # removes the other 6 of layer 0 and o_proj of layers 1-3
    assert len(layers) == 27 - 6 - 3


def test_fp16_runs_with_a_grad_scaler_and_counts_skipped_steps(tmp_path):
    cfg = load_config(
        TINY, {**FAST, "fp8": False, "fp16": True, "max_steps": 4, "logging_steps": 1, "output_dir": str(tmp_path)}
    )
    result = train(cfg)
    assert result.precision == "fp16"
    recs = read_metrics(str(tmp_path), "train")
    skipped = [r["skipped_steps"] for r in recs]
    assert skipped == sorted(skipped) and 0 <= skipped[-1] < 4  # cumulative, and training happened
    assert 3.0 < result.final_train_loss < 5.7


def test_deepspeed_zero2_two_processes_match_one_process(tmp_path):
    """`deepspeed:` inline in the YAML (here as a flag), through the Accelerator's DeepSpeed plugin."""
    pytest.importorskip("deepspeed")
    env = _env()
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    out = tmp_path / "ds"
    run_torchrun(
        [
            sys.executable,
            "-m",
            "lowprec.cli.main",
            "train",
            TINY,
            "--num_processes",
            "2",
            "--micro_batch_size",
            "2",
            "--deepspeed",
            "{zero_optimization: {stage: 2}}",
            "--fp8",
            "false",
            "--bf16",
            "false",
            "--max_steps",
            "3",
            "--warmup_steps",
            "0",
            "--sequence_len",
            "32",
            "--dataset_max_bytes",
            "100000",
            "--eval_batches",
            "1",
            "--output_dir",
            str(out),
            "--quiet",
        ],
        lambda p: (out / "summary.json").exists(),
        env=env,
        timeout=400,
    )
    single = train(
        load_config(
            TINY,
            {
                **FAST,
                "fp8": False,
                "bf16": False,
                "max_steps": 3,
                "logging_steps": 1,
                "micro_batch_size": 4,
                "output_dir": str(tmp_path / "one"),
            },
        )
    )
    ds_losses = [r["loss"] for r in read_metrics(str(out), "train")]
    assert ds_losses == pytest.approx([x for _, x in single.train_losses], rel=1e-4)
