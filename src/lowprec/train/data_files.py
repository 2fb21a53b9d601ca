"""Rows of local data files, whatever they are stored in: ``.jsonl``, ``.json``, ``.parquet``,
``.csv`` and a directory written by ``datasets``' ``save_to_disk``.

Every reader yields ``(key, row)``: ``row`` a dict of column -> value, ``key`` a stable name
(``file.jsonl:12``) that drives the train/validation split (``data.split_documents``). Reading
needs nothing beyond the standard library except for parquet (``pyarrow``) and ``datasets``
directories (``datasets``); a missing package is a one-line error naming it and the extra that
installs it, never a fallback.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Iterator, Optional

__all__ = ["read_rows", "ROW_EXTENSIONS", "BUILTIN_CORPORA", "is_saved_dataset"]

BUILTIN_CORPORA = ("builtin:stdlib",)  # the built-in text (read by lowprec.train.data)
ROW_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")
_INSTALL = "install it with `pip install 'lowprec[data]'` (or `pip install {pkg}`)"


def is_saved_dataset(path: str) -> bool:
    """A directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def read_rows(path: str, split: Optional[str] = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(key, row)`` for each row of one file or ``datasets`` directory. ``split`` picks a split
    of a ``DatasetDict`` directory (default ``train``); a plain file is a single ``train`` split."""
    path = os.fspath(path)
    if is_saved_dataset(path):
        yield from _read_saved_dataset(path, split)
        return
    if split not in (None, "train"):
        raise ValueError(
            f"data file {path!r} has a single split; split: {split} applies to a directory saved by "
            "`datasets` (save_to_disk); drop split or point path at such a directory"
        )
    if not os.path.exists(path):
        raise ValueError(f"data file {path!r} does not exist (working directory {os.getcwd()!r}); fix the path")
    name = os.path.basename(path)
    if path.endswith(".jsonl"):
        yield from _read_jsonl(path)
    elif path.endswith(".json"):
        yield from ((f"{name}:{i}", row) for i, row in enumerate(_read_json(path), start=1))
    elif path.endswith(".csv"):
        with open(path, encoding="utf-8", newline="") as fh:
            # csv.DictReader line numbers: the header is line 1
            yield from ((f"{name}:{i}", dict(row)) for i, row in enumerate(csv.DictReader(fh), start=2))
    elif path.endswith(".parquet"):
        yield from ((f"{name}:{i}", row) for i, row in enumerate(_read_parquet(path), start=1))
    else:
        raise ValueError(
            f"data file {path!r} has an unsupported extension; use .txt, .jsonl, .json, .parquet, .csv "
            "or a directory saved by `datasets`"
        )


def _read_jsonl(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    name = os.path.basename(path)
    with open(path, encoding="utf-8", errors="strict") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.colno}); each line of a "
                    ".jsonl file must be one JSON object"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
            yield f"{name}:{lineno}", row


def _read_json(path: str) -> list[dict[str, Any]]:
    """A JSON array of objects, or an object holding one (``{"data": [...]}``), as ``datasets``
    reads them; a .json file that is really JSON Lines is read as such."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return [row for _, row in _read_jsonl(path)]
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: expected a JSON array of objects (or an object holding one array)")
        data = lists[0]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected a JSON array of objects, one per example")
    return data


def _read_parquet(path: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"data file {path!r} is parquet, which needs 'pyarrow'; " + _INSTALL.format(pkg="pyarrow")
        ) from None
    return pq.read_table(path).to_pylist()


def _read_saved_dataset(path: str, split: Optional[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{path!r} is a directory saved by `datasets`, which needs the 'datasets' package; "
            + _INSTALL.format(pkg="datasets")
        ) from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        want = split or "train"
        if want not in ds:
            raise ValueError(f"{path!r} has splits {sorted(ds)}, not {want!r}; set split: to one of them")
        ds = ds[want]
    elif split not in (None, "train"):
        raise ValueError(f"{path!r} is a single dataset (no splits); drop split: {split}")
    name = os.path.basename(os.path.normpath(path))
    for i, row in enumerate(ds, start=1):
        yield f"{name}:{i}", dict(row)
