"""``force_recompute_fp8_weight_in_bwd`` in one process, and outputs that are not views (issue 29).

The FSDP2 side (2 processes, 0 unsharded weights held, bitwise equal to the FP8 copy kept) is
tests/test_fsdp_saved_weights.py; here: the same bitwise equality without a wrapper (forced on,
every recipe, bf16 autocast included), what backward keeps in each case, the auto rule's
inputs (FSDP's module flag, ZeRO-3's ``ds_id``) and its log line, the option's validation, and
the output of a Linear without a bias.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import lowprec.fp8 as fp8
from lowprec.fp8.modules.sharding import recast_weight_in_backward, reshape_output, weight_sharded

RECIPES = ("delayed", "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8", "nvfp4")
# recipes whose forward weight cast also serves grad_input: backward keeps it unless told otherwise
KEEPS_CAST = ("delayed", "tensorwise", "nvfp4")


def _model(name: str, recompute, d: int = 128) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d, bias=False))
    over = {"force_recompute_fp8_weight_in_bwd": recompute}
    if name == "nvfp4":
        over["high_precision_last"] = 0.0
    fp8.convert(model, recipe=fp8.Recipe.from_name(name, **over), skip_first_last=False)
    return model


def _steps(model: nn.Module, autocast: bool, steps: int = 3):
    """Losses, input gradients and weight gradients of ``steps`` SGD steps, and the bytes of
    weight-sized tensors autograd saved in the first forward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x0 = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(1))
    out, weight_sized, saved = [], [], []
    for step in range(steps):
        x = x0.clone().requires_grad_()
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with fp8.autocast(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(x).float().pow(2).mean()
        if step == 0:  # FP8 / FP4 weights (the Parameters themselves are not counted)
            params = {p.untyped_storage()._cdata for p in model.parameters()}
            weight_sized = [
                t.dtype for t in saved if t.numel() >= 128 * 64 and t.untyped_storage()._cdata not in params
            ]
        loss.backward()
        out.append((loss.detach(), x.grad, *[p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out, weight_sized


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("name", RECIPES)
def test_forced_recompute_is_bitwise_the_kept_cast(name, autocast):
    kept, kept_saved = _steps(_model(name, None), autocast)  # unsharded + auto: the FP8 copy is kept
    recast, recast_saved = _steps(_model(name, True), autocast)
    for a, b in zip(kept, recast):
        for ta, tb in zip(a, b):
            assert torch.equal(ta, tb), name
    if name in KEEPS_CAST:
        assert len(kept_saved) == 2 and not recast_saved, (kept_saved, recast_saved)  # one per layer
    else:  # re-cast from the weight in backward whatever the option says
        assert not kept_saved and not recast_saved
    off, _ = _steps(_model(name, False), autocast)  # "never re-cast": the unsharded default's numerics
    assert all(torch.equal(ta, tb) for a, b in zip(kept, off) for ta, tb in zip(a, b))


def test_frozen_weight_cache_is_not_kept_when_recasting():
    for recompute, cached in ((None, True), (True, False)):
        layer = fp8.Float8Linear(64, 64, recipe=fp8.Recipe(force_recompute_fp8_weight_in_bwd=recompute))
        layer.weight.requires_grad_(False)
        layer(torch.randn(4, 64, requires_grad=True)).sum().backward()
        assert ("_fp8_frozen_weight_cast" in layer.__dict__) is cached


def test_auto_follows_the_wrappers_marks_and_logs_once(caplog):
    layer = fp8.Float8Linear(32, 32)
    auto, on, off = (fp8.Recipe(force_recompute_fp8_weight_in_bwd=v) for v in (None, True, False))
    assert weight_sharded(layer, layer.weight) is None
    assert not recast_weight_in_backward(layer, layer.weight, auto)
    assert recast_weight_in_backward(layer, layer.weight, on)
    zero3 = nn.Parameter(torch.empty(0))
    zero3.ds_id = 7  # type: ignore[attr-defined]  # what DeepSpeed's ZeRO-3 gives a partitioned parameter
    assert weight_sharded(layer, zero3) == "DeepSpeed ZeRO-3 partitions the weight"
    layer._is_fsdp_managed_module = True  # what fully_shard sets on every module it manages
    assert weight_sharded(layer, layer.weight) == "FSDP manages the layer"
    with caplog.at_level(logging.INFO, logger="lowprec"):
        assert recast_weight_in_backward(layer, layer.weight, auto)
        assert recast_weight_in_backward(layer, layer.weight, auto)
        assert not recast_weight_in_backward(layer, layer.weight, off)  # false keeps the copy even so
    logged = [r.getMessage() for r in caplog.records if "force_recompute_fp8_weight_in_bwd=auto" in r.getMessage()]
    assert len(logged) <= 1  # once per process and reason (an earlier test may have logged it)


def test_option_values():
    assert fp8.Recipe().force_recompute_fp8_weight_in_bwd is None
    assert fp8.Recipe(force_recompute_fp8_weight_in_bwd="auto").force_recompute_fp8_weight_in_bwd is None
    assert fp8.Recipe.from_name("delayed", force_recompute_fp8_weight_in_bwd=True).force_recompute_fp8_weight_in_bwd
    with pytest.raises(ValueError, match="force_recompute_fp8_weight_in_bwd must be true, false or auto"):
        fp8.Recipe(force_recompute_fp8_weight_in_bwd="sometimes")


@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 64)])
@pytest.mark.parametrize("name", ["tensorwise", "mxfp8"])
def test_output_without_bias_is_not_a_view(name, shape):
    layer = fp8.Float8Linear(64, 32, bias=False, recipe=fp8.Recipe.from_name(name))
    x = torch.randn(*shape, requires_grad=True)
    y = layer(x)
    assert y._base is None and y.shape == (*shape[:-1], 32)
    ref = copy.deepcopy(layer)
    xr = x.detach().clone().requires_grad_()
    y2 = ref(xr.reshape(-1, 64)).reshape(y.shape)  # the 2-D product, reshaped: the same values
    assert torch.equal(y, y2)
    y.pow(2).sum().backward()
    y2.pow(2).sum().backward()
    assert torch.equal(x.grad, xr.grad) and torch.equal(layer.weight.grad, ref.weight.grad)


def test_reshape_output_copies_only_a_non_contiguous_product():
    t = torch.randn(6, 4)
    same = reshape_output(t, (2, 3, 4))
    assert same._base is None and same.data_ptr() == t.data_ptr()
    tt = torch.randn(4, 6).t()
    moved = reshape_output(tt, (2, 3, 4))
    assert moved._base is None and torch.equal(moved, tt.reshape(2, 3, 4))


def test_compiled_recast_is_bitwise_the_kept_cast():
    """torch.compile(fullgraph=True) of a layer FSDP manages (its two marks set by hand): auto
    re-casts in the compiled backward, with the same bits as keeping the cast (delayed: the
    scale handed to the re-cast is the history's; tensorwise measured the same, left out for time)."""
    name = "delayed"
    torch._dynamo.reset()
    with fp8.autocast():  # the CPU GEMM choice is probed eagerly (a file read), then cached
        fp8.Float8Linear(64, 48)(torch.randn(4, 64))
    lin = nn.Linear(64, 48)
    outs = []
    for recompute in (False, None):
        recipe = fp8.Recipe.from_name(name, force_recompute_fp8_weight_in_bwd=recompute)
        layer = fp8.Float8Linear.from_linear(copy.deepcopy(lin), recipe)
        layer._is_fsdp_managed_module = True  # what fully_shard sets (dynamo reads both)
        layer._fsdp_use_orig_params = True
        compiled = torch.compile(layer, fullgraph=True)
        x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        with fp8.autocast():
            y = compiled(x)
        y.pow(2).sum().backward()
        outs.append((y.detach(), x.grad, layer.weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_experts_under_fsdp_keep_a_reference_to_their_weights():
    """An expert's slot is sharded as its grouped GEMM module is (fully_shard marks every module
    it manages); there the tensor- and block-scaled kinds' one-call path, which keeps every expert
    weight's FP8 cast until backward, gives way to the per-expert loop (each expert as a Linear:
    a reference, cast again in backward). Traced as an H100: per-expert GEMMs, not the grouped one."""
    from lowprec.fp8.kernels.select import triton_importable
    from lowprec.fp8.modules.grouped import Float8GroupedGemm
    from lowprec.fp8.observe.traffic import trace_grouped

    recipe = fp8.Recipe.from_name("tensorwise")
    gemm = Float8GroupedGemm(4, recipe)
    w = torch.randn(4, 32, 64)
    slot = gemm.slot(0, w[0])
    assert weight_sharded(slot, w[0]) is None
    gemm._is_fsdp_managed_module = True  # what fully_shard sets on the modules it manages
    assert weight_sharded(slot, w[0]) == "FSDP manages the layer"
    assert recast_weight_in_backward(gemm, w, recipe)
    gemm._lowprec_ep_local = True  # expert parallelism: each rank's own experts, FSDP2's ignored params
    assert weight_sharded(slot, w[0]) is None and not recast_weight_in_backward(gemm, w, recipe)

    def names(fsdp):
        def make(experts):
            g = Float8GroupedGemm(experts, recipe).to("meta")
            if fsdp:
                g._is_fsdp_managed_module = True
            return lambda x, weight, c: g(x, weight, c, recipe, torch.bfloat16)

        c = trace_grouped(make, (32, 48, 0, 16), 128, 64, sm=(9, 0), triton=triton_importable())
        return {r.name for r in c.gemms()}

    assert "aten._scaled_grouped_mm" in names(False)
    assert names(True) == {"aten._scaled_mm"}
