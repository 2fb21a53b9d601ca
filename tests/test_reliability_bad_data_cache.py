"""Bad inputs, continued: a damaged prepared-data cache (each damage one line, exit 2) and a batch
with no trainable token; and the count of every bad-input table (the tables and the one-line
checks: test_reliability_bad_inputs.py)."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from tests.test_reliability_bad_inputs import (
    BASE,
    CHAT,
    FLAGS,
    LAUNCH_YAML,
    PYTHON,
    TRAIN_YAML,
    _check_one_line,
    _cli,
    _data_files,
    _fill,
    _write,
)


def _damage_garbage(cache) -> None:
    (cache / "train.pt").write_bytes(b"not a torch file" * 10)


def _damage_unlabelled(cache) -> None:
    t = torch.load(cache / "train.pt", weights_only=True)
    torch.save({**t, "labels": torch.full_like(t["labels"], -100)}, cache / "train.pt")


def _damage_offsets(cache) -> None:
    t = torch.load(cache / "train.pt", weights_only=True)
    torch.save({**t, "offsets": t["offsets"].flip(0)}, cache / "train.pt")


def _damage_pickle(cache) -> None:
    import pickle

    class _Runs:  # what a tampered cache would hold: code that runs on unpickling
        def __reduce__(self):
            return (os.mkdir, (str(cache.parent / "code-ran"),))

    with open(cache / "train.pt", "wb") as f:
        pickle.dump(_Runs(), f)


def _damage_meta(cache) -> None:
    (cache / "meta.json").write_text("{not json")


CACHE = [
    ("garbage", _damage_garbage, "is damaged or was not written by lowprec"),
    ("all-labels-ignored", _damage_unlabelled, "has no trainable token"),
    ("offsets-shuffled", _damage_offsets, "do not agree"),
    ("pickle-payload", _damage_pickle, "delete that directory to tokenize the data again"),
    ("meta-not-json", _damage_meta, "dataset_prepared_path: the cache"),
]


@pytest.fixture(scope="module")
def prepared_cache(tmp_path_factory):
    """A cache written by a one-step run on chat data (once for the module's rows)."""
    from lowprec.cli.main import main

    root = tmp_path_factory.mktemp("prepared")
    names = _data_files(root)
    cfg = {
        **BASE,
        **_fill(CHAT, names),
        "chat_template": "chatml",
        "sequence_len": 128,
        "dataset_prepared_path": str(root / "cache"),
        "output_dir": str(root / "out"),
    }
    (root / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(root / "c.yaml"), "--quiet"]) == 0
    (key,) = os.listdir(root / "cache")
    return root, cfg, key


@pytest.mark.parametrize("damage, expected", [r[1:] for r in CACHE], ids=[r[0] for r in CACHE])
def test_damaged_prepared_cache(prepared_cache, tmp_path, capsys, damage, expected):
    import shutil

    root, cfg, key = prepared_cache
    shutil.copytree(root / "cache", tmp_path / "cache")
    damage(tmp_path / "cache" / key)
    path = _write(
        tmp_path, {**cfg, "dataset_prepared_path": str(tmp_path / "cache"), "output_dir": str(tmp_path / "out")}, {}
    )
    capsys.readouterr()
    rc, lines = _cli(["train", path, "--quiet"], capsys)
    _check_one_line(rc, lines, expected)
    assert not (tmp_path / "cache" / "code-ran").exists()


def test_a_batch_with_no_trainable_token_says_so(prepared_cache, tmp_path, capsys, monkeypatch):
    """Past the checks (here: the cache check switched off), every label -100 gives a NaN loss;
    the stop names the cause, not "lower the learning rate"."""
    import shutil

    from lowprec.train import examples

    root, cfg, key = prepared_cache
    shutil.copytree(root / "cache", tmp_path / "cache")
    _damage_unlabelled(tmp_path / "cache" / key)
    monkeypatch.setattr(
        examples,
        "_checked_set",
        lambda t, name, key: examples.ExampleSet(t["ids"], t["labels"], t["offsets"], name, key),
    )
    path = _write(
        tmp_path,
        {
            **cfg,
            "dataset_prepared_path": str(tmp_path / "cache"),
            "output_dir": str(tmp_path / "out"),
            "max_steps": 4,
            "val_set_size": 0.05,
        },
        {},
    )
    rc, lines = _cli(["train", path, "--quiet"], capsys)
    stops = [line for line in lines if line.startswith("lowprec: stopped: ")]
    assert rc == 3 and len(stops) == 1, lines[-5:]
    assert "no trainable tokens in the batch" in stops[0] and "learning rate" not in stops[0], stops[0]


def test_the_tables_hold_at_least_150_bad_inputs():
    assert len(TRAIN_YAML) + len(FLAGS) + len(LAUNCH_YAML) + len(PYTHON) + len(CACHE) >= 150
