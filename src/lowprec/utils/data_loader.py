"""Accelerate's ``accelerate.data_loader``: the prepared dataloaders and their helpers, importable
from one module as in Accelerate.

The classes live in their own modules: :class:`DataLoaderShard` (every process reads its share;
:mod:`lowprec.utils.loader_shard`), :class:`DataLoaderDispatcher` (process 0 reads and sends;
:mod:`lowprec.utils.dispatcher`), :class:`BatchSamplerShard` (which batches a process gets;
:mod:`lowprec.utils.batch_shard`).
"""

from __future__ import annotations

from lowprec.utils.batch_shard import BatchSamplerShard
from lowprec.utils.dispatcher import DataLoaderDispatcher
from lowprec.utils.loader_shard import (
    DataLoaderShard,
    DataLoaderStateMixin,
    GradientState,
    SkipDataLoader,
    skip_first_batches,
)

__all__ = [
    "GradientState",
    "BatchSamplerShard",
    "DataLoaderStateMixin",
    "DataLoaderShard",
    "DataLoaderDispatcher",
    "SkipDataLoader",
    "skip_first_batches",
]
