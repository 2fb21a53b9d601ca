"""Instruction / chat data: tokenized examples (with prompt masks), cached, batched or packed.

Pipeline (the plain-text path, ``data.build_datasets`` -> ``TokenBatches``, stays for
``completion`` data without packing)::

    rows (data_files.read_rows) --split by hash of row key--> train / validation rows
    --prompts.tokenize_row--> (input_ids, labels) per example; longer than sequence_len: dropped
    --ExampleBatches--> padded batches, or packed rows (packing.pack) with position_ids

``dataset_prepared_path``: the tokenized examples are saved under
``<dataset_prepared_path>/<key>/`` (tensors only; read back with ``weights_only=True``) where the
key hashes the tokenizer, the data files' bytes and every setting that changes the tokens, so a
second run with the same data and config skips tokenization and any change re-tokenizes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from lowprec.train.data import ShardedEpochs, split_documents
from lowprec.train.data_files import read_rows
from lowprec.errors import did_you_mean
from lowprec.train.prompts import IGNORE, PromptOptions, check_vocab, row_roles, tokenize_row
from lowprec.checkpoint.serialization import load_error_reason
from lowprec.train.packing import pack as pack_rows

__all__ = ["ExampleSet", "ExampleBatches", "DataSource", "build_examples"]

logger = logging.getLogger("lowprec")
_FORMAT = 2  # bump when the saved layout or the tokenization rules change


@dataclass(frozen=True)
class DataSource:
    """One ``datasets:`` entry as the builder needs it: files and how rows become tokens."""

    paths: tuple[str, ...]
    split: Optional[str]
    options: PromptOptions
    entry: str = "datasets"  # its place in the config (``datasets.0``), for error messages


@dataclass(frozen=True)
class ExampleSet:
    """Examples as flat int32 tensors: example i is ``ids[offsets[i]:offsets[i+1]]``."""

    ids: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor
    name: str
    fingerprint: str

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def n_tokens(self) -> int:
        return self.ids.numel()

    @property
    def n_trained(self) -> int:
        return int((self.labels != IGNORE).sum())

    def example(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.labels[a:b]

    @classmethod
    def from_lists(cls, examples: Sequence[tuple[list[int], list[int]]], name: str, fingerprint: str) -> "ExampleSet":
        lengths = torch.tensor([len(i) for i, _ in examples], dtype=torch.int64)
        offsets = torch.zeros(len(examples) + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        flat = lambda k: torch.tensor([t for ex in examples for t in ex[k]], dtype=torch.int32)  # noqa: E731
        return cls(flat(0), flat(1), offsets, name, fingerprint)


# ---------------------------------------------------------------------- building
def build_examples(
    sources: Sequence[DataSource],
    tokenizer: Any,
    seq_len: int,
    val_fraction: float,
    seed: int,
    prepared_path: Optional[str] = None,
) -> tuple[ExampleSet, Optional[ExampleSet]]:
    """(train, validation or None) examples, from the cache when it holds this exact data."""
    files = [p for s in sources for p in s.paths]
    key = _cache_key(sources, tokenizer, seq_len, val_fraction, seed)
    name = ",".join(files)
    cache = os.path.join(prepared_path, key) if prepared_path else None
    if cache and os.path.isfile(os.path.join(cache, "meta.json")):
        logger.info("lowprec: dataset_prepared_path: reusing tokenized data in %s", cache)
        return _load(cache, name, key)
    rows = []
    for src in sources:
        for path in src.paths:
            rows += [(k, r, src.options) for k, r in read_rows(path, src.split)]
    if not rows:
        raise ValueError(f"data files {files} hold no rows")
    for src in sources:
        _check_roles_to_train(src, [(k, r) for k, r, opt in rows if opt is src.options])
    is_val = split_documents([k for k, _, _ in rows], val_fraction, seed) if val_fraction else [False] * len(rows)
    train: list[tuple[list[int], list[int]]] = []
    val: list[tuple[list[int], list[int]]] = []
    dropped = 0
    for (k, row, opt), v in zip(rows, is_val):
        ids, labels = tokenize_row(row, opt, tokenizer, k)
        bad = check_vocab(ids, tokenizer.vocab_size, k)
        if bad:
            raise ValueError(bad + "; tokenize with the model's tokenizer")
        pieces = _chunks(ids, labels, seq_len) if opt.type == "completion" else [(ids, labels)]
        for ids_, labels_ in pieces:
            if len(ids_) > seq_len:  # Axolotl drops over-long examples: a cut answer teaches to stop mid-way
                dropped += 1
            elif any(t != IGNORE for t in labels_[1:]):  # label 0 is never predicted
                (val if v else train).append((ids_, labels_))
    if dropped:
        logger.warning("lowprec: dropped %d of %d examples longer than sequence_len: %d", dropped, len(rows), seq_len)
    if not train:
        raise ValueError(
            f"{name}: no training example fits sequence_len: {seq_len} with a token to learn; raise "
            "sequence_len, or check the data (train_on_inputs: false masks every prompt token)"
        )
    if val_fraction and not val:  # a tiny file: the last rows become the validation set
        n = max(1, round(val_fraction * len(train)))
        if n >= len(train):
            raise ValueError(
                f"{name}: {len(train)} example(s), too few for a validation split; add data or set val_set_size: 0"
            )
        train, val = train[:-n], train[-n:]
    out_train = ExampleSet.from_lists(train, f"{name} (train)", key)
    out_val = ExampleSet.from_lists(val, f"{name} (validation)", key) if val_fraction else None
    if cache:
        _save(cache, out_train, out_val)
        logger.info("lowprec: dataset_prepared_path: tokenized data saved to %s", cache)
    return out_train, out_val


def _check_roles_to_train(src: DataSource, rows: Sequence[tuple[str, dict]]) -> None:
    """A chat dataset whose roles_to_train names no role of its data (after the roles mapping)
    would train nothing: one line naming the key, the value and the data's roles."""
    opt = src.options
    if opt.type != "chat_template" or opt.train_on_inputs or not rows:
        return
    present: set[str] = set()
    for k, row in rows:
        present |= row_roles(row, opt, k)
    if present and not present & set(opt.roles_to_train):
        bad = opt.roles_to_train[0] if opt.roles_to_train else ""
        raise ValueError(
            f"{src.entry}.roles_to_train: {list(opt.roles_to_train)} names no role of the data (its roles after "
            f"the roles mapping: {', '.join(sorted(present))}){did_you_mean(bad, present)}; list the roles to "
            "learn, or map the data's role names with roles: {assistant: [<name>]}"
        )


def _chunks(ids: list[int], labels: list[int], n: int) -> list[tuple[list[int], list[int]]]:
    """A long completion text in pieces of at most ``n`` tokens (as Axolotl's completion type)."""
    return [(ids[i : i + n], labels[i : i + n]) for i in range(0, len(ids), n)] or [([], [])]


def _cache_key(sources: Sequence[DataSource], tokenizer: Any, seq_len: int, val_fraction: float, seed: int) -> str:
    h = hashlib.sha256(f"v{_FORMAT}|{tokenizer_fingerprint(tokenizer)}|{seq_len}|{val_fraction}|{seed}".encode())
    for src in sources:
        h.update(repr((src.split, sorted(vars(src.options).items()))).encode())
        for path in src.paths:
            h.update(_file_digest(path).encode())
    return h.hexdigest()[:20]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """The tokenizer's name plus a hash of its files (an edited tokenizer.json re-tokenizes)."""
    path = tokenizer.name.removeprefix("hf:")
    extra = getattr(tokenizer, "settings", "")  # special_tokens / tokens set on top of the files
    return f"{tokenizer.name}:{_file_digest(path) if os.path.isdir(path) else ''}:{tokenizer.vocab_size}{extra}"


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
    for f in files:
        h.update(os.path.relpath(f, path).encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def _save(cache: str, train: ExampleSet, val: Optional[ExampleSet]) -> None:
    """Atomic: written to a temporary directory, then renamed into place."""
    tmp = f"{cache}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    for split, ex in (("train", train), ("validation", val)):
        if ex is not None:
            torch.save({"ids": ex.ids, "labels": ex.labels, "offsets": ex.offsets}, os.path.join(tmp, f"{split}.pt"))
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"format": _FORMAT, "validation": val is not None}, f)
    try:
        os.replace(tmp, cache)
    except OSError:  # another process saved it first: theirs is the same data
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _load(cache: str, name: str, key: str) -> tuple[ExampleSet, Optional[ExampleSet]]:
    """The cached examples, checked as a file from outside: any damage (unreadable, refused by
    ``weights_only``, inconsistent tensors, examples with nothing to learn) is one line naming
    the cache and the fix, never a traceback or a NaN loss later."""

    try:
        with open(os.path.join(cache, "meta.json")) as f:
            meta = json.load(f)
        splits = ("train", "validation") if meta["validation"] else ("train",)
        sets = [
            _checked_set(torch.load(os.path.join(cache, f"{s}.pt"), weights_only=True), f"{name} ({s})", key)
            for s in splits
        ]  # tensors only, no code
    except Exception as exc:  # noqa: BLE001 - every kind of damage is the same user-facing problem
        raise ValueError(
            f"dataset_prepared_path: the cache {cache} is damaged or was not written by lowprec "
            f"({load_error_reason(exc)}); "
            f"delete that directory to tokenize the data again"
        ) from None
    return sets[0], sets[1] if len(sets) > 1 else None


def _checked_set(t: Any, name: str, key: str) -> ExampleSet:
    if not isinstance(t, dict) or not all(isinstance(t.get(k), torch.Tensor) for k in ("ids", "labels", "offsets")):
        raise ValueError("expected tensors ids, labels, offsets")
    ex = ExampleSet(t["ids"], t["labels"], t["offsets"], name, key)
    off = ex.offsets
    if (
        ex.ids.shape != ex.labels.shape
        or ex.ids.dim() != 1
        or off.dim() != 1
        or off.numel() < 2
        or int(off[0]) != 0
        or int(off[-1]) != ex.ids.numel()
        or bool((off[1:] < off[:-1]).any())
    ):
        raise ValueError("ids, labels and offsets do not agree")
    # the builder keeps only examples with a token to learn (label 0 is never predicted)
    learned = ex.labels != IGNORE
    starts = off[:-1][off[1:] > off[:-1]]
    learned[starts] = False
    counts = torch.cat([torch.zeros(1, dtype=torch.int64), learned.cumsum(0)])
    empty = ((counts[off[1:]] - counts[off[:-1]]) == 0).nonzero()
    if empty.numel():
        raise ValueError(f"example {int(empty[0])} has no trainable token (every label is {IGNORE})")
    return ex


# ---------------------------------------------------------------------- batches
class ExampleBatches(ShardedEpochs):
    """Batches of examples: ``{"input_ids", "labels"}`` padded at the right, or with
    ``pack=True`` rows of several examples (``packing.pack``) plus ``position_ids`` that restart
    at 0 for each example, which is what keeps packed examples from attending to each other
    (the built-in model and transformers both read sequence boundaries from position_ids).

    Right padding needs no attention mask in a causal model: real tokens only attend to earlier
    positions, all real; padded positions are labelled -100. Rows are padded to ``seq_len``
    (``pad_to_sequence_len``, always when packing) or to the batch's longest rounded up to 16,
    the multiple FP8 GEMMs need."""

    _CHECKED = (*ShardedEpochs._CHECKED, "seq_len", "n_rows", "pack")

    def __init__(
        self,
        examples: ExampleSet,
        batch_size: int,
        seq_len: int,
        pad_id: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
        pack: bool = False,
        pad_to_sequence_len: bool = False,
    ) -> None:
        self.examples, self.seq_len, self.pad_id, self.pack = examples, seq_len, pad_id, pack
        self.pad_to_sequence_len = pad_to_sequence_len or pack
        lengths = examples.lengths.tolist()
        self.rows = pack_rows(lengths, seq_len) if pack else [[i] for i in range(len(examples))]
        self.n_rows = len(self.rows)
        self._setup(self.n_rows, batch_size, seed, rank, world_size, shuffle, drop_last)
        if self._len == 0:
            what = "packed rows" if pack else "examples"
            raise ValueError(
                f"{examples.name}: {self.n_rows} {what}, fewer than micro_batch_size: {batch_size} x "
                f"{world_size} process(es); lower micro_batch_size or add data"
            )

    def _batch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = [self.rows[int(i)] for i in idx]
        used = [sum(int(self.examples.lengths[j]) for j in r) for r in rows]
        width = self.seq_len if self.pad_to_sequence_len else min(self.seq_len, -(-max(used) // 16) * 16)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        pos = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            at = 0
            for j in row:
                x, y = self.examples.example(j)
                n = x.numel()
                ids[b, at : at + n], labels[b, at : at + n] = x, y
                labels[b, at] = IGNORE  # never predicted from the previous example's last token
                pos[b, at : at + n] = torch.arange(n)
                at += n
            pos[b, at:] = torch.arange(width - at)  # padding: a segment of its own
        batch = {"input_ids": ids, "labels": labels}
        if self.pack:
            batch["position_ids"] = pos
        return batch
