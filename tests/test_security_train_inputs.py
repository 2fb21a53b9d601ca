"""Reliability table 1c: what `lowprec train` reads besides its checkpoints runs no code.

* A model directory whose config (or tokenizer config) names its own Python code through
  ``auto_map``: with ``trust_remote_code`` unset, transformers would ask ``[y/N]`` on a terminal
  and run the code on "y". Run under a pseudo-terminal that answers "y": no prompt, no marker,
  one error line (exit 2) saying to set ``trust_remote_code: true`` if the code is trusted.
* Pickle-bearing files, refused by the weights-only unpickler: a tampered ``pytorch_model.bin``
  (no safetensors beside it) and a tampered ``dataset_prepared_path`` cache: one line, exit 2,
  no traceback, no marker.
Each case runs the real CLI in a subprocess.
"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (dev extra)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
ALPACA = os.path.join(ROOT, "examples", "alpaca_fp8.yaml")
ONE_STEP = ["--max_steps", "1", "--eval_steps", "null", "--val_set_size", "0", "--use_tensorboard", "false", "--quiet"]


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_"))}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    return env


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lowprec.cli.main", "train", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )


def _in_terminal(args: list[str], answer: bytes = b"y\n", limit: float = 300) -> tuple[int, str]:
    """The CLI on a pseudo-terminal (stdin, stdout and stderr all a tty, as a user's shell has),
    answering ``answer`` up front and to any ``[y/N]``; returns (exit status, everything printed)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: becomes the CLI
        os.environ.clear()
        os.environ.update(_env())
        os.execv(sys.executable, [sys.executable, "-m", "lowprec.cli.main", "train", *args])
    os.write(fd, answer)
    out, deadline = b"", time.monotonic() + limit  # a safety stop only: a prompt left waiting would hang
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
        if b"[y/N]" in chunk:
            os.write(fd, answer)
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace").replace("\r\n", "\n")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_tiny_llama", os.path.join(ROOT, "examples", "make_tiny_llama.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main([str(tmp_path_factory.mktemp("tiny-llama")), "--hidden", "32", "--pretrain_steps", "0"])


def _remote_code_dir(src: str, dest, marker: str, where: str) -> str:
    """A copy of ``src`` whose ``where`` config names ``evil_code.py``, which creates ``marker`` on import."""
    shutil.copytree(src, dest)
    (dest / "evil_code.py").write_text(
        f"import pathlib\npathlib.Path({marker!r}).touch()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil_llama'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    path = dest / where
    cfg = json.loads(path.read_text())
    if where == "config.json":  # a model type transformers does not know: only the directory's code builds it
        cfg.update(
            model_type="evil_llama",
            auto_map={"AutoConfig": "evil_code.EvilConfig", "AutoModelForCausalLM": "evil_code.EvilModel"},
        )
    else:
        # a tokenizer class transformers does not have: only the directory's code provides it
        cfg.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil_code.EvilTokenizer"]})
    path.write_text(json.dumps(cfg))
    return str(dest)


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_remote_code_unset_is_refused_without_a_prompt(tiny_llama, tmp_path, where):
    marker = tmp_path / "MARKER"
    model = _remote_code_dir(tiny_llama, tmp_path / "model", str(marker), where)
    rc, out = _in_terminal([TINY, "--base_model", model, "--output_dir", str(tmp_path / "out"), *ONE_STEP])
    assert not marker.exists(), f"{where}: the model directory's code ran\n{out[-3000:]}"
    assert "[y/N]" not in out and "custom code" not in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("lowprec: error:")]
    assert rc == 2 and len(errors) == 1, (rc, out[-3000:])
    assert model in errors[0] and "trust_remote_code: true" in errors[0] and "trust" in errors[0], errors


def _assert_one_line_refusal(proc: subprocess.CompletedProcess, *names: str) -> None:
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert err[-1].startswith("lowprec: error: ") and all(n in err[-1] for n in names), err[-3:]


def test_tampered_pytorch_model_bin_is_one_line(tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    os.remove(model / "model.safetensors")  # the weights only as a pickle, which transformers then reads
    marker = tmp_path / "MARKER"
    torch.save({"model.embed_tokens.weight": Evil(str(marker))}, str(model / "pytorch_model.bin"))
    proc = _cli([TINY, "--base_model", str(model), "--output_dir", str(tmp_path / "out"), *ONE_STEP])
    assert not marker.exists()
    _assert_one_line_refusal(proc, "pytorch_model.bin", "posix.system", "refused")


def test_tampered_prepared_dataset_cache_is_one_line(tmp_path):
    from lowprec.cli.main import main

    prepared = tmp_path / "prepared"
    args = [
        ALPACA,
        "--dataset_prepared_path",
        str(prepared),
        "--output_dir",
        str(tmp_path / "out"),
        "--max_steps",
        "1",
        "--use_tensorboard",
        "false",
        "--quiet",
    ]
    assert main(["train", *args]) == 0  # tokenizes and fills the cache
    (cache,) = [p for p in prepared.iterdir() if (p / "meta.json").is_file()]
    marker = tmp_path / "MARKER"
    torch.save({"ids": Evil(str(marker))}, str(cache / "train.pt"))
    proc = _cli(args)
    assert not marker.exists()
    _assert_one_line_refusal(proc, "dataset_prepared_path", cache.name, "posix.system", "delete that directory")


@pytest.mark.parametrize("damage", ["garbage-tensors", "garbage-meta", "missing-split"])
def test_damaged_prepared_dataset_cache_is_one_line(tmp_path, damage):
    from lowprec.train.examples import _load

    cache = tmp_path / "key"
    cache.mkdir()
    (cache / "meta.json").write_text(json.dumps({"format": 1, "validation": False}))
    torch.save(
        {
            "ids": torch.zeros(3, dtype=torch.int32),
            "labels": torch.zeros(3, dtype=torch.int32),
            "offsets": torch.tensor([0, 3]),
        },
        str(cache / "train.pt"),
    )
    _load(str(cache), "d", "key")  # intact: loads
    if damage == "garbage-tensors":
        (cache / "train.pt").write_bytes(b"\x00garbage")
    elif damage == "garbage-meta":
        (cache / "meta.json").write_text("{not json")
    else:
        os.remove(cache / "train.pt")
    with pytest.raises(
        ValueError,
        match=r"^dataset_prepared_path: the cache .*key is damaged .*"
        r"delete that directory",
    ) as info:
        _load(str(cache), "d", "key")
    assert "\n" not in str(info.value)
