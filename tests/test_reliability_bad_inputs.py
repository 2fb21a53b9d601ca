"""Reliability table 3: bad inputs give one clear line, never silence, never a traceback.

Four tables, one row each: trainer YAML (``lowprec train bad.yaml``), command-line flags
(``lowprec train|launch|compare ...``), launch YAML (``lowprec launch --config_file bad.yaml``)
and Python arguments (``Accelerator(...)`` and friends). A CLI row passes when the exit code is
2, stderr has exactly one ``lowprec...: error: ...`` line holding the expected words, and no
traceback; a Python row when the call raises ``ValueError``/``TypeError`` with a one-line
message holding them. Everything runs in-process; rows that fail late stop before any training.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import yaml
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
# a valid, fast base every dict row starts from (a row that wrongly passes trains one tiny step)
BASE = {"base_model": "builtin:llama-tiny", "datasets": ["builtin:stdlib"], "dataset_max_bytes": 20000,
        "sequence_len": 32, "micro_batch_size": 2, "max_steps": 1, "val_set_size": 0.05, "progress_bar": False,
        "use_tensorboard": False, "cpu_threads": 1}
ERROR_LINE = re.compile(r"^lowprec( \w+)?: error: ")

TRAIN_YAML = [
    ("empty-file", "", "the file is empty"),
    ("comments-only", "# nothing here\n", "the file is empty"),
    ("duplicate-key", "learning_rate: 1.0e-3\nlearning_rate: 5.0\n", "'learning_rate' is given twice"),
    ("duplicate-nested-key", "fsdp_version: 2\nfsdp_config:\n  reshard_after_forward: true\n  reshard_after_forward: false\n",
     "'reshard_after_forward' is given twice"),
    ("syntax-error", "learning_rate: [1\n", "not valid YAML"),
    ("top-level-list", "- learning_rate\n", "expected a mapping"),
    ("top-level-scalar", "hello\n", "expected a mapping"),
    ("unknown-key", {"lerning_rate": 1e-3}, "did you mean 'learning_rate'"),
    ("unknown-nested-key", {"fsdp_version": 2, "fsdp_config": {"reshard": True}}, "unknown key 'reshard'"),
    ("negative-lr", {"learning_rate": -1}, "learning_rate"),
    ("lr-not-a-number", {"learning_rate": "fast"}, "learning_rate"),
    ("micro-batch-0", {"micro_batch_size": 0}, "micro_batch_size"),
    ("accumulation-0", {"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ("max-steps-0", {"max_steps": 0}, "max_steps"),
    ("epochs-0", {"num_epochs": 0, "max_steps": None}, "num_epochs"),
    ("sequence-len-1", {"sequence_len": 1}, "sequence_len"),
    ("sequence-len-too-long", {"sequence_len": 4096}, "max_seq_len"),
    ("fp8-sequence-len", {"fp8": True, "sequence_len": 100}, "use sequence_len: 112"),
    ("unknown-optimizer", {"optimizer": "adam8bit"}, "unknown optimizer"),
    ("unknown-scheduler", {"lr_scheduler": "step"}, "unknown lr_scheduler"),
    ("unknown-builtin-model", {"base_model": "builtin:llama-huge"}, "unknown built-in model"),
    ("missing-model-dir", {"base_model": "/nonexistent/model"}, "downloads are not supported"),
    ("unknown-corpus", {"datasets": ["builtin:nope"]}, "unknown builtin corpus"),
    ("dataset-type", {"datasets": [{"path": "builtin:stdlib", "type": "chat"}]}, "datasets.0.type"),
    ("missing-data-file", {"datasets": ["/nonexistent/data.txt"]}, "does not exist"),
    ("fp16-and-bf16", {"fp16": True, "bf16": True}, "keep one"),
    ("fp8-and-fp16", {"fp8": True, "fp16": True}, "drop fp16"),
    ("unknown-recipe", {"fp8": True, "fp8_recipe": "fancy"}, "unknown FP8 recipe"),
    ("unknown-recipe-field", {"fp8": True, "fp8_recipe": {"name": "delayed", "amax_history_lenn": 4}}, "amax_history_len"),
    ("all-gather-without-fsdp", {"fp8": True, "fp8_enable_fsdp_float8_all_gather": True}, "requires FSDP2"),
    ("fsdp-version-1", {"fsdp_version": 1}, "fsdp_version: 1 is not supported"),
    ("fsdp-config-alone", {"fsdp_config": {"reshard_after_forward": False}}, "add fsdp_version: 2"),
    ("deepspeed-and-fsdp", {"deepspeed": {"zero_optimization": {"stage": 1}}, "fsdp_version": 2}, "pick one"),
    ("deepspeed-missing-file", {"deepspeed": "/nonexistent/ds.json"}, "not found"),
    ("deepspeed-bad-json", {"deepspeed": "{bad_json}"}, "not valid JSON"),
    ("eval-without-validation", {"eval_steps": 5, "val_set_size": 0}, "set val_set_size"),
    ("val-set-size-1.5", {"val_set_size": 1.5}, "val_set_size"),
    ("bf16-maybe", {"bf16": "maybe"}, "bf16"),
    ("tensorboard-sometimes", {"use_tensorboard": "sometimes"}, "use_tensorboard"),
    ("save-total-limit-0", {"save_total_limit": 0}, "save_total_limit"),
    ("skip-limit-0", {"max_consecutive_skipped_steps": 0}, "max_consecutive_skipped_steps"),
    ("skip-guard-perhaps", {"skip_nonfinite_steps": "perhaps"}, "skip_nonfinite_steps"),
    ("cpu-threads-0", {"cpu_threads": 0}, "cpu_threads"),
    ("weight-decay-negative", {"weight_decay": -0.1}, "weight_decay"),
    ("beta1-1.5", {"adam_beta1": 1.5}, "adam_beta1"),
    ("max-grad-norm-0", {"max_grad_norm": 0}, "max_grad_norm"),
    ("logging-steps-0", {"logging_steps": 0}, "logging_steps"),
    ("seed-negative", {"seed": -1}, "seed"),
    ("resume-missing-dir", {"resume_from_checkpoint": "/nonexistent/checkpoint-3"}, "not a checkpoint directory"),
    ("output-dir-unwritable", {"output_dir": "/proc/lowprec-nope"}, "cannot be created or written"),
    ("fp8-fallback-unknown", {"fp8_fallback": "fp4"}, "fp8_fallback"),
]

FLAGS = [
    ("train-negative-lr", ["train", TINY, "--learning_rate", "-1"], "flag --learning_rate"),
    ("train-steps-not-int", ["train", TINY, "--max_steps", "abc"], "flag --max_steps"),
    ("train-unknown-recipe", ["train", TINY, "--fp8_recipe", "nope"], "flag --fp8_recipe"),
    ("train-misspelt-flag", ["train", TINY, "--lerning_rate", "1"], "did you mean '--learning_rate'"),
    ("train-processes-0", ["train", TINY, "--num_processes", "0"], "--num_processes 0"),
    ("train-bf16-maybe", ["train", TINY, "--bf16", "maybe"], "flag --bf16"),
    ("train-fp16-with-yaml-fp8", ["train", TINY, "--fp16", "true"], "with flags --fp16"),
    ("train-fp8-sequence-len", ["train", TINY, "--sequence_len", "100"], "use sequence_len: 112"),
    ("train-save-limit-0", ["train", TINY, "--save_total_limit", "0"], "flag --save_total_limit"),
    ("train-nested-unknown", ["train", TINY, "--fsdp_config", "{{reshard: 1}}"], "unknown key 'reshard'"),
    ("train-missing-config", ["train", "/nonexistent/config.yaml"], "not found"),
    ("train-skip-limit-0", ["train", TINY, "--max_consecutive_skipped_steps", "0"], "flag --max_consecutive_skipped_steps"),
    # the flag names its key once ("flag --fsdp_version: 1 is not ...", not "... fsdp_version: 1 ...")
    ("train-fsdp-version-1", ["train", TINY, "--fsdp_version", "1"], "flag --fsdp_version: 1 is not supported"),
    ("train-recipe-named-once", ["train", TINY, "--fp8_recipe", "nope"], "flag --fp8_recipe: unknown FP8 recipe"),
    ("unknown-command", ["trian"], "unknown command 'trian'"),
    ("launch-no-script", ["launch"], "needs a training script"),
    ("launch-missing-script", ["launch", "/nonexistent/script.py"], "not found"),
    ("launch-processes-0", ["launch", "--num_processes", "0", "{script}"], "num_processes"),
    ("launch-mixed-precision", ["launch", "--mixed_precision", "fp9", "{script}"], "mixed_precision"),
    ("launch-fp8-backend", ["launch", "--fp8_backend", "nope", "{script}"], "fp8_backend"),
    ("launch-missing-ds-config", ["launch", "--use_deepspeed", "--deepspeed_config_file", "/nonexistent.json", "{script}"],
     "--deepspeed_config_file: '/nonexistent.json' does not exist"),
    ("launch-bad-ds-json", ["launch", "--use_deepspeed", "--deepspeed_config_file", "{bad_json}", "{script}"], "not valid JSON"),
    ("launch-fsdp1", ["launch", "--use_fsdp", "--fsdp_version", "1", "{script}"], "FSDP1 is not supported"),
    ("launch-fsdp-and-deepspeed", ["launch", "--use_fsdp", "--use_deepspeed", "{script}"], "pick one"),
    ("launch-machine-rank", ["launch", "--num_processes", "2", "--num_machines", "2", "--machine_rank", "2", "{script}"], "machine_rank"),
    ("launch-missing-config", ["launch", "--config_file", "/nonexistent.yaml", "{script}"], "does not exist"),
    ("launch-flag-blamed-not-yaml", ["launch", "--config_file", "{launch_yaml}", "--num_machines", "3", "{script}"],
     "num_processes from {launch_yaml}; num_machines from --num_machines"),
    ("launch-flag-fsdp1-over-yaml", ["launch", "--config_file", "{launch_yaml}", "--use_fsdp", "--fsdp_version", "1", "{script}"],
     "fsdp_version from --fsdp_version"),
    ("compare-unknown-precision", ["compare", TINY, "--precisions", "fp9"], "unknown precision 'fp9'"),
]

LAUNCH_YAML = [
    ("empty-file", "", "the file is empty"),
    ("comments-only", "# written by hand\n", "the file is empty"),
    ("duplicate-key", "mixed_precision: bf16\nmixed_precision: fp8\n", "'mixed_precision' is given twice"),
    ("duplicate-nested-key", "fp8_config:\n  recipe: delayed\n  recipe: tensorwise\n", "'recipe' is given twice"),
    ("syntax-error", "mixed_precision: [bf16\n", "not valid YAML"),
    ("top-level-list", "- mixed_precision\n", "expected a mapping"),
    ("unknown-key", {"distributed_typ": "MULTI_GPU"}, "unknown key 'distributed_typ'"),
    ("mixed-precision-fp9", {"mixed_precision": "fp9"}, "mixed_precision"),
    ("num-processes-0", {"num_processes": 0}, "num_processes"),
    ("fsdp-version-1", {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 1}}, "FSDP1 is not supported"),
    ("fp8-backend-unknown", {"mixed_precision": "fp8", "fp8_config": {"backend": "nope"}}, "backend"),
    ("mxfp8-and-nvfp4", {"mixed_precision": "fp8", "fp8_config": {"use_mxfp8_block_scaling": True,
                                                                 "use_nvfp4_block_scaling": True}}, "both set"),
    ("sagemaker", {"compute_environment": "AMAZON_SAGEMAKER"}, "only LOCAL_MACHINE"),
    ("downcast-bf16", {"downcast_bf16": True}, "TPU option"),
    ("multi-cpu-without-cpu", {"distributed_type": "MULTI_CPU", "use_cpu": False}, "contradicts use_cpu"),
    ("no-shard", {"distributed_type": "FSDP", "fsdp_config": {"sharding_strategy": "NO_SHARD"}}, "NO_SHARD"),
    ("missing-ds-config", {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "/nonexistent.json"}},
     "deepspeed_config.deepspeed_config_file in"),
    ("both-alias-spellings", {"fp8_config": {"amax_history_len": 4, "amax_history_length": 8}}, "mean the same"),
    ("margin-negative", {"mixed_precision": "fp8", "fp8_config": {"margin": -1}}, "margin"),
    ("distributed-type-tpu", {"distributed_type": "TPU"}, "distributed_type"),
    ("port-not-int", {"main_process_port": "abc"}, "main_process_port"),
]


def _cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    from lowprec.cli.main import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, (out.out + out.err).splitlines()


def _check_one_line(rc: int, lines: list[str], expected: str) -> None:
    errors = [line for line in lines if ERROR_LINE.match(line)]
    assert rc == 2, (rc, lines[-5:])
    assert not any("Traceback" in line for line in lines), lines
    assert len(errors) == 1, lines[-5:]
    assert expected in errors[0], errors[0]


def _write(tmp_path, body, base: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(body if isinstance(body, str) else yaml.safe_dump({**base, **body}, sort_keys=False))
    return str(path)


@pytest.mark.parametrize("body, expected", [r[1:] for r in TRAIN_YAML], ids=[r[0] for r in TRAIN_YAML])
def test_trainer_yaml(tmp_path, capsys, body, expected):
    bad_json = tmp_path / "ds.json"
    bad_json.write_text("{zero_optimization: 1")
    if isinstance(body, dict):
        body = {k: v.format(bad_json=bad_json) if isinstance(v, str) else v for k, v in body.items()}
    path = _write(tmp_path, body, {**BASE, "output_dir": str(tmp_path / "out")})
    _check_one_line(*_cli(["train", path, "--quiet"], capsys), expected)


@pytest.mark.parametrize("argv, expected", [r[1:] for r in FLAGS], ids=[r[0] for r in FLAGS])
def test_command_line_flags(tmp_path, capsys, argv, expected):
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    bad_json = tmp_path / "ds.json"
    bad_json.write_text("{zero_optimization: 1")
    launch_yaml = tmp_path / "launch.yaml"
    launch_yaml.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    names = {"script": script, "bad_json": bad_json, "launch_yaml": launch_yaml}
    argv = [a.format(**names) for a in argv]
    expected = expected.format(**names)
    if argv[0] == "train" and argv[1] == TINY:  # the row's own flags come last and win
        argv = argv[:2] + ["--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--quiet"] + argv[2:]
    _check_one_line(*_cli(argv, capsys), expected)


@pytest.mark.parametrize("body, expected", [r[1:] for r in LAUNCH_YAML], ids=[r[0] for r in LAUNCH_YAML])
def test_launch_yaml(tmp_path, capsys, monkeypatch, body, expected):
    monkeypatch.setenv("LOWPREC_CONFIG_HOME", str(tmp_path / "home"))
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    path = _write(tmp_path, body, {})
    _check_one_line(*_cli(["launch", "--config_file", path, "--dry_run", str(script)], capsys), expected)


# ----------------------------------------------------------------------------- Python arguments
def _acc(**kw):
    from lowprec import Accelerator

    return Accelerator(**kw)


def _recipe_kwargs(**kw):
    from lowprec.kwargs import NativeRecipeKwargs

    return NativeRecipeKwargs(**kw)


def _python_rows():
    from lowprec.fp8.recipes import Recipe
    from lowprec.kwargs import GradientAccumulationPlugin
    from lowprec.train.config import parse_config

    def prepared():
        acc = _acc()
        acc.prepare(nn.Linear(4, 4))
        return acc

    return [
        ("mixed-precision-fp9", lambda: _acc(mixed_precision="fp9"), "fp9"),
        ("misspelt-argument", lambda: _acc(mixd_precision="bf16"), "did you mean 'mixed_precision'"),
        ("accumulation-steps-0", lambda: _acc(gradient_accumulation_steps=0), "integer >= 1, got 0"),
        ("handler-not-kwargs", lambda: _acc(kwargs_handlers=[object()]), "kwargs_handlers"),
        ("accumulation-twice", lambda: _acc(gradient_accumulation_steps=2,
                                           gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2)), "not both"),
        ("guard-not-bool", lambda: _acc(skip_nonfinite_steps="yes"), "skip_nonfinite_steps"),
        ("skip-limit-0", lambda: _acc(max_consecutive_skipped_steps=0), "max_consecutive_skipped_steps"),
        ("skip-limit-float", lambda: _acc(max_consecutive_skipped_steps=1.5), "max_consecutive_skipped_steps"),
        ("unknown-recipe", lambda: _recipe_kwargs(recipe="nope"), "unknown FP8 recipe"),
        ("unknown-recipe-field", lambda: _recipe_kwargs(recipe="delayed", overrides={"amax_history_lenn": 3}), "amax_history_len"),
        ("recipe-from-name", lambda: Recipe.from_name("nope"), "unknown FP8 recipe"),
        ("block-size-17", lambda: Recipe.from_name("blockwise", block_size=17), "block_size"),
        ("recipe-without-fp8", lambda: _acc(mixed_precision="bf16", kwargs_handlers=[_recipe_kwargs()]), "mixed_precision='fp8'"),
        ("two-recipes", lambda: _acc(mixed_precision="fp8", kwargs_handlers=[_recipe_kwargs(), _recipe_kwargs()]), "two FP8 recipes"),
        ("load-missing-checkpoint", lambda: _acc().load_state("/nonexistent/ckpt"), "not a lowprec checkpoint"),
        ("save-without-dir", lambda: _acc().save_state(), "need a directory"),
        ("register-plain-object", lambda: _acc().register_for_checkpointing(object()), "Item at index 0"),
        ("placement-mismatch", lambda: _acc().prepare(nn.Linear(2, 2), device_placement=[True, False]), "one bool per object"),
        ("parse-config-negative-lr", lambda: parse_config({"learning_rate": -1}), "learning_rate"),
        ("parse-config-not-mapping", lambda: parse_config([1, 2]), "expected a mapping"),
        ("save-model-unprepared-nan", lambda: _nan_save(prepared()), "not finite"),
    ]


def _nan_save(acc):
    with torch.no_grad():
        acc._models[0].weight.fill_(float("nan"))
    acc.save_model(acc._models[0], "/nonexistent/never-written")


PYTHON = _python_rows()


@pytest.mark.parametrize("call, expected", [r[1:] for r in PYTHON], ids=[r[0] for r in PYTHON])
def test_python_arguments(call, expected):
    from lowprec.errors import NonFiniteError

    with pytest.raises((ValueError, TypeError, NonFiniteError)) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and expected in message, message


def test_the_tables_hold_at_least_80_bad_inputs():
    assert len(TRAIN_YAML) + len(FLAGS) + len(LAUNCH_YAML) + len(PYTHON) >= 80


def test_a_smoke_run_shorter_than_the_warmup_is_clamped_with_a_note(tmp_path, caplog):
    """``--max_steps 3`` on a config with ``warmup_steps: 10`` is a normal smoke run: the
    warmup is clamped (logged, and recorded in resolved_config.yaml), not refused."""
    from lowprec.train.config import load_config
    from lowprec.train.trainer import train

    cfg = load_config(TINY, {"max_steps": 3, "warmup_steps": 10, "output_dir": str(tmp_path), "fp8": False,
                             "eval_steps": None, "val_set_size": 0.0, "use_tensorboard": False})
    with caplog.at_level("WARNING", logger="lowprec"):
        result = train(cfg)
    assert result.steps == 3
    assert any("warmup_steps: 10 clamped to 2" in r.getMessage() for r in caplog.records)
    resolved = yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())
    assert resolved["_resolved"]["warmup_steps"]["value"] == 2
