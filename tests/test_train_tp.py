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

import json
import os
import subprocess
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


@pytest.mark.parametrize("tp, bad", [(4, "2 key/value heads"), (3, "4 attention heads and 2 key/value heads")])
def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_one_line_before_any_worker(tmp_path, tp, bad):
    """builtin:llama-tiny has 4 attention heads and 2 key/value heads: --num_processes 4
    --tensor_parallel_size 4 (or 3 and 3) crashed in every worker (``shape '[4, 32, -1, 32]' is
    invalid``, exit 1, advising a resume); now one line naming the setting and the sizes that
    fit, exit 2, before any worker starts."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "lowprec.cli.main", "train", TINY, "--num_processes", str(tp)]
        + ["--tensor_parallel_size", str(tp), "--output_dir", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"lowprec: error: tensor_parallel_size: {tp} does not divide builtin:llama-tiny's {bad} (each process "
        f"takes 1/{tp} of them; the model has 4 attention heads, 2 key/value heads, 384 MLP units): set "
        "tensor_parallel_size to 2, or shard with fsdp_version: 2 instead"
    ]
    assert not out.exists()  # nothing started


def test_a_hugging_face_models_heads_are_read_from_its_config_json(tmp_path):
    from lowprec.train.tp_dims import check_tensor_parallel_dims

    conf = {"num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 1536}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    check_tensor_parallel_dims(str(tmp_path), 4)  # 12, 4 and 1536 all split in 4
    with pytest.raises(
        ValueError,
        match=r"^tensor_parallel_size: 8 does not divide .*'s 12 attention heads and 4 "
        r"key/value heads .*: set tensor_parallel_size to 2 or 4, or shard",
    ):
        check_tensor_parallel_dims(str(tmp_path), 8)
    nested = {"text_config": {"num_attention_heads": 6, "intermediate_size": 1536}}  # a multimodal model's
    (tmp_path / "config.json").write_text(json.dumps(nested))
    with pytest.raises(
        ValueError, match=r"6 key/value heads \(each process takes 1/4 .*: set tensor_parallel_size to 2 or 3 or 6,"
    ):
        check_tensor_parallel_dims(str(tmp_path), 4)


def test_the_resolved_distribution_names_tensor_parallelism():
    """The run's ``distributed`` line and the Accelerator's ``distributed_type`` reason said
    ``DDP (2 processes)`` / ``DistributedDataParallel`` under --tensor_parallel_size 2, and
    ``FSDP2 (4 processes...)`` under TP 2 x FSDP2: they now name tensor parallelism."""
    from lowprec.state import DistributedEnv, DistributedType, _resolve_distributed
    from lowprec.train.resolve import Capabilities, resolve

    cpu = Capabilities(cuda_capability=None, packages=frozenset())
    tp = parse_config({"tensor_parallel_size": 2, "fp8": True, "fp8_recipe": "tensorwise"})
    assert resolve(tp, cpu, world_size=2).decisions["distributed"].value == "TP"
    both = resolve(tp.model_copy(update={"fsdp_version": 2}), cpu, world_size=4).decisions["distributed"]
    assert (both.value, both.reason) == (
        "TP x FSDP2",
        "4 processes, tensor_parallel_size: 2 x 2 FSDP2 shards, fsdp_version: 2",
    )
    assert resolve(parse_config({}), cpu, world_size=2).decisions["distributed"].value == "DDP"
    decision, _, _ = _resolve_distributed(DistributedEnv(world_size=2), None, None, tp=2)
    assert (
        decision.value == DistributedType.MULTI_CPU and decision.reason == "WORLD_SIZE=2: tensor parallelism, tp_size=2"
    )
    decision, _, _ = _resolve_distributed(DistributedEnv(world_size=2), None, None)
    assert decision.reason == "WORLD_SIZE=2: DistributedDataParallel"


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
