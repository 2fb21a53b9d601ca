"""A rank aborted at interpreter exit after its work finished is a warning, not a failed run.

torch's gloo threads can SIGABRT a finished rank at exit (docs/LOG.md, "abort" (2026-11-26)). Under
``lowprec launch`` each rank runs in ``lowprec.cli._worker``: once the script succeeded it runs
the atexit handlers, flushes, writes a marker and leaves without finalization; the launcher
(cli/_torchrun.py) accepts an abort only from ranks that all wrote their marker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lowprec.cli._torchrun import aborted_after_done
from lowprec.cli._worker import marker_path
from lowprec.config.env import owned_env_var

SRC = str(Path(__file__).resolve().parent.parent / "src")
ABORT_WORKER = str(Path(__file__).parent / "scripts" / "abort_worker.py")


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not owned_env_var(k)}
    env.update(
        PYTHONPATH=SRC + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        LOWPREC_CONFIG_HOME=str(tmp_path / "none"),
        **extra,
    )
    return env


def _failure(exitcode: int, pid: int, local_rank: int, timestamp: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode, pid=pid, local_rank=local_rank, timestamp=timestamp)


def _mark(done_dir: Path, local_rank: int, pid: int, restart: str = "0") -> None:
    Path(marker_path(str(done_dir), local_rank)).write_text(json.dumps({"pid": pid, "restart": restart}))


ABRT, TERM = -int(signal.SIGABRT), -int(signal.SIGTERM)


def test_abort_after_every_marker_is_accepted(tmp_path):
    _mark(tmp_path, 0, 100)
    _mark(tmp_path, 1, 101)
    # rank 1 aborted first; torchrun then stopped rank 0 (finished too) with SIGTERM
    assert aborted_after_done({1: _failure(ABRT, 101, 1, 1.0), 0: _failure(TERM, 100, 0, 2.0)}, str(tmp_path), 2)


@pytest.mark.parametrize(
    "case", ["peer_missing", "failed_missing", "pid_differs", "not_sigabrt", "term_first", "other_restart"]
)
def test_abort_without_proof_of_finish_fails(tmp_path, case):
    failures = {1: _failure(ABRT, 101, 1, 1.0)}
    _mark(tmp_path, 1, 101)
    _mark(tmp_path, 0, 100, restart="1" if case == "other_restart" else "0")
    if case == "peer_missing":  # rank 0 was stopped mid-work by torchrun after rank 1's abort
        os.remove(marker_path(str(tmp_path), 0))
    elif case == "failed_missing":
        os.remove(marker_path(str(tmp_path), 1))
    elif case == "pid_differs":  # a marker of another process (an earlier attempt)
        failures = {1: _failure(ABRT, 999, 1, 1.0)}
    elif case == "not_sigabrt":
        failures = {1: _failure(-int(signal.SIGSEGV), 101, 1, 1.0)}
    elif case == "term_first":
        failures = {0: _failure(TERM, 100, 0, 0.5), 1: _failure(ABRT, 101, 1, 1.0)}
    assert not aborted_after_done(failures, str(tmp_path), 2)


def _launch(tmp_path: Path, when: str, worker_exit: str) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    out.mkdir()
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "lowprec.cli.main",
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            ABORT_WORKER,
            str(out),
            when,
        ],
        capture_output=True,
        text=True,
        env=_env(tmp_path, LOWPREC_WORKER_EXIT=worker_exit),
        timeout=300,
    )


def test_launch_abort_after_work_is_a_warning_and_exit_0(tmp_path):
    # ordinary interpreter exit: rank 1 aborts in finalization, after its marker
    p = _launch(tmp_path, "after", "finalize")
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("lowprec:")]
    assert len(lines) == 1 and lines[0].startswith("lowprec: warning: rank 1 (pid "), lines
    assert "killed by SIGABRT at interpreter exit, after the work finished" in lines[0]
    assert all((tmp_path / "out" / f"rank{r}.txt").read_text() == "done\n" for r in range(2))


def test_launch_default_exit_skips_the_finalization_that_aborts(tmp_path):
    # the same script, default worker exit: finalization (where the abort is) never runs
    p = _launch(tmp_path, "after", "fast")
    assert p.returncode == 0, p.stderr[-4000:]
    assert not [ln for ln in p.stderr.splitlines() if ln.startswith("lowprec:")], p.stderr[-4000:]


def test_launch_abort_before_work_finished_fails(tmp_path):
    p = _launch(tmp_path, "before", "finalize")
    assert p.returncode == 128 + signal.SIGABRT, p.stderr[-4000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("lowprec:")]
    assert len(lines) == 1 and "rank 1" in lines[0] and "failed first: killed by SIGABRT" in lines[0], lines
    assert "warning" not in lines[0]


def _run_worker(
    tmp_path: Path, body: str, *args: str, failed_peer: int | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "user_script.py"
    script.write_text(body)
    done = tmp_path / "done"
    done.mkdir()
    if failed_peer is not None:
        (done / f"failed_rank{failed_peer}").touch()
    p = subprocess.run(
        [sys.executable, "-m", "lowprec.cli._worker", str(script), *args],
        capture_output=True,
        text=True,
        env=_env(tmp_path, LOWPREC_DONE_DIR=str(done), LOCAL_RANK="0"),
        timeout=120,
        cwd=str(tmp_path),
    )
    return p, Path(marker_path(str(done), 0))


def test_worker_runs_atexit_and_flushes_before_its_marker(tmp_path):
    body = (
        "import atexit, json, os, sys\n"
        "import torch.distributed\n"  # holds a deprecated object (reduce_op): the exit must not touch it
        "marker = os.path.join(os.environ['LOWPREC_DONE_DIR'], 'local_rank0')\n"
        "log = open('unclosed.txt', 'w')\n"  # never closed: the interpreter would flush it at exit
        "log.write('kept')\n"
        "def bye():\n"
        "    with open('atexit.json', 'w') as f:\n"
        "        json.dump({'marker_before': os.path.exists(marker), 'name': __name__, 'argv': sys.argv[1:],\n"
        "                   'path0': sys.path[0]}, f)\n"
        "atexit.register(bye)\n"
        "print('out', end='')\n"
    )
    p, marker = _run_worker(tmp_path, body, "a", "--b")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "out"
    assert marker.is_file() and json.loads(marker.read_text())["pid"] > 0
    seen = json.loads((tmp_path / "atexit.json").read_text())
    assert seen == {"marker_before": False, "name": "__main__", "argv": ["a", "--b"], "path0": str(tmp_path)}
    assert (tmp_path / "unclosed.txt").read_text() == "kept"
    assert "FutureWarning" not in p.stderr, p.stderr  # printed at the end of every launched run, before


@pytest.mark.parametrize(
    "body,code", [("import sys\nsys.exit(3)\n", 3), ("raise ValueError('boom')\n", 1), ("import sys\nsys.exit(0)\n", 0)]
)
def test_worker_marks_only_a_success(tmp_path, body, code):
    p, marker = _run_worker(tmp_path, body)
    assert p.returncode == code, p.stderr
    assert marker.is_file() == (code == 0)
    if code == 1:
        assert "ValueError: boom" in p.stderr


def test_worker_failure_leaves_without_the_finalization_that_aborts(tmp_path):
    # a failed rank holding what aborts at finalization (as live gloo threads do): its exit is the
    # script's error (code 1, traceback), not a SIGABRT that would hide it; atexit ran, files flushed
    body = (
        "import atexit, os, sys, types\n"
        "class A:\n"
        "    def __del__(self, _abort=os.abort):\n"
        "        _abort()\n"
        "holder = types.ModuleType('_abort_at_exit')\n"
        "holder.obj = A()\n"
        "sys.modules['_abort_at_exit'] = holder\n"
        "log = open('unclosed.txt', 'w')\n"
        "log.write('kept')\n"
        "atexit.register(lambda: open('atexit.txt', 'w').write('ran'))\n"
        "raise RuntimeError('rank failed')\n"
    )
    p, marker = _run_worker(tmp_path, body)
    assert p.returncode == 1, p.stderr
    assert "RuntimeError: rank failed" in p.stderr and "Traceback" in p.stderr
    assert not marker.exists()
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "unclosed.txt").read_text() == "kept"


def test_worker_exit_message_is_printed_with_code_1(tmp_path):
    p, marker = _run_worker(tmp_path, "import sys\nsys.exit('bad input: see --help')\n")
    assert p.returncode == 1 and "bad input: see --help" in p.stderr and not marker.exists()


def test_a_misspelt_worker_exit_mode_is_refused_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    """LOWPREC_WORKER_EXIT other than fast / finalize (any case) ran the fast exit without a word."""
    from lowprec.cli.main import main

    def no_launch(*args, **kwargs):
        raise AssertionError("a worker was started")

    script, tiny = tmp_path / "s.py", os.path.join(os.path.dirname(ABORT_WORKER), "..", "..", "examples", "tiny.yaml")
    script.write_text("pass\n")
    monkeypatch.setenv("LOWPREC_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(subprocess, "Popen", no_launch)
    monkeypatch.setenv("LOWPREC_WORKER_EXIT", "finalise")
    for argv in (
        ["launch", "--cpu", "--num_processes", "2", str(script)],
        ["train", tiny, "--num_processes", "2", "--output_dir", str(tmp_path / "run")],
    ):
        assert main(argv) == 2
        assert "LOWPREC_WORKER_EXIT='finalise': use fast (the default) or finalize" in capsys.readouterr().err
    monkeypatch.setenv("LOWPREC_WORKER_EXIT", "Finalize")
    assert main(["launch", "--dry_run", "--cpu", "--num_processes", "2", str(script)]) == 0


PEER_LOST = (
    "raise RuntimeError('[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1. This is "
    "typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error.')\n"
)


def test_a_rank_that_lost_its_peer_prints_one_line_or_nothing(tmp_path):
    """A rank whose collective fails because another rank died printed a 40-line traceback of its
    wait (under the other rank's one-line user error). Now: one line naming what was lost; nothing
    where a local peer's failed marker says its error is already printed. Every failure leaves
    that marker, for its peers."""
    p, _ = _run_worker(tmp_path, PEER_LOST)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("lowprec: rank 0 lost another process of this run, which failed or was stopped ")
    assert p.stderr.count("\n") == 1 and "Connection closed by peer" in p.stderr, p.stderr
    assert (tmp_path / "done" / "failed_rank0").is_file()
    second = tmp_path / "second"
    second.mkdir()
    p, _ = _run_worker(second, PEER_LOST, failed_peer=1)  # local rank 1 failed first
    assert p.returncode == 1 and p.stderr == "", p.stderr


@pytest.mark.parametrize("failing", [0, 1])
def test_a_user_error_on_one_rank_of_a_launch_is_its_one_line(tmp_path, failing):
    """One rank stops with a user error (one line, exit 2) while the other waits in a barrier: the
    run prints that line and nothing else (no traceback of the other's wait, no torchrun log
    lines) and exits 2, also where the waiting rank is the lower one (torchrun's tie-break)."""
    script = tmp_path / "fails_on_one_rank.py"
    script.write_text(
        "import sys, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        f"if dist.get_rank() == {failing}:\n"
        "    print('lowprec: error: data.jsonl, line 2: not valid JSON', file=sys.stderr)\n"
        "    sys.exit(2)\n"
        "dist.barrier()\n"
    )
    p = subprocess.run(
        [sys.executable, "-m", "lowprec.cli.main", "launch", "--cpu", "--num_processes", "2", str(script)],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-4000:]
    assert p.stderr.splitlines() == ["lowprec: error: data.jsonl, line 2: not valid JSON"], p.stderr[-4000:]
