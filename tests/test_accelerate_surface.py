

def test_gpt2_conv1d_layers_are_reported():
    transformers = pytest.importorskip("transformers", reason="needs transformers (dev extra)")
    from lowprec.fp8 import convert

    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=16)
    report = convert(transformers.GPT2LMHeadModel(cfg))
    reasons = dict(report.skipped)
    conv1d = [n for n, r in reasons.items() if "Conv1D" in r]
    assert sorted(conv1d) == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                              "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
