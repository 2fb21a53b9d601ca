"""An FP8 export interrupted while it writes leaves no truncated file: each file is written to a
temporary name and renamed, so a directory holds an earlier export's files whole, or the new ones."""

import os

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (dev extra)")

from lowprec import fp8  # noqa: E402
from lowprec.export import writers  # noqa: E402
from lowprec.export.model import export_model  # noqa: E402
from tests.test_export import _llama  # noqa: E402


def _files(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def test_an_interrupted_export_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    model = _llama()
    fp8.convert(model, "blockwise")
    export_model(model, str(tmp_path), "hf-fp8")
    before = _files(tmp_path)
    assert "model.safetensors" in before and "config.json" in before
    real = writers.save_file

    def dies_half_way(tensors, path, metadata=None):
        real(dict(list(tensors.items())[:1]), path, metadata=metadata)  # part of the file is on disk
        raise KeyboardInterrupt

    monkeypatch.setattr(writers, "save_file", dies_half_way)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # a different model: the files would change
    with pytest.raises(KeyboardInterrupt):
        export_model(model, str(tmp_path), "hf-fp8")
    assert _files(tmp_path) == before  # the earlier export, byte for byte; no temporary file left


def test_a_run_that_did_not_finish_is_not_exported_from_an_earlier_runs_files(tmp_path, capsys):
    """A fresh run into the directory of a finished one, interrupted before its end, leaves the
    earlier run's model.safetensors there: the export refuses the run (it is not that model)."""
    from lowprec.cli.main import main
    from lowprec.train.config import load_config
    from lowprec.train.trainer import train
    from tests.test_export import _FAST, TINY

    run, fast = tmp_path / "run", {**_FAST, "dataset_max_bytes": 100_000, "output_dir": str(tmp_path / "run")}
    train(load_config(TINY, {**fast, "max_steps": 1}))
    assert os.path.isfile(run / "summary.json") and os.path.isfile(run / "model.safetensors")
    seen = []

    def ctrl_c(record):
        seen.append(os.path.exists(run / "summary.json"))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(load_config(TINY, {**fast, "max_steps": 5}), on_log=ctrl_c)
    assert seen == [False]  # the earlier run's summary.json went when this run started
    assert main(["export", str(run), "--format", "hf-fp8", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "did not finish: it was interrupted at step 1" in err
    assert not os.path.exists(tmp_path / "o" / "model.safetensors")
    os.remove(run / "summary.json")  # killed: no summary at all
    assert main(["export", str(run), "--format", "hf-fp8", "--out", str(tmp_path / "o")]) == 2
    assert "it has no complete summary.json" in capsys.readouterr().err
