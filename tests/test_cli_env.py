"""`lowprec env` and the subcommand registry of `lowprec.cli.main`."""

from __future__ import annotations

import importlib.metadata
import json
import sys
import types

import pytest

from lowprec.cli import env as env_cmd
from lowprec.cli import main as main_module
from lowprec.cli.main import main


@pytest.fixture(autouse=True)
def config_home(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWPREC_CONFIG_HOME", str(tmp_path))
    return tmp_path


def test_env_reports_versions_devices_and_backends(capsys):
    import torch

    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] == torch.__version__
    assert info["python"] == sys.version.split()[0]
    assert info["cuda_available"] == torch.cuda.is_available()
    assert len(info["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if torch.cuda.is_available():
        assert info["fp8_gemm"].startswith(("native", "emulated"))
    else:  # the CPU kernel in use and the probe's reason, as the trainer logs it
        assert info["fp8_gemm"].startswith(("cpu: upcast", "cpu: scaled_mm"))
    assert set(info["optional_backends"]) == set(env_cmd.OPTIONAL_PACKAGES)
    assert info["default_config_exists"] is False


def test_env_text_lists_backends_and_default_config(config_home, monkeypatch, capsys):
    (config_home / "default_config.yaml").write_text("mixed_precision: bf16\n")
    monkeypatch.setenv("ACCELERATE_FP8_MARGIN", "3")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name in env_cmd.OPTIONAL_PACKAGES:
        assert f"    {name}: " in out
    assert "(present)" in out and "mixed_precision: bf16" in out
    assert "ACCELERATE_FP8_MARGIN=3" in out


def test_package_version_is_import_free(monkeypatch):
    assert env_cmd.package_version("pydantic") == importlib.metadata.version("pydantic")
    assert env_cmd.package_version("surely_not_installed_pkg_xyz") is None
    # An installed backend is reported without being imported.
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda dist: (
            "9.9" if dist == "torchao" else (_ for _ in ()).throw(importlib.metadata.PackageNotFoundError(dist))
        ),
    )
    before = set(sys.modules)
    assert env_cmd.package_version("torchao") == "9.9"
    assert "torchao" not in set(sys.modules) - before


def test_env_never_crashes_when_probes_fail(monkeypatch, capsys):
    def broken():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(env_cmd, "_torch_info", broken)
    monkeypatch.setattr(env_cmd, "package_version", lambda name: broken())
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch: unknown (RuntimeError: driver exploded)" in out


def test_a_bad_cpu_fp8_gemm_variable_fails_its_own_line_not_torchs(monkeypatch, capsys):
    import torch

    from lowprec.fp8.gemm import cpu as cpu_gemm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "bogus")
    cpu_gemm.reset_cpu_gemm_choice()
    try:
        assert main(["env"]) == 0
    finally:
        cpu_gemm.reset_cpu_gemm_choice()
    out = capsys.readouterr().out
    assert f"- torch: {torch.__version__}\n" in out and "- cuda_available: False" in out
    assert "- fp8_gemm: unknown (ValueError: LOWPREC_CPU_FP8_GEMM='bogus'" in out


def test_env_names_the_forced_cpu_fp8_gemm(monkeypatch):
    from lowprec.cli import hardware
    from lowprec.fp8.gemm import cpu as cpu_gemm

    monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "upcast")
    cpu_gemm.reset_cpu_gemm_choice()
    try:
        assert hardware.cpu_fp8_gemm() == "cpu: " + cpu_gemm.cpu_gemm_choice().describe()
        assert "LOWPREC_CPU_FP8_GEMM=upcast" in hardware.cpu_fp8_gemm()
    finally:
        cpu_gemm.reset_cpu_gemm_choice()


def test_every_commands_help_shows_its_text_as_written(capsys):
    # argparse expands %-escapes in help strings and usage, not in a description: "95%%" stays doubled there
    for name in main_module.COMMANDS:
        assert main([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert "%%" not in out, f"lowprec {name} --help: {out[out.index('%%') - 60 : out.index('%%') + 20]!r}"


def test_a_bare_ctrl_c_in_a_command_is_one_line_saying_so(monkeypatch, capsys):
    # lowprec compare's Ctrl-C (or one before a run starts) is a KeyboardInterrupt with no text
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(main_module, "runner", lambda name: interrupted)
    assert main(["env"]) == 130
    assert capsys.readouterr().err == "lowprec: interrupted\n"


def test_registry_skips_missing_commands_and_loads_present_ones(monkeypatch):
    commands = {**main_module.COMMANDS, "no_such_command_yet": ("lowprec.cli.no_such_command_yet", "x:run")}
    monkeypatch.setattr(
        main_module, "COMMANDS", {k: commands[k] for k in ("launch", "config", "env", "no_such_command_yet")}
    )
    parser, commands = main_module.build_parser()
    assert list(commands) == ["launch", "config", "env"]


def test_registry_adds_a_new_command_module(monkeypatch, capsys):
    module = types.ModuleType("lowprec.cli.hello")
    module.NAME, module.HELP = "hello", "say hello"

    def add_parser(subparsers):
        p = subparsers.add_parser("hello", help=module.HELP)
        p.add_argument("--name", default="world")
        return p

    def run(args):
        if args.name == "bad":
            raise ValueError("name: 'bad' is not allowed; pick another")
        print(f"hello {args.name}")
        return 0

    module.add_parser, module.run = add_parser, run
    monkeypatch.setitem(sys.modules, "lowprec.cli.hello", module)
    monkeypatch.setattr(
        main_module,
        "COMMANDS",
        {"env": main_module.COMMANDS["env"], "hello": ("lowprec.cli.hello", "lowprec.cli.hello:run")},
    )
    assert main(["hello", "--name", "x"]) == 0
    assert capsys.readouterr().out == "hello x\n"
    assert main(["hello", "--name", "bad"]) == 2
    err = capsys.readouterr().err
    assert err == "lowprec: error: name: 'bad' is not allowed; pick another\n"


def test_debug_env_shows_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWPREC_DEBUG", "1")
    with pytest.raises(ValueError, match="not found"):
        main(["launch", "no_such_script.py"])
