"""The transformers examples (a Llama causal LM and a BERT classifier, each built from a config,
in FP8 with gradient accumulation, TensorBoard, automatic checkpoints and resume) run on CPU,
alone (the causal LM) and on 2 processes through `lowprec launch`."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.torchrun_util import free_port, run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(tmp_path, script: str, procs: int) -> dict:
    """``lowprec launch --cpu --num_processes procs examples/<script> OUT``; its one JSON line."""
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
        str(procs),
        "--main_process_port",
        str(free_port()),
        os.path.join(ROOT, "examples", script),
        str(tmp_path / "run"),
    ]
    proc = run_torchrun(
        cmd, lambda p: any(line.startswith("{") for line in p.stdout.splitlines()), env=env, timeout=300, cwd=ROOT
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("procs", [1, 2])
def test_causal_lm_example(tmp_path, procs):
    pytest.importorskip("transformers", reason="the example needs transformers (dev extra)")
    r = _launch(tmp_path, "accelerate_causal_lm.py", procs)
    assert r["processes"] == procs and r["ddp"] == (procs > 1)
    assert r["fp8_layers"] > 0  # the Llama's projections run in FP8
    assert r["loss_last"] < 0.8 * r["loss_first"]
    assert r["resume_max_abs_diff"] == 0.0  # resumed from the automatic checkpoint, bit-identical losses
    assert r["tensorboard_files"] >= 1 and r["checkpoints"] == ["checkpoint_0"]


@pytest.mark.parametrize("procs", [2])  # one process: the causal LM's row (the same script shape)
def test_seq_classification_example(tmp_path, procs):
    pytest.importorskip("transformers", reason="the example needs transformers (dev extra)")
    r = _launch(tmp_path, "accelerate_seq_classification.py", procs)
    assert r["processes"] == procs and r["fp8_layers"] > 0
    assert r["losses"][-1] < 0.5 * r["losses"][0]
    assert r["accuracy"][-1] >= 0.9  # 40 held-out sentences, counted once (gather_for_metrics drops the padding)
    assert r["resume_max_abs_diff"] == 0.0
