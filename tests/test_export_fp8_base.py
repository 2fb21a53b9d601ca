"""FP8 bases (issue 26): ``load_fp8_base``'s direct loader (FP8 weights from the safetensors files
straight into Float8BaseLinear, never upcast) against transformers' dequantizing loader, and
``merge_lora`` from an FP8 base to a plain bf16 model (``merge_lora_format: bf16``)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import lowprec.export.fp8_base as fp8_base
import lowprec.fp8 as fp8
from lowprec.cli.main import main
from lowprec.export import export_model, load_fp8_base
from lowprec.export.fp8_merge import merge_lora_fp8_base
from tests.test_export import _FAST, TINY, _base_layers, _gpt2, _llama, _one_line, _qwen3, _rel
from tests.test_export_lora_bases import _lora_steps

import transformers  # noqa: E402  (the dev extra)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MODELS = {"llama": _llama, "qwen3": _qwen3, "gpt2": _gpt2}
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def _export(tmp_path, arch: str, recipe: str, fmt: str) -> str:
    model = MODELS[arch]()
    fp8.convert(model, recipe)
    out = str(tmp_path / f"{arch}-{recipe}-{fmt}")
    export_model(model, out, fmt)
    return out


class _Upcasts(TorchDispatchMode):
    """Records every op that reads an FP8 tensor and returns a wider floating one: a dequantization."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES for t in pytree.tree_leaves((args, kwargs))):
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and o.is_floating_point() and o.dtype not in FP8_DTYPES:
                    self.seen.append((str(func), tuple(o.shape), o.dtype))
        return out


def _direct_only(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the direct loader fell back to transformers' dequantizing load")

    monkeypatch.setattr(fp8_base, "_load_dequantized", refuse)


LOADS = [  # arch, recipe, format, dtype of the high-precision rest
    ("llama", "blockwise", "hf-fp8", torch.float32),
    ("llama", "blockwise", "hf-fp8", torch.bfloat16),
    ("qwen3", "rowwise", "compressed-tensors", torch.float32),
    ("llama", "tensorwise", "compressed-tensors", torch.float32),
    ("gpt2", "blockwise", "hf-fp8", torch.float32),
]


@pytest.mark.parametrize("arch,recipe,fmt,dtype", LOADS, ids=[f"{c[0]}-{c[2]}-{c[1]}-{str(c[3])[6:]}" for c in LOADS])
def test_the_direct_load_is_transformers_load_bit_for_bit(tmp_path, monkeypatch, arch, recipe, fmt, dtype):
    """The same modules, FP8 bytes, scales, parameters and buffers (values, dtypes, requires_grad),
    config and mode as the dequantizing load, so the same logits, FP8 forward and dequantized."""
    d = _export(tmp_path, arch, recipe, fmt)
    old = load_fp8_base(d, dtype, direct=False)
    _direct_only(monkeypatch)
    new = load_fp8_base(d, dtype)
    assert _base_layers(new) and sorted(_base_layers(new)) == sorted(_base_layers(old))
    assert [(n, type(m)) for n, m in new.named_modules()] == [(n, type(m)) for n, m in old.named_modules()]
    a, b = old.state_dict(), new.state_dict()  # Float8BaseLinear: uint8 bytes and the scales' int32 bits
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert [(n, p.requires_grad) for n, p in new.named_parameters()] == [
        (n, p.requires_grad) for n, p in old.named_parameters()
    ]
    tied = new.get_output_embeddings().weight is new.get_input_embeddings().weight
    assert tied == (old.get_output_embeddings().weight is old.get_input_embeddings().weight)
    assert new.training == old.training and new.config.to_dict() == old.config.to_dict()
    assert new.generation_config.to_dict() == old.generation_config.to_dict()
    assert getattr(new, fp8_base.BASE_ATTR).format == fmt
    with torch.no_grad():
        assert torch.equal(new(IDS).logits, old(IDS).logits)  # FP8 GEMMs from the stored scales
        with fp8.autocast(enabled=False):
            assert torch.equal(new(IDS).logits, old(IDS).logits)


def _shard(src: str, dst: str, parts: int = 3) -> None:
    """``src``'s model.safetensors as ``parts`` files with a model.safetensors.index.json, as
    ``save_pretrained(max_shard_size=...)`` writes a large model (the other files copied)."""
    import shutil

    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "model.safetensors"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    keys = sorted(tensors)
    weight_map = {}
    for i in range(parts):
        name = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {k: tensors[k] for k in keys[i::parts]}
        save_file(chunk, os.path.join(dst, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, name))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("fmt,recipe", [("hf-fp8", "blockwise"), ("compressed-tensors", "rowwise")])
def test_a_sharded_fp8_base_loads_as_the_single_file_one(tmp_path, monkeypatch, fmt, recipe):
    """A base stored in several files (model.safetensors.index.json) loads directly, bit for bit
    the model of the same base in one file, and through transformers' load too."""
    one = _export(tmp_path, "llama", recipe, fmt)
    sharded = str(tmp_path / "sharded")
    _shard(one, sharded)
    old = load_fp8_base(sharded, torch.float32, direct=False)
    _direct_only(monkeypatch)
    want, got = load_fp8_base(one, torch.float32), load_fp8_base(sharded, torch.float32)
    assert _base_layers(got)
    for other in (old, want):
        a, b = other.state_dict(), got.state_dict()
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(got(IDS).logits, want(IDS).logits)


@pytest.mark.parametrize("fmt,recipe", [("hf-fp8", "blockwise"), ("compressed-tensors", "rowwise")])
def test_the_direct_load_never_upcasts_an_fp8_weight(tmp_path, monkeypatch, fmt, recipe):
    """No op of the direct load reads an FP8 tensor and writes a wider float one (no bf16 / fp32
    copy of an FP8 weight exists at any time); the same detector on transformers' dequantizing
    load sees every FP8 layer's weight upcast, so it can fail."""
    d = _export(tmp_path, "llama", recipe, fmt)
    with _Upcasts() as old:
        base = load_fp8_base(d, torch.bfloat16, direct=False)
    shapes = {tuple(m.weight.shape) for m in _base_layers(base).values()}
    assert {s for _, s, _ in old.seen} >= shapes  # the old path's dequantized weights, caught
    _direct_only(monkeypatch)
    with _Upcasts() as new:
        base = load_fp8_base(d, torch.bfloat16)
    assert new.seen == []
    assert _base_layers(base) and all(m.weight.dtype == torch.uint8 for m in _base_layers(base).values())


def test_stored_names_that_are_not_the_models_load_through_transformers(tmp_path, caplog):
    """A tensor the model does not have (a renamed or extra key): the direct loader steps aside,
    says so, and transformers' loader gives what it always gave."""
    d = _export(tmp_path, "llama", "blockwise", "hf-fp8")
    path = os.path.join(d, "model.safetensors")
    save_file({**load_file(path), "model.extra_scale": torch.ones(3)}, path, metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="lowprec"):
        got = load_fp8_base(d)
    assert "stored tensor model.extra_scale is not the model's" in caplog.text
    assert "loading through transformers' dequantizing loader" in caplog.text
    want = load_fp8_base(d, direct=False)
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt", ["hf-fp8", "compressed-tensors"])
def test_an_moe_export_as_an_fp8_base_is_one_line(tmp_path, fmt):
    """A Mixtral export stores its experts per expert, as transformers' checkpoints do; transformers'
    model fuses them on load, so there is no Linear layer to hold them frozen in FP8: one line, for
    both loaders (before: the fallback's AttributeError for hf-fp8, a line blaming the config for
    compressed-tensors)."""
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    from tests.tiny_moe import build

    model = build("mixtral")
    fp8.convert(model, "tensorwise")
    export_model(model, str(tmp_path), fmt)
    for direct in (True, False):
        with pytest.raises(
            ValueError,
            match=r"experts\.0\.w1 \(and \d+ more\) holds FP8 weights but is not a layer of transformers' "
            r"MixtralForCausalLM \(it fuses",
        ) as info:
            load_fp8_base(str(tmp_path), direct=direct)
        assert "\n" not in str(info.value)


MERGES = [  # arch, recipe, format, LoRA targets
    ("llama", "blockwise", "hf-fp8", ["q_proj", "v_proj", "up_proj"]),
    ("llama", "rowwise", "compressed-tensors", ["q_proj", "v_proj", "up_proj"]),
    ("gpt2", "blockwise", "hf-fp8", ["c_attn", "c_fc"]),
]


@pytest.mark.parametrize("arch,recipe,fmt,targets", MERGES, ids=[f"{c[0]}-{c[2]}" for c in MERGES])
def test_merge_lora_of_an_fp8_base_to_bf16(tmp_path, arch, recipe, fmt, targets):
    """``merge_lora_fp8_base(format="bf16")``: a plain bf16 transformers model (no quantization
    config, no scales), each merged FP8 layer the bf16 rounding of its dequantized weight + the
    LoRA delta, the others of their dequantized weight; its logits within 1e-2 (relative L2) of
    base-dequantized + adapter in float32, and under 0.05 x the adapter's own effect."""
    import peft

    base = load_fp8_base(_export(tmp_path, arch, recipe, fmt))
    layers = _base_layers(base)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=targets))
    losses = _lora_steps(lora, IDS)
    assert losses[-1] < losses[0]
    want = {}  # the bf16 weights the merge should write: dequantized FP8 (+ the LoRA delta), the model's layout
    for n, m in layers.items():
        w = m.fp8_weight().dequantize(torch.float32)
        wrapper = lora.get_base_model().get_submodule(n)
        if wrapper is not m:  # a LoRA layer around m
            w = w + wrapper.get_delta_weight("default").float()
        want[n] = (w.t() if m.transposed else w).bfloat16()
    with torch.no_grad(), fp8.autocast(enabled=False):
        unmerged = lora(IDS).logits.float()
        with lora.disable_adapter():
            base_only = lora(IDS).logits.float()
    with pytest.raises(ValueError, match=r"format='fp4'\): choose one of fp8, bf16") as info:
        merge_lora_fp8_base(lora, str(tmp_path / "bad"), "fp4")
    assert "\n" not in str(info.value) and not os.path.exists(tmp_path / "bad")
    out = tmp_path / "merged"
    report = merge_lora_fp8_base(lora, str(out), "bf16")
    targeted = sorted(n for n in layers if n.endswith(tuple(targets)))
    assert report.format == "bf16" and report.merged == targeted
    assert sorted(report.merged + report.unchanged) == sorted(layers)
    assert json.load(open(out / "lowprec_merge.json"))["format"] == "bf16"
    config = json.load(open(out / "config.json"))
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    stored = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values() if t.is_floating_point()) and not any(
        "scale" in k for k in stored
    )
    for n, w in want.items():
        assert torch.equal(stored[f"{n}.weight"], w), n
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert not fp8_base.is_fp8_base(str(out))
    with torch.no_grad():
        got = loaded(IDS).logits.float()
    gap = _rel(got, unmerged)
    assert gap < 1e-2 and gap < 0.05 * _rel(base_only, unmerged), (gap, _rel(base_only, unmerged))


def test_trainer_merge_lora_format_bf16_on_an_fp8_base(tmp_path, capsys):
    """``merge_lora_format: bf16`` with an hf-fp8 base_model: merged/ is a plain bf16 model
    (transformers loads it; ``lowprec export`` of the run exports it); a bad value, the key
    without merge_lora, and fp8 on a bf16 base are one exit-2 line each."""
    from lowprec.train.config import load_config
    from lowprec.train.trainer import train

    base = _export(tmp_path, "llama", "blockwise", "hf-fp8")
    run = tmp_path / "lora"
    lora = {
        **_FAST,
        "base_model": base,
        "tokenizer": "byte",
        "adapter": "lora",
        "lora_target_modules": ["q_proj", "v_proj"],
        "merge_lora": True,
        "merge_lora_format": "bf16",
        "dataset_max_bytes": 50_000,
        "max_steps": 2,
        "save_steps": None,
        "output_dir": str(run),
    }
    assert train(load_config(TINY, lora)).steps == 2
    merged = run / "merged"
    written = json.load(open(merged / "lowprec_merge.json"))
    assert written["format"] == "bf16" and written["merged"]
    assert "quantization_config" not in json.load(open(merged / "config.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
    assert model(IDS).logits.isfinite().all()
    capsys.readouterr()
    assert main(["export", str(run), "--format", "hf-fp8", "--out", str(tmp_path / "o")]) == 0
    assert any(
        "source: the run's merged/ model" in n for n in json.load(open(tmp_path / "o" / "lowprec_export.json"))["notes"]
    )
    capsys.readouterr()
    flags = ["train", TINY, "--base_model", base, "--adapter", "lora", "--lora_target_linear", "true"]
    assert main([*flags, "--merge_lora", "true", "--merge_lora_format", "fp4"]) == 2
    assert "--merge_lora_format: Input should be 'fp8' or 'bf16' (got fp4)" in _one_line(capsys)
    assert main([*flags, "--merge_lora_format", "bf16"]) == 2
    assert "add merge_lora: true or drop merge_lora_format" in _one_line(capsys)
    plain = tmp_path / "bf16-base"
    _llama().save_pretrained(str(plain))
    with pytest.raises(ValueError, match="merge_lora_format: fp8 .* is not an FP8 checkpoint"):
        train(load_config(TINY, {**lora, "base_model": str(plain), "merge_lora_format": "fp8"}))
