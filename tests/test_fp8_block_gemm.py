"""The CUDA blockwise GEMM path, checked without a GPU: every GEMM of the blockwise recipe goes
through torch's own meta function for ``F.scaled_mm`` on meta tensors (it checks the scale
shapes and strides the cuBLAS kernel needs), and the dispatch picks the kernel only on sm_90
after the self-check (decided from shapes and dtypes: CPU tensors stand in for CUDA ones). The
kernel's numbers are checked on a GPU by ``pytest -m gpu``."""

from __future__ import annotations

import logging

import pytest
import torch

import lowprec.fp8 as fp8
from lowprec.fp8.gemm import block as block_gemm, block_triton as block_gemm_triton, dispatch as gemm
from lowprec.fp8.gemm.dispatch import gemm_path

pytestmark = pytest.mark.skipif(not block_gemm._torch_has_it(), reason="this torch has no blockwise F.scaled_mm")
CUDA = torch.device("cuda")


def _as_gpu(monkeypatch, sm, triton=True):
    """Dispatch as on a GPU of capability ``sm`` whose self-checks passed (no GPU here)."""
    for mod in (gemm, block_gemm_triton):
        monkeypatch.setattr(mod, "cuda_capability", lambda device: sm)
    monkeypatch.setattr(block_gemm, "self_check", lambda device: True)
    monkeypatch.setattr(block_gemm_triton, "self_check", lambda device: True)
    monkeypatch.setattr(block_gemm_triton, "_triton_allowed", lambda: triton)


@pytest.fixture
def as_sm90(monkeypatch):
    _as_gpu(monkeypatch, (9, 0))


def test_every_blockwise_gemm_passes_torchs_layout_checks():
    """The three GEMMs of the blockwise recipe, cast as ``Float8Linear`` casts them (its plan and
    ``_cast``), on meta tensors: each reaches ``F.scaled_mm``'s meta function, which checks the
    scale shapes and strides cuBLAS needs."""
    from lowprec.fp8.modules.linear_fn import cast as _cast

    recipe = fp8.Recipe.from_name("blockwise")
    plan = recipe.plan
    m, k, n = 256, 640, 384
    x, w, dy = (torch.empty(s, device="meta") for s in ((m, k), (n, k), (m, n)))
    gemms = {
        "output": (_cast(x, plan.fprop.a, 1, recipe), _cast(w, plan.fprop.b, 1, recipe).t(), (m, n)),
        "grad_input": (_cast(dy, plan.dgrad.a, 1, recipe), _cast(w, plan.dgrad.b, 0, recipe), (m, k)),
        "grad_weight": (_cast(dy, plan.wgrad.a, 0, recipe).t(), _cast(x, plan.wgrad.b, 0, recipe), (n, k)),
    }
    for name, (a, b, shape) in gemms.items():
        assert block_gemm.supported(a, b), name
        assert block_gemm.blockwise_mm(a, b, torch.float32).shape == shape, name
    assert gemms["grad_weight"][1].block == (128, 1)  # the 1x128 x 1x128 pair


def test_a_traced_h100_runs_blockwise_on_torchs_kernel(monkeypatch):
    """The whole Float8Linear fwd+bwd traced as an H100 (meta tensors): all three GEMMs take the
    kernel path, and each passes torch's meta checks."""
    calls = []
    real = block_gemm.blockwise_mm
    monkeypatch.setattr(block_gemm, "blockwise_mm", lambda a, b, o: calls.append((a.block, b.block)) or real(a, b, o))
    m, k, n = 256, 640, 384
    with fp8.trace_as(sm=(9, 0), triton=False):
        layer = fp8.Float8Linear.from_linear(
            torch.nn.Linear(k, n, bias=False, device="meta"), fp8.Recipe.from_name("blockwise")
        )
        x = torch.randn(m, k, device="meta", requires_grad=True)
        with fp8.autocast():
            y = layer(x)
        y.backward(torch.ones_like(y))
    assert y.shape == (m, n) and layer.weight.grad.shape == (n, k)
    assert sorted(calls) == sorted([((1, 128), (128, 128)), ((1, 128), (128, 128)), ((1, 128), (128, 1))])


def _operands(m, k, n):
    a = fp8.quantize(torch.randn(m, k), fp8.E4M3, "block", block=(1, 128))
    b = fp8.quantize(torch.randn(n, k), fp8.E4M3, "block", block=(128, 128)).t()
    return a, b


def test_sm90_picks_the_kernel_after_its_self_check(as_sm90):
    a, b = _operands(256, 640, 384)
    assert gemm_path("auto", CUDA, a, b) == "scaled_mm"
    assert gemm_path("scaled_mm", CUDA, a, b) == "scaled_mm"
    assert gemm_path("emulate", CUDA, a, b) == "emulate"


def test_shapes_torchs_kernel_cannot_take_run_on_the_triton_kernel(as_sm90):
    a, b = _operands(24, 200, 48)  # K=200 is not whole 128-tiles: cuBLAS refuses, Triton masks
    assert gemm_path("auto", CUDA, a, b) == "triton"
    assert gemm_path("scaled_mm", CUDA, a, b) == "triton"  # a real FP8 kernel, as asked
    assert gemm_path("emulate", CUDA, a, b) == "emulate"


def test_without_triton_those_shapes_are_emulated_and_logged_once(monkeypatch, caplog):
    _as_gpu(monkeypatch, (9, 0), triton=False)
    gemm._LOGGED.discard("block_cuda")
    a, b = _operands(24, 200, 48)
    with caplog.at_level(logging.WARNING, logger="lowprec.fp8"):
        assert gemm_path("auto", CUDA, a, b) == "emulate"
        assert gemm_path("auto", CUDA, a, b) == "emulate"
    with pytest.raises(RuntimeError, match="gemm='auto' or 'emulate'"):
        gemm_path("scaled_mm", CUDA, a, b)
    assert sum("runs emulated" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("sm", [(8, 9), (10, 0), (12, 0)])
def test_ada_and_blackwell_run_the_triton_kernel(monkeypatch, sm):
    """torch's blockwise kernel is Hopper-only: sm_89 / sm_100 / sm_120 take lowprec's Triton
    GEMM (never torch's self-check), and emulate only without triton."""
    _as_gpu(monkeypatch, sm)
    monkeypatch.setattr(block_gemm, "self_check", lambda device: pytest.fail("torch's kernel is sm_90 only"))
    a, b = _operands(128, 256, 128)
    assert gemm_path("auto", CUDA, a, b) == "triton"
    monkeypatch.setattr(block_gemm_triton, "_triton_allowed", lambda: False)
    assert gemm_path("auto", CUDA, a, b) == "emulate"


def test_below_sm89_blockwise_is_emulated(monkeypatch):
    _as_gpu(monkeypatch, (8, 0))
    monkeypatch.setattr(block_gemm_triton, "self_check", lambda device: pytest.fail("no FP8 tensor cores"))
    a, b = _operands(128, 256, 128)
    assert gemm_path("auto", CUDA, a, b) == "emulate"


def test_a_traced_ada_gpu_runs_every_blockwise_gemm_on_the_triton_kernel():
    """Float8Linear fwd+bwd traced as sm_89 with triton: three lowprec.block_scaled_mm GEMMs on
    FP8 operands (the custom op's fake implementation checks shapes), the weight gradient
    written in float32 by the kernel, no cast after it."""
    from lowprec.fp8.observe.traffic import trace_linear

    c = trace_linear(
        lambda lin: fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("blockwise")),
        256,
        640,
        384,
        sm=(8, 9),
        triton=True,
    )
    assert [(g.name, g.operand_dtype) for g in c.gemms()] == [("lowprec.block_scaled_mm", "float8_e4m3fn")] * 3
    assert not any(r.name in ("aten._to_copy", "aten.clone") for r in c.records), c.by_op()


@pytest.mark.parametrize(
    "module,kernel,says",
    [
        (block_gemm, "blockwise_mm", "torch's blockwise kernel"),
        (block_gemm_triton, "mm", "Triton blockwise FP8 GEMM failed its self-check"),
    ],
)
def test_a_failed_self_check_means_emulation_logged_once(monkeypatch, caplog, module, kernel, says):
    module._CHECKED.clear()

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(module, kernel, broken)
    dev = torch.device("cpu")  # the check itself runs anywhere: the kernel call is what fails
    with caplog.at_level(logging.WARNING, logger="lowprec.fp8"):
        assert module.self_check(dev) is False
        assert module.self_check(dev) is False
    module._CHECKED.clear()
    assert sum("are emulated" in r.message and says in r.message for r in caplog.records) == 1


@pytest.mark.gpu
def test_blockwise_kernel_matches_emulation_on_gpu():
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("torch's blockwise FP8 GEMM needs sm_90")
    assert block_gemm.self_check(dev)
    a = fp8.quantize(torch.randn(256, 512, device=dev), fp8.E4M3, "block", block=(1, 128))
    b = fp8.quantize(torch.randn(384, 512, device=dev), fp8.E4M3, "block", block=(128, 128)).t()
    got = fp8.scaled_mm(a, b, torch.float32)
    ref = fp8.scaled_mm(a, b, torch.float32, path="emulate")
    assert (got - ref).abs().max() <= 2.0**-7 * ref.abs().max()


@pytest.mark.parametrize(
    "sm,says",
    [
        ((9, 0), "torch blockwise-scaled scaled_mm"),
        ((8, 9), block_gemm_triton.KERNEL),
        ((10, 0), block_gemm_triton.KERNEL),
        ((8, 0), "emulated"),
    ],
)
def test_the_conversion_report_names_the_kernel_that_runs(monkeypatch, sm, says):
    _as_gpu(monkeypatch, sm)
    from lowprec.fp8.convert import _gemm_note

    note = _gemm_note(fp8.Recipe.from_name("blockwise"), CUDA)
    assert note.startswith(says) or says in note.split(";")[0], note
    assert ("emulated" in note.split(";")[0]) == (sm < (8, 9)), note


def test_backward_keeps_half_of_bf16s_bytes_or_less():
    """Backward keeps the FP8 x (1 byte/element) and its 128x1-tile scales; the weight is re-cast
    from the Parameter (issue 9: <= 0.50x of what a bf16 Linear under autocast keeps: its bf16
    input and bf16 weight copy)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _common import count_saved_bytes

    m, k, n = 256, 128, 256
    lin = torch.nn.Linear(k, n, bias=False)
    layer = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("blockwise"))
    x = torch.randn(m, k, requires_grad=True)
    with count_saved_bytes(exclude=[layer.weight]) as saved, fp8.autocast():
        layer(x)
    bf16 = 2 * m * k + 2 * n * k
    assert saved["bytes"] == m * k + (m // 128) * k * 4  # FP8 x + float32 scales
    assert saved["bytes"] <= 0.50 * bf16


def test_a_frozen_weight_is_cast_once_and_serves_both_gemms(monkeypatch):
    """A frozen blockwise weight (a LoRA base layer): its 128x128 cast is made once over several
    micro-batches (fp8/modules/frozen.py) and grad_input reads it, with the same values as a trained
    layer's backward re-cast."""
    from lowprec.fp8.kinds import blockwise

    squares = []
    real = blockwise.cast_block_both
    monkeypatch.setattr(blockwise, "cast_block_both", lambda *a, **k: squares.append(k.get("square")) or real(*a, **k))
    lins = [torch.nn.Linear(256, 128, bias=False) for _ in range(2)]
    lins[1].load_state_dict(lins[0].state_dict())
    frozen, trained = (fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name("blockwise")) for lin in lins)
    frozen.weight.requires_grad_(False)
    for step in range(3):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(step))
        grads = []
        for layer in (frozen, trained):
            xi = x.clone().requires_grad_()
            with fp8.autocast():
                y = layer(xi)
            y.square().sum().backward()
            grads.append((y.detach(), xi.grad))
        for a, b in zip(*grads):
            assert torch.equal(a, b)
    assert squares.count(True) == 1


def test_experts_gemms_write_their_rows_and_read_strided_weights_in_place():
    """The grouped experts' per-expert path on torch's kernel, on meta tensors: a GEMM given
    ``out`` (an expert's rows of one output) is written there by the kernel (``_scaled_mm_v2.out``,
    which passes torch's meta checks), and grad_input's B, an expert's columns of all experts'
    transposed weight cast (leading dimension E*N), reaches the kernel without a copy."""
    from lowprec.fp8.cast.quantize import Float8Data
    from lowprec.fp8.observe.traffic import ByteCounter

    e4m3 = torch.float8_e4m3fn
    experts, m, k, n = 3, 64, 256, 128
    qt = torch.empty(k, experts * n, device="meta", dtype=e4m3)  # (E*N, K) cast, written transposed
    st = torch.empty(experts * n // 128, k // 128, device="meta")
    w1 = Float8Data(qt.t()[n : 2 * n], st[1:2], "block", (128, 128), True)  # expert 1's W (N, K)
    dy = Float8Data(
        torch.empty(m, n, device="meta", dtype=e4m3), torch.empty(m, 1, device="meta"), "block", (1, 128), True
    )
    out = torch.empty(2 * m, k, device="meta", dtype=torch.bfloat16)
    assert block_gemm.supported(dy, w1)
    with ByteCounter() as c:
        got = block_gemm.blockwise_mm(dy, w1, torch.bfloat16, out=out[m:])
    assert got.data_ptr() == out[m:].data_ptr() and got.shape == (m, k)
    assert [r.name for r in c.records if r.gemm] == ["aten._scaled_mm_v2"]
    copies = [r for r in c.records if r.name in ("aten.clone", "aten.copy_", "aten.contiguous")]
    assert sum(r.read for r in copies) < n * k // 128, c.records  # the scales' layout at most, never W's data
