"""``tensor_parallel_size`` (Axolotl's key) with ``sequence_parallel`` in the trainer: `lowprec
train --num_processes 2 --tensor_parallel_size 2 --sequence_parallel true` splits every block's
Linears over two processes (the built-in model's _tp_plan; FP8 layers through
Float8ColwiseParallel / Float8RowwiseParallel) and its norms and residual stream over the
sequence (_sp_plan; attention and MLP inputs all-gathered in FP8), and follows the one-process
run of the same config: both processes read the same batches (one tensor-parallel group), the
scales are the whole tensors' and only the order of bf16 sums and the per-shard grad_output
scales differ (measured: max |loss diff| 7.1e-3 without sequence parallelism, 7.1e-3 with it,
at loss ~5 over 3 steps; tolerance 2e-2). The numerics of TP alone, FSDP2+TP and FSDP2+TP+SP
are compared in test_tensor_parallel_fp8.py."""

from __future__ import annotations

import os
import sys

import pytest

from lowprec.train.config import load_config, parse_config
from lowprec.train.metrics import read_metrics
from lowprec.train.trainer import train
from tests.torchrun_util import run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
RUN = {
    "max_steps": 3,
    "warmup_steps": 0,
    "sequence_len": 32,
    "dataset_max_bytes": 100000,
    "eval_steps": None,
    "eval_batches": 1,
    "micro_batch_size": 4,
    "logging_steps": 1,
}


def test_tensor_parallel_size_needs_tensorwise_fp8():
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 .*fp8_recipe: tensorwise"):
        parse_config({"tensor_parallel_size": 2, "fp8": True, "fp8_recipe": "rowwise"})


def test_tensor_parallel_training_follows_one_process(tmp_path):
    out = tmp_path / "tp"
    flags = [f"--{k}={'null' if v is None else v}" for k, v in RUN.items()]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    run_torchrun(
        [
            sys.executable,
            "-m",
            "lowprec.cli.main",
            "train",
            TINY,
            "--num_processes",
            "2",
            "--tensor_parallel_size",
            "2",
            "--sequence_parallel",
            "true",
            "--output_dir",
            str(out),
            "--quiet",
            *flags,
        ],
        lambda p: (out / "summary.json").exists(),
        env=env,
        timeout=300,
    )
    single = train(load_config(TINY, {**RUN, "output_dir": str(tmp_path / "one")}))
    tp_losses = [r["loss"] for r in read_metrics(str(out), "train")]
    assert tp_losses == pytest.approx([x for _, x in single.train_losses], abs=2e-2)


def test_a_one_process_checkpoint_resumes_under_fsdp2_and_tensor_parallelism(tmp_path):
    """checkpoint-3 of a one-process run (8 sequences a step: gradient_accumulation_steps 2; its
    optimizer file keys states by parameter index) resumed on 2 processes under ``--fsdp_version 2``
    and under ``--tensor_parallel_size 2`` (8 a step there too), whose loaders key states by
    parameter name: steps 4-5 follow the uninterrupted one-process run within 1e-2 (measured,
    2-core Intel Xeon: 8e-4 FSDP2, 1e-4 TP). Was: KeyError 'state.0.step' on every rank, exit 2."""
    keys = {**RUN, "max_steps": 5, "save_steps": 3, "gradient_accumulation_steps": 2}
    single = train(load_config(TINY, {**keys, "output_dir": str(tmp_path / "one")}))
    ckpt = tmp_path / "one" / "checkpoint-3"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    flags = [f"--{k}={'null' if v is None else v}" for k, v in {**RUN, "max_steps": 5}.items()]
    for name, parallel in (("fsdp2", ["--fsdp_version", "2"]), ("tp", ["--tensor_parallel_size", "2"])):
        out = tmp_path / name
        accumulate = ["--gradient_accumulation_steps", "2"] if name == "tp" else []  # TP: one batch a step
        run_torchrun(
            [sys.executable, "-m", "lowprec.cli.main", "train", TINY, "--num_processes", "2", *parallel, *accumulate]
            + ["--resume_from_checkpoint", str(ckpt), "--output_dir", str(out), "--quiet", *flags],
            lambda p, out=out: (out / "summary.json").exists(),
            env=env,
            timeout=300,
        )
        rows = read_metrics(str(out), "train")
        assert [r["step"] for r in rows] == [4, 5], name
        expected = [x for _, x in single.train_losses][3:]
        assert [r["loss"] for r in rows] == pytest.approx(expected, abs=1e-2), name
