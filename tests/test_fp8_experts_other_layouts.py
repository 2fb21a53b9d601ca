"""Mixture-of-experts models whose experts are not in a layout the grouped FP8 GEMMs run
(transformers 5's Llama 4: ``Llama4TextExperts``, a batched ``bmm`` over every expert; JetMoE's
``JetMoeParallelExperts``; built from small configs, nothing downloaded). ``fp8.convert`` keeps
their experts in high precision; it must say so, never report an FP8 model whose experts, most
of its GEMMs, silently run in bf16."""

from __future__ import annotations

import logging
import re

import pytest
import torch

pytest.importorskip("transformers")

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.fp8.modules.experts import Float8Experts  # noqa: E402


def _llama4():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    cfg = Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=1,
    )  # fmt: skip
    return Llama4ForCausalLM(cfg)


def _jetmoe():
    from transformers import JetMoeConfig, JetMoeForCausalLM

    torch.manual_seed(0)
    cfg = JetMoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_key_value_heads=2,
        kv_channels=16, num_local_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    return JetMoeForCausalLM(cfg)


def test_llama4_experts_kept_in_high_precision_are_reported_and_logged(caplog):
    """Llama 4's experts stayed in bf16 with no warning; the summary line the trainer prints said
    '4 kept in high precision (Linear 2, expert projections 2)' (the two 'expert projections' being
    its routers, a Linear subclass) and 'MoE: 0 experts module(s)'."""
    m = _llama4()
    with caplog.at_level(logging.WARNING, logger="lowprec.fp8"):
        report = fp8.convert(m, "tensorwise")
    names = [f"model.layers.{i}.feed_forward.experts" for i in range(2)]
    assert report.experts_kept == [(n, "Llama4TextExperts") for n in names]
    assert not any(isinstance(mod, Float8Experts) for mod in m.modules())
    warned = [r.getMessage() for r in caplog.records if "experts module(s) stay in high precision" in r.getMessage()]
    assert len(warned) == 1 and "Llama4TextExperts" in warned[0] and names[0] in warned[0], warned
    line = report.summary()
    kept = re.search(r"(\d+) kept in high precision \(([^)]*)\)", line)
    assert kept is not None and "expert projections" not in kept.group(2), line
    counts = [int(part.rsplit(" ", 1)[1]) for part in kept.group(2).split(", ")]
    assert sum(counts) == int(kept.group(1)) == len(report.skipped), line
    assert "2 experts module(s) in high precision (Llama4TextExperts)" in line, line
    text = str(report)
    assert all(f"experts kept {n}  (Llama4TextExperts:" in text for n in names), text
    assert report.to_dict()["experts_kept"][0] == {"name": names[0], "type": "Llama4TextExperts"}
    # the model still trains (its experts in high precision, the rest in FP8)
    x = torch.randint(0, 128, (2, 8))
    m(input_ids=x, labels=x).loss.backward()
    assert m.model.layers[0].feed_forward.experts.gate_up_proj.grad is not None


def test_jetmoe_parallel_experts_are_reported_and_fused_experts_are_not():
    report = fp8.convert(_jetmoe(), "rowwise")
    assert {t for _, t in report.experts_kept} == {"JetMoeParallelExperts"}
    assert "model.layers.0.mlp.input_linear" in dict(report.experts_kept)
    from tests.tiny_moe import MODELS, build

    for name in MODELS:  # transformers' fused experts convert: nothing reported as kept
        report = fp8.convert(build(name), "rowwise")
        assert report.experts and not report.experts_kept, (name, report.experts_kept)
