"""The launch contract: LaunchSettings <-> env vars, and the launch YAML schema.

Several tests prove we do not have a bug Accelerate has (reference accelerate-fp8.md §3.4 and
§8); their names say which.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import yaml

from lowprec.config import values as V
from lowprec.config.env import ENV_VARS, FP8_OVERRIDE_VARS, UNREAD_FIELDS, LaunchSettings, owned_env_var
from lowprec.config.launch_config import (
    load_launch_config,
    parse_launch_config,
    settings_to_yaml_dict,
    write_launch_config,
)
from lowprec.errors import UsageError

# The TE example from Accelerate's low-precision guide (seed 002), verbatim.
ACCELERATE_DOC_TE_YAML = """
mixed_precision: fp8
fp8_config:
  amax_compute_algo: max
  amax_history_len: 1024
  backend: TE
  fp8_format: HYBRID
  interval: 1
  margin: 0
  override_linear_precision: (false, false, false)
  use_autocast_during_eval: false
"""

# What `accelerate config` writes for TE and MS-AMP (wizard spellings, reference §3.3).
ACCELERATE_WIZARD_YAML = """
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: fp8
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
fp8_config:
  backend: MSAMP
  amax_history_length: 16
  amax_compute_algorithm: most_recent
  optimization_level: O1
"""


def settings_of(text: str) -> LaunchSettings:
    return LaunchSettings.from_layers(parse_launch_config(yaml.safe_load(text)).to_settings())


def random_settings(rng: random.Random) -> LaunchSettings:
    """A valid LaunchSettings with a random subset of fields set to random valid values."""
    machines = rng.choice([1, 1, 2])
    kw: dict = {
        "mixed_precision": rng.choice(V.MIXED_PRECISIONS),
        "num_machines": machines,
        "num_processes": machines * rng.randint(1, 4),
        "machine_rank": rng.randrange(machines),
        "use_cpu": rng.random() < 0.5,
    }
    if machines > 1:
        kw["main_process_ip"] = f"10.0.0.{rng.randint(1, 250)}"
        kw["main_process_port"] = rng.randint(20000, 30000)
    mode = rng.choice(["ddp", "fsdp", "deepspeed"])
    if mode == "fsdp":
        kw.update(
            use_fsdp=True, fsdp_reshard_after_forward=rng.random() < 0.5, fsdp_transformer_layer_cls_to_wrap="Block"
        )
    if mode == "deepspeed":
        kw.update(use_deepspeed=True, zero_stage=rng.randint(0, 2), offload_optimizer_device="cpu")
    optional = {
        "fp8_backend": lambda: rng.choice(["native", "ao", "auto"]),
        "fp8_recipe": lambda: rng.choice(V.FP8_RECIPES),
        "fp8_fallback": lambda: rng.choice(V.FP8_FALLBACKS),
        "fp8_amax_history_len": lambda: rng.randint(1, 2048),
        "fp8_amax_compute_algo": lambda: rng.choice(V.AMAX_COMPUTE_ALGOS),
        "fp8_margin": lambda: rng.randint(0, 4),
        "fp8_interval": lambda: rng.randint(1, 8),
        "fp8_opt_level": lambda: rng.choice(V.OPT_LEVELS),
        "fp8_override_linear_precision": lambda: (False, rng.random() < 0.5, rng.random() < 0.5),
        "fp8_use_autocast_during_eval": lambda: rng.random() < 0.5,
        "fp8_pad_inner_dim": lambda: rng.random() < 0.5,
        "fp8_force_recompute_fp8_weight_in_bwd": lambda: rng.random() < 0.5,
        "gradient_accumulation_steps": lambda: rng.randint(1, 16),
        "dynamo_backend": lambda: rng.choice(V.DYNAMO_BACKENDS),
    }
    for key, make in optional.items():
        if rng.random() < 0.6:
            kw[key] = make()
    return LaunchSettings(**kw)


LAUNCH_ONLY = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port", "gpu_ids")


@pytest.mark.parametrize("seed", range(6))
def test_env_round_trip_random_settings(seed):
    s = random_settings(random.Random(seed))
    env = s.to_env()
    assert all(owned_env_var(k) for k in env)
    back = LaunchSettings.from_env(env)
    # What travels by env is everything but the torchrun flags; fp8 values only with fp8,
    # FSDP/DeepSpeed values only in their mode.
    expected = s.replace(**{k: getattr(LaunchSettings(), k) for k in LAUNCH_ONLY})
    if not s.fp8:
        expected = expected.replace(**{f.name: None for f in dataclasses.fields(s) if f.name.startswith("fp8_")})
    expected = expected.replace(**{k: None for k in UNREAD_FIELDS})  # accepted, read by nothing: not exported
    assert back == expected


@pytest.mark.parametrize("seed", range(6))
def test_yaml_round_trip_random_settings(seed, tmp_path):
    s = random_settings(random.Random(100 + seed))
    path = write_launch_config(s, tmp_path / "c.yaml")
    assert LaunchSettings.from_layers(load_launch_config(path).to_settings()) == s


def test_unset_values_are_not_exported_so_recipe_defaults_survive():
    env = LaunchSettings(mixed_precision="fp8", fp8_recipe="rowwise").to_env()
    assert env["LOWPREC_FP8_RECIPE"] == "rowwise"
    # Accelerate exported every default (e.g. FORMAT=HYBRID), which would override rowwise's E4M3.
    for name in (
        "ACCELERATE_FP8_FORMAT",
        "ACCELERATE_FP8_AMAX_HISTORY_LEN",
        "ACCELERATE_FP8_MARGIN",
        *FP8_OVERRIDE_VARS,
    ):
        assert name not in env


def test_fp8_values_are_not_exported_without_fp8():
    env = LaunchSettings(mixed_precision="bf16", fp8_backend="te", fp8_margin=2).to_env()
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert not any(k.startswith(("ACCELERATE_FP8_", "LOWPREC_FP8_")) for k in env)


def test_no_bug_lowercase_backend_crashes_child():
    """§3.4 bug 1: `--fp8_backend te` exported lower case, which FP8BackendType rejects."""
    for given, exported in [
        ("te", "TE"),
        ("Ao", "AO"),
        ("torchao", "AO"),
        ("msamp", "MSAMP"),
        ("MS-AMP", "MSAMP"),
        ("NATIVE", "NATIVE"),
        ("transformer_engine", "TE"),
    ]:
        env = LaunchSettings(mixed_precision="fp8", fp8_backend=given).to_env()
        assert env["ACCELERATE_FP8_BACKEND"] == exported
        assert (
            LaunchSettings.from_env({**env, "ACCELERATE_FP8_BACKEND": exported.lower()}).fp8_backend == exported.lower()
        )


def test_no_bug_tuple_string_override_linear_precision():
    """§3.4 bug 3: the documented "(false, false, false)" string was indexed per character."""
    s = settings_of(ACCELERATE_DOC_TE_YAML)
    assert s.fp8_override_linear_precision == (False, False, False)
    env = s.to_env()
    assert [env[n] for n in FP8_OVERRIDE_VARS] == ["false", "false", "false"]
    for text in ["(false, false, true)", "[false,false,true]", "false,false,true", "(False, False, True)"]:
        assert V.parse_override_linear_precision(text) == (False, False, True)
    assert V.parse_override_linear_precision([0, "no", "yes"]) == (False, False, True)


def test_no_bug_lone_boolean_override_linear_precision():
    """Issue #3489: `override_linear_precision: false` was indexed like a string."""
    with pytest.raises(UsageError, match=r"fp8_config\.override_linear_precision.*three booleans"):
        settings_of("mixed_precision: fp8\nfp8_config: {override_linear_precision: false}")


def test_doc_yaml_values_reach_the_right_variables():
    env = settings_of(ACCELERATE_DOC_TE_YAML).to_env()
    assert env["ACCELERATE_FP8_BACKEND"] == "TE"
    assert env["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"] == "max"
    assert env["ACCELERATE_FP8_AMAX_HISTORY_LEN"] == "1024"
    assert env["ACCELERATE_FP8_FORMAT"] == "HYBRID"
    assert env["ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL"] == "false"


def test_no_bug_wizard_spellings_ignored():
    """§3.4 bug 2: `accelerate config` wrote amax_history_length / amax_compute_algorithm /
    optimization_level; Accelerate exported ..._AMAX_HISTORY_LENGTH etc., which nobody reads."""
    s = settings_of(ACCELERATE_WIZARD_YAML)
    assert (s.fp8_amax_history_len, s.fp8_amax_compute_algo, s.fp8_opt_level) == (16, "most_recent", "O1")
    assert (s.num_processes, s.use_fsdp, s.use_deepspeed, s.gpu_ids) == (2, False, False, "all")
    env = s.to_env()
    assert env["ACCELERATE_FP8_AMAX_HISTORY_LEN"] == "16"
    assert env["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"] == "most_recent"
    assert env["ACCELERATE_FP8_OPT_LEVEL"] == "O1"
    assert env["ACCELERATE_FP8_BACKEND"] == "MSAMP"
    assert not {"ACCELERATE_FP8_AMAX_HISTORY_LENGTH", "ACCELERATE_FP8_OPTIMIZATION_LEVEL"} & set(env)
    assert "CUDA_VISIBLE_DEVICES" not in env  # gpu_ids: all masks nothing


def test_no_bug_unvalidated_fp8_config_keys():
    """§8 bug 5: keys inside fp8_config were never validated."""
    with pytest.raises(UsageError) as err:
        settings_of("mixed_precision: fp8\nfp8_config: {amax_histroy_len: 16}")
    assert "unknown key 'fp8_config.amax_histroy_len' (did you mean 'amax_history_len'?)" in str(err.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("mixed_precison: fp8", "unknown key 'mixed_precison' (did you mean 'mixed_precision'?)"),
        ("fsdp_config: {fsdp_versoin: 2}", "did you mean 'fsdp_version'?"),
        ("mixed_precision: fp4", "mixed_precision: 'fp4' is not valid"),
        ("fp8_config: {backend: tee}", "fp8_config.backend: 'tee' is not valid (did you mean 'te'?)"),
        ("fp8_config: {recipe: rowise}", "did you mean 'rowwise'?"),
        ("fp8_config: {amax_compute_algo: mean}", "choose one of max, most_recent"),
        ("fp8_config: {opt_level: '02'}", "write the letter O: O2"),
        ("fp8_config: {margin: -1}", "fp8_config.margin: -1 is too small"),
        ("num_processes: two", "num_processes: 'two' is not an integer"),
        ("fp8_config: 3", "fp8_config: expected a mapping"),
        ("fp8_config: {amax_history_len: 4, amax_history_length: 4}", "mean the same; keep one"),
        ("distributed_type: TPU", "distributed_type: 'TPU' is not valid"),
    ],
)
def test_invalid_yaml_is_one_line_naming_the_key(text, expected):
    with pytest.raises(UsageError) as err:
        settings_of(text)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_fsdp1_is_rejected_with_the_fix():
    with pytest.raises(UsageError, match="FSDP1 is not supported.*set fsdp_version to 2"):
        settings_of("distributed_type: FSDP\nfsdp_config: {fsdp_version: 1}")


def test_accelerate_fsdp_yaml_loads():
    s = settings_of(
        """
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
mixed_precision: BF16
num_machines: 1
num_processes: 8
"""
    )
    assert s.use_fsdp and not s.use_deepspeed and s.mixed_precision == "bf16"
    assert s.fsdp_reshard_after_forward is False  # SHARD_GRAD_OP keeps parameters after forward
    env = s.to_env()
    assert env["FSDP_VERSION"] == "2" and env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "LlamaDecoderLayer"


def test_unquoted_yaml_no_means_no():
    s = settings_of("distributed_type: NO\nmixed_precision: no\ndynamo_config: {dynamo_backend: NO}")
    assert (s.mixed_precision, s.dynamo_backend, s.use_fsdp) == ("no", "no", False)


def test_multi_cpu_means_cpu_and_deepspeed_section():
    s = settings_of("distributed_type: MULTI_CPU\nnum_processes: 2")
    assert s.use_cpu and s.num_processes == 2
    s = settings_of("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 3, zero3_init_flag: true}")
    env = s.to_env()
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert "ACCELERATE_DEEPSPEED_ZERO3_INIT" not in env  # nothing in lowprec reads it


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(use_fsdp=True, use_deepspeed=True), "pick one"),
        (dict(num_machines=2, num_processes=4), "needs main_process_ip"),
        (dict(num_machines=2, num_processes=3, main_process_ip="h"), "not a multiple"),
        (dict(num_machines=2, num_processes=2, machine_rank=2, main_process_ip="h"), "must be below"),
        (dict(mixed_precision="fp8", fp8_format="E5M2"), "TransformerEngine option"),
        (dict(mixed_precision="fp8", fp8_override_linear_precision=(True, True, True)), "no GEMM in FP8"),
        (dict(zero_stage=5), "not a ZeRO stage"),
        (dict(mixed_precision="fp9"), "mixed_precision: 'fp9' is not valid"),
    ],
)
def test_invalid_combinations(kwargs, message):
    with pytest.raises(UsageError, match=message):
        LaunchSettings(**kwargs)


def test_e5m2_allowed_for_te():
    assert LaunchSettings(mixed_precision="fp8", fp8_backend="te", fp8_format="e5m2").fp8_format == "E5M2"


def test_from_env_names_the_bad_variable():
    with pytest.raises(UsageError, match="ACCELERATE_FP8_MARGIN='lots'"):
        LaunchSettings.from_env({"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_MARGIN": "lots"})
    with pytest.raises(UsageError, match="ACCELERATE_FP8_OVERRIDE_WGRAD='maybe'"):
        LaunchSettings.from_env({"ACCELERATE_FP8_OVERRIDE_WGRAD": "maybe"})


def test_from_env_reads_accelerate_spellings():
    """What `accelerate launch` exports (str(True), every default) must read back."""
    env = {
        "ACCELERATE_MIXED_PRECISION": "FP8",
        "ACCELERATE_USE_CPU": "True",
        "ACCELERATE_FP8_BACKEND": "TE",
        "ACCELERATE_FP8_OVERRIDE_FPROP": "False",
        "ACCELERATE_FP8_OVERRIDE_DGRAD": "False",
        "ACCELERATE_FP8_OVERRIDE_WGRAD": "True",
        "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL": "False",
    }
    s = LaunchSettings.from_env(env)
    assert s.fp8 and s.use_cpu and s.fp8_backend == "te"
    assert s.fp8_override_linear_precision == (False, False, True)
    assert s.fp8_use_autocast_during_eval is False


def test_recipe_names_match_the_engine():
    from lowprec.fp8.recipes import RECIPE_NAMES

    assert V.FP8_RECIPES == tuple(RECIPE_NAMES)


@pytest.mark.parametrize("recipe", V.FP8_RECIPES)
def test_exported_values_build_an_engine_recipe(recipe):
    """The consumer side: env -> settings -> lowprec.fp8.Recipe, values intact."""
    from lowprec.fp8.recipes import Recipe

    rng = random.Random(recipe)
    per_tensor = recipe in ("delayed", "tensorwise")
    kw = dict(
        mixed_precision="fp8",
        fp8_recipe=recipe,
        fp8_amax_history_len=rng.randint(1, 64),
        fp8_interval=rng.randint(1, 4),
        fp8_amax_compute_algo=rng.choice(V.AMAX_COMPUTE_ALGOS),
        fp8_use_autocast_during_eval=True,
    )
    if per_tensor:
        kw["fp8_margin"] = rng.randint(0, 3)
    s = LaunchSettings.from_env(LaunchSettings(**kw).to_env())
    r = Recipe.from_name(s.fp8_recipe, **s.fp8_recipe_overrides())
    assert r.name == recipe and r.amax_history_len == kw["fp8_amax_history_len"]
    assert r.interval == kw["fp8_interval"] and r.amax_compute_algo == kw["fp8_amax_compute_algo"]
    assert r.use_during_eval is True
    assert r.margin == kw.get("fp8_margin", 0)


def test_every_env_var_is_documented_in_the_module_docstring():
    import lowprec.config.env as env_module

    for var in ENV_VARS:
        assert var.name in env_module.__doc__
    for name in FP8_OVERRIDE_VARS:
        assert name in env_module.__doc__


def test_yaml_dict_uses_accelerate_layout():
    d = settings_to_yaml_dict(
        LaunchSettings(
            mixed_precision="fp8", fp8_backend="te", num_processes=2, fp8_override_linear_precision=(False, False, True)
        )
    )
    assert d["distributed_type"] == "MULTI_GPU"
    assert d["fp8_config"] == {"backend": "TE", "override_linear_precision": [False, False, True]}
