"""The cost model reproduces published H100 speedups; the auto filter follows it."""

import statistics
import sys
from pathlib import Path

import pytest
from torch import nn

import lowprec.fp8 as fp8
from lowprec.fp8.observe.cost_model import auto_module_filter, predict_speedup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fit_cost_model import points  # noqa: E402


def test_fit_to_published_table():
    errs = [abs(predict_speedup(*shape, recipe, "h100") - s) for recipe, shape, s in points()]
    assert statistics.mean(errs) < 0.08
    # The worst point is torchao's tiny tensorwise shape (1024x2048x1024: 0.80 published, 0.44
    # predicted). The model errs on the safe side there: it keeps such layers in bf16.
    assert max(errs) < 0.4
    assert predict_speedup(1024, 2048, 1024, "tensorwise") < 0.8
    # the qualitative shape: small N loses, large N wins
    assert predict_speedup(16384, 4096, 1024, "rowwise") < 0.8
    assert predict_speedup(16384, 16384, 32768, "rowwise") > 1.4


def test_per_tensor_beats_rowwise_on_casts():
    # rowwise casts every operand once per GEMM; per-tensor recipes cast once and transpose.
    # Delayed costs what tensorwise costs: lowprec still computes its amax in a separate pass.
    shape = (8192, 4096, 4096)
    d, t, r = (predict_speedup(*shape, name) for name in ("delayed", "tensorwise", "rowwise"))
    assert d == pytest.approx(t) and t > r


def test_auto_filter_converts_only_winning_layers():
    model = nn.Sequential(
        nn.Linear(4096, 4096), nn.Linear(4096, 1024), nn.Linear(4096, 14336), nn.Linear(14336, 4096), nn.Linear(16, 8)
    )
    rule = auto_module_filter(tokens_per_step=16384, recipe="tensorwise", device="h100")
    report = fp8.convert(model, "tensorwise", module_filter=rule)
    converted = {n for n, *_ in report.converted}
    assert converted == {"0", "2", "3"}  # 4096->1024 (small N) and 16->8 stay in bf16
    for name, *_ in report.converted:
        lin = model.get_submodule(name)
        assert predict_speedup(16384, lin.in_features, lin.out_features, "tensorwise") >= 1.0


def test_auto_filter_few_tokens_converts_nothing():
    model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096))
    report = fp8.convert(model, "tensorwise", module_filter=auto_module_filter(256, "tensorwise"))
    assert report.num_converted == 0


def test_auto_filter_validates():
    with pytest.raises(ValueError, match="tokens_per_step"):
        auto_module_filter(0, "tensorwise")
