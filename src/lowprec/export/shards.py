"""Writing a model's tensors a file at a time: each tensor is made (dequantized, merged,
re-quantized, cast) only when the file holding it is written, and dropped after, so the writer
holds one file's tensors, not the model's. The files are safetensors' own (``save_file``, metadata
``{"format": "pt"}``): one ``model.safetensors``, or with ``max_shard_bytes`` the shards
``model-0000i-of-0000n.safetensors`` and transformers' ``model.safetensors.index.json``. Every
file is written to ``<name>.tmp`` and renamed into place, so a failed write leaves no partial
file under a loader's name.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["Entry", "write_tensors", "atomic_write", "write_json", "remove_stale_layout"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass
class Entry:
    """One tensor of the file: its key, its size in bytes (known before it is made) and what makes it."""

    key: str
    nbytes: int
    make: Callable[[], torch.Tensor]


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path`` (the same directory, so the rename is atomic)."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str, data: Any, **kwargs: Any) -> None:
    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, **kwargs)

    atomic_write(path, dump)


def _groups(entries: list[Entry], max_shard_bytes: int | None) -> list[list[Entry]]:
    """The entries cut into files of at most ``max_shard_bytes`` (a larger tensor alone), in order."""
    if max_shard_bytes is None:
        return [entries]
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    return groups


def write_tensors(entries: Iterable[Entry], out: str, max_shard_bytes: int | None = None) -> list[str]:
    """Write ``entries`` to ``out`` (see the module docstring); returns the files written. A
    ``max_shard_bytes`` the tensors fit in writes one ``model.safetensors`` as without it."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: give a positive size in bytes, or None for one file")
    entries = list(entries)
    keys = [e.key for e in entries]
    if len(set(keys)) != len(keys):
        raise ValueError(f"write_tensors: a key is given twice ({sorted(k for k in keys if keys.count(k) > 1)[0]})")
    groups = _groups(entries, max_shard_bytes)
    n = len(groups)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for name, group in zip(names, groups):
        tensors = {e.key: e.make().contiguous() for e in group}
        atomic_write(os.path.join(out, name), functools.partial(save_file, tensors, metadata={"format": "pt"}))
        del tensors  # this file's tensors go before the next file's are made
    if n > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.key: name for name, group in zip(names, groups) for e in group},
        }
        write_json(os.path.join(out, INDEX), index, indent=2, sort_keys=True)
    remove_stale_layout(out, names)
    return [os.path.join(out, name) for name in names]


def remove_stale_layout(out: str, names: list[str]) -> None:
    """Remove the weight files of ``out`` that a write of ``names`` did not make (a previous
    write's other layout: the index and shards of a sharded model beside one ``model.safetensors``,
    or the reverse), as transformers' ``save_pretrained`` does: a loader would read them."""
    for stale in ([INDEX] if names == [SINGLE] else [SINGLE]) + [
        f for f in os.listdir(out) if f.startswith("model-") and f.endswith(".safetensors") and f not in names
    ]:
        if os.path.isfile(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
