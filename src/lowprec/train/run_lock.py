"""One run per output directory: an exclusive lock held for the run's whole life.

Two ``lowprec train`` runs on one ``output_dir`` destroy each other: the second removes the
first's checkpoints as an earlier run's and truncates its metrics. So a run takes an advisory
``fcntl.flock`` on ``<output_dir>/lowprec.lock`` before it touches anything there, and writes
its pid, host and start time into the file; a second run finds the lock taken and stops with one
line naming the holder (the CLI's exit 2).

* The kernel drops a flock when its holder exits, however it exits (kill -9 included), so a lock
  is stale exactly when its holder no longer runs: then the next run takes it over and logs
  whose it was (the file still names the dead holder, which a clean exit clears).
* Who holds it: the process that owns the run. One process: that one. ``lowprec train
  --num_processes N``: the launcher, before torchrun starts (a second run is refused before any
  worker exists); it tells its workers through :data:`LAUNCHER_VAR`, and rank 0 checks that the
  launcher named there is the live holder instead of locking again (which would fail: the
  launcher holds it). Workers started by a plain torchrun: rank 0, before the process group
  is set up. Other ranks never touch the lock, so no rank waits on it; it is never waited on
  at all (``LOCK_NB``).
* A file system without locks (``ENOLCK``, some network mounts) runs unlocked, with a warning.

:func:`make_output_dir` creates the directory first (torch-free, as the launcher needs it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from typing import Iterator, Optional

from lowprec.durable import pid_alive, this_host

__all__ = ["LOCK_FILE", "LAUNCHER_VAR", "make_output_dir", "hold_output_dir", "launcher_env"]

LOCK_FILE = "lowprec.lock"
LAUNCHER_VAR = "LOWPREC_OUTPUT_DIR_LOCK"  # "<launcher pid>:<output_dir>" in the workers' environment

logger = logging.getLogger("lowprec")


def make_output_dir(path: str, key: str = "output_dir") -> str:
    """Create ``path`` (and parents); an OS refusal is the user's path, so it becomes a one-line
    ``ValueError`` naming ``key`` (the CLI's exit 2) instead of a traceback."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ValueError(f"{key}: {path} cannot be created or written ({why}); choose a writable directory") from None
    return path


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "a run that has not written its details yet"
    since = holder.get("since", "?")
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {since}"


def _refusal(output_dir: str, path: str, holder: dict) -> str:
    gone = holder.get("host") == this_host() and isinstance(holder.get("pid"), int) and not pid_alive(holder["pid"])
    note = " (that process has exited, but a process it started still holds the lock)" if gone else ""
    return (
        f"output_dir: {output_dir} is in use by another lowprec run ({_describe(holder)}{note}; lock file "
        f"{path}); wait for it to finish or stop it, or choose another output_dir"
    )


def _launcher_holds(output_dir: str, fd: int) -> bool:
    """True in a worker whose launcher (named in :data:`LAUNCHER_VAR`) holds this lock."""
    value = os.environ.get(LAUNCHER_VAR, "")
    pid, _, where = value.partition(":")
    if not pid.isdigit() or os.path.abspath(where) != output_dir:
        return False
    holder = _read(fd)
    return holder.get("pid") == int(pid) and holder.get("host") == this_host() and pid_alive(int(pid))


def _acquire(fd: int, output_dir: str, path: str) -> bool:
    """True: this process now holds the lock; False: it runs without (a launcher holds it for
    this worker, or the file system has no locks). A lock held by another run: ValueError."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if _launcher_holds(output_dir, fd):
            return False
        raise ValueError(_refusal(output_dir, path, _read(fd))) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        logger.warning(
            "lowprec: cannot lock %s (%s): a second run on this output_dir would not be detected", path, exc.strerror
        )
        return False
    previous = _read(fd)
    if previous:  # a clean exit empties the file: this holder died without releasing
        logger.warning(
            "lowprec: taking over the lock on %s left by %s, which is no longer running",
            output_dir,
            _describe(previous),
        )
    me = {"pid": os.getpid(), "host": this_host(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    return True


@contextlib.contextmanager
def hold_output_dir(output_dir: str) -> Iterator[Optional[int]]:
    """Hold the lock on ``output_dir`` (which exists) for the ``with`` block; a held lock is a
    ``ValueError`` (one line, the holder named). Yields the lock's descriptor (None when a
    launcher holds it for this worker, or the file system has no locks)."""
    output_dir = os.path.abspath(output_dir)
    path = os.path.join(output_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        held = _acquire(fd, output_dir, path)
        try:
            yield fd if held else None
        finally:
            if held:
                with contextlib.suppress(OSError):  # empty: the next run sees a clean release
                    os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing drops the flock


def launcher_env(output_dir: str) -> dict[str, str]:
    """The variable that tells a launcher's workers it holds the lock on ``output_dir``."""
    return {LAUNCHER_VAR: f"{os.getpid()}:{os.path.abspath(output_dir)}"}
