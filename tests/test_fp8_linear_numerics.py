"""Float8Linear against a float64 reference, for every recipe: output and every gradient.

Thresholds (dB SQNR, N(0,1) inputs; measured values are 3-5 dB above them):
  output            >= 26   (E4M3 operands: ~28.8 per-tensor, ~29 rowwise/blockwise)
  grad_input/weight >= 22   HYBRID (E5M2 gradient: ~24.7);  >= 26 E4M3 recipes (~28.5-29)
  grad_bias         >= 100  (computed in high precision)
  high-precision GEMMs (override_linear_precision): >= 100
  nvfp4 (E2M1: 4-bit elements): output >= 15 (~16.6), gradients >= 13 (~14.9 grad_input with
  stochastic rounding, ~15.5 grad_weight); mxfp8 meets the E4M3 floors (~28.5)
A wrong scale or transposed operand shows as < 10 dB.
"""

import pytest
import torch
from torch import nn

import lowprec.fp8 as fp8
from tests.conftest import sqnr

RECIPES = list(fp8.RECIPE_NAMES)
SHAPES = [((64, 128), 96), ((3, 40, 256), 160), ((7, 5, 48), 32)]  # 2-D, 3-D, non-square/odd M


def _run(recipe, in_shape, out_features, dtype=torch.float32, autocast_bf16=False, autocast_dtype=None):
    k = in_shape[-1]
    lin = nn.Linear(k, out_features)
    ref = nn.Linear(k, out_features).double()
    ref.load_state_dict(lin.state_dict())
    if dtype == torch.float16:  # a float16 model (ref keeps the float16 weights' values)
        lin.half()
        ref.load_state_dict(lin.state_dict())
    autocast_dtype = torch.bfloat16 if autocast_bf16 else autocast_dtype
    layer = fp8.Float8Linear.from_linear(lin, recipe)
    x = torch.randn(*in_shape) * 2
    g = torch.randn(*in_shape[:-1], out_features)
    xr = x.double().requires_grad_()
    ref(xr).backward(g.double())
    xt = x.clone().to(dtype).requires_grad_()
    with (
        fp8.autocast(),
        torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None),
    ):
        y = layer(xt)
    y.backward(g.to(y.dtype))
    return {
        "out": (ref(xr.detach()), y),
        "grad_input": (xr.grad, xt.grad),
        "grad_weight": (ref.weight.grad, lin.weight.grad),
        "grad_bias": (ref.bias.grad, lin.bias.grad),
    }


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("in_shape,out_features", SHAPES)
def test_sqnr_against_float64(seed, name, in_shape, out_features):
    recipe = fp8.Recipe.from_name(name)
    res = _run(recipe, in_shape, out_features)
    grad_floor = 22 if recipe.fp8_format == fp8.Format.HYBRID else 26
    floors = {"out": 26, "grad_input": grad_floor, "grad_weight": grad_floor, "grad_bias": 100}
    if name == "nvfp4":
        floors.update(out=15, grad_input=13, grad_weight=13)
    if recipe.override_linear_precision[2]:
        floors["grad_weight"] = 100
    for key, (r, t) in res.items():
        assert t.shape == r.shape
        assert sqnr(r, t) >= floors[key], f"{name} {key}: {sqnr(r, t):.1f} dB"


@pytest.mark.parametrize("name", RECIPES)
def test_under_bf16_autocast(seed, name):
    res = _run(fp8.Recipe.from_name(name), (4, 24, 128), 64, autocast_bf16=True)
    out_ref, out = res["out"]
    assert out.dtype == torch.bfloat16
    # bf16 output rounding (8 bits) costs a little on top of FP8 quantization
    fp4 = name == "nvfp4"
    assert sqnr(out_ref, out) >= (15 if fp4 else 25)
    for key in ("grad_input", "grad_weight"):
        r, t = res[key]
        assert t.dtype == torch.float32
        assert sqnr(r, t) >= (13 if fp4 else 20)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("how", ["float16 model", "float16 autocast"])
def test_float16(seed, name, how):
    """float16's range ends at 65504: the unscaled sums of an FP8 GEMM pass it where the scaled
    output does not, so an output scaled after rounding to float16 was inf (rowwise on CPU)."""
    model = how == "float16 model"
    res = _run(
        fp8.Recipe.from_name(name),
        (4, 24, 256),
        64,
        dtype=torch.float16 if model else torch.float32,
        autocast_dtype=None if model else torch.float16,
    )
    assert res["out"][1].dtype == torch.float16
    fp4 = name == "nvfp4"
    for key in ("out", "grad_input", "grad_weight"):
        r, t = res[key]
        assert torch.isfinite(t).all(), f"{name} {key}: not finite"
        floor = (15 if fp4 else 25) if key == "out" else (13 if fp4 else 20)
        assert sqnr(r, t) >= floor, f"{name} {key}: {sqnr(r, t):.1f} dB"


def test_bf16_model(seed):
    res = _run(fp8.Recipe.from_name("tensorwise"), (32, 64), 48, dtype=torch.bfloat16)
    assert res["out"][1].dtype == torch.bfloat16
    assert sqnr(*res["out"]) >= 25


@pytest.mark.parametrize("override", [(True, False, False), (False, True, False), (False, False, True)])
def test_override_linear_precision_runs_that_gemm_in_high_precision(seed, override):
    recipe = fp8.Recipe.from_name("delayed", override_linear_precision=override)
    res = _run(recipe, (64, 128), 64)
    for key, hp in zip(("out", "grad_input", "grad_weight"), override):
        db = sqnr(*res[key])
        assert (db >= 100) if hp else (22 <= db < 60), f"{key}: {db:.1f} dB"


def test_emulation_and_scaled_mm_agree_inside_the_layer(seed):
    outs = {}
    for path in ("scaled_mm", "emulate"):
        torch.manual_seed(0)
        outs[path] = _run(fp8.Recipe.from_name("tensorwise", gemm=path), (16, 64), 32)
    for key in ("out", "grad_input", "grad_weight"):
        assert torch.equal(outs["scaled_mm"][key][1], outs["emulate"][key][1])


def test_high_precision_saved_activations_give_the_same_gradients(seed):
    a = _run(fp8.Recipe.from_name("rowwise"), (32, 64), 32)
    torch.manual_seed(0)
    fp8_saved = _run(fp8.Recipe.from_name("rowwise"), (32, 64), 32)
    torch.manual_seed(0)
    hp_saved = _run(fp8.Recipe.from_name("rowwise", save_fp8_activations=False), (32, 64), 32)
    assert torch.equal(fp8_saved["grad_weight"][1], hp_saved["grad_weight"][1])
    assert sqnr(*a["grad_weight"]) > 26


@pytest.mark.parametrize("m, k, n", [(256, 128, 256), (128, 256, 64)])
def test_rowwise_with_gw_hp_keeps_only_the_hp_input(m, k, n):
    """Its weight-gradient GEMM reads every bit of the bf16 x, so 2 bytes/element of x is the
    floor for its numerics; the weight is re-cast from the Parameter in backward (no copy).
    Against a bf16 Linear under autocast (bf16 x + bf16 weight copy) that is M / (M + N):
    0.50 at M = N, above 0.50 wherever M > N (docs/LOG.md, branch act)."""
    lin = nn.Linear(k, n, bias=False)
    layer = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("rowwise_with_gw_hp"))
    x = torch.randn(m, k, requires_grad=True)
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() != layer.weight.untyped_storage().data_ptr():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fp8.autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)
    assert sum(seen.values()) == 2 * m * k
