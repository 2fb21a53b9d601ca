"""Reliability table 4: SIGKILL in the middle of writing a checkpoint, then a bitwise resume.

A child process trains a small FP8 (delayed scaling: amax histories are state) model with
dropout and a shuffled loader, saving a checkpoint after every step. At step 5 it is killed
with a real SIGKILL at one point of ``save_state`` (row id): after the model file, after the
optimizer file, after the RNG file (the last one), or between moving the old checkpoint aside
and moving the new one in. A second process resumes from whatever is on disk and finishes; its
final weights must equal an uninterrupted run's bit for bit. (Kills during training, through
the trainer and ``resume_from_checkpoint: auto``, are in test_train_resume.py.)
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import terminal_sigint


def _run(mode: str, kill_at: str, ckpt: str, out: str) -> None:
    """The child's whole life: train (or resume), checkpoint every step, maybe die mid-write."""
    import torch
    from safetensors.torch import save_file
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lowprec.checkpoint.state as C
    from lowprec import Accelerator
    from lowprec.kwargs import NativeRecipeKwargs

    steps, kill_step = 8, 5
    torch.set_num_threads(1)
    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 16),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.7)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 32, generator=g)
    y = (x[:, :16] * 2).argmax(1)
    recipe = NativeRecipeKwargs(recipe="delayed", overrides={"amax_history_len": 4})
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe])
    model, opt, dl, sched = acc.prepare(model, opt, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), sched)

    armed = [False]

    def die() -> None:
        if armed[0]:
            os.kill(os.getpid(), signal.SIGKILL)  # a real SIGKILL: no cleanup, no finally

    def after(fn, test=lambda *a: True):
        def wrapped(*a, **k):
            r = fn(*a, **k)
            if test(*a):
                die()
            return r

        return wrapped

    if kill_at == "after-model":
        C.save_tensors = after(C.save_tensors)
    elif kill_at == "after-optimizer":
        C.save_optimizer = after(C.save_optimizer)
    elif kill_at == "after-rng":
        C.save_object = after(C.save_object, lambda state, path, what: what == "the RNG states")
    elif kill_at == "between-swap":
        real_replace = os.replace

        def replace(src, dst):
            real_replace(src, dst)
            if ".old-" in str(dst):
                die()

        C.os.replace = replace

    done = 0
    if mode == "resume":
        acc.load_state(ckpt)
        done = acc.nonfinite.optimizer_steps
    while done < steps:
        for xb, yb in dl:
            with acc.accumulate(model):
                acc.backward(nn.functional.cross_entropy(model(xb), yb))
                opt.step()
                sched.step()
                opt.zero_grad()
            done += 1
            armed[0] = mode == "kill" and done == kill_step
            acc.save_state(ckpt)
            if done == steps:
                break
    save_file({k: v.contiguous() for k, v in acc.unwrap_model(model).state_dict().items()}, out)


def _child(tmp_path, *args) -> int:
    """``_run`` in a forked process (torch already imported: no start-up cost); its exit code."""
    import multiprocessing

    import torch._dynamo  # noqa: F401 - imported once here, not in every child (optimizers pull it in: 3 s)

    proc = multiprocessing.get_context("fork").Process(target=_run, args=tuple(map(str, args)))
    proc.start()
    proc.join(timeout=300)
    return proc.exitcode


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from safetensors.torch import load_file

    tmp = tmp_path_factory.mktemp("ref")
    assert _child(tmp, "run", "none", tmp / "ckpt", tmp / "final.safetensors") == 0
    return load_file(str(tmp / "final.safetensors"))


@pytest.mark.parametrize("kill_at", ["after-model", "after-optimizer", "after-rng", "between-swap"])
def test_sigkill_mid_write_then_bitwise_resume(tmp_path, reference, kill_at):
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    assert _child(tmp_path, "kill", kill_at, ckpt, tmp_path / "never.safetensors") == -signal.SIGKILL
    assert _child(tmp_path, "resume", "none", ckpt, tmp_path / "final.safetensors") == 0
    final = load_file(str(tmp_path / "final.safetensors"))
    assert final.keys() == reference.keys()
    for k in reference:
        assert (final[k] == reference[k]).all() or (final[k].isnan() & reference[k].isnan()).all(), k
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []


def test_ctrl_c_writes_a_summary_and_says_how_to_resume(tmp_path):
    """A real SIGINT during ``lowprec train``: exit 130, no traceback, summary.json written, and
    one line naming the step, the last checkpoint and the command that continues."""
    import json
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "src"), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "lowprec.cli.main",
        "train",
        os.path.join(root, "examples", "tiny.yaml"),
        "--max_steps",
        "500",
        "--save_steps",
        "2",
        "--eval_steps",
        "null",
        "--output_dir",
        str(out),
        "--use_tensorboard",
        "false",
        "--quiet",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=terminal_sigint
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoint-2").is_dir() and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lowprec: interrupted at step ") and "last good checkpoint: " in last
    assert last.endswith("--resume_from_checkpoint auto")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] >= 2


def test_a_killed_rank_ends_in_one_lowprec_line(tmp_path):
    """``lowprec launch --num_processes 2``: rank 1 dies of SIGKILL; the launch ends with one
    lowprec line naming the rank, the cause and the command to continue, no torchrun traceback,
    and the worker's exit status (128 + 9)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(30)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lowprec.cli.main", "launch", "--num_processes", "2", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 137, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lowprec: rank 1 (local rank 1") and "killed by SIGKILL" in last, last
    assert last.endswith(f"to continue: lowprec launch --num_processes 2 {script}")
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


def test_the_first_ctrl_c_is_latched_for_the_step_boundary_the_second_stops_at_once(sigint_as_in_a_terminal):
    """In the loop, Ctrl-C sets a flag the loop turns into KeyboardInterrupt at the next step (an
    exception raised inside a finalizer would be printed and dropped by Python); a second Ctrl-C
    raises at once; Python's default handler is back afterwards."""
    import time

    from lowprec.train.loop import SigintLatch

    with SigintLatch() as latch:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs between bytecodes of the main thread
        assert latch.hit
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class _Workers:
    """torchrun and its workers as ``subprocess.Popen`` sees them: the first wait is cut by the
    Ctrl-C that reached the launcher too; they then exit 130 (the trainer's interrupted exit)."""

    launched: list = []

    def __init__(self, cmd, env=None, **kwargs):
        self.env, self.waits, self.killed, self.returncode = env, 0, False, None
        _Workers.launched.append(self)

    def wait(self, timeout=None):
        self.waits += 1
        if self.waits == 1:
            raise KeyboardInterrupt
        self.returncode = 130
        return 130

    def communicate(self, input=None, timeout=None):
        self.wait()
        return None, None

    def poll(self):
        return self.returncode

    def kill(self):
        self.killed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _launch_interrupted(tmp_path, monkeypatch) -> _Workers:
    """``lowprec train tiny.yaml --num_processes 2`` in-process, its workers faked (exit 130)."""
    import subprocess

    from lowprec.cli.main import main

    _Workers.launched = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(subprocess, "Popen", _Workers)
    assert main(["train", _TINY, "--output_dir", str(tmp_path / "run"), "--num_processes", "2"]) == 130
    (workers,) = _Workers.launched
    return workers


_TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tiny.yaml")


def test_ctrl_c_under_num_processes_waits_for_the_workers(tmp_path, monkeypatch, capsys):
    """``lowprec train --num_processes 2``: Ctrl-C reaches the launcher and its workers alike. The
    launcher waits for the workers to stop (they write the summary and checkpoint; it holds the
    output_dir lock meanwhile) instead of killing them, adds no empty line, exits as they do."""
    workers = _launch_interrupted(tmp_path, monkeypatch)
    assert not workers.killed and workers.waits == 2
    assert capsys.readouterr().err.strip() == ""  # the workers say why and how to continue


def test_a_worker_of_num_processes_names_the_multi_process_command_to_continue(tmp_path, monkeypatch, capsys):
    """Rank 0 of ``lowprec train --num_processes 2`` runs ``train`` without --num_processes (the
    launcher took it off); its "to continue" command is the launcher's, which keeps it."""
    import lowprec.train.trainer as trainer
    from lowprec.cli.main import main

    workers = _launch_interrupted(tmp_path, monkeypatch)
    again = workers.env["LOWPREC_CONTINUE_COMMAND"]
    assert "--num_processes 2" in again and again.endswith("--resume_from_checkpoint auto")

    def interrupted(cfg):  # that launch's rank 0, Ctrl-C at step 3
        raise KeyboardInterrupt("interrupted at step 3 of 8")

    monkeypatch.setattr(trainer, "train", interrupted)
    for key, value in {**workers.env, "WORLD_SIZE": "2", "RANK": "0"}.items():
        if key.startswith(("LOWPREC_", "WORLD_SIZE", "RANK")):
            monkeypatch.setenv(key, value)
    capsys.readouterr()
    assert main(["train", _TINY, "--output_dir", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err.strip() == f"lowprec: interrupted at step 3 of 8; to continue: {again}"


def test_ctrl_c_under_launch_lets_the_script_finish_its_own_handling(tmp_path, monkeypatch, capsys):
    """``lowprec launch script.py``: the script gets the same Ctrl-C and may save a checkpoint in
    its ``except KeyboardInterrupt``; the launcher waits for it (subprocess.run killed it 0.25 s
    later), then says how to continue and exits 130."""
    import subprocess

    from lowprec.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    _Workers.launched = []
    monkeypatch.setenv("LOWPREC_CONFIG_HOME", str(tmp_path))  # no default config file
    monkeypatch.setattr(subprocess, "Popen", _Workers)
    assert main(["launch", str(script)]) == 130
    (child,) = _Workers.launched
    assert not child.killed and child.waits == 2
    assert capsys.readouterr().err.strip() == f"lowprec: interrupted; to continue: lowprec launch {script}"
