"""`lowprec train` on Hugging Face models, what a run leaves behind: the final export written
whole or not at all, the configured chat template saved with the tokenizer, a regex
lora_target_modules, and QLoRA's 4-bit base unchanged by evaluations and checkpoints (so a resumed
run repeats the uninterrupted one). Tiny models from examples/make_tiny_llama.py; nothing downloaded."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")
peft = pytest.importorskip("peft", reason="needs peft (dev extra)")

from lowprec.train.config import parse_config  # noqa: E402
from lowprec.train.trainer import train  # noqa: E402
from test_train_hf import _maker  # noqa: E402  (examples/make_tiny_llama.py, loaded once)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = {
    "micro_batch_size": 2,
    "eval_batches": 1,
    "progress_bar": False,
    "use_tensorboard": False,
    "logging_steps": 4,
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny-llama"))
    return _maker().main([out, "--hidden", "32", "--pretrain_steps", "0"])


@pytest.fixture(scope="module")
def tiny_llama_64(tmp_path_factory) -> str:
    # 64 wide: bitsandbytes quantizes in blocks of 64 inputs, and its CPU inference packing needs a whole block
    out = str(tmp_path_factory.mktemp("tiny-llama-64"))
    return _maker().main([out, "--hidden", "64", "--pretrain_steps", "0"])


def test_the_final_export_never_leaves_a_half_written_model(tmp_path, monkeypatch):
    """save_pretrained wrote model.safetensors in place: a run killed (or out of disk) in the
    middle of the final export left a truncated model.safetensors under the real name, over
    the last good one. The export goes through a temporary directory in the target, whose files
    replace the real ones only once written; one left by a killed export is removed by the next."""
    import errno
    from types import SimpleNamespace

    import transformers.modeling_utils as mu

    from lowprec.train.hf_model import export_pretrained

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(cfg)
    sd = {"model." + k: v for k, v in model.state_dict().items()}
    (tmp_path / ".export-killed").mkdir()  # what a SIGKILL during an earlier export leaves
    export_pretrained(SimpleNamespace(model=model), sd, None, str(tmp_path))
    assert not (tmp_path / ".export-killed").exists()
    good = (tmp_path / "model.safetensors").read_bytes()

    real = mu.safe_save_file

    def dies_half_way(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(mu, "safe_save_file", dies_half_way)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sd = {"model." + k: v for k, v in model.state_dict().items()}
    with pytest.raises(OSError):
        export_pretrained(SimpleNamespace(model=model), sd, None, str(tmp_path))
    assert (tmp_path / "model.safetensors").read_bytes() == good  # the last good export, whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    monkeypatch.setattr(mu, "safe_save_file", real)
    for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):  # an earlier, sharded export
        (tmp_path / stale).write_text("{}")
    export_pretrained(SimpleNamespace(model=model), sd, None, str(tmp_path))
    assert not (tmp_path / "model.safetensors.index.json").exists()  # as save_pretrained in place removes them
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert torch.equal(again.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_lora_target_modules_as_a_string_is_a_regex_as_in_axolotl():
    """Axolotl: 'if you specify lora_target_modules as a str, it will be treated as a regex'
    (peft's full match on module names), e.g. to put adapters on the language model only. The
    string was made a one-name list, so peft matched it as a name suffix and failed with
    'Target modules {...} not found in the base model'."""
    from lowprec.train.adapters import LoraSettings, apply_lora

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    model = apply_lora(
        transformers.LlamaForCausalLM(cfg), LoraSettings(target_modules=r"model.layers.[\d]+.self_attn.(q|v)_proj")
    )
    adapted = sorted(n for n, m in model.named_modules() if n.endswith(".lora_A"))
    assert [n.split("layers.")[1] for n in adapted] == [
        "0.self_attn.q_proj.lora_A",
        "0.self_attn.v_proj.lora_A",
        "1.self_attn.q_proj.lora_A",
        "1.self_attn.v_proj.lora_A",
    ]
    with pytest.raises(ValueError, match=r"^lora_target_modules: the regex '\S+' matches no module"):
        apply_lora(transformers.LlamaForCausalLM(cfg), LoraSettings(target_modules=r"layers\.9\..*"))
    # with lora_target_linear the string is one more name, as Axolotl adds it to the linear layers' names
    both = apply_lora(transformers.LlamaForCausalLM(cfg), LoraSettings(target_modules="q_proj", target_linear=True))
    assert any(n.endswith("mlp.down_proj.lora_A") for n, _ in both.named_modules())


def test_the_configured_chat_template_is_saved_with_the_model(tiny_llama, tmp_path):
    """Axolotl's chat_template: 'the selected chat template will be saved to the tokenizer_config.json
    for easier inferencing' (load_tokenizer sets tokenizer.chat_template). The run trained on
    Llama 3 turns but saved the tokenizer's own ChatML template, so apply_chat_template on the
    output prompted the model in a format it was not trained on."""
    from lowprec.train.chat_templates import TEMPLATES

    chats = os.path.join(ROOT, "examples", "data", "chat_tiny.jsonl")
    cfg = parse_config(
        {
            **FAST,
            "sequence_len": 256,
            "base_model": tiny_llama,
            "datasets": [{"path": chats, "type": "chat_template"}],
            "chat_template": "llama3",
            "output_dir": str(tmp_path / "run"),
            "max_steps": 1,
            "val_set_size": 0,
            "fp8": False,
        }
    )
    train(cfg)
    saved = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "run"))
    assert saved.chat_template == TEMPLATES["llama3"]


def test_a_qlora_evaluation_leaves_the_4bit_base_as_training_runs_it(tiny_llama_64):
    """On CPU bitsandbytes packs a Linear4bit's weights for its inference kernel at the first
    eval-mode forward (the run's first evaluation), and training then ran on the packed weights:
    a QLoRA run resumed from a checkpoint taken after an evaluation (a fresh, unpacked base)
    never matched the uninterrupted run (losses apart from the first resumed step). The trainer's
    4-bit base is never packed, so evaluating changes nothing the run trains with."""
    pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (dev extra)")
    from lowprec.train.hf_model import load_causal_lm

    model = load_causal_lm(tiny_llama_64, load_in_4bit=True)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = model(ids).logits.detach()
    model.eval()
    with torch.no_grad():
        model(ids)  # an evaluation
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        again = model(ids).logits.detach()
    assert torch.equal(fresh, again), (fresh - again).abs().max()
    packed = [m for m in model.modules() if getattr(getattr(m, "weight", None), "quant_state", None) is not None]
    assert packed and not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in packed)


def test_saving_a_4bit_model_state_leaves_its_packed_weights_as_they_were(tiny_llama_64):
    """Accelerator.save_state of a bitsandbytes 4-bit model whose weights an evaluation packed for
    the CPU kernel: Linear4bit.state_dict() unpacks them in place, lossily (logits moved by ~1e-3
    at each save). The saved model state leaves the frozen 4-bit weights out (load_state never
    loads them back), and saving changes nothing."""
    pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (dev extra)")
    from lowprec.train.adapters import LoraSettings, apply_lora
    from lowprec.train.hf_model import load_causal_lm
    from lowprec.utils.distributed import full_model_state_dict

    base = load_causal_lm(tiny_llama_64, load_in_4bit=True)
    for m in base.modules():  # as transformers loads it (the trainer turns packing off)
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = True
    model = apply_lora(base, LoraSettings(target_linear=True)).eval()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)  # an evaluation: packed where the CPU has the kernel
        before = model(ids).logits
        sd = full_model_state_dict(model, checkpoint=True)
        after = model(ids).logits
    assert torch.equal(before, after), (before - after).abs().max()
    assert any(".lora_A." in k for k in sd) and not any("base_layer.weight" in k for k in sd)
    # a saved model (save_model, get_state_dict), not a checkpoint, keeps the 4-bit weights
    assert any("base_layer.weight" in k for k in full_model_state_dict(model))
