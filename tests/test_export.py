"""lowprec.export / `lowprec export`: FP8 exports that transformers loads (hf-fp8 through its
fine-grained FP8 integration, compressed-tensors through that package), bit-identical to the FP8
weights the training forward's GEMM read where recipe and format agree, and one-line refusals."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

import lowprec.fp8 as fp8
from lowprec.cli.main import main
from lowprec.export import export_model

import transformers  # noqa: E402  (the dev extra)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")


def tiny_hf(name: str, **fields):
    """``transformers.<name>ForCausalLM`` built from its config (no download), float32, seed 0:
    2 layers, hidden 128, 4 heads (2 KV), vocab 256, intermediate 256 unless ``fields`` say."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cfg = getattr(transformers, f"{name}Config")(**{**shape, **fields})
    return getattr(transformers, f"{name}ForCausalLM")(cfg).float()


def _llama(tie: bool = True):
    return tiny_hf("Llama", tie_word_embeddings=tie)


def _qwen3():
    return tiny_hf("Qwen3", head_dim=32, tie_word_embeddings=True)


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).float()


def _forward_fp8_weights(model, ids):
    """The converted model's one FP8 training forward on ``ids``, recording the FP8 weight every
    Float8Linear's forward GEMM read (``scaled_mm``'s second operand; MXFP8 / NVFP4: ``mx_mm``'s,
    a BlockScaledData), by layer name."""
    import lowprec.fp8.modules.linear_fn as linear
    import lowprec.fp8.modules.mx_linear as mx

    seen, current, real, real_mx = {}, [None], linear.scaled_mm, mx.mx_mm

    def spy(a, b, *args, **kwargs):
        seen[current[0]] = b.t()  # the GEMM reads W^T; back to (out, in)
        return real(a, b, *args, **kwargs)

    def spy_mx(a, b, *args, **kwargs):
        seen[current[0]] = b  # (out, in), quantized along in
        return real_mx(a, b, *args, **kwargs)

    hooks = [
        m.register_forward_pre_hook(lambda mod, inp, n=n: current.__setitem__(0, n))
        for n, m in model.named_modules()
        if isinstance(m, fp8.Float8Linear)
    ]
    linear.scaled_mm, mx.mx_mm = spy, spy_mx
    try:
        model.train()
        with torch.no_grad():
            model(ids)
    finally:
        linear.scaled_mm, mx.mx_mm = real, real_mx
        for h in hooks:
            h.remove()
    return seen


def _hp_logits_with(model, weights, ids):
    """Logits of ``model`` in high precision with the given FP8 weights dequantized in place of
    its own: the trained model's FP8 weights, as transformers computes with them on CPU."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    for name, q in weights.items():
        w = q.dequantize(torch.float32)
        params[f"{name}.weight"] = w.t() if isinstance(model.get_submodule(name), fp8.Float8Conv1D) else w
    model.eval()
    with torch.no_grad(), fp8.autocast(enabled=False):
        return torch.func.functional_call(model, params, (ids,)).logits.float()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def _load(out, fmt):
    if fmt == "hf-fp8":
        qc = transformers.FineGrainedFP8Config(dequantize=True)
    else:
        qc = transformers.CompressedTensorsConfig(run_compressed=False)
    return transformers.AutoModelForCausalLM.from_pretrained(out, quantization_config=qc, dtype=torch.float32)


CASES = [  # model, recipe, format, the scale tensor's name and shape for the layers' first FP8 layer
    ("llama", "blockwise", "hf-fp8", "weight_scale_inv"),
    ("llama", "rowwise", "compressed-tensors", "weight_scale"),
    ("llama", "tensorwise", "compressed-tensors", "weight_scale"),
    ("gpt2", "blockwise", "hf-fp8", "weight_scale_inv"),
    ("qwen3", "blockwise", "hf-fp8", "weight_scale_inv"),
]


@pytest.mark.parametrize("arch,recipe,fmt,scale_key", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_export_round_trip_is_the_training_forwards_fp8_weights(tmp_path, arch, recipe, fmt, scale_key):
    model = {"llama": _llama, "gpt2": _gpt2, "qwen3": _qwen3}[arch]()
    fp8.convert(model, recipe)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    used = _forward_fp8_weights(model, ids)
    report = export_model(model, str(tmp_path), fmt)
    assert report.trained_scales and "trained scales" in report.how
    assert sorted(report.quantized) == sorted(used)
    stored = load_file(str(tmp_path / "model.safetensors"))
    for name, q in used.items():  # bit-identical bytes, in the layer's storage layout
        data = q.data.t() if isinstance(model.get_submodule(name), fp8.Float8Conv1D) else q.data
        w = stored[f"{name}.weight"]
        assert w.dtype == torch.float8_e4m3fn
        assert torch.equal(w.view(torch.uint8), data.contiguous().view(torch.uint8)), name
        assert f"{name}.{scale_key}" in stored
    # the layers that trained in high precision stay bf16 and are in the ignore list
    cfg = json.load(open(tmp_path / "config.json"))["quantization_config"]
    kept = cfg.get("modules_to_not_convert", cfg.get("ignore"))
    assert sorted(kept) == sorted(report.kept) and "lm_head" in " ".join(kept)
    for name in report.kept:
        key = f"{name}.weight"
        assert key not in stored or stored[key].dtype == torch.bfloat16
    # transformers loads it; its logits are the trained model's with the FP8 weights it trained with
    loaded = _load(str(tmp_path), fmt)
    with torch.no_grad():
        got = loaded(ids).logits.float()
    assert _rel(got, _hp_logits_with(model, used, ids)) < 1e-2
    assert 0 < report.logit_gap < 0.2
    assert f"{report.logit_gap:.3e}" in open(tmp_path / "README.md").read()


def _trained(recipe: str, steps: int = 3):
    """The tiny Llama converted with ``recipe`` and trained ``steps`` AdamW steps."""
    model = _llama()
    fp8.convert(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


MICRO_CASES = [  # recipe, compressed-tensors' format, the report's bound on the bf16-export gap
    ("mxfp8", "mxfp8-quantized", 0.2),
    ("nvfp4", "nvfp4-pack-quantized", 0.5),
]


def _assert_stored_cast(stored: dict, name: str, q) -> None:
    """The layer's stored tensors decode to exactly the trained cast ``q`` (a BlockScaledData):
    NVFP4: the packed E2M1 codes and E4M3 1x16 scales byte for byte, the global scale the
    reciprocal of its tensor factor; MXFP8: the E4M3 values (a trained -0 may be stored +0: the
    same value) and the E8M0 exponents byte for byte."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    from lowprec.fp8.cast.mx import e2m1_unpack

    scale = stored[f"{name}.weight_scale"]
    assert torch.equal(scale.view(torch.uint8), q.scale.view(torch.uint8)), name
    if q.tensor_scale is None:
        w = stored[f"{name}.weight"]
        assert w.dtype == torch.float8_e4m3fn and scale.dtype == torch.uint8
        assert torch.equal(w.float(), q.data.float()), name
        nonzero = q.data.float() != 0
        assert torch.equal(w.view(torch.uint8)[nonzero], q.data.view(torch.uint8)[nonzero]), name
        return
    packed = stored[f"{name}.weight_packed"]
    assert torch.equal(packed, q.data.view(torch.uint8)), name
    codes = unpack_fp4_from_uint8(packed, q.rows, q.cols, dtype=torch.float32)  # compressed-tensors' own decode
    assert torch.equal(codes, e2m1_unpack(q.data)), name
    assert torch.equal(stored[f"{name}.weight_global_scale"].reciprocal(), q.tensor_scale.reshape(1)), name


@pytest.mark.parametrize("recipe,ct_format,gap_bound", MICRO_CASES, ids=[c[0] for c in MICRO_CASES])
def test_microscaled_runs_export_their_trained_casts_to_compressed_tensors(tmp_path, recipe, ct_format, gap_bound):
    model = _trained(recipe)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    used = _forward_fp8_weights(model, ids)
    report = export_model(model, str(tmp_path), "compressed-tensors")
    assert report.trained_scales and "trained scales" in report.how and recipe in report.scheme
    assert sorted(report.quantized) == sorted(used)
    stored = load_file(str(tmp_path / "model.safetensors"))
    for name, q in used.items():
        _assert_stored_cast(stored, name, q)
    cfg = json.load(open(tmp_path / "config.json"))["quantization_config"]
    assert cfg["format"] == ct_format and sorted(cfg["ignore"]) == sorted(report.kept)
    for name in report.kept:  # a tied lm_head is stored once, as the embedding
        key = f"{name}.weight"
        assert key not in stored if name == "lm_head" else stored[key].dtype == torch.bfloat16
    # compressed-tensors' decompression through transformers: the trained model's logits with its casts
    with torch.no_grad():
        got = _load(str(tmp_path), "compressed-tensors")(ids).logits.float()
    assert _rel(got, _hp_logits_with(model, used, ids)) < 1e-2
    assert 0 < report.logit_gap < gap_bound
    card = open(tmp_path / "README.md").read()
    assert f"{report.logit_gap:.3e}" in card and report.layout in card


def test_microscaled_layers_compressed_tensors_cannot_hold_are_one_line(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=272,  # down_proj's input dim: 17 x 16, 8.5 x 32 (MXFP8 trains it padded)
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(cfg).float()
    fp8.convert(model, "mxfp8")
    with pytest.raises(ValueError, match="down_proj has an input dim that is not a multiple of mxfp8's block of 32"):
        export_model(model, str(tmp_path), "compressed-tensors")
    assert not os.path.exists(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="--format hf-fp8: a mxfp8 run.*use --format compressed-tensors"):
        export_model(model, str(tmp_path), "hf-fp8")


def test_a_recipe_that_disagrees_with_the_format_is_quantized_once_and_says_so(tmp_path):
    model = _llama()
    fp8.convert(model, "rowwise")
    report = export_model(model, str(tmp_path), "hf-fp8")
    assert not report.trained_scales and "quantized once" in report.how
    assert "quantized once" in open(tmp_path / "README.md").read()


@pytest.mark.parametrize("fmt", ["hf-fp8", "compressed-tensors"])
def test_a_peft_model_exports_its_adapters_merged_under_transformers_names(tmp_path, fmt):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        _llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    fp8.convert(model, "blockwise")
    report = export_model(model, str(tmp_path), fmt)
    assert any("merged" in n for n in report.notes)
    assert not any("lora" in k or k.startswith("base_model") for k in load_file(str(tmp_path / "model.safetensors")))
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    model.eval()
    with torch.no_grad():  # the adapters' delta is in (init_lora_weights=False: not zero)
        trained, served = model(ids).logits, loaded(ids).logits.float()
    assert float((served - trained).norm() / trained.norm()) < 0.1
    assert any("lora_A" in n for n, _ in model.named_modules())  # the model passed in keeps its adapters


def test_blocks_that_do_not_tile_a_dim_are_noted(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(cfg).float()
    fp8.convert(model, "blockwise")
    report = export_model(model, str(tmp_path), "hf-fp8")
    assert any("not a multiple" in n for n in report.notes)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (3, 1)  # ceil(320 / 128) x 1


def test_untied_head_and_an_unconverted_model_follow_the_default_rules(tmp_path):
    model = _llama(tie=False)
    report = export_model(model, str(tmp_path), "hf-fp8")
    assert report.recipe is None and "lm_head" in report.kept and "not trained in FP8" in report.how
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["lm_head.weight"].dtype == torch.bfloat16


def test_compressed_tensors_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)
    model = _llama()
    fp8.convert(model, "rowwise")
    with pytest.raises(ValueError, match=r"pip install 'lowprec\[export\]'"):
        export_model(model, str(tmp_path), "compressed-tensors")


# a `lowprec train` of examples/tiny.yaml cut to seconds: short rows, no warmup, evals or epoch saves
_FAST = {
    "sequence_len": 32,
    "micro_batch_size": 2,
    "eval_batches": 1,
    "eval_steps": None,
    "warmup_steps": 0,
    "saves_per_epoch": None,
    "evals_per_epoch": None,
    "warmup_ratio": None,
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 1-step blockwise `lowprec train` run of the built-in llama-tiny, with a checkpoint."""
    from lowprec.train.config import load_config
    from lowprec.train.trainer import train

    out = tmp_path_factory.mktemp("run")
    fast = {
        **_FAST,
        "dataset_max_bytes": 100_000,
        "max_steps": 1,
        "save_steps": 1,
        "fp8_recipe": "blockwise",
        "output_dir": str(out),
        "export": ["hf-fp8"],
    }
    train(load_config(TINY, fast))
    return out


def test_cli_exports_a_builtin_run_that_transformers_loads(tiny_run, tmp_path, capsys):
    from lowprec.export.source import load_run

    out = tmp_path / "fp8"
    assert main(["export", str(tiny_run), "--format", "hf-fp8", "--out", str(out)]) == 0
    assert "trained scales" in capsys.readouterr().out
    model, _, _, notes = load_run(str(tiny_run))
    assert "checkpoint-1" in notes[0]
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    used = _forward_fp8_weights(model, ids)
    stored = load_file(str(out / "model.safetensors"))
    for name, q in used.items():
        assert torch.equal(stored[f"{name}.weight"].view(torch.uint8), q.data.view(torch.uint8)), name
    loaded = _load(str(out), "hf-fp8")
    with torch.no_grad():
        got = loaded(ids).logits.float()
    assert _rel(got, _hp_logits_with(model, used, ids)) < 1e-2
    # the trainer's export: key wrote the same bytes from the model in memory at the end of training
    at_end = load_file(str(tiny_run / "hf-fp8" / "model.safetensors"))
    assert _same_bytes(at_end, stored)


def test_requantize_exports_a_run_whose_recipe_no_format_holds(tiny_run, tmp_path, capsys):
    import shutil

    import yaml

    run = tmp_path / "mxfp8-run"
    shutil.copytree(tiny_run, run)
    cfg = yaml.safe_load(open(run / "resolved_config.yaml"))
    cfg["fp8_recipe"] = {"name": "mxfp8"}
    yaml.safe_dump(cfg, open(run / "resolved_config.yaml", "w"))
    assert main(["export", str(run), "--format", "hf-fp8", "--out", str(tmp_path / "o"), "--requantize"]) == 0
    assert "--requantize: mxfp8 weights quantized once" in capsys.readouterr().out
    report = json.load(open(tmp_path / "o" / "lowprec_export.json"))
    assert report["recipe"] == "mxfp8" and not report["trained_scales"] and report["quantized"]


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"fsdp_version": 2}, "under FSDP2 / DeepSpeed"),
        ({"fp8_recipe": "nvfp4"}, "fp8_recipe nvfp4"),
        ({"fp8_recipe": "mxfp8", "export": ["compressed-tensors", "hf-fp8"]}, "that hf-fp8 does not hold"),
        ({"export": ["onnx"]}, "export"),
        ({"adapter": "lora", "lora_target_linear": True}, r"run `lowprec export OUTPUT_DIR .*merges the adapter"),
    ],
)
def test_trainer_export_key_refuses_what_it_cannot_write(extra, needle):
    from lowprec.train.config import load_config

    with pytest.raises(ValueError, match=needle) as info:
        load_config(TINY, {"export": ["hf-fp8"], **extra})
    assert "\n" not in str(info.value).strip()


def test_trainer_export_key_writes_microscaled_runs_to_compressed_tensors():
    from lowprec.train.config import load_config

    for recipe in ("mxfp8", "nvfp4"):
        assert load_config(TINY, {"fp8_recipe": recipe, "export": ["compressed-tensors"]}).export == [
            "compressed-tensors"
        ]


def test_cli_exports_a_hugging_face_gpt2_run(tmp_path):
    """A `lowprec train` run of a local transformers GPT-2 (Conv1D projections), exported from its
    checkpoint's float32 master weights: transformers loads it, with the run's tokenizer."""
    import importlib.util

    from lowprec.export.source import load_run
    from lowprec.train.config import load_config
    from lowprec.train.trainer import train

    spec = importlib.util.spec_from_file_location(
        "make_tiny_llama", os.path.join(ROOT, "examples", "make_tiny_llama.py")
    )
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    base = maker.main([str(tmp_path / "gpt2"), "--arch", "gpt2", "--hidden", "128", "--pretrain_steps", "0"])
    run = tmp_path / "run"
    common = {**_FAST, "dataset_max_bytes": 50_000, "fp8_recipe": "blockwise"}
    train(
        load_config(
            TINY,
            {
                **common,
                "base_model": base,
                "max_steps": 1,
                "save_steps": 1,
                "output_dir": str(run),
                "export": ["hf-fp8"],
            },
        )
    )
    out = tmp_path / "fp8"
    assert main(["export", str(run), "--format", "hf-fp8", "--out", str(out)]) == 0
    assert os.path.isfile(out / "tokenizer.json")
    stored, at_end = (load_file(str(d / "model.safetensors")) for d in (out, run / "hf-fp8"))  # the export: key's
    assert _same_bytes(at_end, stored)
    model, _, _, notes = load_run(str(run))
    assert "checkpoint-1" in notes[0]
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    used = _forward_fp8_weights(model, ids)
    assert used and all(isinstance(model.get_submodule(n), fp8.Float8Conv1D) for n in used)
    loaded = _load(str(out), "hf-fp8")
    with torch.no_grad():
        got = loaded(ids).logits.float()
    assert _rel(got, _hp_logits_with(model, used, ids)) < 1e-2
    # the export as the trainer's base_model: LoRA on its frozen FP8 layers; anything else is one line
    lora = {
        **common,
        "base_model": str(out),
        "adapter": "lora",
        "lora_target_linear": True,
        "max_steps": 2,
        "save_steps": None,
        "output_dir": str(tmp_path / "lora"),
    }
    result = train(load_config(TINY, lora))
    assert result.steps == 2 and os.path.isfile(tmp_path / "lora" / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="FP8 checkpoint whose FP8 layers load frozen.*set adapter: lora"):
        train(load_config(TINY, {**lora, "adapter": None, "lora_target_linear": None}))


def _one_line(capsys):
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_bad_inputs_are_one_exit_2_line(tiny_run, tmp_path, capsys):
    assert main(["export", str(tmp_path), "--format", "hf-fp8", "--out", str(tmp_path / "o")]) == 2
    assert "is neither a `lowprec train` output_dir" in _one_line(capsys)
    assert not os.path.exists(tmp_path / "o")  # a refused export leaves no empty --out behind
    assert main(["export", str(tmp_path / "nope"), "--format", "hf-fp8", "--out", str(tmp_path / "o")]) == 2
    assert "is not a directory" in _one_line(capsys)
    # a run trained with NVFP4: its microscaled weights are not hf-fp8's layout (compressed-tensors' NVFP4)
    import shutil
    import yaml

    run = tmp_path / "nvfp4-run"
    shutil.copytree(tiny_run, run)
    cfg = yaml.safe_load(open(run / "resolved_config.yaml"))
    cfg["fp8_recipe"] = {"name": "nvfp4"}
    yaml.safe_dump(cfg, open(run / "resolved_config.yaml", "w"))
    assert main(["export", str(run), "--format", "hf-fp8", "--out", str(tmp_path / "o")]) == 2
    line = _one_line(capsys)
    assert "--format hf-fp8" in line and "--format compressed-tensors (its NVFP4 scheme" in line
    assert "--requantize" in line
    assert not os.path.exists(tmp_path / "o" / "model.safetensors")
    assert main(["export", str(run), "--format", "compressed-tensors", "--out", str(tmp_path / "ct")]) == 0
    assert "trained scales: the nvfp4 forward's own FP4 weights" in capsys.readouterr().out
    cfg = json.load(open(tmp_path / "ct" / "config.json"))["quantization_config"]
    assert cfg["format"] == "nvfp4-pack-quantized"


def test_an_out_that_is_the_run_or_its_checkpoint_is_refused_before_writing(tiny_run, capsys):
    import hashlib

    digest = lambda f: hashlib.sha256(open(f, "rb").read()).hexdigest()  # noqa: E731
    files = {f: digest(f) for f in tiny_run.rglob("*") if f.is_file()}
    checkpoints = sorted(d for d in tiny_run.iterdir() if d.name.startswith("checkpoint-"))
    for target in [tiny_run, *checkpoints[-1:]]:
        assert main(["export", str(target), "--format", "compressed-tensors", "--out", str(target)]) == 2
        line = _one_line(capsys)
        assert "which this export reads" in line and "Choose a new directory" in line
    assert {f: digest(f) for f in tiny_run.rglob("*") if f.is_file()} == files  # nothing written


def _base_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, fp8.Float8BaseLinear)}


def test_trainer_lora_on_a_compressed_tensors_export_merges_into_fp8(tiny_run, tmp_path, capsys):
    """`lowprec export --format compressed-tensors` of a run, as the trainer's base_model: LoRA on
    its frozen FP8 layers, and merge_lora writes merged/ in compressed-tensors with the merged
    layers re-quantized (said in lowprec_merge.json); `lowprec export` of that run points there."""
    from lowprec.export import load_fp8_base
    from lowprec.train.config import load_config
    from lowprec.train.trainer import train

    ct = tmp_path / "ct"
    assert main(["export", str(tiny_run), "--format", "compressed-tensors", "--out", str(ct)]) == 0
    capsys.readouterr()
    run = tmp_path / "lora"
    lora = {
        "base_model": str(ct),
        "tokenizer": "byte",
        "adapter": "lora",
        "lora_target_linear": True,
        "merge_lora": True,
        **_FAST,
        "dataset_max_bytes": 50_000,
        "max_steps": 2,
        "save_steps": None,
        "output_dir": str(run),
    }
    result = train(load_config(TINY, lora))
    assert result.steps == 2 and os.path.isfile(run / "adapter_model.safetensors")
    merged = run / "merged"
    qc = json.load(open(merged / "config.json"))["quantization_config"]
    assert (
        qc["quant_method"] == "compressed-tensors" and qc["config_groups"]["group_0"]["weights"]["strategy"] == "block"
    )
    written = json.load(open(merged / "lowprec_merge.json"))
    assert written["merged"] and "re-quantized once" in written["how"] and "not trained" in written["how"]
    layers = _base_layers(load_fp8_base(str(merged)))
    assert sorted(layers) == sorted(written["merged"] + written["unchanged"])
    capsys.readouterr()
    assert main(["export", str(run), "--format", "hf-fp8", "--out", str(tmp_path / "o")]) == 2
    assert "merge_lora already wrote" in _one_line(capsys)
    # a compressed-tensors scheme lowprec cannot hold as an FP8 base: one line naming the key
    (ct / "config.json").write_text((ct / "config.json").read_text().replace('"float-quantized"', '"int-quantized"'))
    with pytest.raises(ValueError, match=r"^base_model: FP8 base .*format int-quantized is not float-quantized"):
        train(load_config(TINY, {**lora, "output_dir": str(tmp_path / "refused")}))


def test_accelerator_save_model_writes_the_fp8_export(tmp_path):
    """``Accelerator.save_model(model, dir, fp8_format=...)``: the same files as export_model of the
    unwrapped model (trained scales: blockwise -> hf-fp8), loadable by transformers; a bad format
    is one line."""
    from lowprec import Accelerator
    from lowprec.utils import NativeRecipeKwargs

    acc = Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[NativeRecipeKwargs(recipe="blockwise")])
    model = acc.prepare(_llama())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    acc.save_model(model, str(tmp_path / "acc"), fp8_format="hf-fp8")
    export_model(acc.unwrap_model(model), str(tmp_path / "direct"), format="hf-fp8")
    got, want = (
        load_file(str(tmp_path / "acc" / "model.safetensors")),
        load_file(str(tmp_path / "direct" / "model.safetensors")),
    )
    assert _same_bytes(got, want) and any(k.endswith("weight_scale_inv") for k in got)
    assert json.loads((tmp_path / "acc" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert _load(tmp_path / "acc", "hf-fp8")(input_ids=ids).logits.isfinite().all()
    with pytest.raises(ValueError, match="save_model\\(fp8_format='fp4'\\): choose one of hf-fp8, compressed-tensors"):
        acc.save_model(model, str(tmp_path / "bad"), fp8_format="fp4")
