"""`lowprec launch`: precedence, passthrough, errors, exit codes, and one real torchrun run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.torchrun_util import run_torchrun

from lowprec.cli.main import main
from lowprec.config.env import owned_env_var

SCRIPT = str(Path(__file__).parent / "scripts" / "report_launch_env.py")
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No default config from the user's home, no launch variables from the shell."""
    monkeypatch.setenv("LOWPREC_CONFIG_HOME", str(tmp_path / "config_home"))
    for key in list(os.environ):
        if owned_env_var(key):
            monkeypatch.delenv(key)


def dry_run(argv, capsys):
    """Run `launch --dry_run` in-process; return (exported, unset, command)."""
    code = main(["launch", "--dry_run", *argv])
    out = capsys.readouterr().out
    assert code == 0, out
    exported, unset = {}, []
    lines = out.strip().splitlines()
    for line in lines:
        if line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            exported[key] = shlex.split(value)[0] if value else ""
        elif line.startswith("unset "):
            unset.append(line.split()[1])
    return exported, unset, shlex.split(lines[-1])


def usage_error(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def write(tmp_path, text, name="launch.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_single_process_command_and_passthrough(capsys):
    script_args = ["--fp8_backend=ao", "--mixed_precision", "bf16", "-m", "x", "--help", "--", "--cpu"]
    env, _, cmd = dry_run(["--mixed_precision", "fp8", "--fp8_backend", "te", SCRIPT, *script_args], capsys)
    assert cmd == [sys.executable, SCRIPT, *script_args]
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp8" and env["ACCELERATE_FP8_BACKEND"] == "TE"
    assert env["ACCELERATE_USE_CPU"] == "false"


def test_double_dash_separates_script(capsys):
    _, _, cmd = dry_run(["--cpu", "--", SCRIPT, "--cpu"], capsys)
    assert cmd == [sys.executable, SCRIPT, "--cpu"]


def test_options_with_equals_and_dashes(capsys):
    env, _, cmd = dry_run(["--mixed-precision=fp8", "--fp8-backend=Te", "--fp8-margin", "2", SCRIPT], capsys)
    assert (env["ACCELERATE_FP8_BACKEND"], env["ACCELERATE_FP8_MARGIN"]) == ("TE", "2")
    assert cmd == [sys.executable, SCRIPT]


def test_torchrun_standalone_for_several_processes(capsys):
    _, _, cmd = dry_run(["--num_processes", "4", SCRIPT, "a"], capsys)
    assert cmd == [
        sys.executable,
        "-m",
        "lowprec.cli._torchrun",
        "--standalone",
        "--nproc_per_node=4",
        "-m",
        "lowprec.cli._worker",
        SCRIPT,
        "a",
    ]  # each rank records that it finished


def test_torchrun_multi_machine(capsys):
    _, _, cmd = dry_run(
        [
            "--num_processes",
            "8",
            "--num_machines",
            "2",
            "--machine_rank",
            "1",
            "--main_process_ip",
            "10.1.2.3",
            "--main_process_port",
            "1234",
            "-m",
            "pkg.train",
            "--lr",
            "1",
        ],
        capsys,
    )
    assert cmd == [
        sys.executable,
        "-m",
        "lowprec.cli._torchrun",
        "--nproc_per_node=4",
        "--nnodes=2",
        "--node_rank=1",
        "--master_addr=10.1.2.3",
        "--master_port=1234",
        "-m",
        "lowprec.cli._worker",
        "-m",
        "pkg.train",
        "--lr",
        "1",
    ]


def test_module_single_process(capsys):
    _, _, cmd = dry_run(["-m", "pkg.train", "--x"], capsys)
    assert cmd == [sys.executable, "-m", "pkg.train", "--x"]


def test_precedence_cli_over_yaml_over_defaults(tmp_path, capsys):
    cfg = write(tmp_path, "mixed_precision: fp8\nfp8_config: {margin: 2, amax_history_len: 16, backend: te}\n")
    env, _, _ = dry_run(["--config_file", cfg, "--fp8_margin", "3", SCRIPT], capsys)
    assert env["ACCELERATE_FP8_MARGIN"] == "3"  # CLI beats YAML
    assert env["ACCELERATE_FP8_AMAX_HISTORY_LEN"] == "16"  # YAML kept
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp8"  # no CLI default overrides the YAML
    assert "ACCELERATE_FP8_INTERVAL" not in env  # default: not exported
    # native + the YAML's delayed-scaling fields needs the delayed recipe (tensorwise reads no history)
    env, _, _ = dry_run(
        [
            "--config_file",
            cfg,
            "--fp8_backend",
            "native",
            "--fp8_recipe",
            "delayed",
            "--mixed_precision",
            "fp8",
            SCRIPT,
        ],
        capsys,
    )
    assert env["ACCELERATE_FP8_BACKEND"] == "NATIVE"
    err = usage_error(["launch", "--dry_run", "--config_file", cfg, "--fp8_backend", "native", SCRIPT], capsys)
    assert "fp8_config.amax_history_len in" in err and "tensorwise recipe does not read it" in err, err


def test_cli_mixed_precision_overrides_yaml_fp8_and_notes_it(tmp_path, capsys):
    cfg = write(tmp_path, "mixed_precision: fp8\nfp8_config: {margin: 2}\n")
    code = main(["launch", "--dry_run", "--config_file", cfg, "--mixed_precision", "bf16", SCRIPT])
    out = capsys.readouterr().out
    assert code == 0
    assert "export ACCELERATE_MIXED_PRECISION=bf16" in out
    assert "ACCELERATE_FP8_MARGIN" not in out and "fp8_config" in out  # the note says why


def test_parallelism_flag_replaces_yaml_choice(tmp_path, capsys):
    cfg = write(tmp_path, "distributed_type: FSDP\nnum_processes: 2\nfsdp_config: {fsdp_version: 2}\n")
    env, _, _ = dry_run(["--config_file", cfg, "--use_deepspeed", "--zero_stage", "2", SCRIPT], capsys)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_USE_FSDP"] == "false"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2" and "FSDP_VERSION" not in env


def test_default_config_file_is_read(monkeypatch, tmp_path, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "default_config.yaml").write_text("mixed_precision: bf16\nuse_cpu: true\n")
    monkeypatch.setenv("LOWPREC_CONFIG_HOME", str(home))
    env, _, _ = dry_run([SCRIPT], capsys)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env["ACCELERATE_USE_CPU"] == "true"
    assert main(["launch", "--dry_run", SCRIPT]) == 0
    assert f"# note: using the default config file {home / 'default_config.yaml'}" in capsys.readouterr().out


def test_stale_launch_variables_are_removed(monkeypatch, capsys):
    """A leftover ACCELERATE_FP8_MARGIN in the shell must not reach the child unseen."""
    monkeypatch.setenv("ACCELERATE_FP8_MARGIN", "7")
    monkeypatch.setenv("LOWPREC_FP8_RECIPE", "blockwise")
    monkeypatch.setenv("UNRELATED_VAR", "kept")
    env, unset, _ = dry_run(["--mixed_precision", "fp8", "--fp8_recipe", "rowwise", SCRIPT], capsys)
    assert "ACCELERATE_FP8_MARGIN" in unset and "ACCELERATE_FP8_MARGIN" not in env
    assert env["LOWPREC_FP8_RECIPE"] == "rowwise" and "LOWPREC_FP8_RECIPE" not in unset

    from lowprec.cli.launch import plan_launch
    from lowprec.cli.main import build_parser

    _, commands = build_parser()
    args = commands["launch"][1].parse_args(["--mixed_precision", "fp8", SCRIPT])
    plan = plan_launch(args)
    assert "ACCELERATE_FP8_MARGIN" not in plan.env and plan.env["UNRELATED_VAR"] == "kept"


def test_override_linear_precision_flag(capsys):
    env, _, _ = dry_run(
        ["--mixed_precision", "fp8", "--fp8_override_linear_precision", "(false,false,true)", SCRIPT], capsys
    )
    assert [env[f"ACCELERATE_FP8_OVERRIDE_{g}"] for g in ("FPROP", "DGRAD", "WGRAD")] == ["false", "false", "true"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--fp8_backend", "te", SCRIPT], "FP8 option(s), but mixed_precision is 'no'"),
        (["--fsdp_version", "1", "--use_fsdp", SCRIPT], "FSDP1 is not supported"),
        (["--use_fsdp", "--use_deepspeed", SCRIPT], "pick one"),
        (["--zero_stage", "2", SCRIPT], "DeepSpeed option(s) without --use_deepspeed"),
        (["--fsdp_offload_params", "true", SCRIPT], "FSDP option(s) without --use_fsdp"),
        (["--num_machines", "2", "--num_processes", "2", SCRIPT], "needs main_process_ip"),
        (["missing_script.py"], "training script 'missing_script.py' not found"),
        ([], "launch needs a training script"),
        (["--mixed_precision", "fp8", "--fp8_format", "E5M2", SCRIPT], "TransformerEngine option"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv, expected, capsys):
    err = usage_error(["launch", "--dry_run", *argv], capsys)
    assert err.startswith("lowprec: error: ") and expected in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_yaml_is_one_line_exit_2(tmp_path, capsys):
    cfg = write(tmp_path, "mixed_precision: fp8\nfp8_config:\n  amax_history_length: 16\n  amax_histroy_len: 3\n")
    err = usage_error(["launch", "--dry_run", "--config_file", cfg, SCRIPT], capsys)
    assert "did you mean 'amax_history_len'?" in err and cfg in err and err.count("\n") == 1
    err = usage_error(["launch", "--config_file", str(tmp_path / "nope.yaml"), SCRIPT], capsys)
    assert "does not exist; create it with `lowprec config`" in err
    cfg = write(tmp_path, "mixed_precision: [fp8\n", "broken.yaml")
    err = usage_error(["launch", "--config_file", cfg, SCRIPT], capsys)
    assert "not valid YAML" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--fp8_backnd", "te", SCRIPT], "--fp8_backnd (did you mean '--fp8_backend'?)"),
        (["--mixed_precision", "fp4", SCRIPT], "argument --mixed_precision"),
        (["--fp8_backend", "tee", "--mixed_precision", "fp8", SCRIPT], "did you mean 'te'?"),
        (["--zero_stage", "7", SCRIPT], "argument --zero_stage"),
    ],
)
def test_bad_flags_exit_2_with_hint(argv, expected, capsys):
    err = usage_error(["launch", "--dry_run", *argv], capsys)
    assert expected in err


def test_unknown_command_did_you_mean(capsys):
    assert "did you mean 'launch'?" in usage_error(["lanch"], capsys)


def test_help_and_version(capsys):
    assert main(["launch", "--help"]) == 0
    assert "--fp8_backend" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert "lowprec" in capsys.readouterr().out


def test_exit_code_and_env_of_a_real_single_process_run(tmp_path, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code = main(
        [
            "launch",
            "--mixed_precision",
            "fp8",
            "--fp8_recipe",
            "blockwise",
            "--fp8_fallback",
            "emulate",
            SCRIPT,
            str(out_dir),
            "--fp8_recipe",
            "x",
            "--exit-with",
            "3",
        ]
    )
    assert code == 3
    report = json.loads((out_dir / "rank0.json").read_text())
    assert report["argv"] == ["--fp8_recipe", "x", "--exit-with", "3"]
    assert report["env"]["LOWPREC_FP8_RECIPE"] == "blockwise"
    assert report["env"]["LOWPREC_FP8_FALLBACK"] == "emulate"
    assert report["world_size"] == 1


def test_torchrun_two_cpu_processes_subprocess(tmp_path):
    """The real thing: a fresh interpreter, torchrun, gloo, two ranks."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not owned_env_var(k)}
    env.update(
        PYTHONPATH=SRC + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        LOWPREC_CONFIG_HOME=str(tmp_path / "none"),
    )
    passthrough = [str(out_dir), "--num_processes", "5", "--fp8_backend=te", "-m", "x"]
    run_torchrun(
        [
            sys.executable,
            "-m",
            "lowprec.cli.main",
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            "--mixed_precision",
            "fp8",
            "--fp8_backend",
            "te",
            "--fp8_amax_history_len",
            "32",
            SCRIPT,
            *passthrough,
        ],
        lambda p: all((out_dir / f"rank{r}.json").exists() for r in (0, 1)),
        env=env,
        timeout=120,
    )
    reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["world_size"] == 2
        assert report["all_reduce_sum"] == 3.0  # 1 + 2: both ranks joined one gloo group
        assert report["argv"] == passthrough[1:]
        assert report["env"]["ACCELERATE_USE_CPU"] == "true"
        assert report["env"]["ACCELERATE_FP8_BACKEND"] == "TE"
        assert report["env"]["ACCELERATE_FP8_AMAX_HISTORY_LEN"] == "32"
        assert report["env"]["ACCELERATE_MIXED_PRECISION"] == "fp8"


def test_signal_death_maps_to_128_plus_signal(tmp_path, capsys):
    script = tmp_path / "die.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert main(["launch", str(script)]) == 128 + 15


def test_port_zero_means_any_free_port_on_one_machine(capsys):
    _, _, cmd = dry_run(["--num_processes", "2", "--main_process_port", "0", SCRIPT], capsys)
    assert "--standalone" in cmd
    err = usage_error(
        [
            "launch",
            "--dry_run",
            "--num_processes",
            "2",
            "--num_machines",
            "2",
            "--main_process_ip",
            "h",
            "--main_process_port",
            "0",
            SCRIPT,
        ],
        capsys,
    )
    assert "every machine must know the port" in err


def test_launcher_does_not_import_torch_or_pydantic_without_config(tmp_path):
    """The launcher starts fast: the parent process needs neither torch nor pydantic."""
    code = (
        "import sys; from lowprec.cli.main import main; "
        f"rc = main(['launch', '--dry_run', '--mixed_precision', 'fp8', {SCRIPT!r}]); "
        "assert rc == 0; bad = {'torch', 'pydantic'} & set(sys.modules); assert not bad, bad"
    )
    env = {k: v for k, v in os.environ.items() if not owned_env_var(k)}
    env.update(PYTHONPATH=SRC, LOWPREC_CONFIG_HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_no_bug_fp8_refused_without_a_third_party_library(monkeypatch, capsys):
    """Accelerate's launcher raised "FP8 is not available" unless TE, MS-AMP or torchao was
    installed (reference §3.1); lowprec's native engine needs none, so fp8 launches anyway."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("transformer_engine", "msamp", "torchao") else real_find_spec(name, *a),
    )
    env, _, cmd = dry_run(["--mixed_precision", "fp8", SCRIPT], capsys)
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp8" and cmd == [sys.executable, SCRIPT]


def test_inherited_variables_removed_or_overridden_are_noted_on_stderr(monkeypatch, tmp_path, capsys):
    """A shell's ACCELERATE_MIXED_PRECISION=bf16 replaced by `no`, and a stale ACCELERATE_FP8_MARGIN
    dropped, are said once on stderr in a real run (not only under --dry_run)."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_FP8_MARGIN", "7")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert main(["launch", SCRIPT, str(out_dir)]) == 0
    err = capsys.readouterr().err
    notes = [ln for ln in err.splitlines() if ln.startswith("lowprec: note: ")]
    assert len([n for n in notes if "ACCELERATE_FP8_MARGIN" in n]) == 1, err
    assert len([n for n in notes if "ACCELERATE_MIXED_PRECISION=bf16 with no" in n]) == 1, err
    report = json.loads((out_dir / "rank0.json").read_text())
    assert report["env"]["ACCELERATE_MIXED_PRECISION"] == "no" and "ACCELERATE_FP8_MARGIN" not in report["env"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--gradient_clipping", "1.0", SCRIPT], "accelerator.clip_grad_norm_"),
        (["--use_deepspeed", "--zero3_init_flag", "true", SCRIPT], "--zero3_init_flag: no effect"),
        (
            ["--mixed_precision", "fp8", "--fp8_backend", "te", "--fp8_recipe", "rowwise", SCRIPT],
            "--fp8_recipe: the te FP8 backend does not read it (read by: native)",
        ),
        (
            ["--mixed_precision", "fp8", "--fp8_backend", "msamp", "--fp8_amax_history_len", "8", SCRIPT],
            "--fp8_amax_history_len: the msamp FP8 backend does not read it",
        ),
        (
            ["--mixed_precision", "fp8", "--fp8_recipe", "rowwise", "--fp8_opt_level", "O2", SCRIPT],
            "--fp8_opt_level: the native FP8 backend does not read it (read by: msamp)",
        ),
        (
            ["--mixed_precision", "fp8", "--fp8_backend", "ao", "--fp8_margin", "2", SCRIPT],
            "--fp8_margin: the ao FP8 backend does not read it",
        ),
    ],
)
def test_flags_nothing_reads_are_usage_errors(argv, expected, capsys):
    err = usage_error(["launch", "--dry_run", *argv], capsys)
    assert err.startswith("lowprec: error: ") and expected in err and err.count("\n") == 1, err


def test_gradient_clipping_only_under_deepspeed_and_unread_settings_not_exported(tmp_path, capsys):
    env, _, _ = dry_run(["--use_deepspeed", "--gradient_clipping", "0.5", SCRIPT], capsys)
    assert env["ACCELERATE_GRADIENT_CLIPPING"] == "0.5"
    cfg = write(
        tmp_path,
        "deepspeed_config: {gradient_clipping: 1.0}\ndynamo_config: {dynamo_backend: INDUCTOR}\n"
        "mixed_precision: fp8\nfp8_config: {backend: TE, opt_level: O2, margin: 1}\n",
    )
    assert main(["launch", "--dry_run", "--config_file", cfg, SCRIPT]) == 0
    out = capsys.readouterr().out
    # dynamo_backend is exported: the script's TorchDynamoPlugin reads it, as under accelerate launch
    assert "ACCELERATE_GRADIENT_CLIPPING" not in out and "export ACCELERATE_DYNAMO_BACKEND=INDUCTOR" in out
    notes = [ln for ln in out.splitlines() if ln.startswith("# note: ")]
    assert any("gradient_clipping" in n and "clip_grad_norm_" in n for n in notes), out
    assert not any("dynamo" in n for n in notes), out
    assert any("opt_level" in n and "te FP8 backend does not read it" in n for n in notes), out
    assert not any("margin" in n for n in notes), out  # te reads margin


def _without_transformer_engine(monkeypatch, installed=False):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    fake = object() if installed else None
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: fake if name == "transformer_engine" else real_find_spec(name, *a)
    )


def test_e5m2_without_transformer_engine_is_refused_at_launch(monkeypatch, tmp_path, capsys):
    """E5M2 runs on TransformerEngine only; without it the te backend falls back to the native
    engine, which refused it in every worker with a traceback (exit 1). Now: one line at launch."""
    _without_transformer_engine(monkeypatch)
    flags = ["--mixed_precision", "fp8", "--fp8_backend", "te"]
    err = usage_error(["launch", "--dry_run", *flags, "--fp8_format", "E5M2", SCRIPT], capsys)
    assert err.startswith("lowprec: error: --fp8_format E5M2: runs only on transformer_engine") and err.count("\n") == 1
    assert "install transformer_engine, or use HYBRID or E4M3" in err, err
    cfg = write(tmp_path, "mixed_precision: fp8\nfp8_config: {backend: TE, fp8_format: E5M2}\n")
    err = usage_error(["launch", "--dry_run", "--config_file", cfg, SCRIPT], capsys)
    assert f"fp8_config.fp8_format in {cfg} E5M2: runs only on transformer_engine" in err and err.count("\n") == 1
    env, _, _ = dry_run([*flags, "--fp8_format", "HYBRID", SCRIPT], capsys)  # the native engine runs it
    assert env["ACCELERATE_FP8_FORMAT"] == "HYBRID"
    _without_transformer_engine(monkeypatch, installed=True)
    env, _, _ = dry_run([*flags, "--fp8_format", "E5M2", SCRIPT], capsys)
    assert env["ACCELERATE_FP8_FORMAT"] == "E5M2"


def test_multi_gpu_config_without_a_gpu_warns_once(monkeypatch, tmp_path, capsys):
    """distributed_type MULTI_GPU with use_cpu false where torch sees no GPU ran two CPU/gloo
    processes without a word; now one warning says so (dry run and real run alike)."""
    import torch

    import lowprec.cli.launch as launch_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = write(tmp_path, "distributed_type: MULTI_GPU\ngpu_ids: all\nuse_cpu: false\nnum_processes: 2\n")
    assert main(["launch", "--dry_run", "--config_file", cfg, SCRIPT]) == 0
    out = capsys.readouterr().out
    warnings = [ln for ln in out.splitlines() if ln.startswith("# warning: ")]
    assert len(warnings) == 1 and "no GPU found: running 2 CPU process(es)" in warnings[0] and "gloo" in out, out

    class Finished:  # the launched processes, as launch waits for them
        def __init__(self, *args, **kwargs):
            pass

        def wait(self):
            return 0

    monkeypatch.setattr(launch_mod.subprocess, "Popen", Finished)
    assert main(["launch", "--config_file", cfg, SCRIPT]) == 0
    err = capsys.readouterr().err
    assert err.count("lowprec: warning: no GPU found") == 1, err
    assert main(["launch", "--dry_run", "--config_file", cfg, "--cpu", SCRIPT]) == 0  # said: no warning
    assert "# warning" not in capsys.readouterr().out
    # GPUs not asked for (use_cpu false is only the default): no warning, and torch not imported for it
    assert main(["launch", "--dry_run", "--num_processes", "2", SCRIPT]) == 0
    assert "# warning" not in capsys.readouterr().out


def test_fp8_fields_without_a_backend_reach_the_scripts_handler(monkeypatch, tmp_path, capsys):
    """No --fp8_backend / --fp8_recipe: the script's handler (TERecipeKwargs(), MSAMPRecipeKwargs())
    picks the backend and reads ACCELERATE_FP8_*, as under `accelerate launch`. launch refused
    --fp8_amax_history_len ("the tensorwise recipe does not read it") and --fp8_opt_level ("the
    native FP8 backend does not read it") against its own default; now they pass through, and a
    handler that does not read a set value logs it once."""
    from lowprec.backends.registry import select_backend
    from lowprec.kwargs import MSAMPRecipeKwargs, TERecipeKwargs

    fp8 = ["--mixed_precision", "fp8"]
    env, _, _ = dry_run([*fp8, "--fp8_amax_history_len", "7", "--fp8_opt_level", "O1", SCRIPT], capsys)
    assert (env["ACCELERATE_FP8_AMAX_HISTORY_LEN"], env["ACCELERATE_FP8_OPT_LEVEL"]) == ("7", "O1")
    assert "ACCELERATE_FP8_BACKEND" not in env
    cfg = write(tmp_path, "mixed_precision: fp8\nfp8_config: {amax_history_len: 7, opt_level: O1}\n")
    assert main(["launch", "--dry_run", "--config_file", cfg, SCRIPT]) == 0
    assert "does not read" not in capsys.readouterr().out  # the same as a flag: passed, no note
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert TERecipeKwargs(margin=2).amax_history_len == 7 and MSAMPRecipeKwargs().opt_level == "O1"
    with pytest.warns(UserWarning, match="tensorwise recipe does not read amax_history_len"):
        select_backend(None)  # no handler: native tensorwise, which reads neither
    # a launch that names the backend or recipe is checked against it, and says how to make it count
    err = usage_error(
        ["launch", "--dry_run", *fp8, "--fp8_recipe", "tensorwise", "--fp8_amax_history_len", "7", SCRIPT], capsys
    )
    assert "--fp8_amax_history_len: the tensorwise recipe does not read it" in err, err
    assert "drop it, or set fp8_recipe delayed, or fp8_backend te" in err, err
    err = usage_error(["launch", "--dry_run", *fp8, "--fp8_backend", "native", "--fp8_opt_level", "O1", SCRIPT], capsys)
    assert "(read by: msamp); drop it, or set fp8_backend msamp" in err, err
