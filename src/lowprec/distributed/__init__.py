"""lowprec.distributed: FP8 gradient communication (torch only)."""

from lowprec.distributed.fp8_allreduce import (
    FP8AllReduceState,
    fp8_all_reduce_,
    fp8_allreduce_hook,
    register_fp8_allreduce,
    ring_allreduce_bytes,
)

__all__ = [
    "FP8AllReduceState",
    "fp8_all_reduce_",
    "fp8_allreduce_hook",
    "register_fp8_allreduce",
    "ring_allreduce_bytes",
]
