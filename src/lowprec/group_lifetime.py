"""Destroyed process groups are kept until the process exits.

torch's gloo group destructor joins its worker threads while the thread that drops the last
reference holds the GIL. A worker that is still releasing a finished collective needs the GIL
for its tensors' Python objects, so it never finishes, and the process hangs (docs/LOG.md,
"end_training deadlock" (2026-11-28): gdb showed the main thread in ``~Reducer ->
~ProcessGroupGloo -> std::thread::join`` and the worker in ``~AsyncBarrierWork ->
gil_scoped_acquire``).

The usual trigger is a script that destroys the group, then returns from ``main``; DDP's reducer,
freed with the model, holds the last reference. It was seen in 2 of 8 loaded two-process runs,
and in a test's spawned rank.

So every destroy here keeps a reference to each group it destroys, until the process ends. Under
``lowprec launch`` that is never: its ranks leave with ``os._exit``. Elsewhere (a script under
plain ``torchrun``) an ``atexit`` handler lets them go: it first sleeps 50 ms, the GIL released,
so a worker still dropping a finished collective's tensors finishes, then drops them while the
interpreter is whole. Left to interpreter finalization instead, their gloo threads took the GIL
after finalization began and the finished process aborted ("terminate called without an active
exception": Accelerate's ``test_ops.py`` script, which ends with ``destroy_process_group``, in 4
of 6 runs under torchrun, docs/LOG.md 2026-11-29). Until then each costs its idle threads and
sockets.

* :func:`destroy_group` is lowprec's own destroy: ``end_training`` and the states'.
* :func:`retain_destroyed_groups` makes ``torch.distributed.destroy_process_group`` itself keep
  them. ``lowprec launch`` calls it in every rank before the user's script runs, so Accelerate's,
  DeepSpeed's and the script's own destroys are covered too.
"""

from __future__ import annotations

import atexit
import functools
import gc
import sys
import time
from typing import Any, Callable, Optional

import torch.distributed as dist

__all__ = ["destroy_group", "forget_deepspeed_groups", "retain_destroyed_groups"]

_retired: list[Any] = []
_torch_destroy: Optional[Callable[..., Any]] = None  # torch's own, once patched
_at_exit = {"registered": False, "release": True}  # release: False where ranks leave with os._exit


def _release_at_exit() -> None:
    if not (_retired and _at_exit["release"]):
        return
    time.sleep(0.05)  # the GIL released: a gloo worker still freeing a finished collective ends
    _retired.clear()
    gc.collect()


def _retain(group: Any) -> None:
    if not dist.is_initialized():
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {})) if group is None else [group]
    _retired.extend(g for g in groups if g is not None)
    if not _at_exit["registered"]:
        _at_exit["registered"] = True
        atexit.register(_release_at_exit)


def forget_deepspeed_groups() -> None:
    """DeepSpeed caches groups it derives from the default one (``deepspeed.utils.groups``: a
    clone of the world group, data / model / expert parallel groups); once the default group is
    destroyed they are unregistered, and the next engine in this process failed ("Group ... is
    not registered"). Dropped with the default group, so a new Accelerator after
    ``end_training`` can run DeepSpeed again."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name, value in list(vars(groups).items()):
        if name.endswith("_GROUP") or name.endswith("_GROUP_RANKS") or name == "mesh_device":
            if isinstance(value, dict):
                value.clear()
            else:
                setattr(groups, name, None)


def destroy_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group(group)`` (every group for ``None``), keeping a
    reference to each destroyed group for the rest of the process (module docstring)."""
    if not dist.is_initialized():
        return
    _retain(group)
    (_torch_destroy or dist.destroy_process_group)(group)
    if group is None:
        forget_deepspeed_groups()


def retain_destroyed_groups() -> None:
    """Make ``torch.distributed.destroy_process_group`` keep what it destroys (idempotent), for a
    rank that leaves with ``os._exit`` (``lowprec launch``): kept to the end, never released."""
    global _torch_destroy
    _at_exit["release"] = False
    if _torch_destroy is not None:
        return
    original = dist.destroy_process_group
    _torch_destroy = original

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        _retain(group)
        original(group)
        if group is None:
            forget_deepspeed_groups()

    dist.destroy_process_group = destroy_process_group  # type: ignore[assignment]
    dist.distributed_c10d.destroy_process_group = destroy_process_group  # type: ignore[assignment]
