"""FP8 mixture-of-experts blocks of real transformers models (built from small configs: hidden 64,
8 experts, top-2; nothing downloaded): Mixtral, Qwen3-MoE, Qwen2-MoE (shared expert), gpt-oss
(transposed experts with biases and a clamped GLU) and DeepSeek-V3 (group-limited routing,
shared experts) keep their fused 3-D experts as Parameters; ``fp8.convert`` runs them as grouped
FP8 GEMMs (``fp8/modules/experts.py``).

Numerics: the MoE block's output, input gradient and every parameter gradient against the same
block in float64 (router and expert weights included). Two FP8 GEMMs in series (gate_up, then
down) sit below one Linear's floors: measured 23.1-24.9 dB output and 20.4-28.5 dB gradients for
the FP8 recipes, 11.5-13.0 / 9.0-20.5 for nvfp4; floors 21 / 18 and 9 / 7 (docs/LOG.md,
2026-11-27). A group multiplied by another expert's weight gives ~0 dB.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

pytest.importorskip("transformers")

import lowprec.fp8 as fp8
from lowprec.fp8.modules.experts import Float8Experts
from lowprec.fp8.convert import _ROUTER_WHY
from tests.conftest import sqnr
from tests.tiny_moe import MODELS, ROUTER, build, moe_block

RECIPES = list(fp8.RECIPE_NAMES)


def _run(block, x, dy):
    xt = x.clone().to(next(block.parameters()).dtype).requires_grad_()
    out = block(xt)
    out = out[0] if isinstance(out, tuple) else out  # gpt-oss returns (hidden, router scores)
    out.backward(dy.to(out.dtype))
    return out, xt.grad


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("model", list(MODELS))
def test_moe_block_against_float64(seed, model, name):
    block = moe_block(build(model, seed))
    ref = copy.deepcopy(block).double()
    report = fp8.convert(block, name, skip_first_last=False)
    assert len(report.experts) == 1 and isinstance(block.experts, Float8Experts)
    x, dy = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    out, gx = _run(block, x, dy)
    out64, gx64 = _run(ref, x, dy)
    fp4 = name == "nvfp4"
    floor_out, floor_grad = (9, 7) if fp4 else (21, 18)
    assert sqnr(out64, out) >= floor_out, f"output {sqnr(out64, out):.1f} dB"
    assert sqnr(gx64, gx) >= floor_grad, f"grad_input {sqnr(gx64, gx):.1f} dB"
    named = dict(ref.named_parameters())
    for n, p in block.named_parameters():
        r = named[n]
        if r.grad is None or torch.count_nonzero(r.grad) == 0:
            continue
        floor = 100 if n.endswith("down_proj_bias") else floor_grad  # added in high precision
        assert sqnr(r.grad, p.grad) >= floor, f"{n}: {sqnr(r.grad, p.grad):.1f} dB"


@pytest.mark.parametrize("model", list(MODELS))
def test_conversion_keeps_parameters_keys_and_class(model):
    m = build(model)
    keys, ids = list(m.state_dict()), {n: id(p) for n, p in m.named_parameters()}
    plain = {k: v.clone() for k, v in m.state_dict().items()}
    experts_cls = type(moe_block(m).experts)
    report = fp8.convert(m, "delayed")
    experts = moe_block(m).experts
    assert isinstance(experts, experts_cls) and isinstance(experts, Float8Experts)  # a subclass of its own class
    assert {n: id(p) for n, p in m.named_parameters()} == ids  # the same Parameter objects
    with_state = m.state_dict()
    assert [k for k in with_state if "fp8_" not in k] == keys  # plus delayed scaling's own state
    assert all(k.rpartition(".")[2] in fp8.kinds.state_buffers() for k in set(with_state) - set(keys))
    assert list(fp8.plain_state_dict(m)) == keys
    m.load_state_dict(plain, strict=True)  # a plain checkpoint loads into the converted model
    # the report names every experts module and every router, kept in high precision
    layers = m.config.num_hidden_layers
    assert [n for n, _, _ in report.experts] == [f"model.layers.{i}.mlp.experts" for i in range(layers)]
    routers = [n for n, _ in report.routers]
    assert [f"model.layers.{i}.mlp.{ROUTER[model]}" for i in range(layers)] == [r for r in routers if "shared" not in r]
    for r in routers:
        assert not isinstance(m.get_submodule(r), (fp8.Float8Linear, Float8Experts))
    assert "router model.layers.0.mlp." in str(report) and "experts module(s)" in report.summary()
    d = report.to_dict()
    assert d["experts"][0]["num_experts"] == 8 and [p["projection"] for p in d["experts"][0]["fp8"]] == [
        "gate_up_proj",
        "down_proj",
    ]
    assert fp8.has_fp8_layers(m)
    # deepcopy and pickling rebuild the run-time class
    x = torch.randint(0, 128, (2, 8))
    m.train()
    for other in (copy.deepcopy(m), _pickled(m)):
        assert type(moe_block(other).experts) is type(experts)
        torch.testing.assert_close(other(x).logits, m(x).logits)
    assert fp8.unconvert(m) >= layers and type(moe_block(m).experts) is experts_cls
    assert list(m.state_dict()) == keys and {n: id(p) for n, p in m.named_parameters()} == ids


def _pickled(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("model", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_whole_model_in_fp8_close_to_float64(seed, model):
    m = build(model, seed)
    ref = copy.deepcopy(m).double()
    fp8.convert(m, "rowwise")
    x = torch.randint(0, 128, (2, 16))
    loss = m(x, labels=x).loss
    loss64 = ref(x, labels=x).loss
    loss.backward()
    loss64.backward()
    assert abs(loss.item() - loss64.item()) < 0.01 * loss64.item()
    # per-parameter gradients are compared on the MoE block above: through a whole model a
    # token whose top-2 is a near tie can pick another expert in FP8 than in float64, moving
    # its gradient from one expert's slice to another's (that alone gives ~7 dB on an expert)
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def test_skip_patterns_and_filters_reach_the_experts():
    m = build("mixtral")
    report = fp8.convert(m, "tensorwise", skip_patterns=("down_proj",))
    experts = moe_block(m).experts
    assert list(experts.fp8_gemms()) == ["gate_up_proj"]  # down_proj runs in high precision
    assert ("model.layers.0.mlp.experts.down_proj", "name matches 'down_proj'") in report.skipped
    m = build("mixtral")
    report = fp8.convert(m, "tensorwise", skip_patterns=("*.layers.1.mlp.experts.*",))
    assert [n for n, _, _ in report.experts] == ["model.layers.0.mlp.experts"]
    assert not isinstance(m.model.layers[1].mlp.experts, Float8Experts)
    m = build("mixtral")
    report = fp8.convert(m, "tensorwise", module_filter=lambda mod, fqn: "experts" not in fqn)
    assert not report.experts and ("model.layers.0.mlp.experts", "module_filter returned False") in report.skipped
    assert "MixtralExperts" in report.kept_types


def test_eval_mode_and_fp8_off_run_the_class_own_forward(seed):
    block = moe_block(build("qwen3_moe", seed))
    ref = copy.deepcopy(block)
    fp8.convert(block, "rowwise", skip_first_last=False)
    x = torch.randn(1, 8, 64)
    assert_own_forward_unless_fp8(block, ref, x)
    assert int(block.experts.tokens_per_expert.sum()) == 8 * 2  # top-2 of 8 tokens


def assert_own_forward_unless_fp8(block, ref, x):
    """``block`` (converted) gives ``ref``'s (its unconverted copy) output bit for bit with FP8 off and
    in eval mode, and another in training mode."""
    with fp8.autocast(enabled=False):
        assert torch.equal(block(x), ref(x))
    block.eval()
    ref.eval()
    assert torch.equal(block(x), ref(x))
    block.train()
    assert not torch.equal(block(x), ref(x))


def test_a_region_recipe_needs_the_experts_state():
    block = moe_block(build("mixtral"))
    fp8.convert(block, "tensorwise", skip_first_last=False)
    with pytest.raises(ValueError, match="asks for delayed scaling.*amax history"):
        with fp8.autocast(recipe=fp8.Recipe.from_name("delayed")):
            block(torch.randn(1, 4, 64))


def test_expert_parallel_is_refused():
    block = moe_block(build("mixtral"))
    fp8.convert(block, "tensorwise", skip_first_last=False)
    block.experts._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert parallelism is not supported"):
        block(torch.randn(1, 4, 64))


def _switch_transformers():
    """A small SwitchTransformers (16 experts as separate nn.Linear layers; router a Linear)."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    cfg = SwitchTransformersConfig(
        vocab_size=128,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        num_experts=16,
        expert_capacity=64,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
    )
    return SwitchTransformersForConditionalGeneration(cfg)


def test_per_expert_linear_layers_convert_and_the_router_stays():
    """SwitchTransformers keeps its experts as separate nn.Linear layers (wi, wo) and its router
    as ``router.classifier``, a Linear too (16 experts: dims pass the multiple-of-16 rule)."""
    m = _switch_transformers()
    report = fp8.convert(m, "tensorwise")
    converted = [n for n, _, _ in report.converted]
    assert "encoder.block.1.layer.1.mlp.experts.expert_3.wi" in converted
    router = "encoder.block.1.layer.1.mlp.router.classifier"
    assert (router, _ROUTER_WHY) in report.skipped
    assert (router, "Linear") in report.routers and type(m.get_submodule(router)) is torch.nn.Linear
    ids = torch.randint(0, 128, (2, 8))
    out = m(input_ids=ids, decoder_input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_mixtral_trains_through_the_accelerator_and_a_skipped_step_restores_expert_state(seed):
    """Delayed scaling: the experts' per-expert histories are staged with the Linear layers'
    (fp8/step_stage.py), so a step the non-finite guard skips leaves them as it found them."""
    from lowprec import Accelerator
    from lowprec.fp8.step_stage import ScalingStage
    from lowprec.utils import NativeRecipeKwargs

    m = build("mixtral", seed)
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[NativeRecipeKwargs(recipe="delayed")])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m, opt = acc.prepare(m, opt)
    experts = moe_block(m).experts
    assert isinstance(experts, Float8Experts)
    x = torch.randint(0, 128, (2, 16))
    losses = []
    for _ in range(4):
        loss = m(x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    hist = experts.fp8_gate_up_proj.fp8_amax_history_input
    assert int(hist.count_nonzero()) > 0
    stage = ScalingStage(m)
    before = hist.clone()
    m(x, labels=x).loss.backward()  # a step whose update is then thrown away
    assert not torch.equal(hist, before)
    stage.discard()
    assert torch.equal(hist, before)


def test_delayed_experts_over_several_processes_are_refused():
    from lowprec.backends.base import PrepareContext
    from lowprec.backends.engines.native import NativeBackend

    m = build("mixtral")
    backend = NativeBackend(fp8.Recipe.from_name("delayed"))
    with pytest.raises(ValueError, match="per-expert amax histories cannot be agreed across ranks"):
        backend.convert(m, PrepareContext(distributed_type="MULTI"))
    ok = NativeBackend(fp8.Recipe.from_name("rowwise"))
    ok.convert(build("mixtral"), PrepareContext(distributed_type="MULTI"))


def test_a_linear_only_library_says_the_experts_stay_in_high_precision(caplog):
    import logging

    from lowprec.backends.engines.shared import note_unconverted_conv1d

    with caplog.at_level(logging.INFO, logger="lowprec"):
        note_unconverted_conv1d(build("qwen3_moe"), "torchao-test")
    assert "torchao-test converts nn.Linear only: 2 mixture-of-experts module(s)" in caplog.text


def test_the_cost_model_filter_judges_experts_per_expert_gemm():
    """Mixtral-8x7B's expert shapes (meta device: no memory): with 32768 tokens per step each
    expert gets 8192 rows (top-2 of 8) and rowwise FP8 is predicted faster on an H100 (1.17x,
    1.12x); with 8192 tokens, 2048 rows, it is not (0.84x, 0.80x)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=1024,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    with torch.device("meta"):
        m = MixtralForCausalLM(cfg)
    experts = moe_block(m).experts
    assert fp8.auto_module_filter(32768, "rowwise", "h100")(experts, "model.layers.0.mlp.experts")
    assert not fp8.auto_module_filter(8192, "rowwise", "h100")(experts, "model.layers.0.mlp.experts")


def test_a_router_stays_whatever_the_skip_patterns_and_asking_for_it_is_one_error():
    router = "encoder.block.1.layer.1.mlp.router.classifier"
    m = _switch_transformers()
    report = fp8.convert(m, "tensorwise", skip_patterns=())  # no "router" pattern: still kept
    assert type(m.get_submodule(router)) is torch.nn.Linear
    assert "encoder.block.1.layer.1.mlp.experts.expert_3.wi" in [n for n, _, _ in report.converted]
    m = _switch_transformers()
    with pytest.raises(ValueError, match=f"router '{router}' in FP8.*return False for it in module_filter"):
        fp8.convert(m, "tensorwise", module_filter=lambda module, fqn: True)
    assert type(m.get_submodule(router)) is torch.nn.Linear  # refused before anything was swapped


def test_lora_adapters_on_a_router_are_adapters_not_routers():
    """lora_target_linear puts peft adapters on Qwen2-MoE's shared_expert_gate too: its lora_A /
    lora_B are adapter layers (kept in high precision as adapters), not more routers. The report
    counted them as routers (8 for a 2-layer model with 4) and their kept reason as the router's."""
    peft = pytest.importorskip("peft")
    m = build("qwen2_moe")
    m = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["shared_expert_gate", "q_proj"]))
    report = fp8.convert(m, "tensorwise")
    routers = [n for n, _ in report.routers]
    assert not [n for n in routers if "lora_" in n], routers
    assert len(routers) == 2 * 2  # per layer: the top-k router and the shared-expert gate (its base_layer)
    skipped = dict(report.skipped)
    lora_a = "base_model.model.model.layers.0.mlp.shared_expert_gate.lora_A.default"
    assert skipped[lora_a].startswith("peft adapter layer"), skipped[lora_a]
    assert skipped["base_model.model.model.layers.0.mlp.shared_expert_gate.base_layer"] == _ROUTER_WHY


def test_the_summary_line_counts_what_it_keeps_by_kind():
    """fp8_filter: [mlp] on Mixtral keeps the experts' projections in high precision: the one-line
    summary said '6 kept in high precision (Linear 2)', the projections missing from the
    breakdown (the trainer prints this line)."""
    import re

    m = build("mixtral")
    report = fp8.convert(m, "tensorwise", skip_patterns=tuple(fp8.DEFAULT_SKIP_PATTERNS) + ("mlp",))
    line = report.summary()
    kept = re.search(r"(\d+) kept in high precision \(([^)]*)\)", line)
    assert kept is not None, line
    counts = [int(part.rsplit(" ", 1)[1]) for part in kept.group(2).split(", ")]
    assert sum(counts) == int(kept.group(1)) == len(report.skipped), line
    assert "expert projections 4" in kept.group(2), line
