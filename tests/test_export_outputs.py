"""What an FP8 export directory holds besides the quantized weights, checked against the
third-party libraries that read it: no weight file of something else a loader could read, the
tokenizer and generation defaults transformers loads, ignore lists named as the checkpoint names
its modules, and a report that says which scales training cast."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml
from safetensors import safe_open

import lowprec.fp8 as fp8
from lowprec.cli.main import main
from lowprec.export import export_model
from tests.test_export import _llama

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")


def _weight_files(d) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"))


def test_an_export_over_a_sharded_model_leaves_no_shard_a_loader_would_read(tmp_path):
    """An export into a directory holding a sharded model: its shards go, as transformers'
    save_pretrained removes them, and so does their index (which save_pretrained leaves, naming
    files that are gone; vLLM and SGLang read the files an index names when there is one)."""
    old = _llama()
    for d in ("by_transformers", "by_export"):
        old.save_pretrained(tmp_path / d, max_shard_size="200KB")
        assert "model-00002-of-00009.safetensors" in _weight_files(tmp_path / d)
    _llama().save_pretrained(tmp_path / "by_transformers")  # one file now: the reference behaviour
    by_transformers = _weight_files(tmp_path / "by_transformers")
    assert not any("-of-" in f for f in by_transformers)
    model = _llama()
    fp8.convert(model, "blockwise")
    export_model(model, str(tmp_path / "by_export"), "hf-fp8")
    assert _weight_files(tmp_path / "by_export") == ["model.safetensors"]
    assert set(by_transformers) - {"model.safetensors.index.json"} == {"model.safetensors"}


def _fake_run(run, cfg) -> None:
    """A finished `lowprec train` output_dir as far as the export reads it before loading."""
    os.makedirs(run, exist_ok=True)
    yaml.safe_dump(cfg, open(os.path.join(run, "resolved_config.yaml"), "w"))
    json.dump({"steps": 1}, open(os.path.join(run, "summary.json"), "w"))


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_an_out_that_holds_another_model_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    _fake_run(run, {"base_model": "builtin:llama-tiny", "fp8": True, "fp8_recipe": "blockwise"})
    other = tmp_path / "other-model"
    _llama().save_pretrained(other)
    before = {f: open(other / f, "rb").read() for f in os.listdir(other)}
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["export", str(run), "--format", "hf-fp8", "--out", str(other)]) == 2
    assert "already holds files (config.json" in _one_line(capsys)
    assert {f: open(other / f, "rb").read() for f in os.listdir(other)} == before


@pytest.fixture(scope="module")
def lora_export(tmp_path_factory):
    """A LoRA run as the trainer leaves it (its adapter and tokenizer, here with a named chat
    template besides the default one; no model files), exported: (base, run, export)."""
    peft = pytest.importorskip("peft")
    # here, not at the top: tests.test_train_hf imports peft, which imports triton for a device, and
    # the Triton-interpreter test modules collected after this one need it unimported
    from tests.test_train_hf import _maker

    maker, tmp = _maker(), tmp_path_factory.mktemp("lora")
    tok = maker.make_tokenizer()
    base, run, out = tmp / "base", tmp / "run", tmp / "fp8"
    torch.manual_seed(0)
    model = maker.make_model(tok, hidden=128)
    model.generation_config.max_new_tokens = 7  # not a default: the file is the base's
    model.save_pretrained(base)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    _fake_run(run, {"base_model": str(base), "adapter": "lora", "fp8": True, "fp8_recipe": "blockwise"})
    lora.save_pretrained(run)
    tok.chat_template = {"default": maker.CHATML, "tool_use": maker.CHATML + "{# tools #}"}
    tok.save_pretrained(run)
    assert not os.path.exists(run / "generation_config.json")
    assert main(["export", str(run), "--format", "hf-fp8", "--out", str(out)]) == 0
    return base, run, out


def test_a_lora_run_exports_the_base_generation_config_and_every_chat_template(lora_export):
    base, run, out = lora_export
    served = transformers.GenerationConfig.from_pretrained(out)
    assert served.to_dict() == transformers.GenerationConfig.from_pretrained(base).to_dict()
    assert served.max_new_tokens == 7
    templates = transformers.AutoTokenizer.from_pretrained(out).chat_template
    assert templates == transformers.AutoTokenizer.from_pretrained(run).chat_template
    assert sorted(templates) == ["default", "tool_use"]


def test_a_lora_runs_merged_weights_are_not_reported_as_trained_casts(lora_export):
    _, _, out = lora_export
    report = json.load(open(out / "lowprec_export.json"))
    assert not report["trained_scales"] and "adapter merged" in report["how"]
    assert "adapter merged" in open(out / "README.md").read()


def test_hf_fp8_ignore_list_names_the_checkpoints_modules_as_compressed_tensors_does(tmp_path):
    """Mixtral's router is ``mlp.gate`` in transformers' model and ``block_sparse_moe.gate`` in
    its checkpoint: compressed-tensors maps its ignore list to the checkpoint's names, and the
    hf-fp8 list names the same modules, each one whose weight the file holds."""
    pytest.importorskip("compressed_tensors")
    from tests.tiny_moe import build

    model = build("mixtral")
    fp8.convert(model, "tensorwise")
    lists = {}
    for fmt in ("hf-fp8", "compressed-tensors"):
        export_model(model, str(tmp_path / fmt), fmt)
        qc = json.load(open(tmp_path / fmt / "config.json"))["quantization_config"]
        lists[fmt] = sorted(qc.get("modules_to_not_convert") or qc.get("ignore"))
        with safe_open(str(tmp_path / fmt / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert all(f"{name}.weight" in keys for name in lists[fmt]), (fmt, lists[fmt])
    assert lists["hf-fp8"] == lists["compressed-tensors"]
    assert "model.layers.0.block_sparse_moe.gate" in lists["hf-fp8"]


def test_save_model_fp8_under_fsdp2_names_an_export_path_that_reads_plain_weights(tmp_path, capsys):
    """save_model(fp8_format=...) of a sharded model is refused; the way it names is export_model in
    one process, not `lowprec export`, which reads `lowprec train` runs only (a plain weights
    directory is refused there)."""
    from types import SimpleNamespace

    from lowprec.checkpoint.state import save_fp8_model

    class DTensor(torch.nn.Parameter):  # what FSDP2 makes of a parameter, by its type's name
        pass

    model = torch.nn.Linear(16, 16)
    model.weight = DTensor(model.weight.detach())
    with pytest.raises(ValueError, match=r"call lowprec\.export\.export_model\(model, DIR") as info:
        save_fp8_model(SimpleNamespace(unwrap_model=lambda m: m), model, str(tmp_path / "fp8"), "hf-fp8")
    assert "`lowprec export`" not in str(info.value)
    _llama().save_pretrained(tmp_path / "plain")  # plain weights: what save_model writes, with a config
    capsys.readouterr()
    assert main(["export", str(tmp_path / "plain"), "--format", "hf-fp8", "--out", str(tmp_path / "o")]) == 2
    assert "is neither a `lowprec train` output_dir" in _one_line(capsys)
