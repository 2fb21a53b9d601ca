"""FP8-saved activations of the non-Linear ops (lowprec/fp8/modules/activations.py).

Bounds: only the saved copies are rounded (E4M3, one scale per row: relative error <= 2^-4 per
normal value), so the forward is bit-identical to the plain expression and each gradient's
SQNR against float64 stays near E4M3's ~31 dB (measured 30.2-33.0 dB over 10 draws for SwiGLU
and RMSNorm's weight gradient, 53-59 dB for RMSNorm's input gradient); 26 dB is asserted.
Saved bytes are counted with saved-tensor hooks (deterministic, nothing timed)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import lowprec.fp8 as fp8
from lowprec.fp8.modules import activations
from lowprec.fp8.modules.activations import rms_norm, swiglu
from lowprec.train.model import build_model
from tests.conftest import sqnr

MIN_SQNR_DB = 26.0


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _rows(rows: int, cols: int, dtype: torch.dtype, offset: float = 0.0) -> torch.Tensor:
    """Random rows whose magnitudes span five decades (tokens differ in scale)."""
    mag = torch.logspace(-3, 2, rows)[:, None]
    return ((torch.randn(rows, cols) + offset) * mag).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_same_output_gradients_within_e4m3_bound(seed, dtype):
    gate, up, dy = _rows(96, 160, dtype) * 2, _rows(96, 160, dtype), torch.randn(96, 160).to(dtype)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    (F.silu(g64) * u64).backward(dy.double())
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    with fp8.autocast():
        out, saved = _saved_bytes(lambda: swiglu(g, u))
    out.backward(dy)
    assert torch.equal(out, F.silu(gate) * up)  # the forward is the plain expression
    assert g.grad.dtype == u.grad.dtype == dtype
    assert sqnr(g64.grad, g.grad) >= MIN_SQNR_DB and sqnr(u64.grad, u.grad) >= MIN_SQNR_DB
    # gate and up in E4M3 plus one float32 scale per row each; plain autograd keeps gate,
    # silu(gate) and up in the input dtype
    assert saved == 2 * (gate.numel() + 96 * 4)
    _, plain = _saved_bytes(lambda: F.silu(gate.clone().requires_grad_()) * up.clone().requires_grad_())
    assert plain == 3 * gate.numel() * gate.element_size()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_same_output_gradients_within_e4m3_bound(seed, dtype):
    x, w, dy = _rows(64, 192, dtype, offset=0.3), 1 + 0.1 * torch.randn(192), torch.randn(64, 192).to(dtype)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    (w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)).backward(dy.double())
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    with fp8.autocast():
        out, saved = _saved_bytes(lambda: rms_norm(xs, ws, 1e-5))
    out.backward(dy)
    h = x.float()
    assert torch.equal(out, w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype))
    assert xs.grad.dtype == dtype and ws.grad.dtype == torch.float32
    assert sqnr(x64.grad, xs.grad) >= MIN_SQNR_DB and sqnr(w64.grad, ws.grad) >= MIN_SQNR_DB
    # x in E4M3, its row scales and the exact 1/rms per row (the weight is a Parameter anyway)
    assert saved == x.numel() + 2 * 64 * 4 + w.numel() * 4


def test_a_disabled_fp8_region_runs_the_plain_ops():
    gate, up = torch.randn(8, 32, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    with fp8.autocast(enabled=False):
        _, saved = _saved_bytes(lambda: swiglu(gate, up))
    assert saved == 3 * gate.numel() * 4  # inside fp8.autocast(enabled=False): nothing cast
    _, saved_on = _saved_bytes(lambda: swiglu(gate, up))
    assert saved_on < saved  # outside every region, as for the Linears: E4M3 copies saved


def _tiny():
    torch.manual_seed(0)
    return build_model("llama-tiny", n_layers=2)


def _step(model, ids, ckpt=False):
    if ckpt:
        model.gradient_checkpointing_enable()
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8.autocast():
        out, saved = _saved_bytes(lambda: model(ids, labels=ids))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), saved, grads


def test_convert_option_built_in_model_saves_less_same_loss():
    base = _tiny()
    ids = torch.randint(0, base.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    plain, acts = copy.deepcopy(base), copy.deepcopy(base)
    assert fp8.convert(plain, "tensorwise").fp8_activations == []
    report = fp8.convert(acts, fp8.Recipe.from_name("tensorwise", fp8_activations=True))
    # 2 norms + the MLP per layer, and the final norm
    assert report.fp8_activations == [
        f"model.layers.{i}.{m}" for i in range(2) for m in ("input_layernorm", "post_attention_layernorm", "mlp")
    ] + ["model.norm"]
    assert "fp8_activations" in report.to_dict() and "E4M3 activations" in str(report)
    loss0, saved0, grads0 = _step(plain, ids)
    loss1, saved1, grads1 = _step(acts, ids)
    assert torch.equal(loss0, loss1)  # forward unchanged
    assert saved1 < 0.75 * saved0  # counted bytes: measured 0.62x on this model
    for name, g in grads0.items():  # the FP8 GEMMs' error dominates (model SQNR ~18-30 dB either way)
        assert sqnr(g, grads1[name]) > 15, name
    # activation checkpointing recomputes the same casts: gradients bit-identical
    _, _, grads2 = _step(copy.deepcopy(acts), ids, ckpt=True)
    assert all(torch.equal(grads1[n], grads2[n]) for n in grads1)
    # no new state: the state_dict (checkpoints, resume) is the same as without the option
    assert plain.state_dict().keys() == acts.state_dict().keys()
    assert fp8.unconvert(acts) == report.num_converted and not acts.model.norm.fp8_activations


def test_hf_llama_modules_switch_and_back():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
    norm_cls = type(model.model.norm)
    report = fp8.convert(model, fp8.Recipe.from_name("tensorwise", fp8_activations=True))
    assert sorted(report.fp8_activations) == [
        "model.layers.0.input_layernorm",
        "model.layers.0.mlp",
        "model.layers.0.post_attention_layernorm",
        "model.norm",
    ]
    assert isinstance(model.model.norm, norm_cls) and type(model.model.norm) is not norm_cls
    switched = type(model.model.norm)
    activations.enable(model)  # twice: no subclass of the subclass
    assert type(model.model.norm) is switched and type(model.model.norm).__mro__[1] is norm_cls
    with torch.no_grad(), fp8.autocast(enabled=False):  # FP8 off: the switched modules compute the same
        assert torch.equal(model(ids).logits, ref)
    with fp8.autocast():
        _, saved = _saved_bytes(lambda: model(ids, labels=ids).loss)
    assert activations.disable(model) == 4 and type(model.model.norm) is norm_cls
    with fp8.autocast():  # the same FP8 Linears, plain norms and MLP products: more is saved
        _, plain = _saved_bytes(lambda: model(ids, labels=ids).loss)
    assert saved < 0.9 * plain


def test_recipe_field_is_validated_and_reaches_the_trainer_spec():
    from lowprec.train.config.fp8 import FP8RecipeSpec

    with pytest.raises(ValueError, match="fp8_activations must be true or false"):
        fp8.Recipe.from_name("tensorwise", fp8_activations="yes")
    spec = FP8RecipeSpec(name="rowwise", fp8_activations=True)
    assert spec.to_recipe().fp8_activations and not fp8.Recipe.from_name("rowwise").fp8_activations


def test_resume_from_a_state_dict_is_bit_identical():
    """The option adds no state: 2 steps in one go equal 1 step, a save/load round trip of the
    model and optimizer state (weights_only) into a freshly converted model, and 1 more step."""
    import io

    recipe = fp8.Recipe.from_name("tensorwise", fp8_activations=True)
    ids = [torch.randint(0, 272, (1, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]

    def fresh():
        model = _tiny()
        fp8.convert(model, recipe)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model, opt, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8.autocast():
            model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    a, opt_a = fresh()
    for batch in ids:
        step(a, opt_a, batch)
    b, opt_b = fresh()
    step(b, opt_b, ids[0])
    buf = io.BytesIO()
    torch.save({"model": b.state_dict(), "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    c, opt_c = fresh()
    c.load_state_dict(state["model"])
    opt_c.load_state_dict(state["opt"])
    step(c, opt_c, ids[1])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
