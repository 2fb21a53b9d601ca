"""`lowprec train` on Hugging Face models: a tiny Llama and a tiny GPT-2 written by
examples/make_tiny_llama.py into tmp (random weights, local byte-level tokenizer, no hub), LoRA
through peft with FP8 on the frozen base layers, merge, reload in transformers and peft; the
hub cache lookup; QLoRA on a 4-bit base (bitsandbytes) and its error without it; FP8 for GPT-2's Conv1D; the frozen-weight GEMMs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")
peft = pytest.importorskip("peft", reason="needs peft (dev extra)")

from lowprec import fp8  # noqa: E402
from lowprec.cli.main import main  # noqa: E402
from lowprec.train.config import load_config, parse_config  # noqa: E402
from lowprec.train.metrics import read_metrics  # noqa: E402
from lowprec.train.resolve import Capabilities, resolve  # noqa: E402
from lowprec.train.trainer import train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTES = os.path.join(ROOT, "examples", "data", "notes.jsonl")
CPU = Capabilities(packages=frozenset({"transformers", "peft"}))


def _maker():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_llama", os.path.join(ROOT, "examples", "make_tiny_llama.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny-llama"))
    return _maker().main([out, "--hidden", "32", "--pretrain_steps", "30"])


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny-gpt2"))
    return _maker().main([out, "--arch", "gpt2", "--hidden", "32", "--pretrain_steps", "0"])


FAST = {
    "sequence_len": 32,
    "micro_batch_size": 2,
    "eval_batches": 1,
    "progress_bar": False,
    "use_tensorboard": False,
    "logging_steps": 4,
    "fp8": True,
    "val_set_size": 0.1,
}


def test_alpaca_lora_example_trains_in_fp8_merges_and_reloads(tiny_llama, tmp_path, capfd):
    """examples/hf/alpaca_lora.yaml on the tiny Llama: base layers in FP8, adapters not; the loss
    falls; the adapter loads with peft, the merged model with transformers, and they agree. With
    progress_bar false (``--quiet``) transformers' loading / writing bars stay off too, and
    DeepSpeed (imported by save_pretrained where installed) prints no accelerator guess on CPU."""
    out = tmp_path / "run"
    fast = {k: v for k, v in FAST.items() if k != "sequence_len"}  # alpaca prompts need the example's 256
    cfg = load_config(
        os.path.join(ROOT, "examples", "hf", "alpaca_lora.yaml"),
        {**fast, "base_model": tiny_llama, "output_dir": str(out), "max_steps": 8, "eval_steps": None},
    )
    capfd.readouterr()
    result = train(cfg)
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err, err[-2000:]
    assert "Setting accelerator to CPU" not in err, err[-2000:]
    losses = [loss for _, loss in result.train_losses]
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.1, losses
    tok = _check_lora_outputs(tiny_llama, out)
    _check_merged_agrees(tiny_llama, out, tok("### Instruction:\nName a colour.", return_tensors="pt")["input_ids"])


def _check_lora_outputs(tiny_llama, out):
    """FP8 ran the frozen base GEMMs and never the adapters; the merged dir's tokenizer loads."""
    fp8_layers = [r for r in read_metrics(str(out)) if r["kind"] == "fp8"][-1]["layers"]
    assert any(n.endswith("mlp.up_proj.base_layer") for n in fp8_layers)  # frozen base GEMMs run in FP8
    assert not any("lora_" in n for n in fp8_layers)  # the adapters never do
    return transformers.AutoTokenizer.from_pretrained(str(out / "merged"))


def _check_merged_agrees(tiny_llama, out, ids):
    """The adapter loads with peft, the merged model with transformers, and they agree."""
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    adapted = peft.PeftModel.from_pretrained(base, str(out))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "merged"))
    with torch.no_grad():
        a, m = adapted(ids).logits.float(), merged(ids).logits.float()
        b = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)(ids).logits.float()
    assert merged.dtype == torch.bfloat16
    assert (a - m).abs().max() < 0.05 * a.abs().max()  # merged == base + adapters (bf16 rounding)
    assert (a - b).abs().max() > 10 * (a - m).abs().max()  # ... and the adapters learned something


def test_chat_lora_example_trains_assistant_turns_packed_in_fp8_and_reloads(tiny_llama, tmp_path):
    """examples/hf/chat_lora.yaml (Axolotl's Llama 3 instruct LoRA shape) on the tiny Llama: the
    tokenizer's ChatML template, assistant turns only, packed rows, LoRA on every linear layer
    with FP8 under it; the loss falls and the adapter and merged model reload and agree."""
    out = tmp_path / "run"
    cfg = load_config(
        os.path.join(ROOT, "examples", "hf", "chat_lora.yaml"),
        {
            **FAST,
            "sequence_len": 128,
            "base_model": tiny_llama,
            "output_dir": str(out),
            "max_steps": 8,
            "eval_steps": None,
            "lora_alpha": 64,
        },
    )  # 8 steps on the 32-wide model need a 4x larger LoRA scale
    assert cfg.sample_packing and cfg.datasets[0].type == "chat_template" and cfg.adapter == "lora"
    result = train(cfg)
    losses = [loss for _, loss in result.train_losses]
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.1, losses
    tok = _check_lora_outputs(tiny_llama, out)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template  # the template travels with the model
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Reverse stone."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    _check_merged_agrees(tiny_llama, out, ids)


def test_full_finetune_example_on_gpt2_converts_conv1d_and_saves_pretrained(tiny_gpt2, tmp_path):
    """examples/hf/full_finetune.yaml with a GPT-2 as base_model: its Conv1D layers train in FP8,
    and output_dir is a save_pretrained directory (bf16 weights, config, generation config,
    tokenizer) that transformers loads."""
    fast = {k: v for k, v in FAST.items() if k != "sequence_len"}
    cfg = load_config(
        os.path.join(ROOT, "examples", "hf", "full_finetune.yaml"),
        {
            **fast,
            "base_model": tiny_gpt2,
            "output_dir": str(tmp_path),
            "max_steps": 2,
            "gradient_accumulation_steps": 1,
        },
    )
    assert train(cfg).steps == 2
    fp8_layers = [r for r in read_metrics(str(tmp_path)) if r["kind"] == "fp8"][-1]["layers"]
    assert "model.transformer.h.1.mlp.c_fc" in fp8_layers  # a Conv1D, in FP8
    names = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert type(model).__name__ == "GPT2LMHeadModel" and model.transformer.h[0].mlp.c_fc.weight.shape == (32, 128)
    assert model.dtype == torch.bfloat16


def _fake_cache(root, repo_id: str, src: str, files) -> None:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for f in files:
        os.symlink(os.path.join(src, f), snap / f)


def test_hub_id_resolves_from_the_local_cache_only(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _fake_cache(
        tmp_path,
        "tiny/llama",
        tiny_llama,
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"],
    )
    cfg = parse_config({"base_model": "tiny/llama"})
    plan = resolve(cfg, CPU)
    assert plan.decisions["tokenizer"].value.endswith("snapshots/0123abcd")
    _fake_cache(tmp_path, "tiny/no-weights", tiny_llama, ["config.json"])
    with pytest.raises(
        ValueError,
        match=r"'tiny/no-weights' is incomplete in the local Hugging Face cache .*"
        r"missing model weights \(model.safetensors\); downloads are not supported",
    ):
        parse_config({"base_model": "tiny/no-weights"})
    with pytest.raises(ValueError, match=r"'org/absent' is not in the local .* missing config.json"):
        parse_config({"base_model": "org/absent"})
    _fake_cache(tmp_path, "tiny/no-tokenizer", tiny_llama, ["config.json", "model.safetensors"])
    with pytest.raises(ValueError, match=r"has no tokenizer files .*; set tokenizer_config: <tokenizer directory>"):
        resolve(parse_config({"base_model": "tiny/no-tokenizer"}), CPU)


def test_qlora_without_bitsandbytes_is_one_line_exit_2(tiny_llama, tmp_path, capsys, monkeypatch):
    """Where bitsandbytes is not installed (simulated: find_spec sees None), adapter: qlora is
    one line naming what to install, exit 2; adapter: lora still needs peft."""
    import sys

    from lowprec.cli.main import main

    base = {"base_model": tiny_llama, "adapter": "qlora", "load_in_4bit": True, "lora_target_linear": True}
    with pytest.raises(ValueError, match=r"adapter: qlora .* 'bitsandbytes': pip install 'lowprec\[qlora\]'"):
        resolve(parse_config(base), CPU)
    with pytest.raises(ValueError, match="adapter: lora needs the optional package 'peft'"):
        resolve(
            parse_config({**base, "adapter": "lora", "load_in_4bit": None}),
            Capabilities(packages=frozenset({"transformers"})),
        )
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # importlib.util.find_spec now answers None
    path = tmp_path / "q.yaml"
    path.write_text(json.dumps({**base, "output_dir": str(tmp_path / "o")}))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install bitsandbytes" in err[0], err


@pytest.fixture(scope="module")
def tiny_llama_64(tmp_path_factory) -> str:
    # 64 wide: bitsandbytes quantizes in blocks of 64 inputs, and its CPU inference packing needs a whole block
    out = str(tmp_path_factory.mktemp("tiny-llama-64"))
    return _maker().main([out, "--hidden", "64", "--pretrain_steps", "20"])


def test_qlora_trains_adapters_on_a_4bit_base_and_merges_on_the_full_base(tiny_llama_64, tmp_path):
    """adapter: qlora + load_in_4bit: the base Linear layers load as bitsandbytes NF4 Linear4bit,
    FP8 leaves them alone (named in the report) and never touches the adapters; the loss falls;
    the adapter loads with peft; merge_lora merges onto the base loaded in full precision."""
    pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (dev extra)")
    out = tmp_path / "run"
    cfg = parse_config(
        {
            **FAST,
            "base_model": tiny_llama_64,
            "output_dir": str(out),
            "max_steps": 8,
            "eval_steps": None,
            "datasets": [NOTES],
            "adapter": "qlora",
            "load_in_4bit": True,
            "lora_target_linear": True,
            "lora_r": 8,
            "lora_alpha": 64,
            "learning_rate": 1e-2,
            "merge_lora": True,
            "save_steps": 4,
        }
    )
    caps = Capabilities(packages=frozenset({"transformers", "peft", "bitsandbytes"}))
    result = train(cfg, caps)
    losses = [loss for _, loss in result.train_losses]
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.1, losses
    # resuming from step 4 (the 4-bit base is made again from base_model; the checkpoint's copy is skipped)
    # gives the uninterrupted run's steps 5-8
    shutil.copytree(out / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    resumed = train(
        cfg.model_copy(
            update={"output_dir": str(tmp_path / "resumed"), "resume_from_checkpoint": "auto", "merge_lora": False}
        ),
        caps,
    )
    assert resumed.train_losses[-1][1] == pytest.approx(losses[-1], rel=1e-4), (resumed.train_losses, losses)
    # the adapter's shape and placement are the checkpoint's: another rank or target set is refused
    # before anything loads (resume_check.RULES' LoRA rows), naming the key, both values and the fix
    for key, value in (("lora_r", 16), ("lora_target_modules", ["q_proj"])):
        again = tmp_path / f"again-{key}"
        shutil.copytree(out / "checkpoint-4", again / "checkpoint-4")
        changed = {"output_dir": str(again), "resume_from_checkpoint": "auto", "merge_lora": False, key: value}
        if key == "lora_target_modules":
            changed["lora_target_linear"] = None
        with pytest.raises(ValueError, match=f"was trained with {key}: .*set (it|them) back to continue that run"):
            train(cfg.model_copy(update=changed), caps)
    report = (out / "fp8_conversion.txt").read_text()
    assert "Linear4bit x14 (4-bit base weights: QLoRA" in report, report  # 2 layers x 7 projections
    assert " 0 Linear layer(s) converted" in report  # the head is kept by the recipe; the adapters never convert
    # the adapter reloads with peft on a 4-bit base (its base layers are Linear4bit) and on the full one
    bnb = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    q = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_64, quantization_config=bnb), str(out)
    )
    assert type(q.base_model.model.model.layers[0].mlp.up_proj.base_layer).__name__ == "Linear4bit"
    _check_merged_agrees(tiny_llama_64, out, torch.tensor([[1, 72, 101, 108, 108, 111, 32, 119, 111]]))
    with torch.no_grad():  # the 4-bit base + adapter is close to the merged full-precision model (NF4 error only)
        a, m = (
            q(torch.tensor([[1, 72, 101, 108]])).logits.float(),
            transformers.AutoModelForCausalLM.from_pretrained(str(out / "merged"))(
                torch.tensor([[1, 72, 101, 108]])
            ).logits.float(),
        )
    assert (a - m).abs().max() < 0.25 * a.abs().max(), (a - m).abs().max()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"adapter": "lora"}, "needs lora_target_modules"),
        (
            {"adapter": "lora", "lora_target_modules": ["q_prj"]},
            "no module named 'q_prj' in the model \\(did you mean 'q_proj'",
        ),
        ({"model_type": "LlamaForCasualLM"}, "not a transformers causal LM class \\(did you mean 'LlamaForCausalLM'"),
        ({"load_in_4bit": True}, "load_in_4bit: true is what adapter: qlora loads with"),
        ({"adapter": "qlora", "lora_target_linear": True}, "adapter: qlora needs load_in_4bit: true"),
        ({"merge_lora": True}, "merge_lora: true needs adapter: lora"),
        (  # peft's 'lora.ParamWrapper does not work with lora_dropout != 0', said in the config's terms
            {"adapter": "lora", "lora_target_parameters": ["mlp.experts.down_proj"], "lora_dropout": 0.05},
            "^config: lora_dropout: 0.05 with lora_target_parameters: .*set lora_dropout: 0",
        ),
    ],
)
def test_adapter_and_model_key_errors(tiny_llama, tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        cfg = parse_config(
            {
                "base_model": tiny_llama,
                "output_dir": str(tmp_path),
                "max_steps": 1,
                **bad,
                "datasets": [NOTES],
                "val_set_size": 0,
                "sequence_len": 32,
                "progress_bar": False,
            }
        )
        train(cfg, CPU)


NEW_TOKENS = [f"<|tool_{i}|>" for i in range(12)]  # with <|sep|>: 261 + 13 ids > the 272 padded rows


def test_added_tokens_grow_the_embeddings_and_need_lora_modules_to_save(tiny_llama, tmp_path):
    """special_tokens / tokens new to the vocabulary resize the embeddings (272 -> 288 rows); with
    LoRA they are refused unless lora_modules_to_save trains embed_tokens and lm_head (Axolotl's
    rule), and then the adapter carries the grown layers: peft loads it onto a resized base and
    agrees with the merged model, which transformers loads at the new size."""
    from lowprec.train.adapters import LoraSettings, check_new_tokens

    rows = [{"text": f"{NEW_TOKENS[i % 12]} note {i} <|sep|> {NEW_TOKENS[(i + 3) % 12]} done"} for i in range(40)]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = {
        **FAST,
        "base_model": tiny_llama,
        "datasets": [{"path": str(data), "type": "completion"}],
        "max_steps": 2,
        "logging_steps": 1,
        "adapter": "lora",
        "lora_target_modules": ["q_proj", "v_proj"],
        "lora_alpha": 16,
        "special_tokens": {"pad_token": "<pad>", "additional_special_tokens": ["<|sep|>"]},
        "tokens": NEW_TOKENS,
        "sample_packing": True,
    }
    with pytest.raises(
        ValueError,
        match=r"special_tokens\.additional_special_tokens/tokens: 13 token\(s\) new to the "
        r"tokenizer \(<\|sep\|>, .* and 8 more\) .* set lora_modules_to_save: "
        r"\[embed_tokens, lm_head\]",
    ):
        train(parse_config({**base, "output_dir": str(tmp_path / "refused")}), CPU)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    check_new_tokens(
        model, LoraSettings(), {"<new-pad>": "special_tokens.pad_token"}
    )  # a new pad token is exempt, as in Axolotl

    out = tmp_path / "run"
    train(
        parse_config(
            {**base, "output_dir": str(out), "lora_modules_to_save": ["embed_tokens", "lm_head"], "merge_lora": True}
        ),
        CPU,
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(out / "merged"))
    assert len(tok) == 274 and tok.convert_tokens_to_ids("<|tool_7|>") >= 261  # <pad> was known
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "merged"))
    assert merged.get_input_embeddings().num_embeddings == 288 == merged.config.vocab_size
    grown = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    grown.resize_token_embeddings(len(tok), pad_to_multiple_of=16)  # as the README says
    adapted = peft.PeftModel.from_pretrained(grown, str(out))
    ids = tok("<|tool_7|> note <|sep|>", return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 8  # the added tokens are single ids
    with torch.no_grad():
        a, m = adapted(ids).logits.float(), merged(ids).logits.float()
    assert a.shape[-1] == 288 and (a - m).abs().max() < 0.05 * a.abs().max()


def test_tokenizer_keys(tiny_llama, tiny_gpt2):
    from lowprec.train.hf_model import load_run_tokenizer

    cfg = parse_config(
        {"base_model": tiny_gpt2, "tokenizer_config": tiny_llama, "tokenizer_type": "PreTrainedTokenizerFast"}
    )
    assert resolve(cfg, CPU).decisions["tokenizer"].value == tiny_llama
    tok = load_run_tokenizer(cfg)
    assert (
        isinstance(tok.hf_tokenizer, transformers.PreTrainedTokenizerFast)
        and tok.eos_id == tok.hf_tokenizer.eos_token_id
    )
    with pytest.raises(
        ValueError,
        match="tokenizer_type: 'LlamaTokenizerFsat' is not a transformers tokenizer class "
        "\\(did you mean 'LlamaTokenizerFast'",
    ):
        load_run_tokenizer(parse_config({"base_model": tiny_llama, "tokenizer_type": "LlamaTokenizerFsat"}))
    with pytest.raises(ValueError, match="tokenizer and tokenizer_config are both set"):
        parse_config({"base_model": tiny_llama, "tokenizer": "byte", "tokenizer_config": tiny_llama})
    with pytest.raises(ValueError, match="model_type is set but base_model is built-in"):
        parse_config({"model_type": "LlamaForCausalLM"})
    assert (
        resolve(parse_config({"base_model": tiny_llama, "tokenizer": "byte"}), CPU).decisions["tokenizer"].value
        == "byte"
    )


def test_adapter_on_builtin_model_is_refused():
    with pytest.raises(ValueError, match="adapter: lora needs a Hugging Face base_model"):
        parse_config({"adapter": "lora", "lora_target_linear": True})


# ---------------------------------------------------------------------- the engine side
def test_float8_conv1d_is_float8_linear_on_the_transposed_weight():
    """Same outputs and gradients as a Float8Linear holding W^T (bit for bit: the same GEMMs),
    state_dict unchanged, and unconvert gives back transformers' Conv1D."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(48, 32)
    conv.bias.data.normal_()
    lin = torch.nn.Linear(32, 48)
    lin.weight.data.copy_(conv.weight.data.t())
    lin.bias.data.copy_(conv.bias.data)
    model_c, model_l = torch.nn.Sequential(conv), torch.nn.Sequential(lin)
    keys = {k: v.shape for k, v in model_c.state_dict().items()}
    for m in (model_c, model_l):
        fp8.convert(m, "tensorwise", skip_first_last=False)
    assert isinstance(model_c[0], fp8.Float8Conv1D) and {k: v.shape for k, v in model_c.state_dict().items()} == keys
    x = torch.randn(4, 16, 32)
    with fp8.autocast():
        yc, yl = model_c(x), model_l(x)
    torch.testing.assert_close(yc, yl, rtol=0, atol=0)
    g = torch.randn_like(yc)
    yc.backward(g)
    yl.backward(g)
    torch.testing.assert_close(conv.weight.grad, lin.weight.grad.t(), rtol=0, atol=0)
    assert fp8.unconvert(model_c) == 1 and type(model_c[0]) is Conv1D and model_c[0].weight is conv.weight


def test_frozen_base_layer_runs_two_gemms_and_casts_its_weight_once_per_version(monkeypatch):
    """A frozen Float8Linear (a LoRA base layer): forward + backward = output and input-gradient
    GEMMs only (no weight-gradient GEMM); its weight is cast once for several micro-batches and
    again only after the weight changes; outputs bit-identical to the uncached path."""
    import lowprec.fp8.kinds.tensorwise as tensorwise
    import lowprec.fp8.modules.linear_fn as linear_fn

    gemms, casts = [], []
    real_mm, real_quantize = linear_fn.scaled_mm, tensorwise.quantize_tensorwise
    monkeypatch.setattr(
        linear_fn, "scaled_mm", lambda a, b, *args, **kw: gemms.append(a.data.shape) or real_mm(a, b, *args, **kw)
    )
    monkeypatch.setattr(
        tensorwise, "quantize_tensorwise", lambda t, *a, **kw: casts.append(t.shape) or real_quantize(t, *a, **kw)
    )
    torch.manual_seed(0)
    frozen, trained = (torch.nn.Sequential(torch.nn.Linear(64, 32)) for _ in range(2))
    trained.load_state_dict(frozen.state_dict())
    for m in (frozen, trained):
        fp8.convert(m, "tensorwise", skip_first_last=False)
    frozen[0].weight.requires_grad_(False)
    w_casts = lambda: casts.count(torch.Size([32, 64]))  # noqa: E731
    for _ in range(3):  # three micro-batches
        x = torch.randn(16, 64, requires_grad=True)
        with fp8.autocast():
            y = frozen(x)
            y.sum().backward()
            torch.testing.assert_close(y, trained(x), rtol=0, atol=0)
    assert w_casts() == 1 + 3  # the frozen weight once; the trained one every micro-batch
    assert len(gemms) == 3 * 2 + 3 and frozen[0].weight.grad is None  # 2 GEMMs each (trained: forward only)
    with torch.no_grad():
        frozen[0].weight.mul_(0.5)  # a new version: cast again
    with fp8.autocast():
        frozen(x).sum().backward()
    assert w_casts() == 5


def test_accelerator_keeps_peft_adapters_in_high_precision_and_converts_gpt2_conv1d():
    from lowprec import Accelerator

    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    model = peft.get_peft_model(
        transformers.GPT2LMHeadModel(cfg), peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    )
    acc = Accelerator(mixed_precision="fp8", cpu=True)
    acc.prepare(model)
    report = acc.backend.report
    converted = {n for n, _, _ in report.converted}
    assert "base_model.model.transformer.h.1.mlp.c_fc.base_layer" in converted  # Conv1D inside a LoRA layer
    assert "base_model.model.transformer.h.1.mlp.c_proj" in converted  # plain Conv1D
    assert any("lora_A" in n and "peft adapter" in r for n, r in report.skipped)
    kept = report.to_dict()["kept_in_high_precision_by_type"]
    assert kept["peft adapter Linear"]["count"] == 8 and kept["Embedding"]["reasons"] == ["lookups, not GEMMs"]
    assert "high precision by layer type:" in str(report)


def test_linear_only_backends_name_the_conv1d_layers_they_leave_in_high_precision(caplog):
    """torchao and TransformerEngine swap nn.Linear only; their convert() calls this note."""
    from lowprec.backends.engines.shared import note_unconverted_conv1d

    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    with caplog.at_level("WARNING", logger="lowprec"):
        note_unconverted_conv1d(transformers.GPT2LMHeadModel(cfg), "torchao")
    assert "torchao converts nn.Linear only: 8 transformers Conv1D layer(s) stay in high precision" in caplog.text


def test_a_lora_run_exports_its_adapter_merged_to_fp8(tiny_llama, tmp_path):
    """``lowprec export`` of a LoRA run: from its merged/ (merge_lora), or, without one, the base
    model with the run's adapter merged by peft. Both load in transformers (hf-fp8) and give the
    adapted model's logits within FP8 rounding; the base model's are further off."""
    out = tmp_path / "run"
    fast = {k: v for k, v in FAST.items() if k != "sequence_len"}
    cfg = load_config(
        os.path.join(ROOT, "examples", "hf", "alpaca_lora.yaml"),
        {**fast, "base_model": tiny_llama, "output_dir": str(out), "max_steps": 8, "eval_steps": None},
    )
    train(cfg)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        plain = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, str(out))(ids).logits
    qc = transformers.FineGrainedFP8Config(dequantize=True)
    assert main(["export", str(out), "--format", "hf-fp8", "--out", str(tmp_path / "from_merged")]) == 0
    assert "the run's merged/ model" in (tmp_path / "from_merged" / "README.md").read_text()  # the source, noted
    shutil.rmtree(out / "merged")
    assert main(["export", str(out), "--format", "hf-fp8", "--out", str(tmp_path / "from_adapter")]) == 0
    assert "adapter merged (peft merge_and_unload)" in (tmp_path / "from_adapter" / "README.md").read_text()
    for name in ("from_merged", "from_adapter"):
        exported = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / name), quantization_config=qc, dtype=torch.float32
        )
        with torch.no_grad():
            got = exported(ids).logits
        err, moved = float((got - adapted).norm()), float((plain - adapted).norm())
        assert err < 0.05 * float(adapted.norm()), name  # FP8 weights (and merged/'s bf16 rounding)
        assert err < moved, name  # closer to the adapted model than the base is: the adapter is in


def test_fp8_where_no_layer_converts_says_so_in_trainer_terms(tmp_path, capsys, caplog):
    """hidden_size 40 (not a multiple of 16): fp8: true converts nothing. The warning names no
    Python API the YAML cannot reach (NativeRecipeKwargs) and the summary does not say "(fp8)"
    as if FP8 had run."""
    import logging

    from lowprec.cli.main import main

    base = _maker().main([str(tmp_path / "m40"), "--hidden", "40", "--pretrain_steps", "0"])
    argv = ["train", "--base_model", base, "--output_dir", str(tmp_path / "run"), "--max_steps", "1"]
    argv += ["--datasets", NOTES]
    for key, value in FAST.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    with caplog.at_level(logging.WARNING):
        assert main(argv) == 0
    out, err = capsys.readouterr()
    said = [r.getMessage() for r in caplog.records] + err.splitlines()
    warned = " ".join(line for line in said if "converted no layer" in line)
    assert warned and "NativeRecipeKwargs" not in warned and "first and last Linear" in warned, warned
    assert "1 steps (fp8 (no layer converted))" in out, out


@pytest.mark.parametrize(
    "config, words",
    [
        ('{"model_type": "llama", "hidden_size": "x"}', "Validation error for field 'hidden_size'"),
        ("{not json", "config"),
    ],
)
def test_a_model_directory_with_a_bad_config_is_one_line(tiny_llama, tmp_path, config, words):
    """A config.json value of the wrong type raised huggingface_hub's strict-dataclass error (no
    ValueError) out of from_pretrained: a traceback on every rank instead of the one line naming
    base_model that a missing or unreadable file gets."""
    from lowprec.train.hf_model import load_causal_lm

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    (bad / "config.json").write_text(config)
    with pytest.raises(ValueError, match=rf"^base_model: {bad} cannot be loaded as a causal LM: .*{words}") as err:
        load_causal_lm(str(bad))
    assert "\n" not in str(err.value)
