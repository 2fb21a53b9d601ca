"""Tensor parallelism's surface, one process (the multi-process numerics are in
test_tensor_parallel_fp8.py): `lowprec launch --tp_size` / Accelerate's flag and YAML keys, the
`lowprec config` question, the exported PARALLELISM_CONFIG_* variables, the Accelerator's
`parallelism_config` / `torch_tp_plugin` / `torch_device_mesh`, and one clear message (exit
code 2 from the CLI) for each user error."""

from __future__ import annotations

import io
import os
import shlex
import warnings
from pathlib import Path

import pytest
from torch import nn

from lowprec import Accelerator, ParallelismConfig
from lowprec.cli.main import main
from lowprec.config.env import LaunchSettings, owned_env_var
from lowprec.config.launch_config import load_launch_config
from lowprec.distributed.tensor_parallel import apply_tp_plan
from lowprec.utils import TorchTensorParallelPlugin

SCRIPT = str(Path(__file__).parent / "scripts" / "report_launch_env.py")
ROOT = Path(__file__).parent.parent


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWPREC_CONFIG_HOME", str(tmp_path / "config_home"))
    for key in list(os.environ):
        if owned_env_var(key) or key.startswith("ACCELERATE_") or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(key)


def exported(argv, capsys) -> dict[str, str]:
    assert main(["launch", "--dry_run", *argv, SCRIPT]) == 0
    out = capsys.readouterr().out
    return {
        k: shlex.split(v)[0]
        for k, _, v in (line[7:].partition("=") for line in out.splitlines() if line.startswith("export "))
    }


def one_line_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("lowprec: error: ") and "Traceback" not in err, err
    return err


def test_launch_flags_export_accelerates_variables(capsys):
    env = exported(["--num_processes", "4", "--use_fsdp", "--tp_size", "2"], capsys)
    assert (env["PARALLELISM_CONFIG_TP_SIZE"], env["ACCELERATE_USE_FSDP"]) == ("2", "true")
    env = exported(
        ["--num_processes", "2", "--parallelism_config_tp_size", "2", "--parallelism_config_dp_shard_size", "1"], capsys
    )  # Accelerate's spelling
    assert (env["PARALLELISM_CONFIG_TP_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "1")
    assert "PARALLELISM_CONFIG_TP_SIZE" not in exported(["--num_processes", "2"], capsys)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--num_processes", "4", "--use_fsdp", "--tp_size", "3"], "tp_size=3 does not divide num_processes=4"),
        (["--num_processes", "4", "--tp_size", "2"], "add --use_fsdp"),
        (["--num_processes", "4", "--use_fsdp", "--tp_size", "2", "--dp_shard_size", "4"], "set dp_shard_size to 2"),
        (
            ["--num_processes", "2", "--tp_size", "2", "--mixed_precision", "fp8", "--fp8_recipe", "rowwise"],
            "set fp8_recipe: tensorwise",
        ),
        (["--num_processes", "2", "--tp_size", "2", "--use_deepspeed"], "not DeepSpeed"),
        (
            ["--num_processes", "2", "--tp_size", "2", "--mixed_precision", "fp8", "--fp8_backend", "te"],
            "set fp8_backend: native",
        ),
    ],
)
def test_launch_user_errors_are_one_line(argv, needle, capsys):
    assert needle in one_line_error(["launch", "--dry_run", *argv, SCRIPT], capsys)


def test_accelerate_written_yaml_loads_and_bad_sizes_are_refused(tmp_path, capsys):
    path = tmp_path / "acc.yaml"
    path.write_text(  # what `accelerate config` writes with the parallelism config on
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n"
        "  fsdp_version: 2\nparallelism_config:\n  parallelism_config_dp_replicate_size: 1\n"
        "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n  parallelism_config_cp_size: 1\n"
    )
    s = LaunchSettings.from_layers(load_launch_config(path).to_settings())
    assert (s.tp_size, s.dp_shard_size, s.use_fsdp) == (2, 2, True)
    assert exported(["--config_file", str(path)], capsys)["PARALLELISM_CONFIG_TP_SIZE"] == "2"
    path.write_text("num_processes: 2\nparallelism_config:\n  parallelism_config_cp_size: 2\n")
    assert "context parallelism is not implemented" in one_line_error(
        ["launch", "--dry_run", "--config_file", str(path), SCRIPT], capsys
    )


def test_config_wizard_asks_the_tensor_parallel_size(monkeypatch, tmp_path, capsys):
    # machines, processes, cpu, parallelism, reshard, wrap, tp size (3 does not divide 4: asked
    # again), precision
    answers = ["1", "4", "yes", "fsdp", "", "none", "3", "2", "bf16"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{a}\n" for a in answers)))
    path = tmp_path / "w.yaml"
    assert main(["config", "--config_file", str(path)]) == 0
    assert "3 does not divide the 4 processes" in capsys.readouterr().err
    assert "parallelism_config_tp_size: 2" in path.read_text()  # Accelerate's key: its launcher reads it too
    assert LaunchSettings.from_layers(load_launch_config(path).to_settings()).tp_size == 2
    assert exported(["--config_file", str(path)], capsys)["PARALLELISM_CONFIG_TP_SIZE"] == "2"


def test_accelerator_surface(monkeypatch):
    acc = Accelerator(cpu=True)
    assert acc.parallelism_config is None and acc.torch_device_mesh is None
    with pytest.raises(RuntimeError, match="Tensor parallelism is not configured"):
        _ = acc.tensor_parallel_rank
    # Accelerate 1.15: the old plugin still works, with its FutureWarning, as ParallelismConfig(tp_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="dp_shard_size 1 x tp_size 2 != 1 processes"):
            Accelerator(cpu=True, torch_tp_plugin=TorchTensorParallelPlugin(tp_size=2))
    assert any(
        issubclass(w.category, FutureWarning) and "TorchTensorParallelPlugin` is deprecated" in str(w.message)
        for w in caught
    )
    with pytest.raises(ValueError, match="dp_shard_size 1 x tp_size 2 != 1 processes"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")  # what `lowprec launch --tp_size 2` exports
    with pytest.raises(ValueError, match="tp_size 2"):
        Accelerator(cpu=True)
    with pytest.raises(ValueError, match="context parallelism|cp_size"):
        ParallelismConfig(cp_size=2)
    with pytest.raises(ValueError, match="set tp_size > 1"):
        ParallelismConfig(tp_size=1, sequence_parallel=True)


def test_model_without_a_plan_and_bad_plan_values():
    with pytest.raises(ValueError, match="has no _tp_plan"):
        apply_tp_plan(nn.Sequential(nn.Linear(4, 4)), tp_mesh=None)
    model = nn.Sequential(nn.Linear(4, 4))
    model._tp_plan = {"0": "colwise"}
    with pytest.raises(ValueError, match="has no _sp_plan"):
        apply_tp_plan(model, tp_mesh=None, sequence_parallel=True)
    model._tp_plan = {"0": "diagonal"}
    with pytest.raises(ValueError, match="'diagonal' is not a style"):
        apply_tp_plan(model, tp_mesh=None)


def test_train_refuses_a_process_count_tp_does_not_divide(capsys):
    tiny = str(ROOT / "examples" / "tiny.yaml")
    err = one_line_error(["train", tiny, "--num_processes", "3", "--tensor_parallel_size", "2"], capsys)
    assert "tensor_parallel_size: 2 does not divide --num_processes 3" in err
    err = one_line_error(["train", tiny, "--num_processes", "4", "--tensor_parallel_size", "2"], capsys)
    assert "add fsdp_version: 2" in err


def test_trainer_sequence_parallel_needs_tensor_parallelism():
    from lowprec.train.config import parse_config

    with pytest.raises(ValueError, match="sequence_parallel: true splits each sequence"):
        parse_config({"sequence_parallel": True})
    with pytest.raises(ValueError, match="sequence_len it divides"):
        parse_config({"sequence_parallel": True, "tensor_parallel_size": 3, "sequence_len": 32, "fp8": False})
