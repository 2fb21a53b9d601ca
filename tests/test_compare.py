"""`lowprec compare`: precision names, the report and verdict on synthetic runs, the CLI, and one
tiny real comparison (2 precisions x 2 seeds, a few steps, runs in parallel processes)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from lowprec.cli.main import main
from lowprec.train.compare import plan_runs, resolve_workers
from lowprec.train.compare_report import build_report, choose_baseline, format_report
from lowprec.train.config import load_config, parse_config
from lowprec.train.precisions import FP8_ONLY_OFF, precision_names, precision_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")


# ------------------------------------------------------------------ precision names
def test_precision_names_set_only_precision_keys():
    cfg = parse_config({"fp8": True, "bf16": "full", "fp8_recipe": {"name": "delayed", "amax_history_len": 4}})
    # a high-precision run: its precision keys, and the FP8-only keys off (it has no FP8 layer to watch)
    assert precision_overrides("fp32", cfg) == {
        "fp8": False,
        "fp16": None,
        "bf16": False,
        "fp8_backend": "native",
        **FP8_ONLY_OFF,
    }
    own = precision_overrides("fp8", cfg)
    assert own["bf16"] == "full" and own["fp8_recipe"] == {"name": "delayed", "amax_history_len": 4}
    other = precision_overrides("fp8-rowwise", cfg)  # another recipe: the config's delayed fields do not apply
    assert other["fp8_recipe"] == "rowwise" and other["fp8_backend"] == "native"
    ao = precision_overrides("fp8-torchao-rowwise", cfg)
    assert (ao["fp8_backend"], ao["fp8_recipe"]) == ("torchao", "rowwise")
    for name in precision_names():  # every advertised name validates on a plain config
        parse_config({}).replace(**precision_overrides(name, parse_config({})))
    with pytest.raises(ValueError, match="did you mean 'bf16'"):
        precision_overrides("bf61", cfg)
    with pytest.raises(ValueError, match="unknown precision 'fp8-rowwize'"):
        precision_overrides("fp8-rowwise".replace("s", "z"), cfg)
    with pytest.raises(ValueError, match="torchao has no 'delayed' recipe"):
        precision_overrides("fp8-torchao", cfg)


def test_fp8_backend_key_rules():
    assert parse_config({"fp8": True, "fp8_backend": "torchao"}).fp8_backend == "torchao"
    for bad, msg in (
        ({"fp8_backend": "torchao"}, "needs fp8: true"),
        ({"fp8": True, "fp8_backend": "torchao", "fp8_recipe": "blockwise"}, "no 'blockwise' recipe"),
        ({"fp8": True, "fp8_backend": "torchao", "fp8_filter": ["o_proj"]}, "drop fp8_filter"),
        ({"fp8": True, "fp8_backend": "te"}, "fp8_backend"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_config(bad)


def test_plan_runs_pairs_seeds_across_precisions(tmp_path):
    cfg = parse_config({"fp8": True, "seed": 3, "compare": {"seeds": 2}})
    runs = plan_runs(cfg, ["bf16", "fp8-delayed"], cfg.compare.seed_list(cfg.seed), str(tmp_path))
    assert [(r.precision, r.seed) for r in runs] == [("bf16", 3), ("fp8-delayed", 3), ("bf16", 4), ("fp8-delayed", 4)]
    assert all(r.config.compare is None and r.config.save_steps is None for r in runs)
    assert runs[1].config.fp8_recipe.name == "delayed" and runs[0].config.fp8 is False
    assert runs[3].output_dir == str(tmp_path / "fp8-delayed" / "seed4")
    with pytest.raises(ValueError, match="list each precision once"):
        plan_runs(cfg, ["bf16", "bf16"], [1], str(tmp_path))


def test_a_compare_with_the_guard_guards_the_fp8_runs_only(tmp_path):
    """fp8_guard / fp8_health in a compared config: the FP8 runs keep them, the bf16 baseline
    (no FP8 layers to watch) runs without them instead of failing validation."""
    cfg = parse_config({"fp8": True, "fp8_guard": "act", "fp8_guard_recover_after": 4, "fp8_health": True})
    base, fp8_run = plan_runs(cfg, ["bf16", "fp8-tensorwise"], [1], str(tmp_path))
    assert (base.config.fp8, base.config.fp8_guard, base.config.fp8_health) == (False, "off", None)
    assert base.config.fp8_guard_recover_after is None
    assert (fp8_run.config.fp8_guard, fp8_run.config.fp8_guard_recover_after, fp8_run.config.fp8_health) == (
        "act",
        4,
        True,
    )


def test_the_shipped_compare_config_plans_every_recipe(tmp_path):
    from lowprec.train.config import load_config

    cfg = load_config(os.path.join(ROOT, "examples", "compare.yaml"))
    spec = cfg.compare
    runs = plan_runs(cfg, spec.precisions, spec.seed_list(cfg.seed), str(tmp_path))
    assert len(runs) == len(spec.precisions) * 5 and spec.threshold == 0.005
    recipes = {(r.config.fp8_backend, r.config.fp8_recipe.name) for r in runs if r.config.fp8}
    assert {n for b, n in recipes if b == "native"} == {
        "tensorwise",
        "delayed",
        "rowwise",
        "rowwise_with_gw_hp",
        "blockwise",
    }
    assert all(b == "native" for b, _ in recipes)  # torchao is added on the command line (README), not timed here


def test_workers_resolved_once_with_a_reason():
    cfg = parse_config({"cpu_threads": 1})
    w, threads = resolve_workers("auto", cfg, 10, "cpu")
    assert 1 <= w.value <= 10 and "CPU cores" in w.reason and threads is None
    assert resolve_workers("auto", cfg, 10, "cuda")[0].value == 1
    assert resolve_workers(3, cfg, 2, "cpu")[0].value == 2  # never more than the runs
    w, threads = resolve_workers(2, parse_config({}), 4, "cpu")  # cpu_threads unset: split the cores
    assert threads is not None and threads >= 1


# ------------------------------------------------------------------ the report on synthetic runs
def _run(final, curve, eval_loss=None):
    return {
        "final_train_loss": curve[-1],
        "final_eval_loss": final if eval_loss is None else eval_loss,
        "train_losses": [[10 * (i + 1), v] for i, v in enumerate(curve)],
        "eval_losses": [[10 * len(curve), final]],
        "tokens_per_s": 1000.0,
        "peak_mem_mb": 100.0,
        "wall_s": 1.0,
        "output_dir": "x",
    }


def _runs(finals, scale=1.0):
    """One run per seed; each seed's loss level differs a lot (the noise floor), the precision
    scales it by ``scale`` (so its paired gap is exactly scale - 1)."""
    return {s: _run(f * scale, [5.0 * scale, 3.0 * scale, f * scale]) for s, f in finals.items()}


def test_report_intervals_paired_gaps_and_noise_floor():
    levels = {1: 2.0, 2: 2.5, 3: 2.2}  # seed-to-seed spread of 11% between runs of the same precision
    runs = {"bf16": _runs(levels), "fp8": {s: r for s, r in _runs(levels, 1.001).items()}, "fp32": _runs(levels, 0.999)}
    report = build_report(runs, "bf16", threshold=0.005)
    assert list(report["precisions"]) == ["fp32", "bf16", "fp8"]
    fp8 = report["precisions"]["fp8"]
    assert fp8["final_eval_loss"]["mean"] == pytest.approx(1.001 * 6.7 / 3)
    # the paired gap is exactly +0.1% for every seed: zero spread despite the 11% between seeds
    assert fp8["gap"]["final_eval_loss"]["mean"] == pytest.approx(0.001)
    assert fp8["gap"]["final_eval_loss"]["sd"] == pytest.approx(0.0, abs=1e-12)
    assert fp8["gap"]["tail_train_loss"]["mean"] == pytest.approx(0.001)
    assert fp8["verdict"]["outcome"] == "within" and fp8["first_departure_step"] is None
    assert "verdict" not in report["precisions"]["fp32"]  # above the baseline: gaps, no verdict
    floor = report["noise_floor"]
    assert floor["values"] == [2.0, 2.5, 2.2] and floor["relative_sd"] == pytest.approx(0.25166 / 2.2333, rel=1e-3)
    assert report["metric"] == "final_eval_loss" and (report["outcome"], report["exit_code"]) == ("within", 0)
    assert len(fp8["runs"]) == 3 and fp8["runs"][0]["seed"] == 1  # compare.json keeps every run
    text = format_report(report)
    assert "+0.10% [+0.10, +0.10]" in text and "noise floor: bf16" in text and "exit code 0" in text


def test_report_outcomes_and_exit_codes():
    levels = {1: 2.0, 2: 2.5, 3: 2.2}
    base = _runs(levels)
    worse = build_report({"bf16": base, "fp8": _runs(levels, 1.03)}, "bf16", 0.005)
    assert worse["outcome"] == "outside" and worse["exit_code"] == 1
    assert worse["precisions"]["fp8"]["first_departure_step"] == 10  # 3% above from the first logged point
    mixed = {1: 1.0, 2: 1.01, 3: 0.995}  # paired gaps 0, +1%, -0.5%: straddle the 0.5% threshold
    unsure = {"bf16": base, "fp8": {s: _run(levels[s] * mixed[s], [5.0, 3.0, levels[s] * mixed[s]]) for s in levels}}
    r = build_report(unsure, "bf16", 0.005)
    assert (r["outcome"], r["exit_code"]) == ("inconclusive", 4)
    assert r["precisions"]["fp8"]["verdict"]["seeds_needed"] > 3 and "seeds" in format_report(r)
    diverged = build_report(
        {"bf16": base, "fp8": _runs({1: 2.0, 2: 2.5})}, "bf16", 0.005, failed={"fp8": {3: "stopped: non-finite loss"}}
    )
    assert (
        diverged["outcome"] == "outside" and "diverged (seed 3)" in diverged["precisions"]["fp8"]["verdict"]["reason"]
    )
    skipped = build_report({"bf16": base, "fp8": _runs(levels)}, "bf16", 0.005, skipped={"fp8-torchao": "no torchao"})
    assert "skipped fp8-torchao: no torchao" in format_report(skipped)
    # without validation losses the final training loss decides
    train_only = {p: {s: {**r, "final_eval_loss": None} for s, r in v.items()} for p, v in unsure.items()}
    assert build_report(train_only, "bf16", 0.005)["metric"] == "final_train_loss"


def test_baseline_choice():
    assert choose_baseline(["fp32", "bf16", "fp8"]) == "bf16"
    assert choose_baseline(["fp8", "fp32"]) == "fp32"
    assert choose_baseline(["fp32", "bf16"], "fp32") == "fp32"
    with pytest.raises(ValueError, match="--baseline fp16"):
        choose_baseline(["bf16", "fp8"], "fp16")


# ------------------------------------------------------------------ the command line
def test_cli_parsing_and_usage_errors(tmp_path, capsys):
    import argparse

    from lowprec.cli.runners.compare import compare_settings, parse_seeds

    assert parse_seeds("5") == 5 and parse_seeds("1,2,9") == [1, 2, 9]
    cfg = parse_config({"seed": 10, "compare": {"seeds": 4, "threshold": 0.01, "precisions": ["bf16", "fp8"]}})
    args = argparse.Namespace(
        precisions=None, seeds="2", threshold=None, baseline=None, tail_fraction=None, reuse=None, workers="3"
    )
    spec = compare_settings(args, cfg)  # the flag wins, the YAML fills the rest
    assert (spec.seed_list(cfg.seed), spec.threshold, spec.precisions, spec.workers) == (
        [10, 11],
        0.01,
        ["bf16", "fp8"],
        3,
    )
    for argv, msg in (
        (["--seeds", "x"], "--seeds x: give a number"),
        (["--seeds", "0"], "--seeds: 0: give a number of seeds"),
        (["--seeds", "1,1"], "list each seed once"),
        (["--threshold", "1.5"], "--threshold"),
        (["--workers", "two"], "--workers two"),
        (["--precisions", "bf16,fp9"], "unknown precision 'fp9'"),
        (["--baseline", "fp32", "--precisions", "bf16,fp8"], "--baseline fp32"),
        (["--compare", "{seedz: 2}"], "unknown key 'compare.seedz' (did you mean 'seeds'?)"),
        (["--tensor_parallel_size", "2"], "tensor_parallel_size: 2: that needs several processes per run"),
        (["--deepspeed", "{zero_optimization: {stage: 2}}"], "deepspeed: set: that needs several processes"),
    ):
        assert main(["compare", TINY, "--compare_dir", str(tmp_path), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (argv, err)
    # no config: its usage says CONFIG.yaml; on defaults alone it started three whole-epoch runs
    assert main(["compare", "--precisions", "bf16,fp8", "--compare_dir", str(tmp_path)]) == 2
    assert "a YAML config comes first: lowprec compare CONFIG.yaml" in capsys.readouterr().err


def test_help_prints_percent_signs_once(capsys):
    """The description is printed as written (argparse formats help strings, not descriptions):
    '95%%' there showed as two percent signs."""
    assert main(["compare", "--help"]) == 0
    out = capsys.readouterr().out
    assert "95% intervals" in out and "%%" not in out, out


def test_compare_end_to_end_two_seeds(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "src"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import lowprec.backends.availability as avail

    # fp8-torchao is skipped, with its reason, where torchao is missing (simulated here)
    found = avail.module_available
    monkeypatch.setattr(avail, "module_available", lambda m: m != "torchao" and found(m))
    code = main(
        [
            "compare",
            TINY,
            "--precisions",
            "bf16,fp8,fp8-torchao",
            "--seeds",
            "2",
            "--max_steps",
            "2",
            "--eval_steps",
            "2",
            "--logging_steps",
            "1",
            "--workers",
            "2",
            "--threshold",
            "0.5",
            "--compare_dir",
            str(tmp_path),
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "compare.json").read_text())
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert report["seeds"] == [7, 8] and report["baseline"] == "bf16"
    assert "torchao is not installed" in report["skipped"]["fp8-torchao"] and "skipped fp8-torchao" in out
    fp8, bf16 = report["precisions"]["fp8"], report["precisions"]["bf16"]
    for row in (fp8, bf16):
        assert [r["seed"] for r in row["runs"]] == [7, 8]
        assert all(os.path.isfile(os.path.join(r["output_dir"], "metrics.jsonl")) for r in row["runs"])
    # same seed, same data and init: the first logged losses agree closely; seeds differ
    firsts = {p: [r["train_losses"][0][1] for r in report["precisions"][p]["runs"]] for p in ("bf16", "fp8")}
    assert firsts["fp8"] == pytest.approx(firsts["bf16"], rel=0.02)
    gaps = [
        (f["final_eval_loss"] - b["final_eval_loss"]) / b["final_eval_loss"] for f, b in zip(fp8["runs"], bf16["runs"])
    ]
    assert fp8["gap"]["per_seed"] == pytest.approx(gaps)
    assert code == report["exit_code"] == {"within": 0, "outside": 1, "inconclusive": 4}[report["outcome"]]
    assert f"exit code {code}" in out

    # --reuse: the same comparison again reads every finished run and launches nothing
    import lowprec.train.compare as compare_mod

    monkeypatch.setattr(compare_mod, "_launch", lambda run: pytest.fail(f"{run.precision} seed {run.seed} re-ran"))
    args = [
        "compare",
        TINY,
        "--precisions",
        "bf16,fp8",
        "--seeds",
        "2",
        "--max_steps",
        "2",
        "--eval_steps",
        "2",
        "--logging_steps",
        "1",
        "--workers",
        "2",
        "--threshold",
        "0.5",
        "--compare_dir",
        str(tmp_path),
        "--reuse",
    ]
    assert main(args) == code
    again = json.loads((tmp_path / "compare.json").read_text())
    assert again["precisions"]["fp8"]["gap"] == fp8["gap"] and "reused" in capsys.readouterr().err
    # any other key (here max_steps), and a summary from another lowprec version, run again
    cfg = load_config(TINY, {"max_steps": 2, "eval_steps": 2, "logging_steps": 1})
    same = plan_runs(cfg.replace(cpu_threads=1), ["fp8"], [7], str(tmp_path))[0]
    assert compare_mod.finished_summary(same) is not None
    other = plan_runs(cfg.replace(cpu_threads=1, max_steps=3), ["fp8"], [7], str(tmp_path))[0]
    assert compare_mod.finished_summary(other) is None
    summary = os.path.join(same.output_dir, "summary.json")
    old = json.loads(open(summary).read())
    with open(summary, "w") as f:
        json.dump({**old, "lowprec_version": "0.0.0"}, f)
    assert compare_mod.finished_summary(same) is None


def test_inert_keys_are_noted_once_before_the_runs(tmp_path, monkeypatch, caplog):
    """The runs train from dumped configs, which no longer hold a key the config makes inert
    (lowprec.train.config.inert): compare says it once, before planning them."""
    import lowprec.train.compare as cmp

    def stop(*_a, **_k):
        raise RuntimeError("planned")

    monkeypatch.setattr(cmp, "plan_runs", stop)
    cfg = parse_config({"val_set_size": 0, "evals_per_epoch": 4, "output_dir": str(tmp_path)})
    with caplog.at_level(logging.INFO, logger="lowprec"), pytest.raises(RuntimeError, match="planned"):
        cmp.compare(cfg, ["bf16", "fp8"], [1], 0.05, str(tmp_path))
    assert [r.getMessage() for r in caplog.records if "note" in r.getMessage()] == [
        "lowprec compare: note: evals_per_epoch: 4 is ignored: it only matters with val_set_size above 0, as in "
        "Axolotl; set that or drop evals_per_epoch"
    ]
