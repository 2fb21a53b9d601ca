"""``python -m lowprec.cli._torchrun <torchrun args>``: torchrun, ending in one lowprec line.

When a worker dies, torchrun ends with a 40-line ``ChildFailedError`` traceback that names
neither the cause in plain words nor what to do next. This runs torchrun's own ``run`` and turns
that ending into one line: which rank failed first, its exit cause (exit code or signal), and
the command that continues (``LOWPREC_CONTINUE_COMMAND``, set by ``lowprec train`` /
``lowprec launch``). The exit code is the failed worker's (128 + N for signal N).

A run the workers stop on purpose (``lowprec train``: too many non-finite steps, exit 3) is not a
crash: rank 0 writes its one-line reason to ``LOWPREC_STOP_FILE`` (a fresh file per launch) and
every rank exits with the same code (:func:`report_stop`); this then prints that reason (with
the command that continues) instead of the failed-rank line, so the run ends in one line.

A rank killed by SIGABRT *after* its work finished is not a failed run: torch's gloo threads can
abort a process at interpreter exit (docs/LOG.md, "abort" (2026-11-26)). Each rank runs under
:mod:`lowprec.cli._worker`, which writes a marker to ``LOWPREC_DONE_DIR`` (in the same fresh
directory) once the script succeeded and its outputs are flushed; when every failure is a SIGABRT
of a rank whose marker is there, and every local rank wrote one, this prints one warning line and
exits 0 (:func:`aborted_after_done`). An abort before a rank's marker fails the run as any crash.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Mapping, Optional, Sequence
from lowprec.cli._worker import DONE_DIR_VAR, marker_path

__all__ = ["main", "describe_exit", "CONTINUE_VAR", "STOP_FILE_VAR", "report_stop", "aborted_after_done"]

CONTINUE_VAR = "LOWPREC_CONTINUE_COMMAND"
STOP_FILE_VAR = "LOWPREC_STOP_FILE"


def report_stop(reason: str, rank: int, code: int = 3, wait_s: float = 60.0) -> None:
    """End a worker that stops the run on purpose, the same way on every rank (never returns
    under a launcher; without one it returns and the caller reports as usual).

    Rank 0 writes ``reason`` to the launcher's stop file. torchrun stops the other workers with
    SIGTERM as soon as one exits, so every rank first waits for the others (a barrier when the
    process group is up, else for the file), turns SIGTERM into the same exit ``code`` (the
    stop is decided), and leaves with ``os._exit`` (no interpreter teardown to be caught in;
    the caller has flushed its files)."""
    import time

    path = os.environ.get(STOP_FILE_VAR)
    if not path:
        return
    signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            f.write(reason)
        os.replace(path + ".tmp", path)  # whole or absent
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    elif rank != 0 and os.environ.get("GROUP_RANK", "0") == "0":  # rank 0 runs on this machine
        deadline = time.monotonic() + wait_s
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def describe_exit(code: int) -> str:
    """``exit code 1`` / ``killed by SIGKILL (signal 9)``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (signal {-code})" + (" (out of memory, or killed by hand?)" if -code == 9 else "")
    return f"exit code {code}"


def _continue_hint() -> str:
    cmd = os.environ.get(CONTINUE_VAR)
    return f"; to continue: {cmd}" if cmd else ""


def aborted_after_done(failures: Mapping[int, Any], done_dir: str, local_world_size: int) -> bool:
    """True when the first failure is a SIGABRT, every other one a SIGABRT or torchrun's stop
    (SIGTERM, then SIGKILL, sent to the rest once one worker died), every failed rank had
    finished (its marker holds its pid), and every local rank wrote a marker in the same restart.
    ``failures``: global rank -> torchrun's ``ProcessFailure``."""
    import json

    if not failures:
        return False
    first = min(failures.values(), key=lambda f: f.timestamp)
    stops = {-signal.SIGABRT, -signal.SIGTERM, -signal.SIGKILL}
    if first.exitcode != -signal.SIGABRT or any(f.exitcode not in stops for f in failures.values()):
        return False
    records = {}
    for r in range(local_world_size):
        try:
            with open(marker_path(done_dir, r)) as fh:
                records[r] = json.load(fh)
        except (OSError, ValueError):
            return False  # a rank that did not finish (or never started)
    if len({rec.get("restart") for rec in records.values()}) != 1:
        return False  # markers of an earlier attempt
    return all(records.get(f.local_rank, {}).get("pid") == f.pid for f in failures.values())


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # its "Sending process N closing signal SIGTERM" / "failed (exitcode: 2) local_rank: 0" log
    # lines: the line this ends with says which rank failed first, how, and that the rest stopped
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    stop_dir = tempfile.mkdtemp(prefix="lowprec-run-")
    stop_file = os.environ[STOP_FILE_VAR] = os.path.join(stop_dir, "reason")  # the workers inherit it
    os.environ[DONE_DIR_VAR] = stop_dir  # the workers' "finished" markers (cli/_worker.py)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        if os.path.exists(stop_file):
            with open(stop_file) as f:
                print(f"lowprec: stopped: {f.read().strip()}{_continue_hint()}", file=sys.stderr)
            return code
        if aborted_after_done(exc.failures, stop_dir, determine_local_world_size(args.nproc_per_node)):
            ranks = ", ".join(
                f"rank {r} (pid {f.pid})" for r, f in sorted(exc.failures.items()) if f.exitcode == -signal.SIGABRT
            )
            print(
                f"lowprec: warning: {ranks} killed by SIGABRT at interpreter exit, after the work finished "
                "and the outputs were flushed (a torch/gloo teardown race); the run succeeded",
                file=sys.stderr,
            )
            return 0
        if code == 2:  # a user or checkpoint error: the worker printed its one line; "continue"
            return code  # would retry the same input (e.g. resume from the same bad checkpoint)
        print(
            f"lowprec: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) failed first: "
            f"{describe_exit(code)}; the other workers were stopped{_continue_hint()}",
            file=sys.stderr,
        )
        return 128 - code if code < 0 else (code or 1)
    except (SignalException, KeyboardInterrupt) as exc:
        sig = getattr(exc, "sigval", signal.SIGINT)
        print(
            f"lowprec: interrupted ({signal.Signals(sig).name}); the workers were stopped{_continue_hint()}",
            file=sys.stderr,
        )
        return 128 + int(sig)
    finally:
        shutil.rmtree(stop_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
