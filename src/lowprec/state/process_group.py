"""Creating the default process group, including again after ``end_training`` destroyed it.

``end_training`` destroys the process group (as Accelerate does) and a later ``Accelerator``
creates a new one. Under torchrun (``lowprec launch``) the workers rendezvous through the
launcher's key-value store, which outlives the group, and torch names every new default group
alike (``destroy_process_group`` resets its group counter): the second group's gloo rendezvous
then finds the first group's keys still there, and a process that arrives first reads the
other's *old* address. Measured (2 CPU processes, 12 end/create cycles): "Gloo connectFullMesh
failed ... Connection refused" or a hang until the 30-minute timeout. Every group after the
first therefore rendezvouses under its own key prefix (the same on every process, since every
process creates its groups in the same order).

:func:`destroy_group` (``lowprec.group_lifetime``) is every lowprec ``destroy_process_group``:
it keeps each destroyed group until the process exits (a torch deadlock otherwise).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch.distributed as dist

from lowprec.group_lifetime import destroy_group

__all__ = ["destroy_group", "init_default_group"]

_created = 0  # default groups this process has created


def init_default_group(
    backend: str, rank: int, world_size: int, timeout: Any = None, init_method: Optional[str] = None, store: Any = None
) -> None:
    """``dist.init_process_group`` with the environment's rendezvous (or ``init_method`` /
    ``store`` as given); from the second group on, under a fresh key prefix."""
    global _created
    extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if store is None and init_method is None and _created and os.environ.get("MASTER_ADDR"):
        base, rank, world_size = next(dist.rendezvous("env://", rank, world_size, **extra))
        store = dist.PrefixStore(f"lowprec-group-{_created}/", base)
    if store is not None:
        extra["store"] = store
    elif init_method is not None:
        extra["init_method"] = init_method
    dist.init_process_group(backend, rank=rank, world_size=world_size, **extra)
    _created += 1
