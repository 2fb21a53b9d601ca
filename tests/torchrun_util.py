"""Run a 2-process torchrun job from a test, tolerating gloo's exit-time abort.

gloo sometimes aborts a process *after* the work is done, while it shuts down ("terminate
called without an active exception", a known upstream race; about 1 launch in 20-30 on a loaded
2-core box, more often after DeepSpeed ZeRO-3). A launch that hits it is retried (up to 3
attempts, each on a fresh port); the caller's ``done()`` decides whether the outputs the job
wrote before exiting are complete, in which case that exit abort alone does not fail the test.
Any other failure does.
"""

from __future__ import annotations

import socket
import subprocess
from typing import Callable

GLOO_TEARDOWN = "terminate called without an active exception"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# seconds of launches one test may spend before giving up (pytest-timeout stops a test at 600)
HANG_BUDGET = 570


def run_torchrun(cmd: list[str], done: Callable[[subprocess.CompletedProcess], bool], attempts: int = 3,
                 **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` holds ``--master_port <port>`` (replaced by a fresh port per attempt).

    A launch that hangs past ``timeout`` (seen once in a full CI-style run: a 2-process example
    that passes in ~10 s made no progress for 300 s, and did not recur in 10 runs under load) is
    retried once on a fresh port within :data:`HANG_BUDGET`, with a warning that names it; a
    second hang fails the test."""
    import time
    import warnings

    proc = hang = None
    timeout = kwargs.pop("timeout", None)
    start, hung = time.monotonic(), 0
    for _ in range(attempts):
        for flag in ("--master_port", "--main_process_port"):
            if flag in cmd:
                cmd[cmd.index(flag) + 1] = str(free_port())
        left = HANG_BUDGET - (time.monotonic() - start)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=None if timeout is None else min(timeout, left), **kwargs)
        except subprocess.TimeoutExpired as e:
            hung, hang = hung + 1, e
            if hung > 1 or HANG_BUDGET - (time.monotonic() - start) < 60:
                raise
            tail = (e.stderr or "")[-1500:] if isinstance(e.stderr, str) else ""
            warnings.warn(f"{' '.join(cmd[:6])}...: no exit after {e.timeout:.0f} s; retried on a fresh port. "
                          f"stderr tail: {tail}", stacklevel=2)
            continue
        if proc.returncode == 0:
            return proc
        if GLOO_TEARDOWN not in proc.stderr:
            break
    if proc is None:  # every attempt hung
        raise hang
    if GLOO_TEARDOWN in proc.stderr and done(proc):
        return proc  # the job finished and wrote everything; only the exit aborted
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_ranks(script: str, args: list[str], nproc: int, env: dict, done: Callable[[], bool], attempts: int = 3,
              timeout: float = 300) -> None:
    """Run ``script args`` as ``nproc`` ranks with torchrun's environment, forked from one
    process that imported torch once (tests/fork_ranks.py: a torchrun launch costs a torch import
    per rank plus one for torchrun itself). A fresh port per attempt; gloo's exit-time abort is
    tolerated as in :func:`run_torchrun`."""
    import os
    import sys

    fork = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fork_ranks.py")
    proc = None
    for _ in range(attempts):
        port_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        proc = subprocess.run([sys.executable, fork, str(nproc), script, *args], capture_output=True, text=True,
                              env=port_env, timeout=timeout)
        if proc.returncode == 0:
            return
        if GLOO_TEARDOWN not in proc.stderr:
            break
        if done():
            return  # the job finished and wrote everything; only the exit aborted
    raise AssertionError(proc.stdout[-3000:] + proc.stderr[-8000:])


def spawn_ranks(fn: Callable, args: tuple, nprocs: int, done: Callable[[], bool], attempts: int = 3,
                port_arg: int | None = None) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs, "spawn")``, tolerating gloo's
    exit-time abort as :func:`run_torchrun` does: a rank killed by SIGABRT (the teardown's
    ``std::terminate``) is retried, and accepted once ``done()`` finds every output written.
    ``port_arg``: the index in ``args`` of the rendezvous port, replaced by a fresh one per attempt.
    """
    import torch.multiprocessing as mp

    error = None
    for _ in range(attempts):
        if port_arg is not None:
            args = (*args[:port_arg], free_port(), *args[port_arg + 1:])
        try:
            mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn")
            return
        except mp.ProcessExitedException as e:  # a rank died by a signal: no Python traceback
            if e.signal_name != "SIGABRT":
                raise
            error = e
            if done():
                return  # every rank wrote its outputs; only an exit aborted
    raise error
