"""Kwargs handlers: resolution order, environment variables, aliases, validation.

Bug numbers are those of the known Accelerate FP8 bugs each test names in its docstring.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from lowprec.kwargs import (
    AORecipeKwargs,
    FP8RecipeKwargs,
    GradScalerKwargs,
    MSAMPRecipeKwargs,
    NativeRecipeKwargs,
    TERecipeKwargs,
    normalize_backend,
    parse_override_linear_precision,
    recipe_kwargs_from_config,
)

FP8_ENV = [
    "ACCELERATE_FP8_BACKEND",
    "ACCELERATE_FP8_OPT_LEVEL",
    "ACCELERATE_FP8_FORMAT",
    "ACCELERATE_FP8_AMAX_HISTORY_LEN",
    "ACCELERATE_FP8_AMAX_COMPUTE_ALGO",
    "ACCELERATE_FP8_MARGIN",
    "ACCELERATE_FP8_INTERVAL",
    "ACCELERATE_FP8_OVERRIDE_FPROP",
    "ACCELERATE_FP8_OVERRIDE_DGRAD",
    "ACCELERATE_FP8_OVERRIDE_WGRAD",
    "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL",
    "LOWPREC_FP8_RECIPE",
    "ACCELERATE_FP8_PAD_INNER_DIM",
    "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in FP8_ENV:
        monkeypatch.delenv(name, raising=False)


def test_te_defaults_are_the_documented_ones_and_all_are_forwarded():
    # bug 10: Accelerate forwards only non-defaults, so TE's own amax_compute_algo='max' wins
    kw = TERecipeKwargs().to_kwargs()
    assert kw == {
        "use_autocast_during_eval": False,
        "margin": 0,
        "interval": 1,
        "fp8_format": "HYBRID",
        "amax_history_len": 1024,
        "amax_compute_algo": "most_recent",
        "override_linear_precision": (False, False, False),
        "use_mxfp8_block_scaling": False,
        "use_nvfp4_block_scaling": False,
    }


def test_explicit_beats_env_beats_default(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LEN", "64")
    monkeypatch.setenv("ACCELERATE_FP8_FORMAT", "e4m3")
    monkeypatch.setenv("ACCELERATE_FP8_OVERRIDE_WGRAD", "True")
    assert TERecipeKwargs().amax_history_len == 64
    assert TERecipeKwargs(amax_history_len=8).amax_history_len == 8
    assert TERecipeKwargs().fp8_format == "E4M3"
    assert TERecipeKwargs().override_linear_precision == (False, False, True)
    assert TERecipeKwargs().margin == 0


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_MARGIN", "lots")
    with pytest.raises(ValueError, match="ACCELERATE_FP8_MARGIN"):
        TERecipeKwargs()


@pytest.mark.parametrize(
    "value, expected",
    [
        ((False, False, True), (False, False, True)),
        ([True, False, False], (True, False, False)),
        ("(false, false, true)", (False, False, True)),  # bug 6: the docs' YAML string
        ("false,true,false", (False, True, False)),
        ("[True, False, True]", (True, False, True)),
    ],
)
def test_override_linear_precision_forms(value, expected):
    assert parse_override_linear_precision(value) == expected
    assert TERecipeKwargs(override_linear_precision=value).override_linear_precision == expected


@pytest.mark.parametrize("value", ["(false, false)", False, "(maybe, no, no)"])
def test_override_linear_precision_rejects(value):
    with pytest.raises(ValueError, match="override_linear_precision"):
        TERecipeKwargs(override_linear_precision=value)


def test_wizard_aliases():
    # bug 5: `accelerate config` writes these spellings; Accelerate never reads them
    te = TERecipeKwargs(amax_history_length=16, amax_compute_algorithm="MAX")
    assert (te.amax_history_len, te.amax_compute_algo) == (16, "max")
    assert MSAMPRecipeKwargs(optimization_level="O1").opt_level == "O1"
    with pytest.raises(ValueError, match="alias"):
        TERecipeKwargs(amax_history_len=8, amax_history_length=16)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(fp8_format="E3M4"), "fp8_format"),
        (dict(amax_compute_algo="mean"), "amax_compute_algo"),
        (dict(amax_history_len=0), "amax_history_len"),
        (dict(interval=0), "interval"),
        (dict(margin=-1), "margin"),
    ],
)
def test_te_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TERecipeKwargs(**kwargs)


def test_msamp_opt_level(monkeypatch):
    assert MSAMPRecipeKwargs().opt_level == "O2"
    monkeypatch.setenv("ACCELERATE_FP8_OPT_LEVEL", "o1")
    assert MSAMPRecipeKwargs().opt_level == "O1"
    with pytest.raises(ValueError, match="opt_level"):
        MSAMPRecipeKwargs(opt_level="O3")


def test_legacy_fp8_recipe_kwargs_fixed_quirks():
    # bug 9: opt_level validated and defaulted, msamp works without TE, backend never leaks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ms = FP8RecipeKwargs(backend="msamp", optimization_level="O1")
        assert ms.opt_level == "O1" and ms.backend == "msamp"
        assert ms.to_handler() == MSAMPRecipeKwargs(opt_level="O1")
        te = FP8RecipeKwargs(backend="TE", amax_history_len=32)
        handler = te.to_handler()
        assert isinstance(handler, TERecipeKwargs) and "backend" not in handler.to_kwargs()
        assert handler.amax_history_len == 32
        assert FP8RecipeKwargs(backend="te").opt_level == "O2"
        with pytest.raises(ValueError, match="opt_level"):
            FP8RecipeKwargs(backend="msamp", opt_level="O3")
        with pytest.raises(ValueError, match="backend"):
            FP8RecipeKwargs(backend="ao")


def test_legacy_backend_default_is_te_without_msamp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert FP8RecipeKwargs().backend == "te"


@pytest.mark.parametrize(
    "raw, name",
    [
        ("te", "te"),
        ("TE", "te"),
        ("Ao", "torchao"),
        ("MSAMP", "msamp"),
        ("ms-amp", "msamp"),
        ("native", "native"),
        ("NO", None),
        ("", None),
    ],
)
def test_backend_names_any_case(raw, name):
    # bug 4: lower-case --fp8_backend crashed Accelerate's child process
    assert normalize_backend(raw) == name


def test_unknown_backend_message():
    with pytest.raises(ValueError, match="native, ao, te, msamp"):
        normalize_backend("cuda")


def test_ao_defaults_and_env(monkeypatch):
    ao = AORecipeKwargs()
    assert ao.pad_inner_dim is True and ao.enable_fsdp_float8_all_gather is True
    monkeypatch.setenv("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "false")
    assert AORecipeKwargs().enable_fsdp_float8_all_gather is False
    with pytest.raises(ValueError, match="recipe"):
        AORecipeKwargs(recipe="blockwise")
    with pytest.raises(TypeError, match="module_filter_func"):
        AORecipeKwargs(module_filter_func=3)


def test_native_recipe_by_name(monkeypatch):
    r = NativeRecipeKwargs(recipe="rowwise").to_recipe()
    assert r.scaling == "rowwise" and r.name == "rowwise"
    monkeypatch.setenv("LOWPREC_FP8_RECIPE", "blockwise")
    assert NativeRecipeKwargs().to_recipe().scaling == "blockwise"
    with pytest.raises(ValueError, match="did you mean 'rowwise'"):
        NativeRecipeKwargs(recipe="rowwize")
    with pytest.raises(ValueError, match="amax_history_len"):
        NativeRecipeKwargs(recipe="delayed", overrides={"amax_history_length": 3})


def test_config_block_te_wizard_output():
    cfg = {
        "backend": "TE",
        "amax_history_length": 16,
        "amax_compute_algorithm": "max",
        "override_linear_precision": "(false, false, true)",
        "use_autocast_during_eval": False,
        "fp8_format": "HYBRID",
        "interval": 1,
        "margin": 0,
    }
    h = recipe_kwargs_from_config(cfg)
    assert isinstance(h, TERecipeKwargs)
    assert (h.amax_history_len, h.amax_compute_algo, h.override_linear_precision) == (16, "max", (False, False, True))
    assert recipe_kwargs_from_config({"backend": "msamp", "optimization_level": "O1"}).opt_level == "O1"


def test_config_block_unknown_key_is_an_error_with_hint():
    # bug 5: keys inside fp8_config were never validated
    with pytest.raises(ValueError, match="did you mean 'amax_history_len'"):
        recipe_kwargs_from_config({"backend": "te", "amax_histroy_len": 3})


def test_handlers_are_frozen_and_grad_scaler_forwards_everything():
    h = GradScalerKwargs(init_scale=1024.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.init_scale = 2.0  # type: ignore[misc]
    assert h.to_kwargs() == {
        "init_scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "enabled": True,
    }


def test_native_recipe_takes_set_launch_variables_only(monkeypatch):
    # `lowprec launch --fp8_recipe delayed --fp8_amax_history_len 32` writes these two
    monkeypatch.setenv("LOWPREC_FP8_RECIPE", "delayed")
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LEN", "32")
    monkeypatch.setenv("ACCELERATE_FP8_OVERRIDE_WGRAD", "true")
    r = NativeRecipeKwargs().to_recipe()
    assert (r.scaling, r.amax_history_len, r.override_linear_precision) == ("delayed", 32, (False, False, True))
    assert NativeRecipeKwargs(overrides={"amax_history_len": 8}).to_recipe().amax_history_len == 8
    monkeypatch.delenv("ACCELERATE_FP8_OVERRIDE_WGRAD")
    monkeypatch.setenv("LOWPREC_FP8_RECIPE", "rowwise")
    assert NativeRecipeKwargs().to_recipe().fp8_format.value == "E4M3"  # preset kept: FORMAT unset
    monkeypatch.setenv("ACCELERATE_FP8_MARGIN", "2")
    with pytest.raises(ValueError, match="margin"):
        NativeRecipeKwargs()


def test_deepspeed_plugin_env(monkeypatch, tmp_path):
    from lowprec.kwargs import DeepSpeedPlugin
    from lowprec.utils.deepspeed import build_ds_config

    cfg_file = tmp_path / "ds.json"
    cfg_file.write_text('{"bf16": {"enabled": true}, "zero_optimization": {"stage": 1}}')
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "0.5")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    p = DeepSpeedPlugin()
    assert (p.zero_stage, p.gradient_clipping, p.offload_optimizer_device) == (3, 0.5, "cpu")
    cfg = build_ds_config(p, "fp8", micro_batch_size=4, accumulation_steps=2, world=2)
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    assert (cfg["train_batch_size"], cfg["gradient_clipping"]) == (16, 0.5)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(cfg_file))
    from_file = DeepSpeedPlugin()
    assert build_ds_config(from_file, "bf16", 4, 1, 1)["zero_optimization"]["stage"] == 1  # the file wins
    with pytest.raises(ValueError, match="bf16.enabled"):
        build_ds_config(from_file, "fp16", 4, 1, 1)


def test_fsdp_plugin_env_and_policies(monkeypatch):
    from torch import nn

    from lowprec.kwargs import FullyShardedDataParallelPlugin
    from lowprec.utils.distributed import fsdp2_units

    model = nn.Sequential(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), nn.Linear(32, 4))
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Linear")
    p = FullyShardedDataParallelPlugin()
    assert p.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and len(fsdp2_units(model, p)) == 3
    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "size_based_wrap")
    monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", "1000")
    assert [type(u).__name__ for u in fsdp2_units(model, FullyShardedDataParallelPlugin())] == [
        "Linear",
        "Linear",
        "Sequential",
    ]
    with pytest.raises(ValueError, match="FSDP2"):
        FullyShardedDataParallelPlugin(fsdp_version=1)
    with pytest.raises(ValueError, match="not found in the model"):
        fsdp2_units(model, FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap="Block"))


@pytest.mark.parametrize("text", ["[lm_head, router]", "(1, 2", "[os.getcwd()]"])
def test_config_block_is_parsed_by_the_launch_schema(text):
    # one fp8_config parser (config.launch_config.FP8Config): skip_patterns is no key of it, and
    # nothing in a YAML string is ever evaluated
    with pytest.raises(ValueError, match="unknown key 'fp8_config.skip_patterns'"):
        recipe_kwargs_from_config({"backend": "native", "skip_patterns": text})


@pytest.mark.parametrize(
    "name",
    [
        "FSDP_VERSION",
        "FSDP_MIN_NUM_PARAMS",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        "WORLD_SIZE",
    ],
)
def test_bad_integer_env_names_the_variable(monkeypatch, name):
    from lowprec import Accelerator
    from lowprec.kwargs import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from lowprec.state import read_distributed_env

    for other in (
        "FSDP_VERSION",
        "FSDP_MIN_NUM_PARAMS",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        "WORLD_SIZE",
        "RANK",
        "ACCELERATE_MIXED_PRECISION",
    ):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "two")
    build = {
        "FSDP_VERSION": FullyShardedDataParallelPlugin,
        "FSDP_MIN_NUM_PARAMS": FullyShardedDataParallelPlugin,
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": DeepSpeedPlugin,
        "WORLD_SIZE": read_distributed_env,
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": lambda: Accelerator(cpu=True),
    }[name]
    with pytest.raises(ValueError, match=f"environment variable {name} must be an integer, got 'two'"):
        build()
