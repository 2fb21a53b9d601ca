"""Run a 2-process job from a test: one attempt, and it must succeed.

No retry: gloo's exit-time abort (a torch race, docs/LOG.md, "abort" (2026-11-26)) is the product's to handle.
``lowprec launch`` / ``lowprec train`` runs each rank under ``lowprec.cli._worker``, which leaves
without interpreter finalization once the work is done and reports an abort after that as a
warning; :func:`run_ranks` ends its forked ranks with ``os._exit`` (tests/fork_ranks.py) and
:func:`spawn_ranks` ends each spawned rank with ``lowprec.cli._worker.finish``. An abort before the
work finished fails the test, as it fails a user's run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import Callable


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


_next_port: list[int] = []


def free_port() -> int:
    """A port for a launch's rendezvous, free when asked. Not one the kernel hands out itself
    (``bind(0)``): those are ephemeral ports, which any socket opened meanwhile (gloo connects
    dozens) may take before the launcher binds it (EADDRINUSE, seen in a suite run). Below the
    ephemeral range instead, in a slice of 1000 ports per pytest-xdist worker so that two
    workers never pick the same one, tried in turn."""
    low = _ephemeral_low()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    start = low - 1000 * (index + 1)
    if low < 12000 or start < 10000:  # no room below the ephemeral range: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    if not _next_port:
        _next_port.append(start + (os.getpid() % 1000))
    for _ in range(1000):
        port = start + (_next_port[0] - start) % 1000
        _next_port[0] = port + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}-{start + 999}")


_NOISE = ("Warning", "Failed to load", "warnings.warn", "*****", "OMP_NUM_THREADS")


def explain(proc: subprocess.CompletedProcess) -> str:
    """What a failed launch printed, for the assertion message: stdout's tail, then stderr without
    the import-time warning lines, whole when short, else its start (the first rank to fail, e.g.
    a faulthandler stack of a SIGABRT) and its end (the launcher's summary)."""
    err = "\n".join(line for line in proc.stderr.splitlines() if not any(n in line for n in _NOISE))
    if len(err) > 14000:
        err = err[:6000] + "\n[...]\n" + err[-8000:]
    return f"exit {proc.returncode}\n--- stdout (tail)\n{proc.stdout[-2000:]}\n--- stderr\n{err}"


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc; torchrun starts each worker in a session of
    its own, so a process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _run_tree(cmd: list[str], timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)``; past ``timeout`` the launcher and
    every worker under it are killed (not left running beside the next test) and it fails with
    what they printed."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(p.pid), p.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, err = p.communicate()
            hung = subprocess.CompletedProcess(cmd, p.returncode, out, err)
            raise AssertionError(
                f"no exit after {timeout} s; the launcher and its workers were killed\n{explain(hung)}"
            ) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_torchrun(
    cmd: list[str], done: Callable[[subprocess.CompletedProcess], bool], **kwargs
) -> subprocess.CompletedProcess:
    """Run ``cmd`` once (``--master_port`` / ``--main_process_port`` get a fresh port); it must exit
    0 and ``done(proc)`` must find the outputs the job writes."""
    for flag in ("--master_port", "--main_process_port"):
        if flag in cmd:
            cmd[cmd.index(flag) + 1] = str(free_port())
    proc = _run_tree(cmd, **kwargs)
    assert proc.returncode == 0, explain(proc)
    assert done(proc), "exit 0 without the job's outputs:\n" + explain(proc)
    return proc


def run_ranks(
    script: str, args: list[str], nproc: int, env: dict, done: Callable[[], bool], timeout: float = 300
) -> None:
    """Run ``script args`` as ``nproc`` ranks with torchrun's environment, forked from one
    process that imported torch once (tests/fork_ranks.py: a torchrun launch costs a torch import
    per rank plus one for torchrun itself). It must exit 0 and ``done()`` find the outputs."""
    import os
    import sys

    fork = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fork_ranks.py")
    port_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        [sys.executable, fork, str(nproc), script, *args], capture_output=True, text=True, env=port_env, timeout=timeout
    )
    assert proc.returncode == 0, explain(proc)
    assert done(), "exit 0 without the job's outputs:\n" + explain(proc)


def _finish_rank(rank: int, fn: Callable, *args) -> None:
    from lowprec.group_lifetime import retain_destroyed_groups

    retain_destroyed_groups()  # as a launched rank does (lowprec.cli._worker): no deadlock at the group's end
    fn(rank, *args)
    from lowprec.cli._worker import finish

    finish()  # atexit handlers, flush, os._exit(0): no interpreter finalization to abort in


def spawn_ranks(fn: Callable, args: tuple, nprocs: int, done: Callable[[], bool], port_arg: int | None = None) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs, "spawn")``, each rank ending as a
    launched rank does (:func:`lowprec.cli._worker.finish`); ``done()`` must then find every
    output. ``port_arg``: the index in ``args`` of the rendezvous port, replaced by a fresh one."""
    import torch.multiprocessing as mp

    if port_arg is not None:
        args = (*args[:port_arg], free_port(), *args[port_arg + 1 :])
    mp.start_processes(_finish_rank, args=(fn, *args), nprocs=nprocs, start_method="spawn")
    assert done(), "every rank exited 0 without writing its outputs"
