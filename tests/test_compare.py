"""`lowprec compare`: runs per precision, compare.png / compare.json, the table and the verdict."""

from __future__ import annotations

import json
import os

import pytest

from lowprec.cli.main import main
from lowprec.train.compare import format_table, precision_overrides, summarize
from lowprec.train.config import parse_config
from lowprec.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")


def test_compare_cli_on_the_tiny_config(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "src"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = main(["compare", TINY, "--precisions", "fp32,bf16,fp8", "--max_steps", "4", "--eval_steps", "2",
                 "--output_dir", str(tmp_path), "--quiet", "--threshold", "0.0"])
    out = capsys.readouterr().out
    cdir = tmp_path / "compare"
    assert (cdir / "compare.png").stat().st_size > 0
    report = json.loads((cdir / "compare.json").read_text())
    assert report["reference"] == "fp32"
    rows = {r["precision"]: r for r in report["rows"]}
    assert list(rows) == ["fp32", "bf16", "fp8"]
    curves = {p: {r["step"]: r["loss"] for r in read_metrics(rows[p]["output_dir"], "train")} for p in rows}
    # same seed, same data order: identical first-step inputs and weights, so step 1 agrees closely
    assert curves["fp8"][1] == pytest.approx(curves["fp32"][1], rel=0.02)
    for p in ("bf16", "fp8"):  # the gap column is the max relative gap of the training curves
        gap = max(abs(curves[p][s] - curves["fp32"][s]) / curves["fp32"][s] for s in curves["fp32"])
        assert rows[p]["max_rel_gap"] == pytest.approx(gap)
        assert rows[p]["final_eval_loss"] == read_metrics(rows[p]["output_dir"], "eval")[-1]["loss"]
    parity = report["parity"]
    assert parity["baseline"] == "bf16"
    assert parity["rel_diff"] == pytest.approx((rows["fp8"]["final_eval_loss"] - rows["bf16"]["final_eval_loss"]) / rows["bf16"]["final_eval_loss"])
    assert code == (1 if parity["rel_diff"] > 0.0 else 0)  # threshold 0: any excess fails
    for p in rows:
        assert p in out and f"{rows[p]['final_train_loss']:.4f}" in out
    assert "parity: fp8 final validation loss" in out


def _summary(losses, eval_loss, tps=1000.0, mem=100.0):
    return {"final_train_loss": losses[-1], "final_eval_loss": eval_loss, "train_losses": list(enumerate(losses, 1)),
            "tokens_per_s": tps, "peak_mem_mb": mem, "wall_s": 1.0, "output_dir": "x"}


def test_summarize_threshold_and_reference():
    s = {"fp8": _summary([5.0, 4.2, 3.9], 4.07), "bf16": _summary([5.0, 4.0, 3.8], 4.0), "fp32": _summary([5.0, 4.0, 3.7], 3.9)}
    r = summarize(s, threshold=0.02)
    assert r.reference == "fp32" and [x.precision for x in r.rows] == ["fp32", "bf16", "fp8"]
    fp8 = r.rows[2]
    assert fp8.max_rel_gap == pytest.approx(0.2 / 3.7)
    assert r.parity["rel_diff"] == pytest.approx(0.0175) and r.passed
    assert not summarize({**s, "fp8": _summary([5.0, 4.2, 3.9], 4.1)}, 0.02).passed
    # without bf16 the verdict compares with the reference run
    r = summarize({"fp32": s["fp32"], "fp8": s["fp8"]}, 0.02)
    assert r.parity["baseline"] == "fp32" and not r.passed
    # no validation set: the final training loss decides, and the table says so
    r = summarize({"bf16": _summary([4.0], None), "fp8": _summary([4.01], None)}, 0.02)
    assert r.parity["metric"] == "final_train_loss" and r.passed
    assert "train (no validation set)" in format_table(r)
    assert summarize({"bf16": s["bf16"]}).parity is None


def test_precision_overrides_and_bad_list(capsys):
    cfg = parse_config({"fp8": True, "bf16": "full"})
    assert precision_overrides("fp8", cfg)["bf16"] == "full"
    assert precision_overrides("fp32", cfg) == {"fp8": False, "fp16": None, "bf16": False}
    with pytest.raises(ValueError, match="did you mean 'bf16'"):
        precision_overrides("bf61", cfg)
    assert main(["compare", TINY, "--precisions", "fp32,fp32"]) == 2
    assert "list each precision once" in capsys.readouterr().err


def test_fp8_recipe_variants_run_beside_each_other():
    cfg = parse_config({"fp8": True})
    assert precision_overrides("fp8:mxfp8", cfg) == {**precision_overrides("fp8", cfg), "fp8_recipe": "mxfp8"}
    with pytest.raises(ValueError, match="--precisions fp8:mxfp9: unknown FP8 recipe"):
        precision_overrides("fp8:mxfp9", cfg)
    s = {"bf16": _summary([5.0, 4.0], 4.0), "fp8": _summary([5.0, 4.1], 4.04),
         "fp8:mxfp8": _summary([5.0, 4.0], 4.01), "fp8:nvfp4": _summary([5.0, 4.3], 4.2)}
    r = summarize(s, threshold=0.02)
    assert [x.precision for x in r.rows] == ["bf16", "fp8", "fp8:mxfp8", "fp8:nvfp4"]
    assert r.parities["fp8:mxfp8"]["rel_diff"] == pytest.approx(0.0025) and r.parities["fp8"]["passed"]
    assert not r.passed  # nvfp4 is 5% above bf16
    table = format_table(r)
    assert "parity: fp8:mxfp8 final validation loss" in table and "parity: fp8:nvfp4" in table
