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
