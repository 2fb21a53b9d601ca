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

So every destroy here keeps a reference to each group it destroys. Those groups go at interpreter
exit, when their threads are long idle, or never under ``lowprec launch``, whose ranks leave with
``os._exit``. Until then each costs its idle threads and sockets.

* :func:`destroy_group` is lowprec's own destroy: ``end_training`` and the states'.
* :func:`retain_destroyed_groups` makes ``torch.distributed.destroy_process_group`` itself keep
  them. ``lowprec launch`` calls it in every rank before the user's script runs, so Accelerate's,
  DeepSpeed's and the script's own destroys are covered too.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch.distributed as dist

__all__ = ["destroy_group", "retain_destroyed_groups"]

_retired: list[Any] = []
_torch_destroy: Optional[Callable[..., Any]] = None  # torch's own, once patched


def _retain(group: Any) -> None:
    if not dist.is_initialized():
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {})) if group is None else [group]
    _retired.extend(g for g in groups if g is not None)


def destroy_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group(group)`` (every group for ``None``), keeping a
    reference to each destroyed group for the rest of the process (module docstring)."""
    if not dist.is_initialized():
        return
    _retain(group)
    (_torch_destroy or dist.destroy_process_group)(group)


def retain_destroyed_groups() -> None:
    """Make ``torch.distributed.destroy_process_group`` keep what it destroys (idempotent)."""
    global _torch_destroy
    if _torch_destroy is not None:
        return
    original = dist.destroy_process_group
    _torch_destroy = original

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        _retain(group)
        original(group)

    dist.destroy_process_group = destroy_process_group  # type: ignore[assignment]
    dist.distributed_c10d.destroy_process_group = destroy_process_group  # type: ignore[assignment]
