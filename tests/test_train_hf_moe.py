"""transformers mixture-of-experts models (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3, built from small
configs with a local byte-level tokenizer; nothing downloaded) trained for 20 steps in FP8, through
``lowprec train`` (full fine-tune, and LoRA on attention with the experts frozen in FP8) and through
the Accelerator; each saved model reloads in transformers and gives the trained model's logits."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")
peft = pytest.importorskip("peft", reason="needs peft (dev extra)")

from lowprec import fp8  # noqa: E402
from lowprec.fp8.modules.experts import Float8Experts  # noqa: E402
from lowprec.train.config import parse_config  # noqa: E402
from lowprec.train.metrics import read_metrics  # noqa: E402
from lowprec.train.resolve import Capabilities  # noqa: E402
from lowprec.train.trainer import train  # noqa: E402
from tests.tiny_moe import build  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTES = os.path.join(ROOT, "examples", "data", "notes.jsonl")
CPU = Capabilities(packages=frozenset({"transformers", "peft"}))
ARCHS = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]
STEPS = 20


def _tokenizer():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_llama", os.path.join(ROOT, "examples", "make_tiny_llama.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_tokenizer()


@pytest.fixture(scope="module", params=ARCHS)
def moe_dir(request, tmp_path_factory):
    """A tiny model of the arch with the byte-level tokenizer (vocab padded to 272), saved."""
    tok = _tokenizer()
    model = build(request.param)
    model.resize_token_embeddings(-(-len(tok) // 16) * 16)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, k, getattr(tok, k))
    model.config._experts_implementation = None  # transformers' default for a saved model
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return request.param, str(out)


def _config(base, out, **keys):
    return parse_config(
        {
            "base_model": base,
            "output_dir": str(out),
            "datasets": [NOTES],
            "fp8": True,
            "fp8_recipe": "tensorwise",
            "max_steps": STEPS,
            "sequence_len": 32,
            "micro_batch_size": 2,
            "learning_rate": 3e-3,
            "val_set_size": 0,
            "eval_steps": None,
            "logging_steps": 5,
            "progress_bar": False,
            "use_tensorboard": False,
            **keys,
        }
    )


def _logits(model, ids):
    model.eval()
    with torch.no_grad(), fp8.autocast(enabled=False):
        return model(ids).logits.float()


def _text_loss(model, tok):
    ids = tok(open(NOTES).read()[:2000], return_tensors="pt")["input_ids"][:, :256]
    model.eval()
    with torch.no_grad():
        return model(ids, labels=ids).loss.item()


def _fp8_rows(out):
    """The last FP8 metrics row's Linear layers and experts modules."""
    row = [r for r in read_metrics(str(out)) if r["kind"] == "fp8"][-1]
    return list(row["layers"]), list(row.get("experts", ()))


def test_full_fine_tune_through_the_trainer_saves_a_model_transformers_reloads(moe_dir, tmp_path):
    arch, base = moe_dir
    out = tmp_path / "run"
    result = train(_config(base, out), CPU)
    losses = [loss for _, loss in result.train_losses]
    assert len(losses) == STEPS // 5 and losses[-1] < losses[0], losses
    report = (out / "fp8_conversion.txt").read_text()
    assert "experts" in report and "router" in report, report
    layers, experts = _fp8_rows(out)
    assert len(experts) == 2 and layers  # both layers' experts ran FP8 GEMMs, and the attention
    tok = transformers.AutoTokenizer.from_pretrained(out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    before = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert _text_loss(reloaded, tok) < _text_loss(before, tok) - 0.1  # the saved model is the trained one


def test_lora_on_attention_keeps_the_experts_frozen_in_fp8(moe_dir, tmp_path):
    arch, base = moe_dir
    out = tmp_path / "run"
    attention = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    targets = attention if arch == "deepseek_v3" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    keys = dict(adapter="lora", lora_r=8, lora_alpha=32, lora_target_modules=targets, merge_lora=True)
    result = train(_config(base, out, **keys), CPU)
    losses = [loss for _, loss in result.train_losses]
    assert losses[-1] < losses[0], losses
    layers, experts = _fp8_rows(out)
    assert len(experts) == 2 and not any("lora_" in n for n in layers)  # frozen experts in FP8, adapters not
    tok = transformers.AutoTokenizer.from_pretrained(out / "merged")
    ids = tok("Reverse stone.", return_tensors="pt")["input_ids"]
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), str(out))
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged")
    plain = transformers.AutoModelForCausalLM.from_pretrained(base)
    a, m, b = (_logits(x, ids) for x in (adapted, merged, plain))
    # means, not maxima: bf16 rounding of the merged weights can move a token to another expert
    assert (a - m).abs().mean() < 0.05 * a.abs().mean()  # merged == base + adapters (bf16 rounding)
    assert (a - b).abs().mean() > 10 * (a - m).abs().mean()  # ... and the adapters learned something


def test_twenty_steps_through_the_accelerator_save_and_reload(moe_dir, tmp_path):
    from lowprec import Accelerator

    arch, base = moe_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    acc = Accelerator(mixed_precision="fp8")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    assert any(isinstance(m, Float8Experts) for m in model.modules())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 32), generator=gen)
    losses = []
    for _ in range(STEPS):
        loss = model(ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    # Accelerate's way of saving a transformers model: its save_pretrained with the gathered state dict
    acc.unwrap_model(model).save_pretrained(
        tmp_path / "saved", state_dict=acc.get_state_dict(model), save_function=acc.save
    )
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    want, got = _logits(acc.unwrap_model(model, keep_fp32_wrapper=False), ids), _logits(reloaded, ids)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), (got - want).abs().max()


def test_lora_on_the_experts_through_lora_target_parameters(moe_dir, tmp_path):
    """Axolotl's ``lora_target_parameters`` (peft's ``target_parameters``) on the fused expert
    weights: the experts' grouped FP8 GEMMs read each weight with its adapter's delta added, only
    the adapters train, and the merged model reloads in transformers and agrees with base + adapter."""
    arch, base = moe_dir
    out = tmp_path / "run"
    before = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    experts = next(n for n, m in before.named_modules() if n.endswith("layers.0.mlp.experts"))
    names = [n.rpartition(".")[2] for n, p in before.named_parameters() if n.startswith(experts + ".") and p.dim() == 3]
    keys = dict(adapter="lora", lora_r=8, lora_alpha=32, lora_target_parameters=[f"mlp.experts.{n}" for n in names])
    result = train(_config(base, out, merge_lora=True, **keys), CPU)
    losses = [loss for _, loss in result.train_losses]
    assert losses[-1] < losses[0], losses
    _, fp8_experts = _fp8_rows(out)
    assert len(fp8_experts) == 2  # the experts ran their grouped GEMMs in FP8, adapters included
    tok = transformers.AutoTokenizer.from_pretrained(out / "merged")
    ids = tok("Reverse stone.", return_tensors="pt")["input_ids"]
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), str(out))
    a = _logits(adapted, ids)
    # what merged/ must hold: base + adapter merged, in bf16 (that rounding alone moves the tiny
    # DeepSeek-V3's logits by ~6% on average: its group-limited routing flips near ties)
    want = _logits(adapted.merge_and_unload().to(torch.bfloat16), ids)
    got = _logits(transformers.AutoModelForCausalLM.from_pretrained(out / "merged"), ids)
    b = _logits(transformers.AutoModelForCausalLM.from_pretrained(base), ids)
    assert (got - want).abs().mean() < 0.02 * a.abs().mean()
    assert (a - b).abs().mean() > 5 * (a - want).abs().mean()  # the adapters learned something


def test_a_target_parameter_the_model_lacks_is_one_line(moe_dir, tmp_path):
    arch, base = moe_dir
    with pytest.raises(ValueError, match="lora_target_parameters: no parameter of the model ends in 'mlp.experts.w9'"):
        train(_config(base, tmp_path / "run", adapter="lora", lora_target_parameters=["mlp.experts.w9"]), CPU)
