"""The built-in Llama-style model: shapes, loss semantics, sizes, init, GQA, masks, autocast,
torch.compile. Everything runs on CPU in a few seconds; large sizes are built on the meta
device (no memory)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec.train.model import (
    MODEL_NAMES,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    build_model,
)

MICRO = dict(vocab_size=272, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)


def micro(**kw) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**{**MICRO, **kw}))


def test_shapes_and_output_fields():
    torch.manual_seed(0)
    m = build_model("llama-tiny")
    x = torch.randint(0, 259, (3, 20))
    out = m(x)
    assert out.loss is None
    assert out.logits.shape == (3, 20, 272)
    out = m(input_ids=x, labels=x)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    # near-uniform predictions at init: loss within 0.5 nats of ln(vocab)
    assert abs(out.loss.item() - math.log(272)) < 0.5


def test_loss_is_shifted_cross_entropy_and_ignores_minus_100():
    torch.manual_seed(1)
    m = micro()
    x = torch.randint(0, 259, (2, 12))
    labels = x.clone()
    labels[0, 5:] = -100
    out = m(x, labels=labels)
    logits = out.logits
    # HF semantics: position t predicts labels[t + 1]; masked targets drop out of the mean
    keep = labels[:, 1:] != -100
    ref = F.cross_entropy(logits[:, :-1][keep].double(), labels[:, 1:][keep])
    assert keep.sum() == 2 * 11 - 7
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)


def test_llama_tiny_learns_a_fixed_batch():
    torch.manual_seed(0)
    m = build_model("llama-tiny")
    batch = {"input_ids": torch.randint(0, 259, (4, 32))}
    batch["labels"] = batch["input_ids"]
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = m(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    # random tokens: only memorisation lowers the loss, from ~ln(272) = 5.6
    assert losses[0] > 5.0
    assert losses[-1] < 0.3 * losses[0], losses[::5]


def test_tied_and_untied_parameter_counts():
    tied = build_model("llama-tiny")
    untied = build_model("llama-tiny", tie_embeddings=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert untied.num_parameters() - tied.num_parameters() == 272 * 128
    for m in (tied, untied):
        assert m.num_parameters() == m.config.num_parameters()
        assert m.num_parameters(exclude_embeddings=True) == m.config.num_parameters(exclude_embeddings=True)
    assert tied.num_parameters(True) == untied.num_parameters(True)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_linear_dim_is_a_multiple_of_16(name):
    with torch.device("meta"):
        m = build_model(name)
    linears = [(n, mod) for n, mod in m.named_modules() if isinstance(mod, nn.Linear)]
    per_layer = 4 if m.config.n_experts else 7  # an MoE layer's experts are 3-D Parameters, not Linears
    assert len(linears) == per_layer * m.config.n_layers + 1
    for n, mod in linears:
        assert mod.in_features % 16 == 0 and mod.out_features % 16 == 0, (n, mod)
    assert m.model.embed_tokens.num_embeddings % 16 == 0
    assert m.num_parameters() == m.config.num_parameters()


def test_named_sizes():
    counts = {}
    for name in MODEL_NAMES:
        with torch.device("meta"):
            counts[name] = build_model(name).num_parameters()
    assert 0.9e9 <= counts["llama-1b"] <= 1.3e9
    assert 20e6 <= counts["llama-small"] <= 30e6
    assert 100e6 <= counts["llama-base"] <= 150e6
    assert counts["llama-tiny"] < 2e6
    cfg = LlamaConfig.from_name("llama-1b")
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (2048, 32, 8, 64)
    assert cfg.max_seq_len >= 2048


def test_hugging_face_module_names():
    names = {n for n, _ in build_model("llama-tiny").named_modules()}
    for suffix in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ):
        assert f"model.layers.3.{suffix}" in names
    assert {"model.embed_tokens", "model.norm", "lm_head"} <= names
    assert isinstance(build_model("llama-tiny").model.layers[0], LlamaDecoderLayer)
    # no buffers: the state dict is exactly the HF parameter names
    assert not list(build_model("llama-tiny").buffers())


def test_init_is_deterministic_and_scales_residual_projections():
    torch.manual_seed(123)
    a = build_model("llama-tiny")
    torch.manual_seed(123)
    b = build_model("llama-tiny")
    for (na, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), na
    layer = a.model.layers[1]
    std, resid = 0.02, 0.02 / math.sqrt(2 * 4)
    assert abs(layer.self_attn.q_proj.weight.std().item() - std) < 0.1 * std
    assert abs(layer.self_attn.o_proj.weight.std().item() - resid) < 0.1 * resid
    assert abs(layer.mlp.down_proj.weight.std().item() - resid) < 0.1 * resid
    assert torch.equal(layer.input_layernorm.weight, torch.ones(128))


def test_meta_build_then_materialise_matches_eager_build():
    eager = micro()
    torch.manual_seed(7)
    eager.init_weights()  # init_weights is a function of the RNG state alone
    with torch.device("meta"):
        m = micro()
    m.to_empty(device="cpu")
    torch.manual_seed(7)
    m.init_weights()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    for k, v in eager.state_dict().items():
        assert torch.equal(v, m.state_dict()[k]), k


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(2)
    gqa = LlamaForCausalLM(LlamaConfig(**{**MICRO, "n_heads": 4, "n_kv_heads": 2, "dim": 64}))
    mha = LlamaForCausalLM(LlamaConfig(**{**MICRO, "n_heads": 4, "n_kv_heads": 4, "dim": 64}))
    sd = gqa.state_dict()
    hd = 16
    for k in list(sd):
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            # HF repeat_kv: kv head j serves query heads j*rep ... j*rep + rep - 1
            sd[k] = sd[k].view(2, hd, 64).repeat_interleave(2, dim=0).reshape(4 * hd, 64)
    mha.load_state_dict(sd)
    x = torch.randint(0, 259, (2, 10))
    torch.testing.assert_close(gqa(x).logits, mha(x).logits, rtol=1e-5, atol=1e-5)


def test_attention_mask_hides_left_padding():
    torch.manual_seed(3)
    m = micro()
    x = torch.randint(0, 256, (1, 10))
    pad = torch.full((1, 4), 258)
    padded = torch.cat([pad, x], dim=1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 10)], dim=1).long()
    ref = m(x).logits
    out = m(padded, attention_mask=mask).logits
    assert torch.isfinite(out).all()
    # RoPE is relative, so masking the pads makes the real tokens' logits position-invariant
    torch.testing.assert_close(out[:, 4:], ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(m(padded).logits[:, 4:], ref, atol=1e-4)
    # an all-ones mask is the plain causal path
    torch.testing.assert_close(m(x, attention_mask=torch.ones_like(x)).logits, ref, rtol=1e-5, atol=1e-5)


def test_autocast_bf16_forward_and_backward():
    torch.manual_seed(4)
    m = micro()
    x = torch.randint(0, 259, (2, 16))
    ref = m(x, labels=x).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x, labels=x)
    assert out.logits.dtype == torch.bfloat16
    assert out.loss.dtype == torch.float32
    assert abs(out.loss.item() - ref.item()) < 0.02 * ref.item()
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_torch_compile_fullgraph_forward_backward_matches_eager():
    torch.manual_seed(5)
    m = micro(n_layers=1)
    x = torch.randint(0, 259, (2, 16))
    # aot_eager: dynamo must trace the whole model (fullgraph) and AOT autograd the backward;
    # inductor's C++ codegen would add ~15 s and tests nothing about our code.
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    loss = compiled(x, labels=x).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    ref = m(x, labels=x).loss
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
    torch._dynamo.reset()


def test_sequence_longer_than_max_seq_len_is_a_clear_error():
    m = micro(max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_config_validation_messages():
    assert LlamaConfig(**{**MICRO, "vocab_size": 259}).vocab_size == 272
    assert LlamaConfig.from_name("llama-tiny", n_layers=2).n_layers == 2
    assert LlamaConfig.from_name("LLAMA_TINY").name == "llama-tiny"
    assert LlamaConfig(**{**MICRO, "n_kv_heads": None}).n_kv_heads == 2
    cases = [
        (dict(dim=40, n_heads=2), "dim=40 must be a multiple of 16"),
        (dict(ffn_dim=100), "ffn_dim=100 must be a multiple of 16.*use 96 or 112"),
        (dict(n_heads=3), "not divisible by n_heads=3"),
        (dict(dim=64, n_heads=4, n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
        (dict(dim=32, n_heads=4, n_kv_heads=1), "n_kv_heads \\* head_dim = 1 \\* 8"),
        (dict(n_layers=0), "n_layers must be a positive integer"),
        (dict(tie_embeddings="yes"), "tie_embeddings must be true or false"),
        (dict(rope_theta=-1.0), "rope_theta must be a positive number"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            LlamaConfig(**{**MICRO, **kw})
    cfg = LlamaConfig.from_name("llama-small", n_layers=3)
    assert LlamaConfig(**cfg.to_dict()) == cfg and cfg.to_dict()["name"] == "llama-small"
    with pytest.raises(ValueError, match="did you mean 'llama-tiny'"):
        LlamaConfig.from_name("llama-tiy")
    with pytest.raises(ValueError, match="did you mean 'n_layers'"):
        LlamaConfig.from_name("llama-tiny", n_layer=2)
    with pytest.raises(TypeError, match="model name"):
        build_model(3)


def test_flops_per_token_matches_the_6n_rule():
    cfg = LlamaConfig.from_name("llama-1b")
    n_matmul = cfg.num_parameters(exclude_embeddings=True) - (2 * cfg.n_layers + 1) * cfg.dim + cfg.vocab_size * cfg.dim
    assert cfg.flops_per_token(2048) == 6 * n_matmul + 12 * cfg.n_layers * cfg.dim * 2048
