"""Run a 2-process job from a test: one attempt, and it must succeed.

No retry: gloo's exit-time abort (a torch race, docs/LOG.md, "abort" (2026-11-26)) is the product's to handle.
``lowprec launch`` / ``lowprec train`` runs each rank under ``lowprec.cli._worker``, which leaves
without interpreter finalization once the work is done and reports an abort after that as a
warning; :func:`run_ranks` ends its forked ranks with ``os._exit`` (tests/fork_ranks.py) and
:func:`spawn_ranks` ends each spawned rank with ``lowprec.cli._worker.finish``. An abort before the
work finished fails the test, as it fails a user's run.
"""

from __future__ import annotations

import socket
import subprocess
from typing import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    cmd: list[str], done: Callable[[subprocess.CompletedProcess], bool], **kwargs
) -> subprocess.CompletedProcess:
    """Run ``cmd`` once (``--master_port`` / ``--main_process_port`` get a fresh port); it must exit
    0 and ``done(proc)`` must find the outputs the job writes."""
    for flag in ("--master_port", "--main_process_port"):
        if flag in cmd:
            cmd[cmd.index(flag) + 1] = str(free_port())
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert done(proc), "exit 0 without the job's outputs:\n" + proc.stdout[-3000:] + proc.stderr[-6000:]
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
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    assert done(), "exit 0 without the job's outputs:\n" + proc.stdout[-3000:] + proc.stderr[-8000:]


def _finish_rank(rank: int, fn: Callable, *args) -> None:
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
