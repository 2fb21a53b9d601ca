"""lowprec.distributed: FP8 gradient communication (torch only)."""

from lowprec.distributed import fp8_allreduce
from lowprec.distributed.fp8_allreduce import *  # noqa: F403 - the package re-exports that module's API

__all__ = list(fp8_allreduce.__all__)
