"""``force_recompute_fp8_weight_in_bwd`` through every entry point (issue 29): Accelerator kwargs
(``NativeRecipeKwargs``, ``AORecipeKwargs``: Accelerate PR 4109's field), the environment
(``ACCELERATE_FP8_FORCE_RECOMPUTE_FP8_WEIGHT_IN_BWD``), launch flags and YAML, and the trainer's
YAML key, each to the same :class:`lowprec.fp8.Recipe` field; ``auto`` is the default (None); a
bad value is one message naming the key (exit code 2 from the CLI)."""

from __future__ import annotations

import os

import pytest

from lowprec import Accelerator
from lowprec.cli.main import main
from tests.launch_env import clear_launch_env, exported
from lowprec.kwargs import AORecipeKwargs, NativeRecipeKwargs

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "report_launch_env.py")
FIELD = "force_recompute_fp8_weight_in_bwd"
VAR = "ACCELERATE_FP8_FORCE_RECOMPUTE_FP8_WEIGHT_IN_BWD"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    clear_launch_env(monkeypatch)


def _recipe_value(acc: Accelerator):
    return acc.fp8_settings.values()["recipe"][FIELD]


@pytest.mark.parametrize("value", [True, False])
def test_every_entry_point_sets_the_recipe_field(value, monkeypatch, capsys, tmp_path):
    text = "true" if value else "false"
    python = Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[NativeRecipeKwargs(**{FIELD: value})])
    assert _recipe_value(python) is value

    env = exported(["--mixed_precision", "fp8", f"--fp8_{FIELD}", text, SCRIPT], capsys)
    assert env[VAR] == text
    cfg = tmp_path / "launch.yaml"
    cfg.write_text(f"mixed_precision: fp8\nfp8_config:\n  {FIELD}: {text}\n")
    assert exported(["--config_file", str(cfg), SCRIPT], capsys) == env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _recipe_value(Accelerator(cpu=True)) is value
    assert NativeRecipeKwargs().to_recipe().force_recompute_fp8_weight_in_bwd is value  # the variable alone
    assert NativeRecipeKwargs(overrides={FIELD: not value}).to_recipe().force_recompute_fp8_weight_in_bwd is not value
    for k in env:
        monkeypatch.delenv(k)

    from lowprec.train.config import parse_config
    from lowprec.train.resolve import Capabilities, resolve
    from lowprec.train.trainer import _accelerator

    tcfg = parse_config({"fp8": True, f"fp8_{FIELD}": value})
    assert _recipe_value(_accelerator(tcfg, resolve(tcfg, Capabilities()))) is value
    # torchao's handler carries it to the native engine's recipe (torchao's own layers have no copy)
    from lowprec.backends.engines.torchao import native_recipe

    assert native_recipe(AORecipeKwargs(**{FIELD: value})).force_recompute_fp8_weight_in_bwd is value


def test_auto_is_the_default_and_is_not_exported(capsys):
    assert NativeRecipeKwargs().to_recipe().force_recompute_fp8_weight_in_bwd is None
    assert NativeRecipeKwargs(**{FIELD: "auto"}).to_recipe().force_recompute_fp8_weight_in_bwd is None
    assert AORecipeKwargs().force_recompute_fp8_weight_in_bwd is None
    env = exported(["--mixed_precision", "fp8", f"--fp8_{FIELD}", "auto", SCRIPT], capsys)
    assert VAR not in env

    from lowprec.train.config import parse_config

    assert parse_config({"fp8": True}).fp8_force_recompute_fp8_weight_in_bwd == "auto"


def test_bad_values_name_the_key(monkeypatch, capsys):
    with pytest.raises(ValueError, match=rf"NativeRecipeKwargs\({FIELD}='sometimes'\)"):
        NativeRecipeKwargs(**{FIELD: "sometimes"})
    assert main(["launch", "--dry_run", "--mixed_precision", "fp8", f"--fp8_{FIELD}", "sometimes", SCRIPT]) == 2
    assert f"--fp8_{FIELD}" in capsys.readouterr().err
    monkeypatch.setenv(VAR, "sometimes")
    with pytest.raises(ValueError, match=f"environment variable {VAR}='sometimes'"):
        NativeRecipeKwargs()
    monkeypatch.delenv(VAR)

    from lowprec.train.config import parse_config

    for cfg, message in (
        ({f"fp8_{FIELD}": True}, f"fp8_{FIELD}: true needs fp8: true"),
        ({"fp8": True, f"fp8_{FIELD}": "sometimes"}, f"fp8_{FIELD}"),
        (
            {"fp8": True, f"fp8_{FIELD}": True, "fp8_recipe": {"name": "delayed", FIELD: False}},
            "disagree; keep one",
        ),
        ({"fp8": True, "fp8_backend": "torchao", f"fp8_{FIELD}": False}, "torchao's layers always keep"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_config(cfg)
