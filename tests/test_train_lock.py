"""One run per output_dir (issue 28 item 4): a second run is refused in one line while the first
keeps all its files; a lock whose holder died is taken over; a save never deletes a temporary
that a live process is writing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import terminal_sigint

from lowprec.durable import this_host
from lowprec.train.checkpoints import list_checkpoints
from lowprec.train.metrics import read_metrics
from lowprec.train.run_lock import LAUNCHER_VAR, LOCK_FILE, hold_output_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
FAST = ["--fp8", "false", "--eval_steps", "null", "--val_set_size", "0", "--use_tensorboard", "false", "--quiet"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_run_is_refused_in_one_line_and_the_first_keeps_its_files(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lowprec.cli.main",
            "train",
            TINY,
            *FAST,
            "--max_steps",
            "100000",
            "--save_steps",
            "3",
            "--save_total_limit",
            "2",
            "--output_dir",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_env(),
        text=True,
        preexec_fn=terminal_sigint,
    )
    try:
        deadline = time.time() + 240
        while not list_checkpoints(str(out)) and time.time() < deadline:  # the first run is under way
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.2)
        assert list_checkpoints(str(out)), "the first run wrote no checkpoint in time"
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "lowprec.cli.main",
                "train",
                TINY,
                *FAST,
                "--max_steps",
                "2",
                "--save_steps",
                "1",
                "--output_dir",
                str(out),
            ],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=240,
        )
        assert first.poll() is None, "the first run ended before the second tried: nothing was tested"
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith(
            f"lowprec: error: output_dir: {out} is in use by another lowprec run (pid {first.pid} "
            f"on {this_host()}, since "
        ), lines[0]
        first.send_signal(signal.SIGINT)  # the first run stops as a user would stop it
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 130, err
    steps = [r["step"] for r in read_metrics(str(out), "train")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3  # never truncated or interleaved
    kept = [s for s, _ in list_checkpoints(str(out))]
    assert kept and kept[-1] >= 3 and kept[-1] % 3 == 0  # the first run's own checkpoints, not removed
    assert (out / LOCK_FILE).read_text() == ""  # released by the interrupted run too


def test_a_lock_left_by_a_dead_process_is_taken_over_and_logged(tmp_path, capsys):
    from lowprec.cli.main import main

    out = tmp_path / "run"
    out.mkdir()
    dead = _dead_pid()
    (out / LOCK_FILE).write_text(json.dumps({"pid": dead, "host": this_host(), "since": "2026-01-01T00:00:00Z"}))
    rc = main(["train", TINY, *FAST, "--max_steps", "1", "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"taking over the lock on {out} left by pid {dead} on {this_host()}, since 2026-01-01T00:00:00Z" in err
    assert (out / LOCK_FILE).read_text() == ""


def test_the_lock_names_its_holder_and_a_launchers_workers_run_under_its_lock(tmp_path, monkeypatch):
    with hold_output_dir(str(tmp_path)) as fd:
        assert fd is not None
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == this_host()
        with pytest.raises(ValueError, match=rf"in use by another lowprec run \(pid {os.getpid()} on "):
            with hold_output_dir(str(tmp_path)):
                pass
        # rank 0 of `lowprec train --num_processes N`: the launcher (named in the variable) holds it
        monkeypatch.setenv(LAUNCHER_VAR, f"{os.getpid()}:{tmp_path}")
        with hold_output_dir(str(tmp_path)) as inner:
            assert inner is None
        # a variable naming another process is not the holder: refused
        monkeypatch.setenv(LAUNCHER_VAR, f"{_dead_pid()}:{tmp_path}")
        with pytest.raises(ValueError, match="in use by another lowprec run"):
            with hold_output_dir(str(tmp_path)):
                pass
    assert (tmp_path / LOCK_FILE).read_text() == ""
    monkeypatch.delenv(LAUNCHER_VAR)
    with hold_output_dir(str(tmp_path)) as fd:  # free again
        assert fd is not None


def test_save_state_never_removes_a_live_writers_temporary(tmp_path):
    from torch import nn

    from lowprec import Accelerator

    target = tmp_path / "ckpt"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = tmp_path / f"ckpt.tmp-{this_host()}-{sleeper.pid}"
        dead = tmp_path / f"ckpt.tmp-{this_host()}-{_dead_pid()}"
        old_style = tmp_path / f"ckpt.tmp-{sleeper.pid}"  # earlier versions' name (no host): a leftover
        for d in (live, dead, old_style):
            d.mkdir()
            (d / "part").write_text("x")
        acc = Accelerator()
        acc.prepare(nn.Linear(4, 4))
        acc.save_state(str(target))
        assert live.is_dir() and (live / "part").read_text() == "x"
        assert not dead.exists() and not old_style.exists()
        assert (target / "lowprec_state.json").is_file()
    finally:
        sleeper.kill()
        sleeper.wait()
