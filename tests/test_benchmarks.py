"""benchmarks/linear.py --tiny runs and writes its JSON (bytes are checked; times are not)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_linear_benchmark_tiny(tmp_path):
    out = tmp_path / "linear.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "linear.py"),
        "--tiny",
        "--modes",
        "eager",
        "--recipes",
        "tensorwise,rowwise",
        "--iters",
        "1",
        "--out",
        str(out),
    ]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    data = json.loads(out.read_text())
    assert {"command", "date", "torch", "device", "results"} <= set(data)
    rows = {(r["M"], r["K"], r["N"], r["variant"]): r for r in data["results"]}
    for r in rows.values():
        assert "error" not in r, r
        assert r["ms"] > 0
    # Backward keeps FP8 (1 byte) where the bf16 Linear keeps bf16 (2 bytes): at most 0.55x.
    for shape in {(m, k, n) for m, k, n, _ in rows}:
        assert rows[(*shape, "bf16")]["saved_bytes"] > 0
        assert rows[(*shape, "tensorwise")]["saved_bytes_vs_bf16"] <= 0.55
        assert rows[(*shape, "rowwise")]["saved_bytes_vs_bf16"] <= 0.55


def test_engine_demo_example_runs():
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "fp8_engine_demo.py"),
        "--steps",
        "3",
        "--seq_len",
        "64",
        "--batch_size",
        "2",
    ]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=300)
    assert "Linear layer(s) converted" in res.stdout and "step    1" in res.stdout


def test_train_step_benchmark_tiny(tmp_path):
    out = tmp_path / "ts.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "train_step.py"),
        "--tiny",
        "--recipes",
        "tensorwise",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--out",
        str(out),
    ]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) >= {"bf16", "tensorwise", "tensorwise+auto"}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["bf16"]["fp8_layers"] == 0 and rows["tensorwise"]["fp8_layers"] == 27
    # llama-tiny at 128 tokens per step: the cost model predicts no layer wins on an H100
    assert rows["tensorwise+auto"]["fp8_layers"] == 0
