"""Every examples/accelerate_*.py runs (CPU; 2 processes for the distributed ones), its loss goes
down and matches its hand-written raw-engine baseline within the stated tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.torchrun_util import free_port, run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


NEEDS_DS = pytest.mark.skipif(
    not has_deepspeed(), reason="DeepSpeed is an optional extra (pip install 'lowprec[deepspeed]')"
)


@pytest.mark.parametrize(
    "script, procs",
    [
        ("accelerate_single_device.py", 1),
        ("accelerate_ddp.py", 2),
        ("accelerate_fsdp2.py", 2),
        # ZeRO 1 (DeepSpeed's stage-2 optimizer class, without gradient partitioning): 2 processes
        # through the Accelerator in test_msamp_deepspeed.py
        pytest.param("accelerate_deepspeed.py --zero_stage 2", 2, marks=NEEDS_DS),
        pytest.param("accelerate_deepspeed.py --zero_stage 3", 2, marks=NEEDS_DS),
    ],
)
def test_example(script, procs, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["DS_ACCELERATOR"] = "cpu"
    # DeepSpeed JIT-compiles C++ ops into this folder: under lowprec it must compile none (its
    # CPU shared-memory all-reduce, inference only, is marked unavailable: utils/deepspeed.py)
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")
    name, *args = script.split()
    path = os.path.join(ROOT, "examples", name)
    if procs == 1:
        cmd = [sys.executable, path, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "lowprec.cli._torchrun",
            "--nproc_per_node",
            str(procs),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "-m",
            "lowprec.cli._worker",
            path,
            *args,
        ]
    limit = 480
    if procs == 1:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    else:
        proc = run_torchrun(
            cmd, lambda p: any(line.startswith("{") for line in p.stdout.splitlines()), env=env, timeout=limit, cwd=ROOT
        )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout
    result = lines[0]
    assert result["ok"] and result["max_rel_diff_vs_baseline"] <= result["tolerance"]
    assert result["loss_last5"] < 0.7 * result["loss_first5"]
    built = sorted(p.name for p in (tmp_path / "torch_extensions").glob("*/*"))
    assert built == [], f"DeepSpeed compiled {built}"
