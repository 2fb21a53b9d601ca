"""Accelerate's dataloader API on lowprec against Accelerate's own."""

from __future__ import annotations

import traceback

import pytest

import lowprec.utils.dataclasses as lp_dataclasses
from lowprec.utils import DataLoaderConfiguration
from lowprec.utils.data_loader import DataLoaderDispatcher, DataLoaderShard


def test_use_stateful_dataloader_without_torchdata_is_one_error_naming_the_fix(monkeypatch):
    """torchdata missing: one ImportError naming the call and ``pip install torchdata``, raised by
    lowprec's check right under the call, not by torchdata's import deep inside."""
    monkeypatch.setattr(lp_dataclasses, "is_torchdata_stateful_dataloader_available", lambda: False)
    calls = {
        "use_stateful_dataloader=True": [
            lambda: DataLoaderShard(range(4), use_stateful_dataloader=True),
            lambda: DataLoaderDispatcher(range(4), use_stateful_dataloader=True),
        ],
        r"DataLoaderConfiguration\(use_stateful_dataloader=True\)": [
            lambda: DataLoaderConfiguration(use_stateful_dataloader=True)
        ],
    }
    for named, makers in calls.items():
        for build in makers:
            with pytest.raises(ImportError, match=named + r" needs torchdata.*pip install torchdata") as info:
                build()
            frames = traceback.extract_tb(info.tb)
            assert frames[-1].name == "require_torchdata" and len(frames) <= 5, frames
    monkeypatch.setattr(lp_dataclasses, "is_torchdata_stateful_dataloader_available", lambda: True)
    assert [b.tolist() for b in DataLoaderShard(range(4), batch_size=2, use_stateful_dataloader=True)] == [
        [0, 1],
        [2, 3],
    ]
