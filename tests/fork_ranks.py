"""Run a worker script as N ranks forked from one process that imported torch once.

``python tests/fork_ranks.py NPROC SCRIPT ARGS...`` (environment: MASTER_ADDR/MASTER_PORT and
the rest of the caller's). Each process of a distributed test otherwise pays torch's and
lowprec's import (~3 s of CPU on the loaded 2-core CI box, the larger part of a small
checkpoint test); forked children inherit the imported modules. Safe because the parent only
imports: no process group, no intra-op thread pool (OMP_NUM_THREADS=1 from the caller), no
threads when it forks. Each child gets torchrun's variables (RANK, WORLD_SIZE, ...), writes its
output to ``<SCRIPT>.rank<r>.log``; when one fails the others are killed and every log is
printed; the exit status is the first failure's.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback

import torch  # noqa: F401  (inherited by the children)
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401

import lowprec.accelerator  # noqa: F401


def _die_with_parent() -> None:
    # a test's timeout kills this parent; its ranks must not live on until gloo's own timeout
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass  # elsewhere: the ranks end at gloo's timeout


def main() -> int:
    nproc, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    children = {}
    for rank in range(nproc):
        log = f"{script}.rank{rank}.log"
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                _die_with_parent()
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc),
                    GROUP_RANK="0",
                )
                sys.argv = [script, *args]
                from lowprec.group_lifetime import retain_destroyed_groups

                retain_destroyed_groups()  # as a launched rank does (lowprec.cli._worker)
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = log
    status = 0
    while children:
        pid, raw = os.wait()
        code = os.waitstatus_to_exitcode(raw)
        if code and not status:
            status = code if code > 0 else 1
            for other in children:  # the ranks would wait on the failed one until gloo's timeout
                if other != pid:
                    try:
                        os.kill(other, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        children.pop(pid, None)
    if status:
        for rank in range(nproc):
            with open(f"{script}.rank{rank}.log") as f:
                sys.stderr.write(f"--- rank {rank}\n{f.read()[-4000:]}\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
