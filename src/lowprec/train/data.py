"""Corpora, splits and a deterministic, resumable batch loader.

The bundled corpus (``builtin:stdlib``) is the Python standard library's own ``.py`` files on the
running machine: always present, no download, a few MB of real text with long-range structure.
It depends on the Python version, so golden loss curves record ``corpus_fingerprint()``.

Pipeline::

    documents (key, text)  --split by hash of key-->  train / validation documents
    --tokenizer.encode_documents-->  1-D token stream per split (documents joined by EOS)
    --TokenBatches-->  blocks of seq_len tokens, shuffled per epoch, sharded by rank,
                       {"input_ids": (B, T), "labels": (B, T)} with labels == input_ids

Labels equal the inputs because the model shifts them (Hugging Face semantics), so a block of
``seq_len`` tokens gives ``seq_len - 1`` predictions; ``seq_len`` itself (not seq_len + 1) stays
the GEMM dimension, which FP8 needs to be a multiple of 16.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import sysconfig
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence, cast

import torch

from lowprec.train.data_files import BUILTIN_CORPORA
from lowprec.train.prompts import row_type_hint
from lowprec.train.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "TokenDataset",
    "TokenBatches",
    "ShardedEpochs",
    "position_on",
    "build_datasets",
    "corpus_fingerprint",
    "stdlib_documents",
    "read_documents",
    "split_documents",
    "BUILTIN_CORPORA",
    "DEFAULT_MAX_BYTES",
]

DEFAULT_MAX_BYTES = 8_000_000
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}


# ---------------------------------------------------------------------- documents
@functools.lru_cache(maxsize=4)
def stdlib_documents(
    max_bytes: int | None = DEFAULT_MAX_BYTES, include_tests: bool = False
) -> tuple[tuple[str, bytes], ...]:
    """(relative posix path, bytes) of the stdlib's .py files in sorted path order, the last
    one cut so the total is at most ``max_bytes``. Cached: later calls cost nothing."""
    root = sysconfig.get_paths()["stdlib"]
    skip = _SKIP_DIRS | (set() if include_tests else _TEST_DIRS)
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for f in filenames:
            if f.endswith(".py"):
                full = os.path.join(dirpath, f)
                found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    if not found:
        raise ValueError(
            f"no .py files under the standard library directory {root!r} (a stripped Python?); "
            "use local .txt/.jsonl data files instead of builtin:stdlib"
        )
    found.sort()
    docs: list[tuple[str, bytes]] = []
    total = 0
    for rel, full in found:
        with open(full, "rb") as fh:
            data = fh.read()
        if max_bytes is not None and total + len(data) >= max_bytes:
            docs.append((rel, data[: max_bytes - total]))
            break
        docs.append((rel, data))
        total += len(data)
    return tuple(docs)


def corpus_fingerprint(max_bytes: int | None = DEFAULT_MAX_BYTES) -> str:
    """``python3.11.7-sha256:<16 hex>`` of the stdlib corpus as loaded (paths and bytes).
    Two machines with the same fingerprint train on the same tokens."""
    return f"python{platform.python_version()}-{_fingerprint(stdlib_documents(max_bytes))}"


def _fingerprint(docs: Sequence[tuple[str, str | bytes]]) -> str:
    h = hashlib.sha256()
    for key, text in docs:
        h.update(key.encode("utf-8") + b"\0")
        h.update((text.encode("utf-8") if isinstance(text, str) else text) + b"\0")
    return "sha256:" + h.hexdigest()[:16]


def read_documents(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    text_field: str = "text",
    max_bytes: int | None = None,
    names: Mapping[str, str] | None = None,
) -> list[tuple[str, str]]:
    """(key, text) documents from local files: a ``.txt`` file is one document, each line of a
    ``.jsonl`` file is one (its ``text_field``). Directories contribute their .txt/.jsonl files
    in sorted order. Keys (file name, plus line number for jsonl) drive the split. ``names``
    renames ``text_field`` in error messages (the trainer's ``datasets[].field``)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[str] = []
    for p in (os.fspath(x) for x in paths):
        if os.path.isdir(p):
            inner = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs if f.endswith((".txt", ".jsonl")))
            if not inner:
                raise ValueError(f"data directory {p!r} holds no .txt or .jsonl files")
            files.extend(inner)
        elif not os.path.exists(p):
            raise ValueError(f"data file {p!r} does not exist (working directory {os.getcwd()!r}); fix the path")
        elif p.endswith((".txt", ".jsonl")):
            files.append(p)
        else:
            raise ValueError(f"data file {p!r} has an unsupported extension; use .txt (plain text) or .jsonl")
    docs: list[tuple[str, str]] = []
    total = 0
    for f in files:
        for key, text in (
            _read_jsonl(f, text_field, _named(names)("text_field")) if f.endswith(".jsonl") else [_read_txt(f)]
        ):
            if not text:
                continue
            size = len(text.encode("utf-8"))
            if max_bytes is not None and total + size >= max_bytes:
                docs.append((key, text.encode("utf-8")[: max_bytes - total].decode("utf-8", errors="ignore")))
                return docs
            docs.append((key, text))
            total += size
    return docs


def _read_txt(path: str) -> tuple[str, str]:
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return os.path.basename(path), data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data file {path!r} is not UTF-8 text (bad byte at offset {e.start}); re-encode it as UTF-8"
        ) from e


def _read_jsonl(path: str, text_field: str, field_key: str = "text_field") -> Iterator[tuple[str, str]]:
    name = os.path.basename(path)
    with open(path, encoding="utf-8", errors="strict") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line of a .jsonl "
                    f'file must be one JSON object such as {{"{text_field}": "..."}}'
                ) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{where}: expected a JSON object with a {text_field!r} field, got {type(row).__name__}"
                )
            if text_field not in row:
                raise ValueError(
                    f"{where}: no {text_field!r} field (keys: {sorted(row)}); set {field_key} to the field "
                    f"that holds the text{row_type_hint(row)}"
                )
            text = row[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
            yield f"{name}:{lineno}", text


def split_documents(keys: Sequence[str], val_fraction: float, seed: int = 0) -> list[bool]:
    """True for validation documents: sha256(seed, key) below val_fraction. Depends only on the
    key, so adding a file never moves another between splits. Keep ``seed`` fixed to compare
    runs on the same validation set."""
    threshold = int(val_fraction * 2**32)
    return [int.from_bytes(hashlib.sha256(f"{seed}:{k}".encode()).digest()[:4], "big") < threshold for k in keys]


# ---------------------------------------------------------------------- datasets
@dataclass(frozen=True)
class TokenDataset:
    """A 1-D int32 stream of token ids (documents joined by EOS) plus where it came from.
    Treat ``tokens`` as read-only: builtin datasets share it through a cache."""

    tokens: torch.Tensor
    name: str
    fingerprint: str
    n_documents: int

    @property
    def n_tokens(self) -> int:
        return self.tokens.numel()


_CACHE: dict[tuple, tuple[TokenDataset, TokenDataset | None]] = {}


def build_datasets(
    spec: str | Sequence[str] = "builtin:stdlib",
    tokenizer: Tokenizer | None = None,
    seq_len: int = 128,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    val_fraction: float = 0.03,
    seed: int = 0,
    text_field: str = "text",
    names: Mapping[str, str] | None = None,
) -> tuple[TokenDataset, TokenDataset | None]:
    """(train, validation) token streams; validation is None when ``val_fraction`` is 0.

    ``spec`` is ``"builtin:stdlib"`` or local ``.txt``/``.jsonl`` paths. Documents go to
    validation by a hash of their key (about ``val_fraction`` of them). When that leaves either
    side shorter than one sequence (a single .txt file, a tiny corpus) the last
    ``val_fraction`` of the tokens becomes the validation set instead.

    ``names`` renames the parameters in error messages (a caller with its own config keys,
    e.g. the trainer's ``sequence_len``), see :func:`_named`."""
    n = _named(names)
    # ByteTokenizer is a Tokenizer but for its bos_id, int where the protocol's settable attribute is int | None
    tokenizer = tokenizer or cast(Tokenizer, ByteTokenizer())
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"{n('val_fraction')} must be in [0, 1), got {val_fraction!r}")
    if seq_len < 1:
        raise ValueError(f"{n('seq_len')} must be a positive integer, got {seq_len!r}")
    builtin = isinstance(spec, str) and spec.startswith("builtin:")
    if builtin:
        if spec not in BUILTIN_CORPORA:
            raise ValueError(f"unknown builtin corpus {spec!r}; choose one of {BUILTIN_CORPORA} or list local files")
        key = (spec, tokenizer.name, max_bytes, val_fraction, seed)
        if key in _CACHE:
            return _CACHE[key]
        docs: Sequence[tuple[str, str | bytes]] = stdlib_documents(max_bytes)
        prefix = f"python{platform.python_version()}-"
    else:
        docs = read_documents(spec, text_field=text_field, max_bytes=max_bytes, names=names)
        if not docs:
            raise ValueError(f"data files {spec!r} contain no text")
        prefix = ""
    name = spec if isinstance(spec, str) else ",".join(map(os.fspath, spec))
    fingerprint = prefix + _fingerprint(docs)

    is_val = split_documents([k for k, _ in docs], val_fraction, seed) if val_fraction else [False] * len(docs)
    train_tokens = tokenizer.encode_documents([t for (_, t), v in zip(docs, is_val) if not v])
    val_tokens = tokenizer.encode_documents([t for (_, t), v in zip(docs, is_val) if v])
    n_val_docs = sum(is_val)
    if val_fraction and (train_tokens.numel() < seq_len or val_tokens.numel() < seq_len):
        stream = tokenizer.encode_documents([t for _, t in docs])
        n_val = max(math.ceil(val_fraction * stream.numel()), seq_len)
        if stream.numel() - n_val < seq_len:
            raise ValueError(
                f"{name} has {stream.numel()} tokens, too few for a train and a validation sequence "
                f"of {n('seq_len', seq_len)}; add data, lower {n('seq_len')} or set {n('val_fraction', 0)}"
            )
        train_tokens, val_tokens = stream[:-n_val], stream[-n_val:]
        n_val_docs = 0
    if train_tokens.numel() < seq_len:
        raise ValueError(
            f"{name} has {train_tokens.numel()} training tokens, fewer than {n('seq_len', seq_len)}; "
            f"add data, raise {n('max_bytes')} or lower {n('seq_len')}"
        )
    train = TokenDataset(train_tokens, f"{name} (train)", fingerprint, len(docs) - n_val_docs)
    val = TokenDataset(val_tokens, f"{name} (validation)", fingerprint, n_val_docs) if val_fraction else None
    if builtin:
        _CACHE[key] = (train, val)
    return train, val


def _named(names: Mapping[str, str] | None) -> Callable[..., str]:
    """``n(key)`` / ``n(key, value)`` for messages: ``seq_len`` / ``seq_len=128`` by default; with
    ``names={"seq_len": "sequence_len"}`` it is ``sequence_len`` / ``sequence_len: 128``, so a
    YAML user reads the key they can change."""
    table = dict(names or {})

    def n(key: str, *value: Any) -> str:
        if not value:
            return table.get(key, key)
        return f"{table[key]}: {value[0]}" if key in table else f"{key}={value[0]}"

    return n


# ---------------------------------------------------------------------- batches
def position_on(state: Mapping[str, Any], world_size: int) -> int:
    """The batches each of ``world_size`` ranks has taken at the place a :class:`ShardedEpochs`
    state (saved by ``state["world_size"]`` ranks) stands in its epoch. Rank r takes every
    world-th item of the epoch's order, so after p batches of b the ranks together have taken
    its first ``p * b * world`` items: on another world size the same items are taken when
    ``b * world_size`` divides that count. Otherwise no position continues without repeating
    or skipping items: one ValueError naming the process counts that do."""
    saved, position, batch = int(state.get("world_size", world_size)), int(state["position"]), int(state["batch_size"])
    if saved == world_size:
        return position
    items = position * batch * saved
    if items % (batch * world_size):
        fits = [n for n in range(1, min(position * saved, 1024) + 1) if (position * saved) % n == 0][:6]
        raise ValueError(
            f"the data position was saved by {saved} processes, {items} sequences into epoch {state['epoch']} "
            f"({position} batches of {batch} each); {world_size} processes read {batch * world_size} per batch, "
            f"which does not divide {items}: resume with --num_processes {' / '.join(map(str, fits))}, or from "
            "a checkpoint where it divides"
        )
    return items // (batch * world_size)


class ShardedEpochs:
    """Batches of indexed items, shuffled per epoch, sharded by rank, resumable.

    Iterating yields the rest of the current epoch, then moves to the next epoch, so both
    ``for epoch ...: for batch in loader`` and ``for batch in loader.forever()`` work. The
    item order of an epoch is ``randperm(n_items, seed + epoch)``; rank r takes every
    world_size-th item of it (all ranks get the same number of batches, so DDP never waits
    on a rank that ran out). ``state_dict()`` after n batches + ``load_state_dict()`` in a new
    loader continues with batch n+1 exactly. Subclasses set ``n_items`` and ``_batch(idx)``."""

    _CHECKED: tuple[str, ...] = ("seed", "batch_size", "world_size", "shuffle", "drop_last")

    def _setup(
        self, n_items: int, batch_size: int, seed: int, rank: int, world_size: int, shuffle: bool, drop_last: bool
    ) -> None:
        for k, v in (("batch_size", batch_size), ("world_size", world_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be a positive integer, got {v!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.batch_size, self.seed = batch_size, int(seed)
        self.rank, self.world_size, self.shuffle, self.drop_last = rank, world_size, shuffle, drop_last
        self._n_items = n_items
        self.items_per_rank = n_items // world_size
        div = self.items_per_rank / batch_size
        self._len = math.floor(div) if drop_last else math.ceil(div)
        self.epoch = 0
        self.position = 0  # batches of self.epoch already handed out

    def _batch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self._len

    def _order(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self._n_items, generator=g)
        else:
            order = torch.arange(self._n_items)
        return order[self.rank :: self.world_size][: self.items_per_rank]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.position >= self._len:  # stopped right after an epoch's last batch
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)
        while self.position < self._len:
            i = self.position
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            self.position = i + 1  # count it before yielding: a state_dict taken now resumes after it
            yield self._batch(idx)
        self.epoch, self.position = self.epoch + 1, 0

    def forever(self) -> Iterator[dict[str, torch.Tensor]]:
        """Batches across epochs without end (for step-based training loops)."""
        while True:
            yield from self

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, **{k: getattr(self, k) for k in self._CHECKED}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at (epoch, position). The data settings must match the saved ones, since a
        different batch size or corpus would silently feed different data. Another
        ``world_size`` (a run resumed on another process count) is the same place in the epoch's
        item order: :func:`position_on`."""
        diff = [
            f"{k}: saved {state[k]!r}, now {getattr(self, k)!r}"
            for k in self._CHECKED
            if k != "world_size" and k in state and state[k] != getattr(self, k)
        ]
        if diff:
            raise ValueError(
                "cannot resume the data loader, its settings changed (" + "; ".join(diff) + "); "
                "restore the original data settings or start a fresh run"
            )
        self.epoch, self.position = int(state["epoch"]), position_on(state, self.world_size)


class TokenBatches(ShardedEpochs):
    """Fixed-length blocks of a token stream (the items), ``{"input_ids", "labels"}`` with
    labels == input_ids, batched as described in :class:`ShardedEpochs`."""

    _CHECKED = (*ShardedEpochs._CHECKED, "seq_len", "n_blocks")

    def __init__(
        self,
        dataset: TokenDataset | torch.Tensor,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
        names: Mapping[str, str] | None = None,
    ) -> None:
        n = _named(names)
        tokens = dataset.tokens if isinstance(dataset, TokenDataset) else dataset
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise TypeError("TokenBatches takes a TokenDataset or a 1-D tensor of token ids")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        self.seq_len = seq_len
        self.n_blocks = tokens.numel() // seq_len
        self._blocks = tokens[: self.n_blocks * seq_len].view(self.n_blocks, seq_len)
        self._setup(self.n_blocks, batch_size, seed, rank, world_size, shuffle, drop_last)
        self.blocks_per_rank = self.items_per_rank
        if self._len == 0:
            raise ValueError(
                f"{tokens.numel()} tokens make {self.n_blocks} sequences of {n('seq_len', seq_len)}, fewer "
                f"than {n('batch_size', batch_size)} x {n('world_size', world_size)}; lower {n('batch_size')} or "
                f"{n('seq_len')}, or use more data"
            )

    def block(self, i: int) -> torch.Tensor:
        """Block ``i`` of the stream, whatever the rank (eval_table_size's prompts)."""
        return self._blocks[i]

    def _batch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self._blocks[idx].long()
        return {"input_ids": x, "labels": x.clone()}
