"""benchmarks/memory.py and benchmarks/comm_bytes.py run in their smallest mode and write the
JSON the issue notes quote (keys checked, numbers sanity-checked, nothing timed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_memory_benchmark_tiny_writes_json(tmp_path):
    out = tmp_path / "memory.json"
    _load("memory").main(
        [
            "--tiny",
            "--steps",
            "1",
            "--batch",
            "1",
            "--seq",
            "16",
            "--variants",
            "bf16_amp,bf16_amp_o2",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    for key in (
        "device",
        "torch",
        "date",
        "command",
        "model",
        "state_bytes_per_param",
        "peak",
        "peak_ratio_vs_bf16_amp",
    ):
        assert key in data, key
    sb = data["state_bytes_per_param"]
    assert sb["torch_adamw_fp32_params"]["moments_bytes_per_param"] == pytest.approx(8.0)
    assert sb["fp8adamw_fp32_params"]["moments_bytes_per_param"] <= 3 + 4 / 128 + 1e-3
    assert sb["fp8adamw_bf16_params"]["total_bytes_per_param"] > 7.0  # + fp32 master
    base, o2 = data["peak"]["bf16_amp"], data["peak"]["bf16_amp_o2"]
    assert base["peak_bytes"] > 0 and 0 < o2["peak_bytes"] < base["peak_bytes"]
    # O2 holds gradients in FP8: 1 byte per element + 4 per tensor, vs 4 for fp32 grads
    assert o2["grad_bytes_after_backward"] < 0.3 * base["grad_bytes_after_backward"]
    saved = data["saved_bytes"]  # what backward keeps: FP8 / FP4 inputs of the Linear layers
    for recipe in ("tensorwise", "mxfp8", "nvfp4"):
        assert 0 < saved[recipe]["bytes"] < saved["bf16_amp"]["bytes"], recipe
    # fp8_activations: RMSNorm and SwiGLU keep E4M3 copies too (0.83x at this size)
    assert saved["tensorwise+fp8_activations"]["bytes"] < 0.9 * saved["tensorwise"]["bytes"]


def test_comm_bytes_benchmark_counts_half_of_bf16(tmp_path):
    # its own process: the benchmark spawns its gloo workers from __main__
    import os
    import subprocess
    import sys

    out = tmp_path / "comm.json"
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent / "src"), OMP_NUM_THREADS="1")
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "comm_bytes.py"),
            "--world",
            "2",
            "--dtypes",
            "e4m3",
            "--setups",
            "ddp",
            "--batch",
            "1",
            "--seq",
            "16",
            "--out",
            str(out),
        ],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
    )
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert row["fp8_payload_bytes"] <= row["bf16_bytes"] / 2 + 2
    assert row["fp8_over_bf16"] < 0.51
    assert row["rel_err"] < 0.06
