"""``python -m lowprec.cli._worker [-m] script [args]``: one rank of a launch, recording that it finished.

Why this exists (docs/LOG.md, "abort" (2026-11-26)): a rank whose work is done can still die at interpreter exit
with ``terminate called without an active exception`` (SIGABRT, exit 134). gloo's worker threads
outlive ``destroy_process_group`` once FSDP2 / DTensor has used the group (a cache inside torch
keeps it), and a gloo thread that needs the GIL while the interpreter finalizes is ended by
CPython with ``pthread_exit``, which ``std::terminate``s a C++ thread. That is a race inside torch;
what lowprec can do is (1) not enter interpreter finalization with those threads alive, and (2) let
the launcher tell "aborted after its work finished" from "aborted while working".

So, torchrun runs each rank as this module around the user's script. When the script returns or
calls ``sys.exit(0)`` (:func:`finish`):

1. the script's non-daemon threads are joined and the ``atexit`` handlers run (user's and
   libraries', last registered first), exactly as the interpreter would at exit, while everything
   is still alive;
2. every open file object and stdio is flushed;
3. ``$LOWPREC_DONE_DIR/local_rank<N>`` is written (temp + rename; pid and restart count inside):
   the launcher's proof that this rank finished (cli/_torchrun.py);
4. the process leaves with ``os._exit(0)``: no interpreter finalization, so no abort.

What step 4 skips is finalization itself: ``__del__`` of objects still alive at exit and module
teardown, which Python does not promise to run at exit (language reference, ``object.__del__``);
``weakref.finalize`` and ``tempfile`` cleanups run (they are atexit handlers), and the one thing
CPython does at finalization that scripts rely on, flushing unclosed files, is step 2.
``LOWPREC_WORKER_EXIT=finalize`` keeps the ordinary exit instead: the marker is still written
(after every local rank has written its own, so one rank's abort cannot get the others stopped
mid-work) and an abort after it is reported as a warning.

A script that fails (an exception, a non-zero exit) writes no done marker (a ``failed_rank<N>``
one instead, read by its peers: :func:`_fail`). Its traceback (or exit
message) is printed as Python prints it, the atexit handlers run, files are flushed, and the rank
leaves with exit code 1 (or the script's code) without finalization too: the same gloo race at
finalization would otherwise turn the failure into a SIGABRT, and the launcher would report
"killed by SIGABRT" for what was a Python error (a CI run did: docs/LOG.md, 2026-11-28).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import sys
import time
from collections.abc import Mapping

__all__ = ["DONE_DIR_VAR", "EXIT_MODE_VAR", "marker_path", "exit_mode", "finish", "main"]

DONE_DIR_VAR = "LOWPREC_DONE_DIR"
EXIT_MODE_VAR = "LOWPREC_WORKER_EXIT"  # "fast" (default) or "finalize"
EXIT_MODES = ("fast", "finalize")


def exit_mode(environ: Mapping[str, str] | None = None) -> str:
    """``LOWPREC_WORKER_EXIT`` (any case; unset or empty: fast). The launchers check it before any
    worker starts: another value is a ``ValueError`` naming it, not a silent fast exit."""
    environ = os.environ if environ is None else environ
    value = environ.get(EXIT_MODE_VAR, "").strip().lower() or "fast"
    if value not in EXIT_MODES:
        raise ValueError(f"{EXIT_MODE_VAR}={environ[EXIT_MODE_VAR]!r}: use fast (the default) or finalize")
    return value


_WAIT_FOR_PEERS_S = 600.0
_PEER_LOST_GRACE_S = 2.0


def marker_path(done_dir: str, local_rank: int) -> str:
    return os.path.join(done_dir, f"local_rank{local_rank}")


def _flush_open_files() -> None:
    """Flush what the interpreter's finalization would: unclosed buffered files, then stdio."""
    import gc
    import io

    for obj in gc.get_objects():
        # the type, not isinstance: that asks a deprecated object (torch.distributed.reduce_op) for
        # its __class__, which printed a FutureWarning at the end of every launched run
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()  # a text wrapper flushes its buffer below it too
            except Exception:  # noqa: BLE001 - a broken file must not stop the exit
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stdio
            pass


def _local_peer_failed(done_dir: str, local_rank: int) -> bool:
    """Whether another local rank has already failed (its ``failed_rank<N>`` marker)."""
    try:
        names = os.listdir(done_dir)
    except OSError:
        return False
    return any(n.startswith("failed_rank") and n != f"failed_rank{local_rank}" for n in names)


def _write_marker(done_dir: str, local_rank: int) -> None:
    path = marker_path(done_dir, local_rank)
    record = {"pid": os.getpid(), "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # whole or absent


def _wait_for_peers(done_dir: str) -> None:
    """Every local rank's marker, before this one finalizes: torchrun stops every worker as soon as
    one fails, so an abort here must not come while a peer still works."""
    n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    deadline = time.monotonic() + _WAIT_FOR_PEERS_S
    while time.monotonic() < deadline:
        if all(os.path.exists(marker_path(done_dir, r)) for r in range(n)):
            return
        time.sleep(0.05)


def finish() -> None:
    """End a rank whose work succeeded (steps 1-4 of the module docstring). Returns only in
    ``finalize`` mode, after the marker is written, for the ordinary interpreter exit."""
    import atexit
    import threading

    # what the interpreter calls first at exit: join non-daemon threads (a private CPython
    # function, absent from typeshed's stubs: hence the ignore)
    threading._shutdown()  # type: ignore[attr-defined]  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001 - runs and clears them, printing (not raising) their errors
    _flush_open_files()
    done_dir = os.environ.get(DONE_DIR_VAR)
    if done_dir and os.path.isdir(done_dir):
        _write_marker(done_dir, int(os.environ.get("LOCAL_RANK", "0")))
    if os.environ.get(EXIT_MODE_VAR, "").strip().lower() == "finalize":  # checked by the launcher
        if done_dir and os.path.isdir(done_dir):
            _wait_for_peers(done_dir)
        return
    os._exit(0)


def _run(argv: list[str]) -> None:
    import runpy

    if argv and argv[0] in ("-m", "--module"):
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]  # run_module puts the module's file in argv[0]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = argv[0], argv[1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py`: its folder first
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-m", "--module") and len(argv) < 2:
        raise SystemExit("usage: python -m lowprec.cli._worker [-m] script [args...]")
    faulthandler.enable(all_threads=True)  # a crash (SIGABRT, SIGSEGV) prints every thread's Python stack
    if importlib.util.find_spec("torch") is not None:
        # torch.distributed.destroy_process_group keeps what it destroys: a gloo group freed right
        # after it can deadlock the rank (lowprec.group_lifetime)
        from lowprec.group_lifetime import retain_destroyed_groups  # torch: a launched script may run without it

        retain_destroyed_groups()
    try:
        _run(argv)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _fail(exc)
    except BaseException as exc:  # noqa: BLE001 - every failure leaves the same way
        _fail(exc)
    finish()


# what torch's collectives raise on a rank whose peer process is gone (gloo, NCCL, the TCP store)
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited",
    "caused by a remote worker crashing",
)


def _peer_lost(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_LOST)


def _fail(exc: BaseException) -> None:
    """Leave a failed rank as the interpreter would (traceback or exit message, atexit handlers,
    flushed files, its exit code) but without finalization (module docstring).

    A rank that fails first leaves a ``failed_rank<N>`` marker before anything else. A rank whose
    collective then fails because that peer is gone prints no traceback of the wait (in a
    barrier, say): nothing where a local peer's marker says the error is already printed (a user
    error is then one line, as on one process), else one line naming what was lost."""
    import atexit

    done_dir = os.environ.get(DONE_DIR_VAR)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    lost = _peer_lost(exc)
    peers_failed = bool(done_dir) and lost and _local_peer_failed(str(done_dir), local_rank)
    if done_dir and os.path.isdir(done_dir):
        open(os.path.join(done_dir, f"failed_rank{local_rank}"), "w").close()
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    elif lost:
        code = 1
        if not peers_failed:
            print(
                f"lowprec: rank {os.environ.get('RANK', local_rank)} lost another process of this run, which failed "
                f"or was stopped ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})",
                file=sys.stderr,
            )
        # torchrun names the failure it sees first, ties (the same second) going to the lowest
        # rank: give the rank that failed the time to be seen, so its exit code is the run's
        time.sleep(_PEER_LOST_GRACE_S)
    else:
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        sys.excepthook(type(exc), exc, exc.__traceback__)
    _flush_open_files()
    atexit._run_exitfuncs()  # noqa: SLF001
    _flush_open_files()
    os._exit(code)


if __name__ == "__main__":
    main()
