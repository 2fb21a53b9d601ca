"""The streaming ``merge_lora_fp8_base`` (issue 26): the files it writes are the dense merge's
(``stream=False``, the merge before it) byte for byte, for hf-fp8 and compressed-tensors bases,
Llama and GPT-2 (Conv1D), fp8 and bf16; sharded output holds the same tensors and loads again;
a failed write leaves no partial file."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import lowprec.export.shards as shards
from lowprec.export import load_fp8_base
from lowprec.export.fp8_merge import merge_lora_fp8_base
from tests.test_export_lora_bases import _lora_steps
from tests.test_export_fp8_base import IDS, _export

CASES = [  # arch, recipe, base format, LoRA targets, merge formats
    ("llama", "blockwise", "hf-fp8", ["q_proj", "v_proj", "up_proj"], ("fp8", "bf16")),
    ("llama", "rowwise", "compressed-tensors", ["q_proj", "v_proj", "up_proj"], ("fp8", "bf16")),
    ("llama", "tensorwise", "compressed-tensors", ["q_proj", "down_proj"], ("fp8",)),
    ("llama", "blockwise", "compressed-tensors", ["k_proj", "gate_proj"], ("fp8",)),
    ("gpt2", "blockwise", "hf-fp8", ["c_attn", "c_fc"], ("fp8", "bf16")),
]
PARAMS = [(*c[:4], f) for c in CASES for f in c[4]]


def _lora(base_dir: str, targets: list[str]):
    import peft

    torch.manual_seed(0)
    lora = peft.get_peft_model(load_fp8_base(base_dir), peft.LoraConfig(r=8, target_modules=targets))
    _lora_steps(lora, IDS, steps=2)
    return lora


def _tensors(d) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


@pytest.mark.parametrize("arch,recipe,fmt,targets,merge", PARAMS, ids=[f"{p[0]}-{p[2]}-{p[1]}-{p[4]}" for p in PARAMS])
def test_streaming_merge_writes_the_dense_merges_files(tmp_path, arch, recipe, fmt, targets, merge):
    lora = _lora(_export(tmp_path, arch, recipe, fmt), targets)
    copies = [copy.deepcopy(lora), copy.deepcopy(lora)]
    dense, stream, sharded = tmp_path / "dense", tmp_path / "stream", tmp_path / "sharded"
    want = merge_lora_fp8_base(lora, str(dense), merge, stream=False)
    got = merge_lora_fp8_base(copies[0], str(stream), merge)
    assert (got.merged, got.unchanged, got.format, got.how) == (want.merged, want.unchanged, want.format, want.how)
    assert got.merged and sorted(os.listdir(stream)) == sorted(os.listdir(dense))
    for f in os.listdir(dense):
        if f != "lowprec_merge.json":  # it names its own directory
            assert (stream / f).read_bytes() == (dense / f).read_bytes(), f
    # sharded: 4 KiB shards (several files here), the same tensors, an index naming each once
    merge_lora_fp8_base(copies[1], str(sharded), merge, max_shard_bytes=4096)
    files = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert (
        len(files) > 2 and "model.safetensors" not in files and not any(f.endswith(".tmp") for f in os.listdir(sharded))
    )
    index = json.load(open(sharded / "model.safetensors.index.json"))
    a, b = _tensors(dense), _tensors(sharded)
    assert set(index["weight_map"]) == set(a) == set(b) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    for k, t in a.items():
        assert t.dtype == b[k].dtype and t.shape == b[k].shape and torch.equal(_bits(t), _bits(b[k])), k
    assert (sharded / "config.json").read_bytes() == (dense / "config.json").read_bytes()
    if merge == "fp8":  # the sharded merge loads again as an FP8 base, as the single file does
        x, y = load_fp8_base(str(sharded)).state_dict(), load_fp8_base(str(dense)).state_dict()
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_merge_shard_size_and_a_failed_write(tmp_path, monkeypatch):
    """A shard size that is not positive, or with ``stream=False``, is one ValueError; a write that
    fails leaves no file under a loader's name, and no temporary file."""
    lora = _lora(_export(tmp_path, "llama", "blockwise", "hf-fp8"), ["q_proj"])
    with pytest.raises(ValueError, match=r"max_shard_bytes=0: give a positive size"):
        merge_lora_fp8_base(copy.deepcopy(lora), str(tmp_path / "a"), max_shard_bytes=0)
    with pytest.raises(ValueError, match=r"stream=False\) writes one file"):
        merge_lora_fp8_base(copy.deepcopy(lora), str(tmp_path / "b"), stream=False, max_shard_bytes=4096)

    def fail(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(shards, "save_file", fail)
    out = tmp_path / "c"
    with pytest.raises(OSError, match="disk full"):
        merge_lora_fp8_base(lora, str(out), max_shard_bytes=4096)
    assert os.listdir(out) == []


def test_a_model_transformers_renames_on_save_merges_to_bf16_through_save_pretrained(tmp_path, monkeypatch, caplog):
    """Where transformers would convert the weight names on save (fused MoE experts: Mixtral),
    the bf16 merge goes through the dense merge's ``save_pretrained``, logged."""
    import logging

    import lowprec.export.fp8_merge as fp8_merge

    lora = _lora(_export(tmp_path, "llama", "blockwise", "hf-fp8"), ["q_proj"])
    twin = copy.deepcopy(lora)
    monkeypatch.setattr(fp8_merge, "_converts_keys_on_save", lambda model: True)
    with caplog.at_level(logging.INFO, logger="lowprec"):
        merge_lora_fp8_base(lora, str(tmp_path / "a"), "bf16")
    assert "converts LlamaForCausalLM's weight names on save" in caplog.text
    merge_lora_fp8_base(twin, str(tmp_path / "b"), "bf16", stream=False)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
