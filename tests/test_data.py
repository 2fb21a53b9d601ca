"""Tokenizers, the bundled stdlib corpus, local .txt/.jsonl files, splits and the resumable,
rank-sharded batch loader."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from lowprec.train import data as data_mod
from lowprec.train.data import (
    TokenBatches,
    build_datasets,
    corpus_fingerprint,
    read_documents,
    split_documents,
    stdlib_documents,
)
from lowprec.train.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer, HFTokenizer, load_tokenizer

SMALL = 300_000  # bytes of stdlib: enough for thousands of sequences, loads in milliseconds


# ---------------------------------------------------------------------- tokenizers
@pytest.mark.parametrize(
    "text", ["", "hello world", "naïve café — 東京 🚀\n\ttabs", "e\u0301 combining", "\x00\x7f nul and del"]
)
def test_byte_tokenizer_round_trips_utf8(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text


def test_byte_tokenizer_vocab_and_documents():
    tok = ByteTokenizer()
    assert tok.vocab_size == BYTE_VOCAB_SIZE == 272
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3 and min(tok.bos_id, tok.eos_id, tok.pad_id) >= 256
    docs = ["abc", "", "ünï", b"\xff raw bytes"]
    stream = tok.encode_documents(docs)
    expected = [i for d in docs for i in tok.encode(d, eos=True)]
    assert stream.dtype == torch.int32
    assert stream.tolist() == expected
    assert tok.encode_documents([]).numel() == 0
    # bytes that are not valid UTF-8 (a cut character) decode without raising
    assert tok.decode(tok.encode("東")[:2]) == "\ufffd"


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    with pytest.raises(ValueError, match="neither 'byte' nor an existing directory"):
        load_tokenizer(str(tmp_path / "nope"))


def test_hf_tokenizer_without_transformers_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    with pytest.raises(ValueError, match="pip install transformers"):
        load_tokenizer(str(tmp_path))


def test_a_damaged_tokenizer_directory_is_one_line_naming_it(tmp_path):
    """A truncated tokenizer.json made transformers raise a bare JSON error, printed as
    "lowprec: error: Expecting ',' delimiter: line 2 column 1": no file, no key, no fix."""
    pytest.importorskip("transformers")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    with pytest.raises(ValueError, match=rf"^tokenizer: {tmp_path} cannot be loaded as a Hugging Face tokenizer \("):
        load_tokenizer(str(tmp_path))


def test_hf_tokenizer_wrapper_with_a_stub(tmp_path, monkeypatch):
    class Stub:
        """Character-level stand-in for a transformers tokenizer."""

        eos_token_id, bos_token_id, pad_token_id = 1, 0, None

        def __len__(self):
            return 300

        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 290 + 2 for c in text]

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [self.encode(t) for t in texts]}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i - 2) for i in ids if i > 1)

    fake = types.ModuleType("transformers")
    seen = {}

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(path, local_files_only, trust_remote_code):
            seen["offline"], seen["trust_remote_code"] = local_files_only, trust_remote_code
            return Stub()

    fake.AutoTokenizer = AutoTokenizer
    monkeypatch.setitem(sys.modules, "transformers", fake)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and seen["offline"] is True
    assert seen["trust_remote_code"] is False  # unset means refused, never "ask" (None)
    assert tok.vocab_size == 304 and tok.pad_id == tok.eos_id == 1
    assert tok.encode("ab", bos=True, eos=True) == [0, 99, 100, 1]
    assert tok.encode_documents(["ab", "c"]).tolist() == [99, 100, 1, 101, 1]
    assert tok.decode(tok.encode("hello")) == "hello"


# ---------------------------------------------------------------------- stdlib corpus
def test_stdlib_corpus_is_sorted_capped_and_excludes_site_packages_and_tests():
    docs = stdlib_documents(SMALL)
    keys = [k for k, _ in docs]
    assert keys == sorted(keys) and len(keys) > 5
    assert sum(len(b) for _, b in docs) == SMALL
    assert all(k.endswith(".py") for k in keys)
    assert not any("site-packages" in k or "/test/" in k or k.startswith("test/") for k in keys)
    # a larger cap starts with the same files
    assert stdlib_documents(2 * SMALL)[: len(docs) - 1] == docs[:-1]


def test_corpus_fingerprint():
    fp = corpus_fingerprint(SMALL)
    assert fp.startswith(f"python{sys.version_info.major}.{sys.version_info.minor}.")
    assert "sha256:" in fp and fp == corpus_fingerprint(SMALL)
    assert fp != corpus_fingerprint(SMALL + 1)
    train, val = build_datasets("builtin:stdlib", seq_len=64, max_bytes=SMALL)
    assert train.fingerprint == val.fingerprint == fp


def test_builtin_datasets_are_deterministic_and_disjoint(monkeypatch):
    train, val = build_datasets("builtin:stdlib", seq_len=64, max_bytes=SMALL, val_fraction=0.2, seed=0)
    monkeypatch.setattr(data_mod, "_CACHE", {})  # rebuild from disk, not from the cache
    train2, val2 = build_datasets("builtin:stdlib", seq_len=64, max_bytes=SMALL, val_fraction=0.2, seed=0)
    assert train2 is not train and torch.equal(train.tokens, train2.tokens) and torch.equal(val.tokens, val2.tokens)
    eos = ByteTokenizer.eos_id
    # every byte of the corpus lands in exactly one split, each document followed by one EOS
    n_docs = len(stdlib_documents(SMALL))
    assert train.n_documents + val.n_documents == n_docs and val.n_documents > 0
    assert int((train.tokens == eos).sum() + (val.tokens == eos).sum()) == n_docs
    assert train.n_tokens + val.n_tokens == SMALL + n_docs
    # the two splits hold different files: split by path, not by position
    tok = ByteTokenizer()
    val_text = tok.decode(val.tokens)
    val_docs = [
        k
        for (k, b), v in zip(stdlib_documents(SMALL), split_documents([k for k, _ in stdlib_documents(SMALL)], 0.2))
        if v
    ]
    train_docs = [k for k, _ in stdlib_documents(SMALL) if k not in val_docs]
    assert val_docs and train_docs and not set(val_docs) & set(train_docs)
    first_val = dict(stdlib_documents(SMALL))[val_docs[0]].decode("utf-8")
    assert val_text.startswith(first_val)


def test_split_documents_fraction_and_seed():
    keys = [f"pkg/mod_{i}.py" for i in range(20000)]
    a = split_documents(keys, 0.03, seed=0)
    assert 0.025 < sum(a) / len(keys) < 0.035
    assert split_documents(keys, 0.03, seed=0) == a
    b = split_documents(keys, 0.03, seed=1)
    assert b != a and 0.025 < sum(b) / len(keys) < 0.035
    # growing the fraction only moves documents into validation
    c = split_documents(keys, 0.1, seed=0)
    assert all(cv for av, cv in zip(a, c) if av)


def test_validation_can_be_switched_off():
    train, val = build_datasets("builtin:stdlib", seq_len=64, max_bytes=SMALL, val_fraction=0.0)
    assert val is None and train.n_tokens == SMALL + len(stdlib_documents(SMALL))


def test_build_datasets_errors():
    with pytest.raises(ValueError, match="unknown builtin corpus 'builtin:wiki'"):
        build_datasets("builtin:wiki")
    with pytest.raises(ValueError, match="val_fraction must be in"):
        build_datasets("builtin:stdlib", val_fraction=1.5)


# ---------------------------------------------------------------------- local files
def test_txt_and_jsonl_files(tmp_path):
    (tmp_path / "a.txt").write_text("first document\nwith two lines\n", encoding="utf-8")
    rows = [{"text": "row one"}, {"text": "row two", "id": 2}, {"body": "x", "text": "ünï"}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    docs = read_documents([tmp_path / "a.txt", tmp_path / "b.jsonl"])
    assert docs == [
        ("a.txt", "first document\nwith two lines\n"),
        ("b.jsonl:1", "row one"),
        ("b.jsonl:2", "row two"),
        ("b.jsonl:3", "ünï"),
    ]
    assert read_documents(tmp_path) == docs  # a directory: its files in sorted order
    train, val = build_datasets([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], seq_len=8, val_fraction=0.0)
    assert ByteTokenizer().decode(train.tokens) == "".join(t for _, t in docs)
    assert int((train.tokens == ByteTokenizer.eos_id).sum()) == 4


def test_jsonl_text_field_is_configurable(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"body": "one"}\n{"body": "two"}\n', encoding="utf-8")
    assert [t for _, t in read_documents(p, text_field="body")] == ["one", "two"]
    with pytest.raises(ValueError, match=r"c.jsonl, line 1: no 'text' field \(keys: \['body'\]\); set text_field"):
        read_documents(p)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": "broken"\n', r"bad.jsonl, line 2: not valid JSON"),
        ('{"text": "ok"}\n\n["a list"]\n', r"bad.jsonl, line 3: expected a JSON object"),
        ('{"text": 5}\n', r"bad.jsonl, line 1: field 'text' must be a string, got int"),
    ],
)
def test_bad_jsonl_lines_name_the_file_and_line(tmp_path, content, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        build_datasets([str(p)], seq_len=4)


def test_local_file_errors(tmp_path):
    with pytest.raises(ValueError, match="missing.txt' does not exist"):
        read_documents(tmp_path / "missing.txt")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported extension; use .txt"):
        read_documents(tmp_path / "x.csv")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8 text .*offset 3"):
        read_documents(tmp_path / "latin1.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .txt or .jsonl"):
        read_documents(tmp_path / "empty")
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(ValueError, match="too few for a train and a validation sequence"):
        build_datasets([str(tmp_path / "short.txt")], seq_len=16)


def test_single_txt_file_gets_a_tail_validation_split(tmp_path):
    p = tmp_path / "one.txt"
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(200))
    p.write_text(text, encoding="utf-8")
    train, val = build_datasets([str(p)], seq_len=32, val_fraction=0.1)
    n = len(text.encode()) + 1
    assert val.n_tokens == -(-n // 10) and train.n_tokens + val.n_tokens == n
    assert ByteTokenizer().decode(torch.cat([train.tokens, val.tokens])) == text


# ---------------------------------------------------------------------- batches
def _stream(n=4000, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def test_batches_shape_labels_and_length():
    tokens = _stream(1000)
    loader = TokenBatches(tokens, batch_size=4, seq_len=16, seed=0)
    assert len(loader) == (1000 // 16) // 4 == 15
    batches = list(loader)
    assert len(batches) == 15
    b = batches[0]
    assert b["input_ids"].shape == b["labels"].shape == (4, 16)
    assert b["input_ids"].dtype == torch.long and torch.equal(b["input_ids"], b["labels"])
    assert b["labels"].data_ptr() != b["input_ids"].data_ptr()
    # each epoch is a permutation of the blocks: no block twice
    blocks = torch.cat([x["input_ids"] for x in batches])
    assert torch.unique(blocks, dim=0).shape[0] == 60
    assert len(TokenBatches(tokens, batch_size=4, seq_len=16, drop_last=False)) == 16
    unshuffled = next(iter(TokenBatches(tokens, batch_size=2, seq_len=16, shuffle=False)))
    assert torch.equal(unshuffled["input_ids"], tokens[:32].view(2, 16).long())


def test_same_seed_same_batches_new_epoch_new_order():
    tokens = _stream()
    a = [x["input_ids"] for x in TokenBatches(tokens, 4, 16, seed=3)]
    b = [x["input_ids"] for x in TokenBatches(tokens, 4, 16, seed=3)]
    c = [x["input_ids"] for x in TokenBatches(tokens, 4, 16, seed=4)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    loader = TokenBatches(tokens[: 64 * 16], 4, 16, seed=3)  # 64 blocks: no remainder dropped
    e0 = torch.cat([x["input_ids"] for x in loader])
    e1 = torch.cat([x["input_ids"] for x in loader])
    assert loader.epoch == 2 and loader.position == 0
    assert not torch.equal(e0, e1)
    assert torch.equal(torch.unique(e0, dim=0), torch.unique(e1, dim=0))  # same blocks, new order


def test_resume_mid_epoch_reproduces_the_uninterrupted_run():
    tokens = _stream()
    reference = TokenBatches(tokens, 4, 16, seed=9)
    steps = 3 * len(reference) // 2 + 5  # crosses an epoch boundary after resuming
    expected = [x["input_ids"] for _, x in zip(range(steps), reference.forever())]
    n = len(reference)
    # the reference itself walks a full permutation per epoch, then a new one
    assert torch.unique(torch.cat(expected[:n]), dim=0).shape[0] == 4 * n
    assert not torch.equal(torch.cat(expected[:5]), torch.cat(expected[n : n + 5]))
    for stop in (0, 7, len(reference) - 1, len(reference), len(reference) + 3):
        first = TokenBatches(tokens, 4, 16, seed=9)
        got = [x["input_ids"] for _, x in zip(range(stop), first.forever())]
        state = first.state_dict()
        resumed = TokenBatches(tokens, 4, 16, seed=9)
        resumed.load_state_dict(state)
        got += [x["input_ids"] for _, x in zip(range(steps - stop), resumed.forever())]
        assert len(got) == steps
        assert all(torch.equal(x, y) for x, y in zip(got, expected)), stop


def test_rank_shards_are_disjoint_and_equal_length():
    tokens = torch.arange(3 * 16 * 40 + 7, dtype=torch.int32)  # block id = first token // 16
    seen = []
    lengths = set()
    for rank in range(3):
        loader = TokenBatches(tokens, 2, 16, seed=1, rank=rank, world_size=3)
        lengths.add(len(loader))
        seen.append({int(row[0]) // 16 for b in loader for row in b["input_ids"]})
    assert lengths == {20}
    assert all(len(s) == 40 for s in seen)
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])


def test_resume_on_another_world_size_reads_the_same_sequences():
    """Rank r reads every world-th item of the epoch's order, so 2 ranks after 3 batches of 2
    have read the order's first 12 items: one rank continues at its 7th batch, 3 ranks at their
    3rd, and the next 4 items are the 2 ranks' next batches; 4 ranks (8 a batch) cannot continue."""
    tokens = torch.arange(16 * 64, dtype=torch.int32)  # block id = first token // 16

    def blocks(batches):
        return sorted(int(row[0]) // 16 for b in batches for row in b["input_ids"])

    loaders = [TokenBatches(tokens, 2, 16, seed=3, rank=r, world_size=2) for r in range(2)]
    two = [iter(x) for x in loaders]
    read = blocks([next(it) for it in two for _ in range(3)])
    state = loaders[0].state_dict()
    following = blocks([next(it) for it in two])
    one = TokenBatches(tokens, 2, 16, seed=3)
    assert blocks([b for _, b in zip(range(6), one)]) == read  # the same 12 from the start
    one.load_state_dict(state)
    assert one.position == 6 and blocks([b for _, b in zip(range(2), one)]) == following
    three = [TokenBatches(tokens, 2, 16, seed=3, rank=r, world_size=3) for r in range(3)]
    for x in three:
        x.load_state_dict(state)
    assert {x.position for x in three} == {2}
    with pytest.raises(ValueError, match="4 processes read 8 per batch, which does not divide 12"):
        TokenBatches(tokens, 2, 16, seed=3, world_size=4).load_state_dict(state)


def test_loader_errors():
    tokens = _stream(100)
    with pytest.raises(ValueError, match="fewer than batch_size=8 x world_size=1"):
        TokenBatches(tokens, 8, 16)
    with pytest.raises(ValueError, match="rank=2 must be in"):
        TokenBatches(tokens, 1, 16, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        TokenBatches(tokens, 0, 16)
    saved = TokenBatches(_stream(), 4, 16, seed=0).state_dict()
    with pytest.raises(ValueError, match="batch_size: saved 4, now 2"):
        TokenBatches(_stream(), 2, 16, seed=0).load_state_dict(saved)


def test_builtin_corpus_feeds_the_model_vocab():
    from lowprec.train.model import build_model

    tok = load_tokenizer("byte")
    train, _ = build_datasets("builtin:stdlib", tok, seq_len=32, max_bytes=SMALL)
    batch = next(iter(TokenBatches(train, 2, 32, seed=0)))
    assert int(batch["input_ids"].max()) < tok.vocab_size
    loss = build_model("llama-tiny", vocab_size=tok.vocab_size, n_layers=1)(**batch).loss
    assert torch.isfinite(loss)


def test_train_modules_import_with_torch_alone():
    import subprocess

    code = (
        "import sys, lowprec.train.model, lowprec.train.tokenizer, lowprec.train.data; "
        "bad = [m for m in ('pydantic', 'yaml', 'transformers', 'lowprec.accelerator') if m in sys.modules]; "
        "assert not bad, bad"
    )
    src = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src")
    env = {**__import__("os").environ, "PYTHONPATH": src}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
