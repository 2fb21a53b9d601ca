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
BASE = {
    "base_model": "builtin:llama-tiny",
    "datasets": ["builtin:stdlib"],
    "dataset_max_bytes": 20000,
    "sequence_len": 32,
    "micro_batch_size": 2,
    "max_steps": 1,
    "val_set_size": 0.05,
    "progress_bar": False,
    "use_tensorboard": False,
    "cpu_threads": 1,
}
ERROR_LINE = re.compile(r"^lowprec( \w+)?: error: ")


class AfterBase(str):
    """A row's YAML text appended to the fast base (for keys no dict can hold: ``learning-rate``,
    ``1:``, values that only YAML text spells: ``1e999``, ``.inf``)."""


# chat rows for the template rows ({chat} is a small messages file the test writes)
CHAT = {"datasets": [{"path": "{chat}", "type": "chat_template"}], "chat_template": "jinja"}

TRAIN_YAML = [
    ("empty-file", "", "the file is empty"),
    ("comments-only", "# nothing here\n", "the file is empty"),
    ("duplicate-key", "learning_rate: 1.0e-3\nlearning_rate: 5.0\n", "'learning_rate' is given twice"),
    (
        "duplicate-nested-key",
        "fsdp_version: 2\nfsdp_config:\n  reshard_after_forward: true\n  reshard_after_forward: false\n",
        "'reshard_after_forward' is given twice",
    ),
    ("syntax-error", "learning_rate: [1\n", "not valid YAML"),
    ("top-level-list", "- learning_rate\n", "expected a mapping"),
    ("top-level-scalar", "hello\n", "expected a mapping"),
    ("unknown-key", {"lerning_rate": 1e-3}, "did you mean 'learning_rate'"),
    ("unknown-nested-key", {"fsdp_version": 2, "fsdp_config": {"reshard": True}}, "unknown key 'fsdp_config.reshard'"),
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
    (
        "unknown-recipe-field",
        {"fp8": True, "fp8_recipe": {"name": "delayed", "amax_history_lenn": 4}},
        "amax_history_len",
    ),
    ("all-gather-without-fsdp", {"fp8": True, "fp8_enable_fsdp_float8_all_gather": True}, "requires FSDP2"),
    ("fsdp-version-1", {"fsdp_version": 1}, "fsdp_version: 1 is not supported"),
    ("fsdp-config-alone", {"fsdp_config": {"reshard_after_forward": False}}, "add fsdp_version: 2"),
    ("deepspeed-and-fsdp", {"deepspeed": {"zero_optimization": {"stage": 1}}, "fsdp_version": 2}, "pick one"),
    ("deepspeed-missing-file", {"deepspeed": "/nonexistent/ds.json"}, "not found"),
    ("deepspeed-bad-json", {"deepspeed": "{bad_json}"}, "not valid JSON"),
    (
        "loss-watchdog-patience-0",
        {"loss_watchdog_threshold": 5.0, "loss_watchdog_patience": 0},
        "loss_watchdog_patience",
    ),
    (
        "eval-max-new-tokens-past-sequence",
        {"eval_table_size": 2, "eval_max_new_tokens": 500},
        "leaves no room for a prompt",
    ),
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
    # keys that are not ASCII identifiers, at the top and nested (issue 28 item 8: an IndexError)
    (
        "key-with-dash",
        AfterBase("learning-rate: 0.001\n"),
        "unknown key 'learning-rate' (did you mean 'learning_rate'?",
    ),
    (
        "key-with-space",
        AfterBase("learning rate: 0.001\n"),
        "unknown key 'learning rate' (did you mean 'learning_rate'?",
    ),
    ("key-accented", AfterBase("léarning_rate: 0.001\n"), "unknown key 'léarning_rate' (did you mean 'learning_rate'?"),
    ("key-emoji", AfterBase("\U0001f680: 1\n"), "(keys are ASCII names with underscores)"),
    ("key-capitals", AfterBase("Learning_Rate: 0.1\n"), "(did you mean 'learning_rate'?"),
    (
        "nested-key-dash",
        AfterBase("fsdp_version: 2\nfsdp_config:\n  re-shard: true\n"),
        "unknown key 'fsdp_config.re-shard'; fsdp_config takes auto_wrap_policy",
    ),
    (
        "nested-key-space",
        AfterBase("fsdp_version: 2\nfsdp_config:\n  reshard after forward: true\n"),
        "unknown key 'fsdp_config.reshard after forward' (did you mean 'reshard_after_forward'?",
    ),
    (
        "nested-key-emoji",
        AfterBase("fsdp_version: 2\nfsdp_config:\n  \U0001f680: true\n"),
        "unknown key 'fsdp_config.\U0001f680'",
    ),
    (
        "dataset-key-dash",
        {"datasets": [{"path": "builtin:stdlib", "ds-type": "json"}]},
        "unknown key 'datasets.0.ds-type' (did you mean 'ds_type'?",
    ),
    ("key-number", AfterBase("1: 2\n"), "key 1 is not a name"),
    ("key-null", AfterBase("~: 2\n"), "key null is not a name"),
    ("key-bool", AfterBase("yes: 2\n"), "key true is not a name"),
    # silently accepted before: strict ints and booleans, finite floats, bounds
    ("max-steps-true", {"max_steps": True}, "max_steps: Input should be a valid integer (got true)"),
    ("max-steps-1e30", AfterBase("max_steps: 1e30\n"), "max_steps: Input should be a valid integer"),
    ("max-steps-2.5", {"max_steps": 2.5}, "max_steps: Input should be a valid integer"),
    ("max-steps-quoted", {"max_steps": "5"}, "max_steps: Input should be a valid integer (got '5')"),
    ("warmup-steps-float", {"warmup_steps": 1.5}, "warmup_steps: Input should be a valid integer"),
    ("fp16-1", {"fp16": 1}, "fp16: Input should be a valid boolean (got 1)"),
    ("train-on-inputs-quoted-yes", {"train_on_inputs": "yes"}, "train_on_inputs: Input should be a valid boolean"),
    ("lr-1e999", AfterBase("learning_rate: 1e999\n"), "learning_rate: Input should be a finite number"),
    ("lr-inf", AfterBase("learning_rate: .inf\n"), "learning_rate: Input should be a finite number"),
    ("lr-nan", AfterBase("learning_rate: .nan\n"), "learning_rate: Input should be a finite number"),
    ("lr-1e39", {"learning_rate": 1e39}, "learning_rate: 1e+39 is beyond float32's range"),
    ("weight-decay-inf", AfterBase("weight_decay: .inf\n"), "weight_decay: Input should be a finite number"),
    ("seed-2**70", {"seed": 2**70}, "seed: Input should be less than or equal to 4294967295"),
    ("output-dir-empty", {"output_dir": ""}, "output_dir: '' is empty, which would write"),
    ("output-dir-blank", {"output_dir": "  "}, "output_dir: '  ' is empty"),
    ("datasets-empty", {"datasets": []}, "datasets: the list is empty"),
    (
        "amax-history-1e9",
        {"fp8": True, "fp8_recipe": {"name": "delayed", "amax_history_len": 10**9}},
        "amax_history_len must be at most 16384",
    ),
    (
        "amax-history-float",
        {"fp8": True, "fp8_recipe": {"name": "delayed", "amax_history_len": 1e9}},
        "amax_history_len must be an integer",
    ),
    # chat templates: syntax at load, sandbox refusals and render errors when the data is read
    (
        "jinja-syntax",
        {**CHAT, "chat_template_jinja": "{% for m in messages %}{{ m.content }"},
        "chat_template_jinja: not valid Jinja (line 1",
    ),
    (
        "jinja-syntax-in-dataset",
        {
            "datasets": [
                {"path": "{chat}", "type": "chat_template", "chat_template": "jinja", "chat_template_jinja": "{% if %}"}
            ]
        },
        "datasets.0.chat_template_jinja: not valid Jinja",
    ),
    (
        "jinja-sandbox",
        {**CHAT, "chat_template_jinja": "{{ ''.__class__.__mro__ }}{% for m in messages %}{{ m.content }}{% endfor %}"},
        "chat template: refused by the sandbox",
    ),
    (
        "jinja-render-error",
        {**CHAT, "chat_template_jinja": "{{ messages[0].content.nope() }}"},
        "chat template: rendering failed",
    ),
    ("pretokenized-all-ignored", {"datasets": ["{pretok}"]}, "with a token to learn"),
    # DeepSpeed: one process, and its own schema's errors named by key and source
    ("deepspeed-one-process", {"deepspeed": {"zero_optimization": {"stage": 1}}}, "add --num_processes 2"),
    (
        "deepspeed-bad-stage",
        {"deepspeed": {"zero_optimization": {"stage": "x"}}},
        "deepspeed: zero_optimization.stage:",
    ),
    (
        "deepspeed-file-bad-device",
        {"deepspeed": "{ds_gpu9}"},
        "deepspeed config {ds_gpu9}: zero_optimization.offload_optimizer.device: Input should be",
    ),
    ("binary-file", b"\x00\x80\xff" * 50, "not a text file"),
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
    ("train-nested-unknown", ["train", TINY, "--fsdp_config", "{{reshard: 1}}"], "unknown key 'fsdp_config.reshard'"),
    ("train-missing-config", ["train", "/nonexistent/config.yaml"], "not found"),
    (
        "train-skip-limit-0",
        ["train", TINY, "--max_consecutive_skipped_steps", "0"],
        "flag --max_consecutive_skipped_steps",
    ),
    # the flag names its key once ("flag --fsdp_version: 1 is not ...", not "... fsdp_version: 1 ...")
    ("train-fsdp-version-1", ["train", TINY, "--fsdp_version", "1"], "flag --fsdp_version: 1 is not supported"),
    ("train-recipe-named-once", ["train", TINY, "--fp8_recipe", "nope"], "flag --fp8_recipe: unknown FP8 recipe"),
    ("unknown-command", ["trian"], "unknown command 'trian'"),
    ("launch-no-script", ["launch"], "needs a training script"),
    ("launch-missing-script", ["launch", "/nonexistent/script.py"], "not found"),
    ("launch-processes-0", ["launch", "--num_processes", "0", "{script}"], "num_processes"),
    ("launch-mixed-precision", ["launch", "--mixed_precision", "fp9", "{script}"], "mixed_precision"),
    ("launch-fp8-backend", ["launch", "--fp8_backend", "nope", "{script}"], "fp8_backend"),
    (
        "launch-missing-ds-config",
        ["launch", "--use_deepspeed", "--deepspeed_config_file", "/nonexistent.json", "{script}"],
        "--deepspeed_config_file: '/nonexistent.json' does not exist",
    ),
    (
        "launch-bad-ds-json",
        ["launch", "--use_deepspeed", "--deepspeed_config_file", "{bad_json}", "{script}"],
        "not valid JSON",
    ),
    ("launch-fsdp1", ["launch", "--use_fsdp", "--fsdp_version", "1", "{script}"], "FSDP1 is not supported"),
    ("launch-fsdp-and-deepspeed", ["launch", "--use_fsdp", "--use_deepspeed", "{script}"], "pick one"),
    (
        "launch-machine-rank",
        ["launch", "--num_processes", "2", "--num_machines", "2", "--machine_rank", "2", "{script}"],
        "machine_rank",
    ),
    ("launch-missing-config", ["launch", "--config_file", "/nonexistent.yaml", "{script}"], "does not exist"),
    (
        "launch-flag-blamed-not-yaml",
        ["launch", "--config_file", "{launch_yaml}", "--num_machines", "3", "{script}"],
        "num_processes from {launch_yaml}; num_machines from --num_machines",
    ),
    (
        "launch-flag-fsdp1-over-yaml",
        ["launch", "--config_file", "{launch_yaml}", "--use_fsdp", "--fsdp_version", "1", "{script}"],
        "fsdp_version from --fsdp_version",
    ),
    ("compare-unknown-precision", ["compare", TINY, "--precisions", "fp9"], "unknown precision 'fp9'"),
    ("train-config-is-directory", ["train", "{tmp}"], "is a directory; give the YAML file"),
    ("train-lr-inf", ["train", TINY, "--learning_rate", "inf"], "flag --learning_rate"),
    (
        "train-max-steps-true",
        ["train", TINY, "--max_steps", "true"],
        "flag --max_steps: Input should be a valid integer",
    ),
    ("train-seed-2**70", ["train", TINY, "--seed", str(2**70)], "flag --seed: Input should be less than or equal"),
    (
        "train-dashed-nested-key",
        ["train", TINY, "--fsdp_config", "{{re-shard: 1}}"],
        "unknown key 'fsdp_config.re-shard'",
    ),
    (
        "launch-config-is-directory",
        ["launch", "--config_file", "{tmp}", "{script}"],
        "is a directory; give the YAML file",
    ),
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
    (
        "mxfp8-and-nvfp4",
        {"mixed_precision": "fp8", "fp8_config": {"use_mxfp8_block_scaling": True, "use_nvfp4_block_scaling": True}},
        "both set",
    ),
    ("sagemaker", {"compute_environment": "AMAZON_SAGEMAKER"}, "only LOCAL_MACHINE"),
    ("downcast-bf16", {"downcast_bf16": True}, "TPU option"),
    ("multi-cpu-without-cpu", {"distributed_type": "MULTI_CPU", "use_cpu": False}, "contradicts use_cpu"),
    ("no-shard", {"distributed_type": "FSDP", "fsdp_config": {"sharding_strategy": "NO_SHARD"}}, "NO_SHARD"),
    (
        "missing-ds-config",
        {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "/nonexistent.json"}},
        "deepspeed_config.deepspeed_config_file in",
    ),
    ("both-alias-spellings", {"fp8_config": {"amax_history_len": 4, "amax_history_length": 8}}, "mean the same"),
    ("margin-negative", {"mixed_precision": "fp8", "fp8_config": {"margin": -1}}, "margin"),
    ("distributed-type-tpu", {"distributed_type": "TPU"}, "distributed_type"),
    ("port-not-int", {"main_process_port": "abc"}, "main_process_port"),
    ("binary-file", b"\x00\x80\xff" * 50, "not a text file"),
    ("amax-history-1e9", {"mixed_precision": "fp8", "fp8_config": {"amax_history_len": 10**9}}, "at most 16384"),
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
    if isinstance(body, bytes):
        path.write_bytes(body)
    elif isinstance(body, AfterBase):  # the base without the keys the row's text sets
        own = {line.split(":")[0] for line in body.splitlines() if line[:1] not in " #"}
        path.write_text(yaml.safe_dump({k: v for k, v in base.items() if k not in own}, sort_keys=False) + body)
    else:
        path.write_text(
            body if isinstance(body, str) else yaml.safe_dump({**base, **body}, sort_keys=False, allow_unicode=True)
        )
    return str(path)


def _data_files(tmp_path) -> dict[str, str]:
    """The files rows name: chat data, pre-tokenized rows with nothing to learn, DeepSpeed JSON."""
    import json

    chat, pretok, ds = tmp_path / "chat.jsonl", tmp_path / "pretok.jsonl", tmp_path / "ds_gpu9.json"
    chat.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
            )
            + "\n"
            for i in range(20)
        )
    )
    pretok.write_text("".join(json.dumps({"input_ids": [1, 2, 3, 4], "labels": [-100] * 4}) + "\n" for _ in range(20)))
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu9"}}}))
    return {"chat": str(chat), "pretok": str(pretok), "ds_gpu9": str(ds)}


def _fill(value, names: dict[str, str]):
    """``{name}`` placeholders in a row's strings, at any depth (JSON/Jinja braces untouched)."""
    if isinstance(value, str) and not isinstance(value, AfterBase):
        for k, v in names.items():
            value = value.replace("{" + k + "}", v)
        return value
    if isinstance(value, dict):
        return {k: _fill(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, names) for v in value]
    return value


@pytest.mark.parametrize("body, expected", [r[1:] for r in TRAIN_YAML], ids=[r[0] for r in TRAIN_YAML])
def test_trainer_yaml(tmp_path, capsys, body, expected):
    bad_json = tmp_path / "ds.json"
    bad_json.write_text("{zero_optimization: 1")
    names = {"bad_json": str(bad_json), **_data_files(tmp_path)}
    path = _write(tmp_path, _fill(body, names), {**BASE, "output_dir": str(tmp_path / "out")})
    _check_one_line(*_cli(["train", path, "--quiet"], capsys), _fill(expected, names))
    assert not (tmp_path / "out" / "model.safetensors").exists()  # nothing trained


@pytest.mark.parametrize("argv, expected", [r[1:] for r in FLAGS], ids=[r[0] for r in FLAGS])
def test_command_line_flags(tmp_path, capsys, argv, expected):
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    bad_json = tmp_path / "ds.json"
    bad_json.write_text("{zero_optimization: 1")
    launch_yaml = tmp_path / "launch.yaml"
    launch_yaml.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    names = {"script": script, "bad_json": bad_json, "launch_yaml": launch_yaml, "tmp": tmp_path}
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
        (
            "accumulation-twice",
            lambda: _acc(
                gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2)
            ),
            "not both",
        ),
        ("guard-not-bool", lambda: _acc(skip_nonfinite_steps="yes"), "skip_nonfinite_steps"),
        ("skip-limit-0", lambda: _acc(max_consecutive_skipped_steps=0), "max_consecutive_skipped_steps"),
        ("skip-limit-float", lambda: _acc(max_consecutive_skipped_steps=1.5), "max_consecutive_skipped_steps"),
        ("unknown-recipe", lambda: _recipe_kwargs(recipe="nope"), "unknown FP8 recipe"),
        (
            "unknown-recipe-field",
            lambda: _recipe_kwargs(recipe="delayed", overrides={"amax_history_lenn": 3}),
            "amax_history_len",
        ),
        ("recipe-from-name", lambda: Recipe.from_name("nope"), "unknown FP8 recipe"),
        ("block-size-17", lambda: Recipe.from_name("blockwise", block_size=17), "block_size"),
        (
            "recipe-without-fp8",
            lambda: _acc(mixed_precision="bf16", kwargs_handlers=[_recipe_kwargs()]),
            "mixed_precision='fp8'",
        ),
        (
            "two-recipes",
            lambda: _acc(mixed_precision="fp8", kwargs_handlers=[_recipe_kwargs(), _recipe_kwargs()]),
            "two FP8 recipes",
        ),
        ("load-missing-checkpoint", lambda: _acc().load_state("/nonexistent/ckpt"), "not a lowprec checkpoint"),
        ("save-without-dir", lambda: _acc().save_state(), "need a directory"),
        ("register-plain-object", lambda: _acc().register_for_checkpointing(object()), "Item at index 0"),
        (
            "placement-mismatch",
            lambda: _acc().prepare(nn.Linear(2, 2), device_placement=[True, False]),
            "one bool per object",
        ),
        ("parse-config-negative-lr", lambda: parse_config({"learning_rate": -1}), "learning_rate"),
        ("parse-config-not-mapping", lambda: parse_config([1, 2]), "expected a mapping"),
        ("save-model-unprepared-nan", lambda: _nan_save(prepared()), "not finite"),
        ("recipe-amax-history-1e9", lambda: Recipe.from_name("delayed", amax_history_len=10**9), "at most 16384"),
        ("parse-config-dashed-key", lambda: parse_config({"learning-rate": 1e-3}), "did you mean 'learning_rate'"),
        (
            "parse-config-steps-bool",
            lambda: parse_config({"max_steps": True}),
            "max_steps: Input should be a valid integer",
        ),
        ("parse-config-lr-inf", lambda: parse_config({"learning_rate": float("inf")}), "finite number"),
        ("load-state-tampered-processes", lambda: _tampered_meta(prepared(), num_processes=0), "not a process count"),
    ]


def _tampered_meta(acc, **changes):
    """A checkpoint whose lowprec_state.json was edited by hand, loaded back."""
    import json
    import tempfile

    directory = os.path.join(tempfile.mkdtemp(prefix="lowprec-badmeta-"), "ckpt")
    acc.save_state(directory)
    meta_path = os.path.join(directory, "lowprec_state.json")
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:
        json.dump({**meta, **changes}, f)
    acc.load_state(directory)


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


def test_a_smoke_run_shorter_than_the_warmup_is_clamped_with_a_note(tmp_path, caplog, monkeypatch):
    """``--max_steps 3`` on a config with ``warmup_steps: 10`` is a normal smoke run: the
    warmup is clamped (logged, and recorded in resolved_config.yaml), not refused."""
    from lowprec.train.config import load_config
    from lowprec.train.trainer import train

    cfg = load_config(
        TINY,
        {
            "max_steps": 3,
            "warmup_steps": 10,
            "output_dir": str(tmp_path),
            "fp8": False,
            "eval_steps": None,
            "val_set_size": 0.0,
            "use_tensorboard": False,
        },
    )
    with caplog.at_level("WARNING", logger="lowprec"):
        result = train(cfg)
    assert result.steps == 3
    assert any("warmup_steps: 10 clamped to 2" in r.getMessage() for r in caplog.records)
    resolved = yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())
    assert resolved["_resolved"]["warmup_steps"]["value"] == 2
