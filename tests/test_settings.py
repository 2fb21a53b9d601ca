"""One FP8 settings path (issue 11 item 1, issue 10 items 7-8): every entry point resolves the
same request to the same FP8Settings; recipe names, defaults and refusals come from one place."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from lowprec import Accelerator
from lowprec.backends.registry import resolve_fp8_settings
from lowprec.catalog import (
    FIELD_DEFAULTS,
    FSDP_FP8_ALL_GATHER_UNSUPPORTED,
    RECIPE_FIELDS,
    RECIPES,
    Granularity,
    ScaleSource,
)
from lowprec.cli.main import main
from tests.launch_env import clear_launch_env, exported
from lowprec.kwargs import AORecipeKwargs, NativeRecipeKwargs, TERecipeKwargs

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "report_launch_env.py")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    clear_launch_env(monkeypatch)


def _from_env(monkeypatch, env) -> dict:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return Accelerator(cpu=True).fp8_settings.values()


def test_every_entry_point_resolves_the_same_settings(monkeypatch, capsys, tmp_path):
    # the request: native delayed scaling, 16-step history, weight-gradient GEMM in high precision
    python = Accelerator(
        mixed_precision="fp8",
        cpu=True,
        kwargs_handlers=[
            NativeRecipeKwargs(
                recipe="delayed", overrides={"amax_history_len": 16, "override_linear_precision": (False, False, True)}
            )
        ],
    )
    want = python.fp8_settings.values()
    assert want["recipe"]["amax_history_len"] == 16 and want["backend"] == "native"

    flags = [
        "--mixed_precision",
        "fp8",
        "--fp8_backend",
        "native",
        "--fp8_recipe",
        "delayed",
        "--fp8_amax_history_len",
        "16",
        "--fp8_override_linear_precision",
        "false,false,true",
    ]
    env = exported([*flags, SCRIPT], capsys)
    cfg = tmp_path / "launch.yaml"
    cfg.write_text(
        "mixed_precision: fp8\nfp8_config:\n  backend: NATIVE\n  recipe: delayed\n"
        "  amax_history_length: 16\n  override_linear_precision: (false, false, true)\n"
    )
    assert exported(["--config_file", str(cfg), SCRIPT], capsys) == env
    assert _from_env(monkeypatch, env) == want

    from lowprec.train.config import parse_config
    from lowprec.train.resolve import Capabilities, resolve
    from lowprec.train.trainer import _accelerator

    for name in env:
        monkeypatch.delenv(name)
    tcfg = parse_config(
        {
            "fp8": True,
            "fp8_recipe": {
                "name": "delayed",
                "amax_history_len": 16,
                "override_linear_precision": [False, False, True],
            },
        }
    )
    acc = _accelerator(tcfg, resolve(tcfg, Capabilities()))
    assert acc.fp8_settings.values() == want


def test_settings_are_frozen_and_carry_reasons(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "te")
    s = resolve_fp8_settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.backend = None  # type: ignore[misc]
    assert s.backend.value == "te" and "ACCELERATE_FP8_BACKEND" in s.backend.reason
    assert s.values()["recipe"]["amax_compute_algo"] == FIELD_DEFAULTS["amax_compute_algo"] == "most_recent"
    monkeypatch.delenv("ACCELERATE_FP8_BACKEND")
    monkeypatch.setenv("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "off")  # set, false: not refused
    s = resolve_fp8_settings()
    assert s.backend.value == "native" and s.backend.reason.startswith("auto")


def test_one_default_for_amax_compute_algo():
    # Accelerate documents most_recent for TERecipeKwargs; the engine's Recipe takes the same
    from lowprec.fp8 import Recipe

    assert Recipe().amax_compute_algo == TERecipeKwargs().amax_compute_algo == "most_recent"
    assert NativeRecipeKwargs(recipe="delayed").to_recipe().amax_compute_algo == "most_recent"


def test_catalog_is_the_engine_recipes():
    from lowprec.fp8 import Recipe

    assert set(RECIPE_FIELDS) == {f.name for f in dataclasses.fields(Recipe)}
    for name, info in RECIPES.items():
        r = Recipe.from_name(name)
        assert r.scaling == info.scaling and r.name == name
        plan = r.plan
        gran = {
            Granularity.TENSOR: ("tensor",),
            Granularity.AXIS: ("axis",),
            Granularity.BLOCK: ("block",),
            Granularity.MICRO: ("mx32", "nv16"),
        }[info.granularity]
        assert plan.fprop.a.granularity in gran
        assert (info.source is ScaleSource.DELAYED) == (r.scaling == "delayed")


def test_recipe_kwargs_types_checked_at_construction():
    # issue 10 item 7: one line naming the field, at construction (not inside prepare)
    with pytest.raises(TypeError, match=r"AORecipeKwargs\(config=123\)"):
        AORecipeKwargs(config=123)
    with pytest.raises(TypeError, match="skip_patterns"):
        NativeRecipeKwargs(skip_patterns="lm_head")
    with pytest.raises(TypeError, match="overrides"):
        NativeRecipeKwargs(overrides=[("margin", 1)])
    with pytest.raises(ValueError, match=r"TERecipeKwargs\(margin='lots'\)"):
        TERecipeKwargs(margin="lots")
    with pytest.raises(ValueError, match="pad_inner_dim"):
        AORecipeKwargs(pad_inner_dim="maybe")


def test_fields_the_recipe_does_not_read(capsys):
    # issue 10 item 8: one warning in the Python API (Accelerate accepts them) ...
    with pytest.warns(UserWarning, match="tensorwise recipe does not read amax_history_len"):
        NativeRecipeKwargs(recipe="tensorwise", overrides={"amax_history_len": 16})
    # ... an error in the trainer's YAML and in launch, naming the key
    from lowprec.train.config import parse_config

    with pytest.raises(ValueError, match="fp8_recipe.amax_history_len: the tensorwise recipe does not read it"):
        parse_config({"fp8": True, "fp8_recipe": {"name": "tensorwise", "amax_history_len": 16}})
    with pytest.raises(ValueError, match="fp8_recipe is set but fp8 is false"):
        parse_config({"fp8": False, "fp8_recipe": "rowwise"})
    # (a launch naming the recipe; with none named the script's handler picks it: test_cli_launch.py)
    launch = ["launch", "--dry_run", "--mixed_precision", "fp8", "--fp8_recipe", "tensorwise"]
    assert main([*launch, "--fp8_amax_history_len", "16", SCRIPT]) == 2
    assert "--fp8_amax_history_len: the tensorwise recipe does not read it" in capsys.readouterr().err


@pytest.mark.parametrize(
    "field,value,reader", [("scale_rounding", "floor", "mxfp8"), ("high_precision_last", 0.1, "nvfp4")]
)
def test_a_field_the_recipe_does_not_read_names_the_recipe_that_does(capsys, field, value, reader):
    # it said "(it tunes delayed scaling)" for MXFP8's scale_rounding and NVFP4's high_precision_last
    from lowprec.train.config import parse_config

    with pytest.raises(ValueError) as err:
        parse_config({"fp8": True, "fp8_recipe": {"name": "tensorwise", field: value}})
    assert f"does not read it (read by: {reader}); drop it or set fp8_recipe name: {reader}" in str(err.value)
    assert "delayed" not in str(err.value)
    if field == "scale_rounding":  # a launch flag too
        launch = ["launch", "--dry_run", "--mixed_precision", "fp8", "--fp8_recipe", "tensorwise"]
        assert main([*launch, "--fp8_scale_rounding", "floor", SCRIPT]) == 2
        err_line = capsys.readouterr().err
        assert "the tensorwise recipe does not read it (read by: mxfp8); drop it, or set fp8_recipe mxfp8" in err_line


@pytest.mark.parametrize("name,switch", [("mxfp8", "use_mxfp8_block_scaling"), ("nvfp4", "use_nvfp4_block_scaling")])
def test_block_scaled_recipes_mean_one_thing_everywhere(monkeypatch, tmp_path, capsys, name, switch):
    from lowprec.backends import select_backend
    from lowprec.fp8 import Recipe
    from lowprec.train.config import parse_config

    expected = Recipe.from_name(name)
    assert expected.scaling == name and Recipe.from_name(name.upper().replace("FP", "_FP")).scaling == name
    assert NativeRecipeKwargs(recipe=name.upper()).to_recipe() == expected
    assert parse_config({"fp8": True, "fp8_recipe": name}).fp8_recipe.name == name
    from lowprec.backends.te import SPEC as TE

    if not TE.available():  # with TE installed, TE runs its own MXFP8BlockScaling / NVFP4BlockScaling
        handler = TERecipeKwargs(**{switch: True})
        backend = select_backend(handler)
        # TE's MXFP8BlockScaling gets the handler's fp8_format (HYBRID: E5M2 gradients); NVFP4 has none
        fmt = handler.fp8_format if name == "mxfp8" else "E4M3"
        assert backend.recipe == expected.replace(fp8_format=fmt, use_during_eval=backend.recipe.use_during_eval)
    monkeypatch.setenv("ACCELERATE_FP8_" + switch.upper(), "true")
    assert getattr(TERecipeKwargs(), switch) is True
    monkeypatch.delenv("ACCELERATE_FP8_" + switch.upper())
    with pytest.raises(ValueError, match="both set"):
        TERecipeKwargs(use_mxfp8_block_scaling=True, use_nvfp4_block_scaling=True)
    assert main(["launch", "--dry_run", "--mixed_precision", "fp8", "--fp8_recipe", name, SCRIPT]) == 0
    assert f"LOWPREC_FP8_RECIPE={name}" in capsys.readouterr().out
    cfg = tmp_path / "mx.yaml"
    cfg.write_text(f"mixed_precision: fp8\nfp8_config: {{{switch}: true}}\n")
    assert main(["launch", "--dry_run", "--config_file", str(cfg), SCRIPT]) == 0
    assert f"LOWPREC_FP8_RECIPE={name}" in capsys.readouterr().out
    cfg.write_text(f"mixed_precision: fp8\nfp8_config: {{backend: TE, {switch}: true}}\n")
    assert main(["launch", "--dry_run", "--config_file", str(cfg), SCRIPT]) == 2
    assert f"TERecipeKwargs({switch}=True)" in capsys.readouterr().err
    # the native engine under another of its spellings runs the switch as the native one does
    cfg.write_text(f"mixed_precision: fp8\nfp8_config: {{backend: lowprec, {switch}: true}}\n")
    assert main(["launch", "--dry_run", "--config_file", str(cfg), SCRIPT]) == 0
    assert f"LOWPREC_FP8_RECIPE={name}" in capsys.readouterr().out


def test_native_fsdp_fp8_all_gather_is_refused_for_block_scales_with_one_message(monkeypatch, capsys):
    from lowprec.train.config import parse_config

    ok = parse_config({"fp8": True, "fsdp_version": 2, "fp8_enable_fsdp_float8_all_gather": True})
    assert ok.fp8_enable_fsdp_float8_all_gather is True
    message = FSDP_FP8_ALL_GATHER_UNSUPPORTED.format(recipe="nvfp4")
    with pytest.raises(ValueError) as e1:
        parse_config({"fp8": True, "fsdp_version": 2, "fp8_recipe": "nvfp4", "fp8_enable_fsdp_float8_all_gather": True})
    assert message in str(e1.value)
    assert (
        main(
            [
                "launch",
                "--dry_run",
                "--mixed_precision",
                "fp8",
                "--use_fsdp",
                "--fp8_recipe",
                "nvfp4",
                "--fp8_enable_fsdp_float8_all_gather",
                "true",
                SCRIPT,
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err
    monkeypatch.setenv("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "true")
    monkeypatch.setenv("LOWPREC_FP8_RECIPE", "nvfp4")
    with pytest.raises(ValueError) as e3:
        Accelerator(mixed_precision="fp8", cpu=True)
    assert message in str(e3.value)
    # the FSDP2 wrapper, for a model converted by hand: the same rule, the same words
    from lowprec import fp8
    from lowprec.distributed.fsdp_float8 import enable_fsdp_float8_all_gather

    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    fp8.convert(model, fp8.Recipe.from_name("nvfp4", high_precision_last=0.0), skip_first_last=False)
    assert fp8.has_fp8_layers(model)
    with pytest.raises(ValueError) as e4:
        enable_fsdp_float8_all_gather(model)
    assert str(e4.value) == message


def test_the_trainer_builds_its_recipe_once(monkeypatch):
    """Issue 11: the trainer's schema check and the settings resolver share one Recipe."""
    from lowprec.fp8 import recipes
    from lowprec.train.config import parse_config
    from lowprec.train.resolve import Capabilities, resolve
    from lowprec.train.trainer import _accelerator

    built = []
    post_init = recipes.Recipe.__post_init__
    monkeypatch.setattr(recipes, "_BUILT", {})
    monkeypatch.setattr(recipes.Recipe, "__post_init__", lambda self: (built.append(self), post_init(self))[1])
    tcfg = parse_config(
        {
            "fp8": True,
            "fp8_recipe": {
                "name": "delayed",
                "amax_history_len": 16,
                "override_linear_precision": [False, False, True],
            },
        }
    )
    acc = _accelerator(tcfg, resolve(tcfg, Capabilities()))
    assert acc.backend.recipe is tcfg.fp8_recipe.to_recipe() and len(built) == 1
    assert acc.backend.recipe.amax_history_len == 16
    # a different request is a different recipe; an invalid one still fails every time
    assert recipes.Recipe.from_name("delayed", amax_history_len=8) is not acc.backend.recipe
    for _ in range(2):
        with pytest.raises(ValueError):
            recipes.Recipe.from_name("delayed", margin=True)


@pytest.mark.parametrize("sm, fallback, mode", [((9, 0), None, "fp8"), ((8, 6), "emulate", "fp8-emulate")])
def test_the_sm89_rule_is_evaluated_once_on_a_trainer_run(monkeypatch, sm, fallback, mode):
    """Issue 11: on a CUDA trainer run the trainer's plan makes the sm_89 decision and the
    Accelerator takes it. Faked GPU: the trainer's Capabilities say ``sm``, and the
    Accelerator's state sees a CUDA device of the same capability."""
    import torch

    from lowprec import state
    from lowprec.decision import Decision
    from lowprec.train.config import parse_config
    from lowprec.train.resolve import Capabilities, resolve
    from lowprec.train.trainer import _accelerator

    calls = []
    rule = state.fp8_capability_check
    monkeypatch.setattr(state, "fp8_capability_check", lambda *a: (calls.append(a[0]), rule(*a))[1])
    monkeypatch.setattr(
        state, "_resolve_device", lambda cpu, env: Decision(torch.device("cuda", 0), "test: a faked GPU")
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: sm)
    tcfg = parse_config({"fp8": True, "fp8_fallback": fallback, "bf16": True, "torch_compile": False})
    plan = resolve(tcfg, Capabilities(cuda_capability=sm))
    acc = _accelerator(tcfg, plan)
    assert calls == [sm]  # resolve evaluated it; the Accelerator did not again
    assert acc.state.decisions["fp8_hardware"] == plan.fp8_hardware
    assert acc.state.decisions["fp8_hardware"].value == mode and acc.state.fp8_emulate == (mode == "fp8-emulate")
    # the same decision as an Accelerator that makes it itself (what a script without the trainer gets)
    calls.clear()
    own = Accelerator(mixed_precision="fp8", fp8_fallback=fallback)
    assert calls == [sm] and own.state.decisions["fp8_hardware"] == plan.fp8_hardware
