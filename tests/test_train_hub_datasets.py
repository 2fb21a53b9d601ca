"""``datasets[].path`` as a hub dataset id (Axolotl's ``path: tatsu-lab/alpaca``) read from the local
Hugging Face cache, never downloaded: the split's data files of the cached snapshot, in
huggingface_hub's cache layout (``datasets--org--name/refs/main`` -> ``snapshots/<commit>/``)."""

from __future__ import annotations

import json

import pytest

from lowprec.train.config import parse_config
from lowprec.train.data_setup import data_sources, uses_examples
from lowprec.train.examples import build_examples
from lowprec.train.tokenizer import ByteTokenizer
from lowprec.train.trainer import train

ROWS = {
    "train": [{"instruction": f"Add {i} and {i}.", "input": "", "output": str(2 * i)} for i in range(24)],
    "test": [{"instruction": f"Double {i}.", "input": "", "output": str(2 * i)} for i in range(6)],
}


def _cache(tmp_path, monkeypatch, files: dict[str, list[dict]]) -> str:
    """A hub cache holding dataset ``org/adds`` with ``files`` (relative path -> rows)."""
    cache = tmp_path / "hub"
    repo = cache / "datasets--org--adds"
    snap = repo / "snapshots" / "c0ffee"
    for rel, rows in files.items():
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".parquet"):
            pa = pytest.importorskip("pyarrow")
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), snap / rel)
        else:
            (snap / rel).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c0ffee")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return str(snap)


def _cfg(tmp_path, **spec):
    return parse_config(
        {
            "base_model": "builtin:llama-tiny",
            "datasets": [{"path": "org/adds", "type": "alpaca", **spec}],
            "sequence_len": 256,
            "micro_batch_size": 2,
            "max_steps": 2,
            "val_set_size": 0.0,
            "eval_steps": None,
            "progress_bar": False,
            "use_tensorboard": False,
            "output_dir": str(tmp_path / "out"),
        }
    )


def test_a_cached_hub_dataset_reads_its_split_files(tmp_path, monkeypatch):
    snap = _cache(
        tmp_path,
        monkeypatch,
        {"data/train-00000-of-00001.parquet": ROWS["train"], "data/test-00000-of-00001.parquet": ROWS["test"]},
    )
    cfg = _cfg(tmp_path)
    assert uses_examples(cfg)
    (src,) = data_sources(cfg, ByteTokenizer())
    assert src.paths == (f"{snap}/data/train-00000-of-00001.parquet",) and src.split is None
    train_set, _ = build_examples([src], ByteTokenizer(), 256, 0.0, 0)
    assert len(train_set) == len(ROWS["train"])  # the test split's rows are not trained on
    (test_src,) = data_sources(_cfg(tmp_path, split="test"), ByteTokenizer())
    assert test_src.paths == (f"{snap}/data/test-00000-of-00001.parquet",)
    result = train(cfg)  # the trainer runs on it
    assert len(result.train_losses) >= 1


def test_a_file_naming_no_split_is_train_and_a_missing_split_or_id_is_one_line(tmp_path, monkeypatch):
    snap = _cache(tmp_path, monkeypatch, {"alpaca_data.jsonl": ROWS["train"]})
    (src,) = data_sources(_cfg(tmp_path), ByteTokenizer())
    assert src.paths == (f"{snap}/alpaca_data.jsonl",)
    with pytest.raises(
        ValueError, match=r"^datasets.0: .* has no .* file of split 'test' \(its files are of split train\)"
    ):
        data_sources(_cfg(tmp_path, split="test"), ByteTokenizer())
    cfg = parse_config({"base_model": "builtin:llama-tiny", "datasets": [{"path": "org/absent", "type": "alpaca"}]})
    with pytest.raises(
        ValueError, match=r"^datasets.0.path: 'org/absent' is neither a local file nor a dataset in the local "
    ):
        data_sources(cfg, ByteTokenizer())


CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# a dataset card
"""


def test_the_cards_configs_pick_the_files_and_name_picks_the_config(tmp_path, monkeypatch):
    """A card declaring two configs (as openai/gsm8k's: main, socratic): name: is needed and picks
    one config's files per split; a name that is not a config, or a name on a local file, is one line."""
    snap = _cache(
        tmp_path,
        monkeypatch,
        {
            "main/train-00000-of-00001.jsonl": ROWS["train"],
            "main/test-00000-of-00001.jsonl": ROWS["test"],
            "socratic/train-00000-of-00001.jsonl": ROWS["test"],
        },
    )
    (tmp_path / "hub" / "datasets--org--adds" / "snapshots" / "c0ffee" / "README.md").write_text(CARD)
    with pytest.raises(ValueError, match=r"^datasets.0: the cached dataset has configs main, socratic; set name:"):
        data_sources(_cfg(tmp_path), ByteTokenizer())
    (src,) = data_sources(_cfg(tmp_path, name="socratic"), ByteTokenizer())
    assert src.paths == (f"{snap}/socratic/train-00000-of-00001.jsonl",)
    (src,) = data_sources(_cfg(tmp_path, name="main", split="test"), ByteTokenizer())
    assert src.paths == (f"{snap}/main/test-00000-of-00001.jsonl",)
    with pytest.raises(ValueError, match=r"^datasets.0.name: 'mian' is not a config .* use one of main, socratic"):
        data_sources(_cfg(tmp_path, name="mian"), ByteTokenizer())
    local = tmp_path / "local.jsonl"
    local.write_text(json.dumps(ROWS["train"][0]) + "\n")
    cfg = parse_config({"datasets": [{"path": str(local), "type": "alpaca", "name": "main"}]})
    with pytest.raises(ValueError, match=r"^datasets.0.name: 'main' picks a config of a hub dataset .* drop name"):
        data_sources(cfg, ByteTokenizer())
