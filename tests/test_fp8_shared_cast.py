"""Linears reading one tensor (q/k/v, gate/up) share its FP8 cast: same bits, fewer casts.

``fp8/modules/shared_cast.py``: the second and third Linear take the first one's cast of their common
input (and, on CPU, its bf16 upcast, in forward and in backward). These tests hold the sharing
to what it promises: bit-identical losses, gradients and scaling state with sharing on and off
(``LOWPREC_SHARE_CASTS=0``), on fresh random data, for every per-tensor/axis/block recipe; the
number of casts it saves; misses wherever the casts would differ (an in-place write to the input,
another scale, another tensor); and nothing left behind once a step is done.
"""

from __future__ import annotations

import gc

import pytest
import torch

import lowprec.fp8 as fp8
from lowprec.fp8.gemm import cpu as cpu_gemm
from lowprec.fp8.modules import linear_fn, shared_cast
from lowprec.train.model import build_model

RECIPES = ["tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise"]


def _train(recipe: str, share: bool, monkeypatch, steps: int = 2, seed: int | None = None):
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "1" if share else "0")
    seed = torch.seed() % 2**31 if seed is None else seed
    torch.manual_seed(seed)
    model = build_model("llama-tiny", max_seq_len=64, n_layers=2)
    fp8.convert(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for _ in range(steps):
        ids = torch.randint(0, 272, (2, 64))
        with fp8.autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, model.state_dict(), seed


@pytest.mark.parametrize("recipe", RECIPES)
def test_sharing_changes_no_bit(recipe, monkeypatch):
    seed = torch.seed() % 2**31  # fresh data each run, the same for both arms
    on = _train(recipe, True, monkeypatch, seed=seed)
    off = _train(recipe, False, monkeypatch, seed=seed)
    for a, b in zip(on[0], off[0]):
        assert torch.equal(a, b), f"seed {seed}"
    for ga, gb in zip(on[1], off[1]):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"{name}, seed {seed}"
    for name, value in on[2].items():
        assert torch.equal(value, off[2][name]), f"{name}, seed {seed}"


def _count_casts(monkeypatch, share: bool, recipe: str = "tensorwise") -> tuple[int, int]:
    """(input casts, bf16 upcasts) in one forward + backward of llama-tiny."""
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "1" if share else "0")
    casts, upcasts = [0], [0]
    cast_pair, upcast = linear_fn.cast_pair, cpu_gemm.upcast_to_bf16

    def counting_cast(t, *args, **kwargs):
        casts[0] += not isinstance(t, torch.nn.Parameter)  # inputs, not weights
        return cast_pair(t, *args, **kwargs)

    def counting_upcast(data):
        upcasts[0] += 1
        return upcast(data)

    monkeypatch.setattr(linear_fn, "cast_pair", counting_cast)
    monkeypatch.setattr(cpu_gemm, "upcast_to_bf16", counting_upcast)
    monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "upcast")
    model = build_model("llama-tiny", max_seq_len=32)
    fp8.convert(model, recipe)
    ids = torch.randint(0, 272, (2, 32))
    with fp8.autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    return casts[0], upcasts[0]


def test_casts_saved_per_block(monkeypatch):
    # llama-tiny: 4 blocks x 7 Linears, the first (layers.0.q_proj) kept in bf16 by the default
    # filter; 28 - 1 = 27 FP8 Linears, 27 input casts without sharing. With it, each block casts
    # its attention input once (q/k/v) and its MLP input once (gate/up), plus o_proj and
    # down_proj: 4 per block, minus block 0's q_proj input cast that k_proj now does: 16.
    off_casts, off_up = _count_casts(monkeypatch, share=False)
    on_casts, on_up = _count_casts(monkeypatch, share=True)
    assert off_casts == 27
    assert on_casts == 16
    # every shared input is upcast once instead of 2-3 times, in forward and again in backward
    assert on_up == off_up - 2 * (off_casts - on_casts)


def _layers(recipe: str = "tensorwise", n: int = 2):
    torch.manual_seed(0)
    layers = [
        fp8.Float8Linear.from_linear(torch.nn.Linear(64, 32, bias=False), fp8.Recipe.from_name(recipe))
        for _ in range(n)
    ]
    return layers


def test_in_place_write_between_layers_is_a_miss(monkeypatch):
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "1")
    a, b = _layers()
    x = torch.randn(16, 64)
    with fp8.autocast():
        a(x)
        with torch.no_grad():
            x.mul_(3.0)  # same tensor object, new values: the version counter moved
        shared = b(x)
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "0")
    with fp8.autocast():
        fresh = b(x)
    assert torch.equal(shared, fresh)


def test_other_scale_is_a_miss(monkeypatch):
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "1")
    a, b = _layers("delayed")
    with torch.no_grad():  # give b another input history, so another scale than a's
        b.fp8_amax_history_input.fill_(100.0)
        b.fp8_scale_input.fill_(448.0 / 100.0)
    x = torch.randn(16, 64)
    key_a = shared_cast.cast_key(a.recipe.plan.fprop.a, a.recipe, torch.tensor(448.0 / 4.0), False)
    key_b = shared_cast.cast_key(b.recipe.plan.fprop.a, b.recipe, torch.tensor(448.0 / 100.0), False)
    assert key_a != key_b
    with fp8.autocast():
        a(x)
        out_b = b(x)
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "0")
    b2 = _layers("delayed")[1]
    with torch.no_grad():
        b2.fp8_amax_history_input.fill_(100.0)
        b2.fp8_scale_input.fill_(448.0 / 100.0)
    with fp8.autocast():
        assert torch.equal(out_b, b2(x))


def test_views_of_one_tensor_are_told_apart(monkeypatch):
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "1")
    a, b = _layers()
    base = torch.randn(2, 16, 64)
    with fp8.autocast():
        first = a(base[0])
        second = b(base[1])  # same root tensor, another storage offset
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "0")
    with fp8.autocast():
        assert torch.equal(first, a(base[0]))
        assert torch.equal(second, b(base[1]))


def test_nothing_kept_after_the_step(monkeypatch):
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "1")
    a, b = _layers()
    x = torch.randn(16, 64, requires_grad=True)
    h = x * 2  # the shared input: dies with this scope's reference
    gc.collect()
    before = set(shared_cast._SHARED_SAVED)  # other tests' graphs may still be alive
    with fp8.autocast():
        out = a(h) + b(h)
    slot = shared_cast._LOCAL.slot
    assert slot.box[1] is not None  # the cast is held while its input lives
    ours = set(shared_cast._SHARED_SAVED) - before
    assert len(ours) == 1  # the saved FP8 copy both layers read
    del h
    gc.collect()
    assert slot.box == [None, None, None]  # input gone: cast and upcast released
    out.sum().backward()
    del out
    gc.collect()
    assert not ours & set(shared_cast._SHARED_SAVED)  # backward done: the shared bf16 upcast is gone
    assert x.grad is not None


def test_off_under_compile(monkeypatch):
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "1")
    seen = []

    def probe(x):
        seen.append(shared_cast.enabled())
        return x + 1

    torch.compile(probe, backend="eager", fullgraph=True)(torch.ones(2))
    assert seen == [False]
    assert shared_cast.enabled()


@pytest.mark.parametrize("recipe", RECIPES)
def test_inference_mode_runs_and_shares_nothing(recipe, monkeypatch):
    """Tensors made under ``torch.inference_mode()`` keep no version counter: a converted model in
    training mode runs there (it raised "Inference tensors do not track version counter"), with
    the same output as outside it and no cast shared."""
    monkeypatch.setenv("LOWPREC_SHARE_CASTS", "1")
    a, b = _layers(recipe)
    c, d = _layers(recipe)
    x = torch.randn(16, 64)
    with torch.inference_mode():
        xi = x.clone()
        got = a(xi) + b(xi)
        assert shared_cast._slot(xi) is None
    with torch.no_grad():
        want = c(x) + d(x)
    assert torch.equal(got, want)
