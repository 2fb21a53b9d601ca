"""The compiled Triton kernels on CUDA against the torch path (``pytest -m gpu``).

Skipped without a CUDA device with FP8 (sm_89+) or without triton. What the CPU runs cannot
check is checked here: the hardware FP8 convert, atomics on the device, large tensors,
``torch.compile(fullgraph=True)``, the operators' fake implementations (opcheck), no host
synchronisation, and the kernels inside Float8Linear.
"""

import importlib

import pytest
import torch

import lowprec.fp8 as fp8
from lowprec.fp8 import E4M3, E5M2, kernels
from lowprec.fp8.kernels import reference, select
from tests.conftest import sqnr

pytestmark = pytest.mark.gpu
FP8 = [E4M3, E5M2]
quantize_mod = importlib.import_module("lowprec.fp8.cast.quantize")


@pytest.fixture
def dev(monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 (sm_89+)")
    pytest.importorskip("triton")
    monkeypatch.delenv(select.DISABLE_ENV, raising=False)
    monkeypatch.setenv(select.ENABLE_ENV, "1")
    assert kernels.available("cuda")
    return torch.device("cuda")


@pytest.fixture
def ops(dev):
    from lowprec.fp8.kernels import ops

    assert not ops.interpreting()
    return ops


def bits(q):
    return q.view(torch.uint8)


def assert_same_fp8(got, ref):
    nan = torch.isnan(ref.float())
    assert torch.equal(torch.isnan(got.float()), nan)
    assert torch.equal(bits(got)[~nan], bits(ref)[~nan])


def awkward(shape, dtype, device):
    x = torch.randn(shape, device=device) * torch.exp2(torch.empty(shape, device=device).uniform_(-12, 12))
    special = torch.tensor([0.0, -0.0, 1.0625], device=device)[: x.numel()]
    x.view(-1)[: special.numel()] = special
    return x.to(dtype)


def test_the_self_check_keeps_every_op_on_the_gpu(dev):
    """The first-use check, run here for every input class, turns no op off: an op running
    as two passes is printed (a compiler fault worked around, correct); one on the torch path
    would be correct but slow, and fails here."""
    from lowprec.fp8.kernels import ops, selfcheck

    for cls in selfcheck.CLASSES:
        for op in selfcheck.OPS:
            selfcheck._passed(dev, op, cls)
    selfcheck._passed(dev, "delayed_scale_update", selfcheck._DELAYED)
    index = torch.cuda.current_device()
    off = sorted((str(cls), op) for (i, cls, op), on in selfcheck._RESULT.items() if i == index and not on)
    print("two passes:", sorted(map(str, ops._TWO_PASS)) or "none")
    assert not off, f"ops on the torch path on this GPU: {off}"


def checked(op, x):
    """Let the self-check choose how ``op`` runs for ``x``'s class (one pass or two), as a
    user's first call does; the op must stay on the GPU."""
    assert kernels.available(x.device, op, x), f"{op} is off for {selfcheck_class(x)}: see the log"
    return x


def selfcheck_class(x):
    from lowprec.fp8.kernels import selfcheck

    return selfcheck.input_class(x)


def explain_scales(x, got, want):
    """The first rows whose scales differ: the row's amax and both scales, as float32 bits."""
    bad = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
    rows = bad.flatten().nonzero().flatten()[:5].tolist()
    amax = x.float().abs().amax(dim=1)
    return "; ".join(
        f"row {r}: amax {amax[r].item()!r} ({amax[r].view(torch.int32).item():#010x}) scale "
        f"{got.flatten()[r].item()!r} ({got.flatten()[r].view(torch.int32).item():#010x}) vs torch "
        f"{want.flatten()[r].item()!r} ({want.flatten()[r].view(torch.int32).item():#010x})"
        for r in rows
    )


@pytest.mark.parametrize("shape", [(1, 1), (65, 130), (129, 63), (2048, 4096), (4097, 1000)])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", FP8)
def test_cast_transpose_amax_matches_the_torch_path(ops, dev, dtype, in_dtype, shape, seed):
    x = awkward(shape, in_dtype, dev)
    scale = torch.tensor(fp8.fp8_max(dtype) / 64.0, device=dev)
    q, qt, a = ops.cast_transpose_amax(checked("cast_transpose_amax", x), scale, dtype)
    rq, rqt, ra = reference.cast_transpose_amax(x, scale, dtype)
    assert_same_fp8(q, rq)
    assert qt.is_contiguous() and torch.equal(bits(qt), bits(q).t())
    assert torch.equal(a, ra)
    q2, a2 = ops.cast_amax(checked("cast_amax", x), scale, dtype)
    assert torch.equal(bits(q2), bits(q)) and torch.equal(a2, a)


@pytest.mark.parametrize("dtype", FP8)
def test_hardware_and_software_converts_agree_on_every_bfloat16(ops, dev, dtype):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256).to(dev)
    one = torch.tensor(1.0, device=dev)
    ref = reference.cast_amax(x, one, dtype)[0]
    for soft in (False, True):
        q = torch.empty(x.shape, dtype=torch.uint8, device=dev)
        ops.launch_cast(x, one, dtype, q, None, None, soft_cast=soft)
        assert_same_fp8(q.view(dtype), ref)


@pytest.mark.parametrize("dtype", FP8)
def test_nan_and_inf_rules_on_device(ops, dev, dtype, seed):
    x = torch.randn(1000, 1000, device=dev, dtype=torch.bfloat16)
    x[0, 0], x[999, 999], x[500, 3] = float("inf"), -float("inf"), float("nan")
    q, qt, a = ops.cast_transpose_amax(checked("cast_transpose_amax", x), torch.tensor(1.0, device=dev), dtype)
    bad = ~torch.isfinite(x)
    assert torch.isnan(q.float()[bad]).all() and torch.isfinite(q.float()[~bad]).all()
    assert torch.isnan(qt.float().t()[bad]).all() and torch.isnan(a)
    x[500, 3] = 2.0
    assert torch.isinf(ops.cast_amax(checked("cast_amax", x), torch.tensor(1.0, device=dev), dtype)[1])
    huge = torch.full((4, 4), 3e38, device=dev)
    assert torch.isnan(
        ops.cast_amax(checked("cast_amax", huge), torch.tensor(10.0, device=dev), dtype)[0].float()
    ).all()


def test_amax_with_many_tiles_racing(ops, dev, seed):
    """~16k tiles publish their amax with atomics: the result is the exact max."""
    for _ in range(3):
        x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        assert torch.equal(
            ops.cast_amax(checked("cast_amax", x), torch.tensor(1.0, device=dev), E4M3)[1], x.float().abs().max()
        )


def test_tensors_beyond_int32_offsets(ops, dev, seed):
    """2**31 + elements: the kernels index in int64."""
    m, n = 65536 + 3, 32768 + 5
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    s = torch.tensor(100.0, device=dev)
    q, qt, a = ops.cast_transpose_amax(checked("cast_transpose_amax", x), s, E4M3)
    for r0 in (0, m - 1024):
        rq = reference.cast_amax(x[r0 : r0 + 1024], s, E4M3)[0]
        assert torch.equal(bits(q[r0 : r0 + 1024]), bits(rq))
        assert torch.equal(bits(qt[:, r0 : r0 + 1024]), bits(rq).t())
    assert torch.equal(a, x.abs().amax().float())


@pytest.mark.parametrize("power_of_2", [True, False])
@pytest.mark.parametrize("dtype", FP8)
def test_rowwise_matches_the_torch_path(ops, dev, dtype, power_of_2, seed):
    x = torch.randn(1000, 5000, device=dev) * torch.logspace(-6, 6, 1000, device=dev)[:, None]
    x[3], x[5, 7], x[8, 4000] = 0.0, float("nan"), float("inf")
    x = x.to(torch.bfloat16)
    q, s = ops.cast_rowwise(checked("cast_rowwise", x), dtype, power_of_2)
    rq, rs = reference.cast_rowwise(x, dtype, power_of_2)
    nan = torch.isnan(rs)
    assert torch.equal(torch.isnan(s), nan) and torch.equal(s[~nan], rs[~nan]), explain_scales(x, s, rs)
    assert_same_fp8(q, rq)


def test_operators_pass_opcheck(ops, dev, seed):
    from lowprec.fp8.kernels import gemm_ops  # noqa: F401 (registers lowprec::block_scaled_mm)

    x = torch.randn(300, 200, device=dev, dtype=torch.bfloat16)
    s = torch.tensor(3.0, device=dev)
    torch.library.opcheck(torch.ops.lowprec.cast_transpose_amax.default, (x, s, E4M3))
    torch.library.opcheck(torch.ops.lowprec.cast_amax.default, (x, s, E5M2))
    torch.library.opcheck(torch.ops.lowprec.cast_rowwise.default, (x, E4M3, True))
    torch.library.opcheck(torch.ops.lowprec.cast_block_1d.default, (x, E4M3, 128, True, True, True))
    torch.library.opcheck(torch.ops.lowprec.cast_block_2d.default, (x, E4M3, 128, False, False, True))
    a = fp8.quantize(torch.randn(256, 256, device=dev), E4M3, "block", block=(1, 128))
    b = fp8.quantize(torch.randn(384, 256, device=dev), E4M3, "block", block=(128, 128)).t()
    args = (a.data, b.data, a.scale.reciprocal(), b.scale.reciprocal(), 128, 128, torch.bfloat16)
    before = [t.view(torch.uint8).clone() if t.dtype == E4M3 else t.clone() for t in args[:4]]
    # opcheck's test_schema compares FP8 inputs with allclose, which has no FP8 CUDA kernel;
    # what it checks (inputs not mutated, output not aliased) is checked by hand below
    torch.library.opcheck(
        torch.ops.lowprec.block_scaled_mm.default,
        args,
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    out = torch.ops.lowprec.block_scaled_mm.default(*args)
    after = [t.view(torch.uint8) if t.dtype == E4M3 else t for t in args[:4]]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert all(out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in args[:4])


def test_compiled_fullgraph_matches_eager(ops, dev, seed):
    torch._dynamo.reset()

    def f(x, s):
        q, qt, a = kernels.cast_transpose_amax(x, s, E4M3)
        r, rs = kernels.cast_rowwise(x, E5M2)
        return q, qt, a, r, rs

    x = torch.randn(1000, 3000, device=dev, dtype=torch.bfloat16)
    s = torch.tensor(5.0, device=dev)
    eager = f(x, s)
    compiled = torch.compile(f, fullgraph=True)(x, s)
    for e, c in zip(eager, compiled):
        assert torch.equal(
            e.view(torch.uint8) if e.element_size() == 1 else e, c.view(torch.uint8) if c.element_size() == 1 else c
        )


def test_no_host_synchronisation(ops, dev, seed):
    x = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    s = torch.tensor(5.0, device=dev)
    (
        ops.cast_transpose_amax(checked("cast_transpose_amax", x), s, E4M3),
        ops.cast_rowwise(checked("cast_rowwise", x), E4M3),
    )  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.cast_transpose_amax(x, s, E4M3)
        kernels.cast_amax(x, s, E5M2)
        kernels.cast_rowwise(x, E4M3)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_float8_linear_is_identical_with_and_without_the_kernels(dev, monkeypatch, recipe, seed):
    """Float8Linear's casts go to the kernels (quantize hook, and the input's one-pass
    cast+transpose for tensorwise/delayed); results are bit-equal to the torch path."""
    routed = []
    real = kernels.cast_amax, kernels.cast_rowwise, kernels.cast_transpose_amax
    monkeypatch.setattr(kernels, "cast_amax", lambda *a: routed.append(1) or real[0](*a))
    monkeypatch.setattr(kernels, "cast_rowwise", lambda *a: routed.append(1) or real[1](*a))
    monkeypatch.setattr(kernels, "cast_transpose_amax", lambda *a: routed.append(1) or real[2](*a))
    base = torch.nn.Linear(1024, 512, device=dev)
    x = torch.randn(4, 256, 1024, device=dev)

    def run():
        torch.manual_seed(0)
        lin = fp8.Float8Linear.from_linear(torch.nn.Linear(1024, 512, device=dev), fp8.Recipe.from_name(recipe))
        lin.load_state_dict(base.state_dict(), strict=False)
        xi = x.clone().requires_grad_()
        outs = []
        for _ in range(3):  # several steps: delayed scaling uses its history from step 1
            with fp8.autocast(), torch.autocast("cuda", dtype=torch.bfloat16):
                y = lin(xi)
            y.float().square().mean().backward()
            outs += [y.detach().clone(), xi.grad.clone(), lin.weight.grad.clone()]
            xi.grad = None
            lin.weight.grad = None
        return outs

    fused = run()
    assert routed, "the kernels were not used"
    monkeypatch.setenv(select.DISABLE_ENV, "1")
    routed.clear()
    plain = run()
    assert not routed
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    assert sqnr(base(x).float(), fused[0].float()) > 20


@pytest.mark.parametrize("shape", [(65, 130), (2048, 4096), (4097, 1000)])
@pytest.mark.parametrize("dtype", FP8)
def test_blockwise_casts_match_the_torch_path(ops, dev, dtype, shape, seed):
    x = awkward(shape, torch.bfloat16, dev)
    for got, want in (
        (
            ops.cast_block_1d(checked("cast_block_1d", x), dtype, 128, True, True, True),
            reference.cast_block_1d(x, dtype, 128, True, True, True),
        ),
        (
            ops.cast_block_2d(checked("cast_block_2d", x), dtype, 128, False, True, True),
            reference.cast_block_2d(x, dtype, 128, False, True, True),
        ),
    ):
        for g, w in zip(got, want):
            if g.dtype == torch.float32:
                assert torch.equal(g, w)
            else:
                assert_same_fp8(g, w)


@pytest.mark.parametrize("shape", [(65, 130), (2048, 4096), (4097, 1000)])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("rceil", [True, False])
def test_mx_casts_match_quantize_mx(ops, dev, rceil, dtype, shape, seed):
    """The MXFP8 cast kernel (both layouts from one read) equals quantize_mx bit for bit on the
    hardware convert."""
    x = awkward(shape, torch.bfloat16, dev)
    got = ops.cast_mx(checked("cast_mx", x), dtype, rceil, True, True)
    want = reference.cast_mx(x, dtype, rceil, True, True)
    for g, w in zip(got, want, strict=True):
        if g.dtype == torch.uint8:
            assert torch.equal(g, w)
        else:
            assert_same_fp8(g, w)


def test_mxfp8_linear_is_identical_with_and_without_the_kernel(dev, monkeypatch, seed):
    """An MXFP8 Float8Linear's casts go to the kernel (transposed operands read as column casts)
    and its output and gradients equal the torch path's bit for bit."""
    routed = []
    real = kernels.cast_mx
    monkeypatch.setattr(kernels, "cast_mx", lambda *a, **k: routed.append(1) or real(*a, **k))
    base = torch.nn.Linear(1024, 512, device=dev)
    x = torch.randn(4, 256, 1024, device=dev)

    def run():
        lin = fp8.Float8Linear.from_linear(torch.nn.Linear(1024, 512, device=dev), fp8.Recipe.from_name("mxfp8"))
        lin.load_state_dict(base.state_dict(), strict=False)
        xi = x.clone().requires_grad_()
        with fp8.autocast(), torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(xi)
        y.float().square().mean().backward()
        return [y.detach(), xi.grad, lin.weight.grad]

    fused = run()
    assert len(routed) >= 6, "the MX casts did not use the kernel"
    monkeypatch.setenv(select.DISABLE_ENV, "1")
    routed.clear()
    plain = run()
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)
    assert sqnr(base(x).float(), fused[0].float()) > 20


@pytest.mark.parametrize("square", [True, False])
def test_triton_block_gemm_matches_emulation(dev, square, seed):
    """The Triton blockwise GEMM on hardware (FP8 tensor cores) against dequantize + matmul."""
    from lowprec.fp8.gemm import block_triton as block_gemm_triton

    assert block_gemm_triton.self_check(dev)
    a = fp8.quantize(torch.randn(1024, 2048, device=dev), E4M3, "block", block=(1, 128))
    if square:
        b = fp8.quantize(torch.randn(768, 2048, device=dev), E4M3, "block", block=(128, 128)).t()
    else:
        b = fp8.quantize(torch.randn(2048, 768, device=dev), E4M3, "block", block=(128, 1))
    got = block_gemm_triton.mm(a, b, torch.float32)
    ref = fp8.scaled_mm(a, b, torch.float32, path="emulate")
    assert (got - ref).abs().max() <= 2.0**-7 * ref.abs().max()
    assert sqnr(ref, got) > 40


@pytest.mark.parametrize("shape", [(65, 130), (2048, 4096), (4097, 1000)])
def test_nvfp4_casts_match_the_torch_path(ops, dev, shape, seed):
    """The NVFP4 cast kernels (1x16 round to nearest and stochastic, 16x16 tiles with both
    layouts, the weight-gradient operands with the random Hadamard transform) equal the torch
    path bit for bit on the hardware."""
    from lowprec.fp8.cast.hadamard import rht_sign_bits
    from lowprec.fp8.cast.nvfp4 import sr_key, tensor_scales

    x = awkward(shape, torch.bfloat16, dev)
    s = tensor_scales(reference.amax(x))[0]
    for args in ((False, True, False), (False, True, False, sr_key(3)), (True, True, True)):
        got = ops.cast_nvfp4(checked("cast_nvfp4", x), s, *args)
        assert all(torch.equal(g, w) for g, w in zip(got, reference.cast_nvfp4(x, s, *args), strict=True)), args
    bits = rht_sign_bits(7)
    a = ops.rht_amax(checked("cast_nvfp4_rht", x), bits)
    assert torch.equal(a, reference.rht_amax(x, bits))
    s = tensor_scales(a)[0]
    for key in (-1, sr_key(5)):
        got = ops.cast_nvfp4_rht(x, s, bits, key)
        assert all(torch.equal(g, w) for g, w in zip(got, reference.cast_nvfp4_rht(x, s, bits, key), strict=True))


@pytest.mark.parametrize("shape", [(65, 130), (2048, 4096), (4097, 1000)])
def test_nvfp4_dual_casts_match_the_torch_path(ops, dev, shape, seed):
    """Both NVFP4 operands of one tensor from one read per pass (the plain 1x16 cast and the
    Hadamard-rotated weight-gradient operand, each with its own tensor scale and rounding stream)
    equal the torch path, and the separate ops, bit for bit on the hardware; and NVCodec's pair
    equals the two separate casts."""
    from lowprec.fp8.cast.hadamard import rht_sign_bits
    from lowprec.fp8.cast.nvfp4 import sr_key, tensor_scales
    from lowprec.fp8.kinds.nvfp4 import NVCodec

    x = awkward(shape, torch.bfloat16, dev)
    bits = rht_sign_bits(7)
    a = ops.nvfp4_dual_amax(checked("cast_nvfp4_dual", x), bits)
    assert torch.equal(a, reference.nvfp4_dual_amax(x, bits))
    s = tensor_scales(a)[0]
    for keys in ((-1, -1), (sr_key(3), sr_key(5)), (-1, sr_key(5))):
        got = ops.cast_nvfp4_dual(x, s, bits, *keys)
        want = reference.cast_nvfp4_dual(x, s, bits, *keys)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), keys
    recipe = fp8.Recipe.from_name("nvfp4")
    codec = NVCodec()
    for seeds in ((None, None), (11, 12)):
        pair = codec.quantize_pair_seeded(x, recipe, E4M3, seeds)
        apart = codec.quantize(x, recipe, E4M3, seeds[0]), codec.quantize_wgrad(x, recipe, E4M3, seeds[1])
        for p, q in zip(pair, apart, strict=True):
            assert torch.equal(p.data.view(torch.uint8), q.data.view(torch.uint8))
            assert torch.equal(p.scale.view(torch.uint8), q.scale.view(torch.uint8))
            assert torch.equal(p.tensor_scale, q.tensor_scale) and p.cols == q.cols
