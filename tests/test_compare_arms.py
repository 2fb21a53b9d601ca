"""``lowprec compare`` with ``compare.arms``: runs that differ in other keys than the precision.
The issue 26 comparison in small (``examples/hf/compare_fp8_base.yaml``: a LoRA on an hf-fp8 base
against the same LoRA on its bf16 upcast, 2 seeds, 2 steps), and the arms' usage errors (one
exit-2 line each). Mechanics only: no loss bound, no timing."""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml

from lowprec.cli.main import main
from lowprec.export import load_fp8_base
from lowprec.export.fp8_base import is_fp8_base
from lowprec.fp8 import Float8BaseLinear
from lowprec.train.compare import plan_runs
from lowprec.train.config import load_config, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf", "compare_fp8_base.yaml")
TINY = os.path.join(ROOT, "examples", "tiny.yaml")


def _bases(tmp_path) -> dict[str, str]:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from make_fp8_bases import main as make
    finally:
        sys.path.pop(0)
    out = tmp_path / "bases"
    make([str(out), "--hidden", "32", "--pretrain_steps", "0"])
    return {"bf16-upcast": str(out / "bf16"), "hf-fp8": str(out / "hf-fp8")}


def test_the_fp8_base_example_compares_its_two_arms(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "src"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bases = _bases(tmp_path)
    data = yaml.safe_load(open(EXAMPLE))
    assert list(data["compare"]["arms"]) == ["bf16-upcast", "hf-fp8"]
    data["compare"]["arms"] = {arm: {"base_model": path} for arm, path in bases.items()}
    data["tokenizer"] = data["base_model"] = bases["bf16-upcast"]
    data["datasets"][0]["path"] = os.path.join(ROOT, "examples", "data", "alpaca_tiny.jsonl")
    data["output_dir"] = str(tmp_path / "run")
    cfg_path = tmp_path / "compare.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    flags = ["--seeds", "2", "--max_steps", "2", "--eval_steps", "2", "--logging_steps", "1", "--workers", "2"]
    out = tmp_path / "cmp"
    code = main(["compare", str(cfg_path), *flags, "--threshold", "0.5", "--compare_dir", str(out), "--quiet"])
    printed = capsys.readouterr().out
    report = json.loads((out / "compare.json").read_text())
    assert code == report["exit_code"] == {"within": 0, "outside": 1, "inconclusive": 4}[report["outcome"]]
    assert report["baseline"] == "bf16-upcast" and report["seeds"] == [42, 43]
    assert report["arms"] == {arm: {"base_model": path} for arm, path in bases.items()}
    assert set(report["precisions"]) == {"bf16-upcast", "hf-fp8"} and "hf-fp8" in printed
    for arm, path in bases.items():
        runs = report["precisions"][arm]["runs"]
        assert [r["seed"] for r in runs] == [42, 43]
        for r in runs:  # each run trained its own arm's base, the rest of the config unchanged
            dumped = yaml.safe_load(open(out / arm / f"seed{r['seed']}.yaml"))
            assert dumped["base_model"] == path and dumped["adapter"] == "lora" and dumped["fp8"] is False
            assert os.path.isfile(os.path.join(r["output_dir"], "adapter_model.safetensors"))
    assert is_fp8_base(bases["hf-fp8"]) and not is_fp8_base(bases["bf16-upcast"])
    # same seed: same adapters' init, data order and weights (exact upcast): the first losses agree closely
    firsts = {a: [r["train_losses"][0][1] for r in report["precisions"][a]["runs"]] for a in bases}
    assert firsts["hf-fp8"] == pytest.approx(firsts["bf16-upcast"], rel=0.02)
    assert len(report["precisions"]["hf-fp8"]["gap"]["per_seed"]) == 2 and "verdict" in report["precisions"]["hf-fp8"]


def test_the_fp8_arms_base_holds_about_a_byte_per_weight(tmp_path):
    """The hf-fp8 base as the FP8 arm loads it: its FP8 layers' resident bytes (E4M3 weights and
    float32 scales) per weight <= 1.05 (here 32x32 layers: one 4-byte scale per 1024 weights)."""
    bases = _bases(tmp_path)
    layers = [m for m in load_fp8_base(bases["hf-fp8"]).modules() if isinstance(m, Float8BaseLinear)]
    held = sum(m.weight.untyped_storage().nbytes() + m.weight_scale_bits.untyped_storage().nbytes() for m in layers)
    assert layers and held / sum(m.weight.numel() for m in layers) <= 1.05


def test_arms_plan_each_arms_keys_and_precision(tmp_path):
    cfg = parse_config(
        {
            "compare": {
                "arms": {"lo": {"learning_rate": 1e-4}, "hi": {"learning_rate": 1e-3, "precision": "fp8-rowwise"}}
            }
        }
    )
    runs = plan_runs(cfg, [], [1, 2], str(tmp_path), cfg.compare.arms)
    assert [(r.precision, r.seed) for r in runs] == [("lo", 1), ("hi", 1), ("lo", 2), ("hi", 2)]
    lo, hi = runs[0].config, runs[1].config
    assert (lo.learning_rate, hi.learning_rate) == (1e-4, 1e-3)
    assert lo.fp8 == cfg.fp8 and hi.fp8 and hi.fp8_recipe.name == "rowwise"
    assert runs[1].output_dir == os.path.join(str(tmp_path), "hi", "seed1")


@pytest.mark.parametrize(
    "arms,extra,msg",
    [
        (
            "{a: {}, b: {base_modle: x}}",
            [],
            "compare.arms.b.base_modle: not a trainer key (did you mean 'base_model'?)",
        ),
        ("{a: {}, b: {seed: 3}}", [], "arms.b.seed: lowprec compare sets seed for every run; drop it"),
        ("{a: {}}", [], "give at least two arms"),
        ("{a: {}, b/c: {}}", [], "arm name 'b/c'"),
        ("{a: {}, b: {precision: fp9}}", [], "compare.arms.b.precision: unknown precision 'fp9'"),
        ("{a: {}, b: {learning_rate: fast}}", [], "compare.arms.b: "),
        ("{a: {}, b: {}}", ["--precisions", "bf16,fp8"], "--precisions with compare.arms in the config"),
        ("{a: {}, b: {}}", ["--baseline", "c"], "--baseline c: not among compare.arms (a, b)"),
    ],
)
def test_arm_usage_errors_are_one_exit_2_line(tmp_path, capsys, arms, extra, msg):
    code = main(["compare", TINY, "--compare_dir", str(tmp_path), "--compare", f"{{arms: {arms}}}", *extra])
    err = capsys.readouterr().err
    assert code == 2 and msg in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("lowprec: error")]) == 1, err


def test_arms_with_precisions_in_the_yaml_is_one_error():
    with pytest.raises(ValueError, match="arms and precisions both given"):
        load_config(TINY, {"compare": {"precisions": ["bf16"], "arms": {"a": {}, "b": {}}}})
