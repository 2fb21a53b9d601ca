"""lowprec.distributed: FP8 gradient communication and amax agreement (torch only)."""

from lowprec.distributed import amax_sync, fp8_allreduce
from lowprec.distributed.amax_sync import *  # noqa: F403 - the package re-exports its modules' APIs
from lowprec.distributed.fp8_allreduce import *  # noqa: F403

__all__ = list(fp8_allreduce.__all__) + list(amax_sync.__all__)
