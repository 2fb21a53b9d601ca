"""`lowprec launch` takes every option of `accelerate launch`: what each does here (acts, refused
in one line, or noted as ignored), checked against Accelerate's own parser."""

from __future__ import annotations

import pytest

from lowprec.cli.main import main
from tests.test_cli_launch import SCRIPT, clean_env, dry_run, usage_error, write  # noqa: F401 (clean_env: autouse)


def test_every_accelerate_launch_option_is_accepted():
    """Each option string of Accelerate's own `accelerate launch` parser (the pinned version) is an
    option of lowprec's, taking a value where Accelerate's does: a new Accelerate flag fails here."""
    launch_command_parser = pytest.importorskip("accelerate.commands.launch").launch_command_parser
    from lowprec.cli.main import build_parser

    ours = build_parser()[1]["launch"][1]._option_string_actions
    theirs = launch_command_parser()._option_string_actions
    missing = sorted(o for o in theirs if o not in ours)
    assert not missing, f"accelerate launch options lowprec launch lacks: {missing}"
    switches = sorted(
        o for o, a in theirs.items() if o not in ("-h", "--help") and (a.nargs == 0) != (ours[o].nargs == 0)
    )
    assert not switches, f"a switch in one parser takes a value in the other: {switches}"


def test_accelerate_flags_take_effect_or_are_noted(tmp_path, capsys):
    argv = ["--multi_gpu", "--num_processes", "2", "--num_cpu_threads_per_process", "1", "--debug", "-q"]
    argv += ["--same_network", "--rdzv_backend", "static", "--main_training_function", "main"]
    argv += ["--max_restarts", "1", "--monitor_interval", "0.5", "--tee", "3", "--log_dir", str(tmp_path)]
    env, _, cmd = dry_run([*argv, SCRIPT], capsys)
    assert env["OMP_NUM_THREADS"] == "1" and env["ACCELERATE_DEBUG_MODE"] == "true"
    assert env["ACCELERATE_USE_CPU"] == "false" and "--nproc_per_node=2" in cmd
    assert {"--max_restarts=1", "--monitor_interval=0.5", "--tee=3", f"--log_dir={tmp_path}"} <= set(cmd)
    assert main(["launch", "--dry_run", *argv, SCRIPT]) == 0
    assert "# note" not in capsys.readouterr().out  # -q: no notes
    # ignored ones: one note per reason, naming the flags; the same keys in a config file alike
    flags = ["--tpu_use_sudo", "--vm", "v1", "--enable_cpu_affinity", "--zero3_save_16bit_model", "true"]
    assert main(["launch", "--dry_run", *flags, SCRIPT]) == 0
    out = capsys.readouterr().out
    assert "# note: --tpu_use_sudo, --vm: ignored: a TPU option" in out, out
    assert "# note: --enable_cpu_affinity: ignored: NUMA" in out and "--zero3_save_16bit_model: ignored" in out
    # torch.compile's settings reach the script's TorchDynamoPlugin, as Accelerate exports them
    dynamo = ["--dynamo_backend", "inductor", "--dynamo_mode", "max-autotune", "--dynamo_use_fullgraph"]
    env, _, _ = dry_run([*dynamo, SCRIPT], capsys)
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR" and env["ACCELERATE_DYNAMO_MODE"] == "max-autotune"
    assert env["ACCELERATE_DYNAMO_USE_FULLGRAPH"] == "true" and "ACCELERATE_DYNAMO_USE_DYNAMIC" not in env
    cfg = write(
        tmp_path,
        "tpu_use_sudo: true\nenable_cpu_affinity: true\ndebug: true\ndynamo_config: {dynamo_mode: max-autotune}\n",
    )
    env, _, _ = dry_run(["--config_file", cfg, SCRIPT], capsys)
    assert env["ACCELERATE_DEBUG_MODE"] == "true" and env["ACCELERATE_DYNAMO_MODE"] == "max-autotune"
    assert main(["launch", "--dry_run", "--config_file", cfg, SCRIPT]) == 0
    out = capsys.readouterr().out
    assert f"tpu_use_sudo in {cfg}: ignored: a TPU option" in out and f"enable_cpu_affinity in {cfg}: ignored" in out
    assert "dynamo_mode" not in out.split("# environment")[0]  # exported, not noted
    # torchrun options on one process: noted, not passed
    assert main(["launch", "--dry_run", "--max_restarts", "2", SCRIPT]) == 0
    assert "--max_restarts: ignored: one process runs without torchrun" in capsys.readouterr().out


def test_accelerate_flags_mapped_to_settings(capsys):
    env, _, _ = dry_run(["--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP", SCRIPT], capsys)
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "false"
    env, _, cmd = dry_run(
        ["--num_processes", "4", "--num_machines", "2", "--main_process_ip", "h", "--rdzv_backend", "c10d", SCRIPT],
        capsys,
    )
    assert {"--rdzv_backend=c10d", "--rdzv_endpoint=h:29500"} <= set(cmd) and not any("master_addr" in c for c in cmd)
    _, _, cmd = dry_run(["--no_python", SCRIPT, "a"], capsys)
    assert cmd == [SCRIPT, "a"]
    env, _, _ = dry_run(["--parallelism_config_cp_size", "1", SCRIPT], capsys)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--tpu"], "--tpu: lowprec does not run on TPU"),
        (["--use_megatron_lm"], "--use_megatron_lm: Megatron-LM is not run by lowprec"),
        (["--downcast_bf16"], "--downcast_bf16: downcast_bf16 is a TPU option"),
        (["--multi_gpu", "--cpu", "--num_processes", "2"], "--multi_gpu and --cpu both given"),
        (
            ["--parallelism_config_cp_size", "2"],
            "--parallelism_config_cp_size 2: context parallelism is not implemented",
        ),
        (["--fsdp_sharding_strategy", "FULL_SHARD"], "--fsdp_sharding_strategy: FSDP option without --use_fsdp"),
        (["--use_fsdp", "--fsdp_sharding_strategy", "NO_SHARD"], "--fsdp_sharding_strategy 'NO_SHARD': use FULL_SHARD"),
        (["--no_python", "-m"], "--no_python and -m/--module both given"),
    ],
)
def test_accelerate_flags_refused_in_one_line(argv, expected, capsys):
    err = usage_error(["launch", "--dry_run", *argv, SCRIPT], capsys)
    assert err.startswith("lowprec: error: ") and expected in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flag, hint", [("--multi_gpus", "--multi_gpu"), ("--use_gpu", None), ("--single_gpu", None)])
def test_unknown_flag_hint_is_close_and_never_the_opposite(flag, hint, capsys):
    err = usage_error(["launch", flag, SCRIPT], capsys)
    assert (f"(did you mean '{hint}'?)" in err) if hint else ("did you mean" not in err), err


def test_accelerate_config_sections_of_ignored_options_are_noted(tmp_path, capsys):
    """`accelerate config` writes mpirun_config (MULTI_CPU with mpirun) and megatron_lm_config: the
    file loads, their keys noted as ignored as the flags of the same names are; a misspelt key is
    an error naming its section (not "did you mean 'fp8_config'" for the section itself)."""
    text = "distributed_type: MULTI_CPU\nnum_processes: 2\nmpirun_config:\n  mpirun_hostfile: ~/hostfile\n"
    cfg = write(tmp_path, text + "megatron_lm_config:\n  megatron_lm_tp_degree: 2\n")
    assert main(["launch", "--dry_run", "--config_file", cfg, SCRIPT]) == 0
    out = capsys.readouterr().out
    assert f"mpirun_hostfile in {cfg}: ignored: several CPU processes start under torchrun" in out
    assert f"megatron_lm_tp_degree in {cfg}: ignored: a Megatron-LM option" in out
    cfg = write(tmp_path, "mpirun_config:\n  mpirun_hostfil: ~/hostfile\n")
    err = usage_error(["launch", "--dry_run", "--config_file", cfg, SCRIPT], capsys)
    assert "unknown key 'mpirun_config.mpirun_hostfil' (did you mean 'mpirun_hostfile'?)" in err


def test_a_config_section_its_distributed_type_does_not_select_is_noted(tmp_path, capsys):
    """fsdp_config under MULTI_GPU, deepspeed_config under MULTI_CPU: Accelerate drops them silently;
    launch runs without them (a file may be Accelerate's, so no error) and says so, as for fp8_config."""
    fsdp = "fsdp_config:\n  fsdp_version: 2\n  fsdp_offload_params: true\n"
    cfg = write(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\n" + fsdp)
    env, _, _ = dry_run(["--config_file", cfg, SCRIPT], capsys)
    assert env["ACCELERATE_USE_FSDP"] == "false" and "FSDP_OFFLOAD_PARAMS" not in env
    assert main(["launch", "--dry_run", "--config_file", cfg, SCRIPT]) == 0
    assert f"fsdp_config in {cfg} is not used (fsdp_offload_params): FSDP2 shards only with" in capsys.readouterr().out
    ds = "deepspeed_config:\n  zero_stage: 3\n  gradient_accumulation_steps: 2\n"
    cfg = write(tmp_path, "distributed_type: MULTI_CPU\nnum_processes: 2\n" + ds)
    assert main(["launch", "--dry_run", "--config_file", cfg, SCRIPT]) == 0
    out = capsys.readouterr().out
    assert f"deepspeed_config in {cfg} is not used (zero_stage): DeepSpeed runs only with" in out
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=2" in out  # read without DeepSpeed too
    cfg = write(tmp_path, "distributed_type: FSDP\nnum_processes: 2\nuse_cpu: true\n" + fsdp)
    assert main(["launch", "--dry_run", "--config_file", cfg, SCRIPT]) == 0
    assert "is not used" not in capsys.readouterr().out


def test_workers_get_one_thread_unless_told_otherwise(monkeypatch, capsys):
    """Several processes per machine with OMP_NUM_THREADS unset: the launcher exports 1 (torchrun's
    own default, which torchrun announced in a four-line banner on every run; Accelerate's
    launcher exports it too). A value from the shell or --num_cpu_threads_per_process is kept; one
    process, or one per machine, gets nothing."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env, _, _ = dry_run(["--cpu", "--num_processes", "2", SCRIPT], capsys)
    assert env["OMP_NUM_THREADS"] == "1"
    env, _, _ = dry_run(["--cpu", "--num_processes", "2", "--num_cpu_threads_per_process", "3", SCRIPT], capsys)
    assert env["OMP_NUM_THREADS"] == "3"
    for one_each in (["--cpu"], ["--num_processes", "2", "--num_machines", "2", "--main_process_ip", "10.0.0.1"]):
        env, _, _ = dry_run([*one_each, SCRIPT], capsys)
        assert "OMP_NUM_THREADS" not in env, one_each
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env, _, _ = dry_run(["--cpu", "--num_processes", "2", SCRIPT], capsys)
    assert "OMP_NUM_THREADS" not in env  # the shell's 2 reaches the workers unchanged
