"""`lowprec config`: wizard on stdin, --default, flags; what it writes, launch reads back."""

from __future__ import annotations

import io
import os
import random
import shlex
from pathlib import Path

import pytest

from lowprec.cli.launch import worker_threads_env
from lowprec.cli.main import main
from lowprec.config import values as V
from lowprec.config.env import LaunchSettings, owned_env_var
from lowprec.config.launch_config import default_config_path, load_launch_config

SCRIPT = str(Path(__file__).parent / "scripts" / "report_launch_env.py")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWPREC_CONFIG_HOME", str(tmp_path / "config_home"))
    for key in list(os.environ):
        if owned_env_var(key):
            monkeypatch.delenv(key)


def launch_env(argv, capsys) -> dict[str, str]:
    assert main(["launch", "--dry_run", *argv, SCRIPT]) == 0
    out = capsys.readouterr().out
    env = {}
    for line in out.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            env[key] = shlex.split(value)[0]
    return env


def loaded(path) -> LaunchSettings:
    return LaunchSettings.from_layers(load_launch_config(path).to_settings())


def feed(monkeypatch, answers):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{a}\n" for a in answers)))


def test_wizard_round_trip_fsdp_fp8(monkeypatch, tmp_path, capsys):
    answers = [
        "1",  # machines
        "2",  # processes
        "yes",  # cpu
        "FSDP",  # parallelism, any case
        "",  # reshard after forward: default yes
        "LlamaDecoderLayer",
        "",  # tensor parallel size: default 1
        "fp8",
        "native",
        "delayed",
        "bf16",  # fallback
        "e4m3",
        "1",  # margin
        "16",  # amax history
        "most_recent",
        "yes",  # override some GEMMs
        "no",
        "no",
        "true",
        "",  # eval: default no
        "",  # FP8 all-gather (asked for the per-tensor recipes, tensorwise and delayed): default yes
    ]
    feed(monkeypatch, answers)
    path = tmp_path / "wizard.yaml"
    assert main(["config", "--config_file", str(path)]) == 0
    capsys.readouterr()
    s = loaded(path)
    assert s == LaunchSettings(
        num_processes=2,
        use_cpu=True,
        use_fsdp=True,
        fsdp_reshard_after_forward=True,
        fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        fsdp_transformer_layer_cls_to_wrap="LlamaDecoderLayer",
        mixed_precision="fp8",
        fp8_backend="native",
        fp8_recipe="delayed",
        fp8_fallback="bf16",
        fp8_format="E4M3",
        fp8_margin=1,
        fp8_amax_history_len=16,
        fp8_amax_compute_algo="most_recent",
        fp8_override_linear_precision=(False, False, True),
        fp8_use_autocast_during_eval=False,
        fp8_enable_fsdp_float8_all_gather=True,
    )
    env = launch_env(["--config_file", str(path)], capsys)
    assert env == {**s.to_env(), **worker_threads_env(s, os.environ)}  # OMP_NUM_THREADS=1 where unset


def test_wizard_reasks_on_bad_answer_and_fails_cleanly_on_eof(monkeypatch, tmp_path, capsys):
    feed(monkeypatch, ["0", "1", "1", "no", "fp4", "bf16"])  # 0 machines and fp4 are re-asked
    path = tmp_path / "w.yaml"
    assert main(["config", "--config_file", str(path)]) == 0
    captured = capsys.readouterr()
    assert "too small" in captured.err and "'fp4' is not valid" in captured.err
    assert loaded(path) == LaunchSettings(mixed_precision="bf16")

    feed(monkeypatch, ["1"])
    assert main(["config", "--config_file", str(tmp_path / "eof.yaml")]) == 2
    assert "stdin ended" in capsys.readouterr().err
    assert not (tmp_path / "eof.yaml").exists()


def test_wizard_msamp_deepspeed(monkeypatch, tmp_path, capsys):
    feed(monkeypatch, ["1", "4", "no", "deepspeed", "1", "fp8", "ms-amp", "o1", "no"])
    path = tmp_path / "ds.yaml"
    assert main(["config", "--config_file", str(path)]) == 0
    s = loaded(path)
    assert (s.use_deepspeed, s.zero_stage, s.fp8_backend, s.fp8_opt_level) == (True, 1, "msamp", "O1")


@pytest.mark.parametrize("seed", range(4))
def test_flags_round_trip_through_config_file(seed, tmp_path, capsys):
    """config with flags, then launch with that file == launch with the same flags."""
    rng = random.Random(seed)
    backend = rng.choice(["native", "TE", "torchao", "auto", "msamp"])
    flags = ["--mixed_precision", "fp8", "--num_processes", str(rng.randint(1, 4)), "--fp8_backend", backend]
    # only fields the backend and its recipe read (launch rejects the others: each backend's
    # SPEC.reads, lowprec.catalog's RecipeInfo.reads)
    if backend in ("native", "auto"):
        flags += ["--fp8_recipe", "delayed"]
    if backend in ("native", "TE", "auto"):
        flags += [
            "--fp8_amax_history_len",
            str(rng.randint(1, 4096)),
            "--fp8_amax_compute_algo",
            rng.choice(V.AMAX_COMPUTE_ALGOS),
            "--fp8_override_linear_precision",
            rng.choice(["(false,false,true)", "false,true,false"]),
        ]
    if backend == "msamp":
        flags += ["--fp8_opt_level", rng.choice(V.OPT_LEVELS)]
    if backend == "torchao":
        flags += ["--fp8_pad_inner_dim", rng.choice(["true", "false"])]
        if rng.random() < 0.5:
            flags += ["--use_fsdp", "--fp8_enable_fsdp_float8_all_gather", rng.choice(["true", "false"])]
    if rng.random() < 0.5 and backend != "msamp":
        flags += ["--fp8_use_during_eval", "--cpu"]
    path = tmp_path / "flags.yaml"
    assert main(["config", "--config_file", str(path), *flags]) == 0
    capsys.readouterr()
    direct = launch_env(flags, capsys)
    via_file = launch_env(["--config_file", str(path)], capsys)
    assert via_file == direct
    assert direct["ACCELERATE_MIXED_PRECISION"] == "fp8"


def test_default_writes_default_location(monkeypatch, tmp_path, capsys):
    assert main(["config", "--default"]) == 0
    out = capsys.readouterr().out
    path = default_config_path()
    assert path.is_file() and str(path) in out
    assert path.parent == tmp_path / "config_home"
    s = loaded(path)
    # launch finds it without --config_file
    assert launch_env([], capsys)["ACCELERATE_MIXED_PRECISION"] == s.mixed_precision


def _fake_cuda(monkeypatch, count, cc, bf16=True):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: cc)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


@pytest.mark.parametrize(
    "count, cc, bf16, precision, procs",
    [
        (0, (0, 0), True, "bf16", 1),
        (2, (9, 0), True, "fp8", 2),
        (4, (8, 0), True, "bf16", 4),
        (1, (7, 0), False, "fp16", 1),
    ],
)
def test_default_follows_hardware(monkeypatch, tmp_path, capsys, count, cc, bf16, precision, procs):
    _fake_cuda(monkeypatch, count, cc, bf16)
    path = tmp_path / "d.yaml"
    assert main(["config", "--default", "--config_file", str(path)]) == 0
    s = loaded(path)
    assert (s.mixed_precision, s.num_processes) == (precision, procs)
    assert "lowprec config:" in capsys.readouterr().out  # the reason is printed
    # a GPU-less machine says use_cpu: true (issue 13: it wrote false); with GPUs it stays unset
    assert ("use_cpu: true" in path.read_text()) == (count == 0) and bool(s.use_cpu) == (count == 0)


def test_default_with_flag_override(tmp_path, capsys):
    path = tmp_path / "d.yaml"
    assert main(["config", "--default", "--mixed_precision", "no", "--config_file", str(path)]) == 0
    assert loaded(path).mixed_precision == "no"


def test_config_flag_errors(tmp_path, capsys):
    assert main(["config", "--fp8_margin", "2", "--config_file", str(tmp_path / "x.yaml")]) == 2
    assert "FP8 option(s)" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()


def test_a_config_file_that_cannot_be_written_is_one_line(monkeypatch, tmp_path, capsys):
    assert main(["config", "--mixed_precision", "bf16", "--config_file", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"--config_file {tmp_path}: is a directory; give a file path" in err
    (tmp_path / "home").write_text("")  # LOWPREC_CONFIG_HOME names a file
    monkeypatch.setenv("LOWPREC_CONFIG_HOME", str(tmp_path / "home"))
    assert main(["config", "--mixed_precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"(LOWPREC_CONFIG_HOME={tmp_path / 'home'}): cannot be written" in err
    assert "give --config_file PATH, or set LOWPREC_CONFIG_HOME to a writable directory" in err


def test_the_config_file_is_written_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: fp8\n")  # an earlier config

    def fails(self, text, *args, **kwargs):  # a write cut short (disk full, Ctrl-C)
        with open(self, "w") as f:
            f.write(text[:20])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", fails)
    assert main(["config", "--mixed_precision", "bf16", "--config_file", str(path)]) == 2
    assert "cannot be written (No space left on device)" in capsys.readouterr().err
    assert path.read_text() == "mixed_precision: fp8\n" and os.listdir(tmp_path) == ["c.yaml"]


def test_wizard_asks_the_recipe_options_the_catalog_declares(monkeypatch, tmp_path, capsys):
    """Issue 14: mxfp8's scale_rounding is asked (its question comes from
    lowprec.catalog.RECIPE_OPTIONS), written to the launch YAML, exported by launch, and reaches
    the engine's Recipe inside the launched script."""
    from lowprec import Accelerator
    from lowprec.catalog import RECIPE_OPTIONS, recipe_info

    option = RECIPE_OPTIONS["scale_rounding"]
    assert option.name in recipe_info("mxfp8").reads
    # machines, processes, cpu, precision, backend, recipe, fallback, scale rounding, override GEMMs?, eval
    feed(monkeypatch, ["1", "1", "no", "fp8", "native", "mxfp8", "", "FLOOR", "", ""])
    path = tmp_path / "mx.yaml"
    assert main(["config", "--config_file", str(path)]) == 0
    assert option.question in capsys.readouterr().out
    assert "scale_rounding: floor" in path.read_text()
    s = loaded(path)
    assert (s.fp8_recipe, s.fp8_scale_rounding, s.fp8_margin) == ("mxfp8", "floor", None)
    env = launch_env(["--config_file", str(path)], capsys)
    assert env["LOWPREC_FP8_SCALE_ROUNDING"] == "floor" and env == {**s.to_env(), **worker_threads_env(s, os.environ)}
    for key, value in env.items():  # what the launched script sees
        monkeypatch.setenv(key, value)
    recipe = Accelerator().backend.recipe
    assert (recipe.name, recipe.scale_rounding) == ("mxfp8", "floor")
    # the flag spelling, and a recipe that does not read the option: one usage error
    assert (
        launch_env(["--mixed_precision", "fp8", "--fp8_recipe", "mxfp8", "--fp8_scale_rounding", "rceil"], capsys)[
            "LOWPREC_FP8_SCALE_ROUNDING"
        ]
        == "rceil"
    )
    assert (
        main(
            [
                "launch",
                "--dry_run",
                "--mixed_precision",
                "fp8",
                "--fp8_recipe",
                "tensorwise",
                "--fp8_scale_rounding",
                "floor",
                SCRIPT,
            ]
        )
        == 2
    )
    assert "--fp8_scale_rounding: the tensorwise recipe does not read it" in capsys.readouterr().err
    # a delayed recipe is not asked it (its options: margin, history, algorithm)
    feed(monkeypatch, ["1", "1", "no", "fp8", "native", "delayed"] + [""] * 7)
    assert main(["config", "--config_file", str(tmp_path / "d.yaml")]) == 0
    assert option.question not in capsys.readouterr().out
    assert loaded(tmp_path / "d.yaml").fp8_scale_rounding is None
