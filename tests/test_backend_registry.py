"""Backends are data: one declaration (a BackendSpec) makes a backend known to the registry,
the launch flags and their checks, the wizard, `lowprec env`, the docs table and the
Accelerator. This test adds a test-only backend touching no other file (issue 11, item 2)."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import pytest

from lowprec.backends import spec as S
from lowprec.backends.engines.native import NativeBackend
from lowprec.config import values as V
from lowprec.fp8_kwargs import RecipeKwargs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class EchoRecipeKwargs(RecipeKwargs):
    """A test-only backend's handler: the native tensorwise recipe with a margin."""

    margin: Optional[int] = None

    backend = "echo"


def _recipe(handler):
    from lowprec.fp8 import Recipe

    return Recipe.from_name("tensorwise", margin=handler.margin or 0)


ECHO = S.BackendSpec(
    name="echo",
    env_value="ECHO",
    aliases=("echo-fp8",),
    summary="a test-only backend (the native engine under another name)",
    kwargs_class=EchoRecipeKwargs,
    reads=("fp8_margin",),
    create=lambda handler, why: NativeBackend(_recipe(handler), name="echo", reason=why),
    native_recipe=_recipe,
)


@pytest.fixture
def echo():
    S.register(ECHO)
    yield ECHO
    S.unregister("echo")


def test_registry_and_spellings(echo):
    assert S.lookup("Echo-FP8") is echo and S.get_spec("ECHO") is echo
    assert "echo" in V.FP8_BACKENDS and V.parse_fp8_backend("ECHO") == "echo"
    assert "| echo | echo, echo-fp8 |" in S.backends_markdown()
    other = type("OtherRecipeKwargs", (EchoRecipeKwargs,), {"backend": "other"})
    with pytest.raises(ValueError, match="already name"):
        S.register(S.BackendSpec(env_value="TE", summary="", kwargs_class=other, reads=(), create=ECHO.create))
    # the name is the kwargs class's backend, declared once
    with pytest.raises(ValueError, match="must name the backend"):
        S.BackendSpec(
            name="other", env_value="OTHER", summary="", kwargs_class=EchoRecipeKwargs, reads=(), create=ECHO.create
        )


def test_launch_flags_and_their_checks(echo, capsys):
    from lowprec.cli.main import main

    assert (
        main(["launch", "--dry_run", "--mixed_precision", "fp8", "--fp8_backend", "echo", "--fp8_margin", "2", "x.py"])
        == 2
    )  # the script does not exist: the flags themselves parsed
    assert "training script 'x.py' not found" in capsys.readouterr().err
    script = os.path.join(ROOT, "tests", "scripts")
    script = next(os.path.join(script, f) for f in sorted(os.listdir(script)) if f.endswith(".py"))
    assert (
        main(["launch", "--dry_run", "--mixed_precision", "fp8", "--fp8_backend", "echo", "--fp8_margin", "2", script])
        == 0
    )
    out = capsys.readouterr().out
    assert "export ACCELERATE_FP8_BACKEND=ECHO" in out and "export ACCELERATE_FP8_MARGIN=2" in out
    assert (
        main(
            [
                "launch",
                "--dry_run",
                "--mixed_precision",
                "fp8",
                "--fp8_backend",
                "echo",
                "--fp8_recipe",
                "rowwise",
                script,
            ]
        )
        == 2
    )
    assert "--fp8_recipe: the echo FP8 backend does not read it (read by: native)" in capsys.readouterr().err
    try:
        main(["launch", "--help"])
    except SystemExit:
        pass
    assert "native, ao, te, msamp, echo, auto" in " ".join(capsys.readouterr().out.split())


def test_wizard_asks_what_the_declaration_reads(echo, monkeypatch, tmp_path, capsys):
    from lowprec.cli.main import main
    from lowprec.config.launch_config import load_launch_config

    # machines, processes, cpu, precision, backend, fallback (it runs on lowprec's engine), margin
    answers = iter(["1", "1", "no", "fp8", "echo", "emulate", "3"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(answers))
    path = tmp_path / "echo.yaml"
    assert main(["config", "--config_file", str(path)]) == 0
    settings = load_launch_config(path).to_settings()
    assert (settings["fp8_backend"], settings["fp8_margin"]) == ("echo", 3)
    assert "fp8_recipe" not in settings and "fp8_opt_level" not in settings


def test_env_report_and_accelerator(echo, monkeypatch):
    from lowprec import Accelerator
    from lowprec.cli.env import collect

    assert collect()["fp8_backends"]["echo"] == {
        "fp8_backend": "ECHO",
        "kwargs": "EchoRecipeKwargs",
        "runs": "lowprec engine",
    }
    for name in [n for n in os.environ if n.startswith(("ACCELERATE_", "LOWPREC_FP8"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "echo-fp8")
    acc = Accelerator(mixed_precision="fp8", cpu=True)
    assert acc.backend.name == "echo" and acc.fp8_backend == "ECHO"
    assert acc.fp8_settings.backend.value == "echo" and "ACCELERATE_FP8_BACKEND" in acc.fp8_settings.backend.reason
    acc = Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[EchoRecipeKwargs(margin=1)])
    assert acc.backend.recipe.margin == 1


def test_no_backend_name_is_compared_outside_backends():
    """Backend names live in backends/<name>.py; nothing else branches on them."""
    names = "|".join(sorted({s for spec in S.specs() for s in spec.spellings()}, key=len, reverse=True))
    pattern = rf"""(==|!=|\bin\b)\s*\(?[^#\n]*["']({names}|auto)["']"""
    out = subprocess.run(
        ["grep", "-rnE", pattern, "src/lowprec", "--include=*.py"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    hits = [
        ln
        for ln in out.splitlines()
        if "/backends/" not in ln and ("backend" in ln or "name" in ln) and '"""' not in ln and "``" not in ln
    ]
    assert hits == [], "\n".join(hits)


def test_launcher_reads_declarations_without_torch():
    code = (
        "import sys; from lowprec.backends.spec import specs; from lowprec.config import values as V; "
        "specs(); V.FP8_BACKENDS; assert 'torch' not in sys.modules, 'torch imported'; "
        "assert not [m for m in sys.modules if m.startswith('lowprec.backends.engines')], 'an engine imported'"
    )
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_implementations_load_when_a_backend_is_built_and_keep_their_old_paths():
    """A declaration names its implementation (``backends/engines/<name>.py``) without importing
    it; the classes that moved there are still importable from the declaration modules."""
    from lowprec.backends import msamp, native, te, torchao
    from lowprec.backends.engines import msamp as msamp_engine
    from lowprec.backends.engines import te as te_engine
    from lowprec.backends.engines import torchao as ao_engine

    assert isinstance(native.SPEC.create, S.Implementation)
    assert S.Implementation("native:NativeBackend").resolve() is NativeBackend
    assert native.NativeBackend is NativeBackend
    assert torchao.TorchAOBackend is ao_engine.TorchAOBackend
    assert torchao.first_last_linear_filter is ao_engine.first_last_linear_filter
    assert (te.TEBackend, te.te_convert, te.build_te_recipe) == (
        te_engine.TEBackend,
        te_engine.te_convert,
        te_engine.build_te_recipe,
    )
    assert msamp.NativeOptLevelBackend is msamp_engine.NativeOptLevelBackend
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        te.nothing  # noqa: B018
    backend = native.SPEC.build(native.SPEC.kwargs_class(recipe="tensorwise"), "asked")
    assert isinstance(backend, NativeBackend) and backend.reason == "asked"


def test_docs_table_is_generated_from_the_declarations():
    with open(os.path.join(ROOT, "docs", "backends.md")) as f:
        assert f.read() == S.docs_page(), "stale: python -m lowprec.backends.spec > docs/backends.md"
