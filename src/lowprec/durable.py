"""Files that survive a crash, a power loss and a full disk.

* :func:`fsync_tree` / :func:`fsync_dir`: a rename is atomic but not durable. After a power
  loss the new name can point at a directory whose files never reached the disk (their data
  was still in the page cache), or the rename itself can be lost. So a checkpoint's files and
  directories are fsynced *before* it is renamed into place, and the parent directory *after*
  (the rename is an entry of the parent).
* :func:`os_error_of`: a full disk reaches us in three shapes: ``OSError`` (Python's own
  writes, without a file name when the error surfaces at flush or close), safetensors'
  ``SafetensorError("... (os error 28)")`` (its Rust writer) and torch's ``RuntimeError`` from
  ``torch.save`` (no errno at all). The first two become one ``OSError`` with its errno and the
  path; the third cannot be told from a bug and is left as it is.
* :func:`temp_owner` / :func:`owner_alive`: temporaries carry the host and pid of the process
  writing them (``<name>.tmp-<host>-<pid>``), so a cleaner removes only those whose writer is
  gone and never a live process's work in progress.
"""

from __future__ import annotations

import errno as errno_mod
import os
import re
import socket
from pathlib import Path
from typing import Optional

__all__ = [
    "cache_home",
    "fsync_file",
    "fsync_dir",
    "fsync_tree",
    "os_error_of",
    "pid_alive",
    "this_host",
    "temp_suffix",
    "temp_owner",
    "owner_alive",
]


def fsync_file(path: str) -> None:
    """Flush ``path``'s data and metadata to the device (any descriptor of a file flushes it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (names created or renamed in it) to the device."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Every file under ``root``, then every directory from the deepest up to ``root`` itself."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
    for dirpath, _, _ in sorted(os.walk(root), key=lambda t: t[0].count(os.sep), reverse=True):
        fsync_dir(dirpath)


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_of(exc: BaseException, path: str) -> Optional[OSError]:
    """``exc`` as an ``OSError`` naming ``path`` when it is one (see the module docstring),
    else None."""
    if isinstance(exc, OSError):
        if exc.errno is None:
            return exc
        return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), exc.filename or path)
    m = _RUST_OS_ERROR.search(str(exc))
    if m and type(exc).__name__ == "SafetensorError":
        code = int(m.group(1))
        return OSError(code, os.strerror(code), path)
    return None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (a pid another user owns counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: the existence and permission check only
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError as exc:
        return exc.errno != errno_mod.ESRCH
    return True


def this_host() -> str:
    return socket.gethostname()


def temp_suffix() -> str:
    """``<host>-<pid>`` of this process, for temporary names (dots and dashes in a host name
    are kept; the pid is the part after the last dash)."""
    return f"{this_host()}-{os.getpid()}"


def temp_owner(name: str, kind: str) -> tuple[Optional[str], Optional[int]]:
    """(host, pid) from ``....<kind>-<host>-<pid>`` (host None for the ``<kind>-<pid>`` names
    of earlier versions; pid None when the name carries none)."""
    tail = name.rsplit(f".{kind}-", 1)[-1]
    host, _, pid = tail.rpartition("-")
    if not pid.isdigit():
        return None, None
    return (host or None), int(pid)


def owner_alive(name: str, kind: str) -> bool:
    """Whether the writer of temporary ``name`` may still be running. Ours (this pid) is not: a
    process never has two saves of one target open. Another host's cannot be checked from here,
    so it counts as alive. A name without a host is an earlier version's leftover: not alive
    (as those versions treated every sibling)."""
    host, pid = temp_owner(name, kind)
    if pid is None or host is None:
        return False
    if host is not None and host != this_host():
        return True
    return pid != os.getpid() and pid_alive(pid)


def cache_home() -> Path:
    """Per-machine measurements lowprec keeps (the CPU FP8 GEMM probe): ``$LOWPREC_CACHE_HOME``,
    else ``~/.cache/lowprec``."""
    home = os.environ.get("LOWPREC_CACHE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "lowprec"
