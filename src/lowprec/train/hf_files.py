"""Where a Hugging Face model or dataset is on disk, without torch or transformers: a local
directory or the cached snapshot of a hub id (never downloaded), and which files it lacks. The
trainer's schema checks ``base_model`` and ``tokenizer_config`` with it; :mod:`lowprec.train.hf_model`
loads the model; ``datasets[].path`` may name a dataset repository in the cache
(:func:`locate_dataset`, :func:`dataset_split_files`)."""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Optional, cast

__all__ = [
    "locate_pretrained",
    "locate_dataset",
    "dataset_split_files",
    "hf_cache_dir",
    "missing_model_files",
    "has_tokenizer",
]

# org/name or name, as the hub spells repository ids
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def hf_cache_dir() -> str:
    """The hub cache the way huggingface_hub finds it, read now (not at import time)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


_NO_TOKENIZER = "tokenizer files (tokenizer.json or tokenizer_config.json)"


def has_tokenizer(path: Optional[str]) -> bool:
    return bool(path and os.path.isdir(path) and set(os.listdir(path)) & set(_TOKENIZER))


def missing_model_files(path: Optional[str], tokenizer: bool = False) -> list[str]:
    """What a model directory lacks: ``config.json``, weights (every shard an index names) and,
    with ``tokenizer``, tokenizer files. An absent directory lacks everything."""
    have = set(os.listdir(path)) if path and os.path.isdir(path) else set()
    missing = [] if "config.json" in have else ["config.json"]
    index = next((w for w in _WEIGHTS if w.endswith(".index.json") and w in have), None)
    if index is not None:
        with open(os.path.join(cast(str, path), index)) as f:  # an index was listed: path is a directory
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing += [s for s in shards if s not in have]
    elif not have & set(_WEIGHTS):
        missing.append("model weights (model.safetensors)")
    if tokenizer and not has_tokenizer(path):
        missing.append(_NO_TOKENIZER)
    return missing


def locate_pretrained(spec: str, key: str = "base_model", tokenizer: bool = False) -> str:
    """The local directory of ``spec``: the directory itself, or the cached snapshot of a hub id.

    Raises ``ValueError`` (one line, naming ``key``) when it is neither, or when the cached
    snapshot lacks files; ``tokenizer=True`` checks for tokenizer files instead of weights.
    ``key=""`` leaves the key out (a field validator's message, which the schema prefixes)."""
    head = f"{key}: " if key else ""
    if os.path.isdir(spec):
        return os.path.abspath(spec)
    if os.path.exists(spec):
        raise ValueError(f"{head}{spec!r} is a file; give a Hugging Face model directory (written by save_pretrained)")
    if spec.startswith((".", "/", "~")) or not _HUB_ID.match(spec):
        raise ValueError(
            f"{head}{spec!r} is neither builtin:<name>, an existing local directory nor a hub id "
            "(org/name) in the local Hugging Face cache; downloads are not supported"
        )
    cache = hf_cache_dir()
    path = _cached_snapshot(spec, cache)
    if tokenizer:
        missing = [] if has_tokenizer(path) else [_NO_TOKENIZER]
    else:
        missing = missing_model_files(path)
    if missing:
        where = "is not in" if path is None else "is incomplete in"
        raise ValueError(
            f"{head}{spec!r} {where} the local Hugging Face cache ({cache}): missing {', '.join(missing)}; "
            f"downloads are not supported: run `hf download {spec}` on a machine with network and copy "
            "the cache here (or set HF_HUB_CACHE), or give a local directory"
        )
    return cast(str, path)  # no snapshot (None) lacks every file: raised above


def _cached_snapshot(repo_id: str, cache: str, kind: str = "models") -> Optional[str]:
    """The snapshot directory ``refs/main`` points at (huggingface_hub's cache layout), or None;
    ``kind``: ``models`` or ``datasets`` (the repository type)."""
    repo = os.path.join(cache, f"{kind}--" + repo_id.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            commit = f.read().strip()
    except OSError:
        snaps = os.path.join(repo, "snapshots")
        found = sorted(os.listdir(snaps)) if os.path.isdir(snaps) else []
        commit = found[-1] if len(found) == 1 else ""  # one snapshot and no ref: unambiguous
    path = os.path.join(repo, "snapshots", commit) if commit else None
    return path if path and os.path.isdir(path) else None


# file formats a dataset repository holds its rows in (what lowprec.train.data_files reads)
_DATA_FILES = (".jsonl", ".json", ".parquet", ".csv")
# words in a data file's path that name its split (the hub's own convention: data/train-0000-of-0001.parquet)
_SPLIT_WORDS = {
    "train": "train",
    "test": "test",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
}


def locate_dataset(spec: str, key: str) -> Optional[str]:
    """The cached snapshot of a hub dataset id (``org/name``, as Axolotl's ``path: tatsu-lab/alpaca``),
    or None where ``spec`` is a local path (or a builtin corpus). A hub id that is not in the cache
    is a ``ValueError`` naming ``key``: nothing is downloaded."""
    if spec.startswith(("builtin:", ".", "/", "~")) or os.path.exists(spec) or "/" not in spec:
        return None
    if not _HUB_ID.match(spec):
        return None
    cache = hf_cache_dir()
    path = _cached_snapshot(spec, cache, "datasets")
    if path is None:
        raise ValueError(
            f"{key}: {spec!r} is neither a local file nor a dataset in the local Hugging Face cache ({cache}); "
            f"downloads are not supported: run `hf download {spec} --repo-type dataset` on a machine with network "
            "and copy the cache here (or set HF_HUB_CACHE), or give a local file"
        )
    return path


def _split_of(rel: str) -> str:
    """The split a data file's path names (``train`` where it names none)."""
    for word in re.split(r"[^a-z]+", rel.lower()):
        if word in _SPLIT_WORDS:
            return _SPLIT_WORDS[word]
    return "train"


def _card_configs(root: str) -> list[dict]:
    """The ``configs:`` of a dataset card's YAML header (``README.md``): which files each config's
    splits read, as the hub declares them; [] where the card declares none."""
    try:
        with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return []
    if not text.startswith("---"):
        return []
    import yaml  # the trainer's own dependency (configs are YAML); imported only for a hub dataset

    try:
        header = yaml.safe_load(text.split("---", 2)[1]) or {}
    except (yaml.YAMLError, IndexError):
        return []
    configs = header.get("configs") if isinstance(header, dict) else None
    return [c for c in configs if isinstance(c, dict)] if isinstance(configs, list) else []


def _declared_files(root: str, configs: list[dict], name: Optional[str], split: str, key: str) -> list[str]:
    """The files the card's ``configs:`` give config ``name`` (default: the one marked default, or
    the only one) for ``split``."""
    names = [str(c.get("config_name", "default")) for c in configs]
    if name is None:
        chosen = [c for c in configs if c.get("default")] or (configs if len(configs) == 1 else [])
        if not chosen:
            raise ValueError(f"{key}: the cached dataset has configs {', '.join(names)}; set name: to one of them")
        config = chosen[0]
    elif name in names:
        config = configs[names.index(name)]
    else:
        raise ValueError(f"{key}.name: {name!r} is not a config of the cached dataset; use one of {', '.join(names)}")
    entries = config.get("data_files") or []
    if isinstance(entries, (str, dict)):
        entries = [entries]
    patterns: list[str] = []
    for e in entries:
        if isinstance(e, str):  # a bare pattern: the train split
            patterns += [e] if split == "train" else []
        elif isinstance(e, dict) and e.get("split", "train") == split:
            path = e.get("path")
            patterns += [path] if isinstance(path, str) else [p for p in path or [] if isinstance(p, str)]
    return sorted({f for p in patterns for f in glob.glob(os.path.join(root, p), recursive=True) if os.path.isfile(f)})


def dataset_split_files(root: str, split: Optional[str], key: str, name: Optional[str] = None) -> list[str]:
    """The data files of ``split`` (default ``train``) of config ``name`` in a dataset snapshot, in
    path order: as the card's ``configs:`` declare them where it has any; else those whose path
    names the split (``data/train-00000-of-00001.parquet``, ``test.jsonl``), and for ``train`` also
    those naming none (``alpaca_data.json``), under the directory ``name`` where it is given."""
    want = _SPLIT_WORDS.get(split or "train", split or "train")
    configs = _card_configs(root)
    if configs:
        files = _declared_files(root, configs, name, want, key)
        found = files
    else:
        base = os.path.join(root, name) if name else root
        if name and not os.path.isdir(base):
            raise ValueError(f"{key}.name: the cached dataset at {root} has no config (directory) {name!r}")
        found = sorted(
            os.path.relpath(os.path.join(d, f), base)
            for d, _, fs in os.walk(base)
            for f in fs
            if f.endswith(_DATA_FILES) and not f.startswith(".")
        )
        files = [os.path.join(base, r) for r in found if _split_of(r) == want]
    if not files:
        have = sorted({_split_of(r) for r in found}) if not configs else []
        raise ValueError(
            f"{key}: the cached dataset at {root} has no {'/'.join(_DATA_FILES)} file of split {want!r}"
            + (f" (its files are of split {', '.join(have)}): set split: to one of them" if have else "")
        )
    return files
