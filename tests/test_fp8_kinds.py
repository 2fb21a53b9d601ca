"""Scaling kinds are modules behind one protocol (``lowprec/fp8/kinds/``): nothing else in the
package branches on a kind's name, and a new kind is one module plus one catalog row. This test
adds a test-only kind that way (the kind below and its row, touching no other file) and trains
with it through ``fp8.convert`` and ``Float8Linear``, checked against a float64 reference."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from conftest import sqnr

import lowprec.fp8 as fp8
from lowprec import catalog
from lowprec.fp8 import kinds
from lowprec.fp8.modules.linear_fn import ScaledGemmKind
from lowprec.fp8.kinds.plan import GemmCast, OperandCast

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "lowprec"
KIND_NAMES = {r.scaling for r in catalog.RECIPES.values()} | set(catalog.RECIPE_NAMES)
# Modules that may compare an operand's *granularity*: the cast and GEMM layer, which works on
# FP8 tensors whatever kind made them (the FSDP2 FP8 all-gather's shard casts included), and the
# export formats' own schemes.
GRANULARITY_LAYER = {
    "fp8/cast/quantize.py",
    "fp8/gemm/dispatch.py",
    "fp8/gemm/grouped.py",
    "fp8/gemm/cpu.py",
    "fp8/gemm/block.py",
    "fp8/gemm/block_triton.py",
    "fp8/gemm/grouped_triton.py",
    "fp8/gemm/grouped_block_triton.py",
    "fp8/gemm/grouped_wgrad.py",
    "fp8/modules/cast_state.py",
    "fp8/modules/gathered.py",
    "fp8/kinds/plan.py",
    "fp8/cast/torch_casts.py",  # the torch definitions of the casts (quantize.py dispatches to them)
    "fp8/modules/fp8_base.py",  # a frozen FP8 checkpoint's GEMMs, per the scale layout it stores
    "distributed/fsdp_float8.py",  # casts each FSDP2 shard for the FP8 all-gather, as the GEMM will read it
    "distributed/expert_parallel.py",  # casts dispatched token rows as the expert GEMM will read them
    "export/casts.py",
    "export/experts.py",  # writes each expert's trained cast in the layout its scales have
    "export/ct_base.py",  # reads a compressed-tensors strategy into the stored scale layout
}


def _compares(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            names = {n.attr for p in parts for n in ast.walk(p) if isinstance(n, ast.Attribute)}
            names |= {n.id for p in parts for n in ast.walk(p) if isinstance(n, ast.Name)}
            consts = {n.value for p in parts for n in ast.walk(p) if isinstance(n, ast.Constant)}
            yield node, names, consts


def _src_files():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith("fp8/kinds/") and rel not in ("catalog.py", "cli/train_keys.py"):
            yield rel, path


def test_no_branch_on_a_scaling_kind_outside_its_module():
    hits = []
    for rel, path in _src_files():
        for node, names, consts in _compares(path):
            if "colwise" in consts or rel == "backends/engines/torchao.py":  # TP styles; torchao's own recipe names
                continue
            if "scaling" in names or consts & KIND_NAMES:
                hits.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not hits, "ask recipe.kind (or its catalog row), not its name:\n" + "\n".join(hits)


def test_granularity_is_compared_only_in_the_cast_and_gemm_layer():
    hits = []
    for rel, path in _src_files():
        for node, names, _ in _compares(path):
            enum_read = any(
                isinstance(c, ast.Attribute) and getattr(c.value, "id", "") == "Granularity"
                for c in [node.comparators[0]]
            )
            if "granularity" in names and rel not in GRANULARITY_LAYER and not enum_read:
                hits.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not hits, "\n".join(hits)


def test_every_kind_has_its_module_and_its_row():
    for name in kinds.names():
        kind = kinds.get(name)
        assert kind.name == name and kind.info.scaling == name
        recipe = fp8.Recipe(scaling=name, **({"fp8_format": "E4M3"} if name == "nvfp4" else {}))
        assert recipe.kind is kind and recipe.describe().count("fprop")
    with pytest.raises(ValueError, match="scaling='bogus' is not known; use one of"):
        fp8.Recipe(scaling="bogus")


# ---------------------------------------------------------------------------------- a new kind
# "split": the output GEMM per-tensor, both backward GEMMs per-row (a kind no built-in recipe
# runs), with one buffer of state (the number of training forwards) to show state handling.
class Split(ScaledGemmKind):
    name = "split"
    state_buffers = ("fp8_split_calls",)
    state_what = "call counter"

    def check(self, recipe):
        if recipe.fp8_format is not fp8.Format.E4M3:
            raise ValueError("split casts every operand to E4M3: set fp8_format='E4M3'")

    def gemms(self, recipe):
        e4m3 = recipe.fp8_format.forward_dtype
        t, ax = OperandCast(e4m3, "tensor"), OperandCast(e4m3, "axis")
        return GemmCast(t, t), GemmCast(ax, ax), GemmCast(ax, ax)

    def init_state(self, layer):
        layer.register_buffer("fp8_split_calls", torch.zeros((), dtype=torch.int64, device=layer.weight.device))

    def reset_state(self, layer):
        layer.fp8_split_calls.zero_()

    def forward(self, layer, x2, recipe, hp):
        if torch.is_grad_enabled():
            layer.fp8_split_calls += 1
        return super().forward(layer, x2, recipe, hp)

    def gemm_note(self, recipe, device):
        return "split: scaled GEMMs (test-only kind)"


ROW = catalog.RecipeInfo(
    "split",
    catalog.ScaleSource.DYNAMIC,
    catalog.Granularity.AXIS,
    "output GEMM per tensor, backward GEMMs per row (a test-only kind)",
    {"scaling": "split", "fp8_format": "E4M3", "power_of_2_scales": True},
)


@pytest.fixture
def split():
    kinds.register(Split())
    catalog.register_recipe(ROW)
    yield
    catalog.unregister_recipe("split")
    kinds.unregister("split")


def test_a_new_kind_is_one_module_and_one_row(split, seed):
    recipe = fp8.Recipe.from_name("split")
    assert recipe.kind.name == "split" and recipe.kind.info is ROW
    assert (
        recipe.describe()
        == "fprop: e4m3fn/tensor x e4m3fn/tensor; dgrad: e4m3fn/axis x e4m3fn/axis; wgrad: e4m3fn/axis x e4m3fn/axis"
    )
    with pytest.raises(ValueError, match="set fp8_format='E4M3'"):
        fp8.Recipe.from_name("split", fp8_format="HYBRID")
    with pytest.raises(ValueError, match="margin applies to per-tensor scaling"):
        fp8.Recipe.from_name("split", margin=1)
    with pytest.raises(ValueError, match="tensor parallel FP8 needs whole-tensor scales"):
        catalog.check_tensor_parallel("split")

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    ref = [p.detach().double().clone().requires_grad_() for p in model.parameters()]
    report = fp8.convert(model, recipe, skip_first_last=False)
    assert report.num_converted == 2 and report.gemm == "split: scaled GEMMs (test-only kind)"
    x = torch.randn(48, 64, requires_grad=True)
    out = model(x)
    out.square().mean().backward()
    x64 = x.detach().double().requires_grad_()
    h = torch.nn.functional.gelu(x64 @ ref[0].t() + ref[1])
    out64 = h @ ref[2].t() + ref[3]
    out64.square().mean().backward()
    assert sqnr(out64, out) > 25
    assert sqnr(x64.grad, x.grad) > 20
    for p, r in zip(model.parameters(), ref):
        assert sqnr(r.grad, p.grad) > 20
    layer = model[0]
    assert int(layer.fp8_split_calls) == 1 and "0.fp8_split_calls" in model.state_dict()
    assert not any(k.endswith("fp8_split_calls") for k in fp8.plain_state_dict(model))
    layer.reset_fp8_state()
    assert int(layer.fp8_split_calls) == 0
    # a region asking for this kind on a layer converted without its state is refused
    other = fp8.Float8Linear.from_linear(torch.nn.Linear(16, 16), fp8.Recipe.from_name("tensorwise"))
    with pytest.raises(ValueError, match="asks for split scaling.*has no call counter"):
        with fp8.autocast(recipe=recipe):
            other(torch.randn(4, 16))


def test_an_unknown_kind_leaves_nothing_behind(split):
    catalog.unregister_recipe("split")
    kinds.unregister("split")
    with pytest.raises(ValueError, match="unknown FP8 recipe 'split'"):
        fp8.Recipe.from_name("split")
    catalog.register_recipe(ROW)  # the fixture removes it again
    kinds.register(Split())


def test_a_new_kind_runs_grouped_expert_gemms_without_writing_anything(split, seed):
    """Kind.grouped_forward's default runs each expert as the kind runs a Linear (its forward on
    the expert's slot), with the kind's state kept per expert."""
    from lowprec.fp8.modules.grouped import Float8GroupedGemm

    recipe = fp8.Recipe.from_name("split")
    gemm = Float8GroupedGemm(3, recipe)
    assert gemm.fp8_split_calls.shape == (3,)
    counts = (20, 0, 12)
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(3, 48, 64, requires_grad=True)
    out = gemm(x, w, counts, recipe, torch.float32)
    out.square().mean().backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    out64 = torch.cat([x64[:20] @ w64[0].t(), x64[20:] @ w64[2].t()])
    out64.square().mean().backward()
    assert sqnr(out64, out) > 25 and sqnr(x64.grad, x.grad) > 20 and sqnr(w64.grad, w.grad) > 20
    assert gemm.fp8_split_calls.tolist() == [1, 0, 1]
