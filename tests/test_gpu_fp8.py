"""CUDA-only checks (run with `pytest -m gpu` on a GPU machine; skipped elsewhere)."""

import pytest
import torch

import lowprec.fp8 as fp8
from lowprec.train.model import build_model
from tests.conftest import sqnr

pytestmark = pytest.mark.gpu


def _fp8_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 (sm_89+)")
    return torch.device("cuda")


@pytest.mark.parametrize("recipe", fp8.RECIPE_NAMES)
def test_training_step_never_syncs_the_host(recipe):
    dev = _fp8_gpu()
    torch.manual_seed(0)
    model = build_model("llama-tiny").to(dev)
    fp8.convert(model, recipe)
    fp8.enable_telemetry(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    ids = torch.randint(0, 256, (4, 128), device=dev)

    def step():
        with fp8.autocast(), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("traced", [True, False])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed", "blockwise"])
def test_compiled_matches_eager_on_cuda(recipe, traced, monkeypatch):
    """Compiled (Inductor) against eager, forward and both gradients, over three SGD steps, on
    float32 master weights with 16-divisible dims (the class whose one-pass transposed cast
    ptxas got wrong on the H200). Traced into the graph (the default) and with the GEMMs left
    eager (``LOWPREC_COMPILE_FP8=0``): runs four and five found the traced form's gradients all
    zeros (the GEMM's identity ``.to``, see ``tests/test_fp8_result_identity.py``); the sixth,
    with the fix, found them equal to eager's."""
    from lowprec.fp8.gemm import compile_guard

    monkeypatch.setenv(compile_guard.ENV, "1" if traced else "0")
    dev = _fp8_gpu()
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = torch.nn.Linear(4096, 2048, bias=False, device=dev)
    layers = [
        fp8.Float8Linear.from_linear(torch.nn.Linear(4096, 2048, bias=False, device=dev), fp8.Recipe.from_name(recipe))
        for _ in range(2)
    ]
    for layer in layers:
        layer.load_state_dict(base.state_dict(), strict=False)
    calls = [layers[0], torch.compile(layers[1], fullgraph=traced)]
    w64 = base.weight.detach().double()
    for step in range(3):
        x = torch.randn(2048, 4096, device=dev)
        x64 = x.double().requires_grad_()
        wr = w64.clone().requires_grad_()
        torch.nn.functional.linear(x64, wr).square().mean().backward()
        ref = (torch.nn.functional.linear(x64, w64).detach(), x64.grad, wr.grad)
        outs = []
        for call, layer in zip(calls, layers):
            xi = x.clone().requires_grad_()
            with fp8.autocast(), torch.autocast("cuda", dtype=torch.bfloat16):
                y = call(xi)
            y.float().square().mean().backward()
            outs.append((y.float(), xi.grad, layer.weight.grad.clone()))
        for what, r, e, c in zip(("output", "grad_input", "grad_weight"), ref, *outs):
            assert sqnr(e.float(), c.float()) > 30, (step, what, sqnr(e.float(), c.float()))
            assert sqnr(r, c.double()) > sqnr(r, e.double()) - 1.5, (step, what)
        with torch.no_grad():  # a large update, the same on both: a stale weight cast would show
            g = layers[0].weight.grad
            layers[0].weight -= 0.5 * g / g.abs().max() * layers[0].weight.abs().max()
            layers[1].weight.copy_(layers[0].weight)
            for layer in layers:
                layer.weight.grad = None
            w64 = layers[0].weight.detach().double()


@pytest.mark.parametrize("recipe", fp8.RECIPE_NAMES)
def test_layer_sqnr_on_cuda(recipe):
    dev = _fp8_gpu()
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 2048, device=dev)
    ref = torch.nn.Linear(1024, 2048, device=dev).double()
    ref.load_state_dict(lin.state_dict())
    layer = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name(recipe))
    x = torch.randn(512, 1024, device=dev)
    with fp8.autocast(), torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    # NVFP4's 4-bit elements: the CPU floor of test_fp8_linear_numerics (15 dB; 16.7 on CPU and
    # on the H200 for this layer); the 8-bit recipes 25 dB
    assert sqnr(ref(x.double()), y.float()) > (15 if recipe == "nvfp4" else 25)


# --- lowprec's Triton grouped FP8 GEMM (fp8/gemm/grouped_triton.py) on hardware --------------------
def _grouped_cuda_operands(dev, gran, gemm, counts, k=1024, n=768):
    """Per-expert casts as grouped_fn makes them (see test_fp8_kernels_interpret.py): tensorwise's
    grad_input has an E5M2 dY; output's B comes from (E, N, K) weights, grad_input's is (E, K, N)."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    a_dtype = e5m2 if (gran == "tensor" and gemm == "grad_input") else e4m3
    groups = [fp8.quantize(torch.randn(c, k, device=dev) * 3, a_dtype, gran, dim=1) if c else None for c in counts]
    if gemm == "output":
        experts = [fp8.quantize(torch.randn(n, k, device=dev), e4m3, gran, dim=1).t() for _ in counts]
    else:
        experts = [fp8.quantize(torch.randn(k, n, device=dev), e4m3, gran, dim=0) for _ in counts]
    return groups, experts


@pytest.mark.parametrize(
    "gran,gemm", [("tensor", "output"), ("tensor", "grad_input"), ("axis", "output"), ("axis", "grad_input")]
)
def test_triton_grouped_gemm_matches_the_loop_on_cuda(gran, gemm):
    """One launch for all experts (ragged groups over the 64-row tiles, empty experts) against
    the per-expert loop (torch._scaled_mm per expert) and the float32 emulation: within the
    self-check's bound (2**-7 max |ref|: the tensor cores' FP8 accumulation) and > 40 dB."""
    dev = _fp8_gpu()
    pytest.importorskip("triton")
    from lowprec.fp8.gemm import grouped as grouped_gemm, grouped_triton

    assert grouped_triton.self_check(dev)
    torch.manual_seed(0)
    counts = (300, 0, 77, 1, 512, 129, 0)
    groups, experts = _grouped_cuda_operands(dev, gran, gemm, counts)
    got = grouped_triton.mm(groups, experts, torch.bfloat16).float()
    loop = grouped_gemm.grouped_mm(groups, experts, torch.bfloat16, single_call=False).float()
    emulated = grouped_triton.loop_reference(groups, experts)
    assert got.shape == loop.shape == (sum(counts), 768)
    assert (got - loop).abs().max() <= 2.0**-7 * loop.abs().max()
    assert sqnr(emulated, got) > 40 and sqnr(loop, got) > 40


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "rowwise"])
def test_grouped_experts_on_the_triton_gemm_on_cuda(name, monkeypatch):
    """The grouped kinds with torch's grouped kernel hidden (as on Ada): output and grad_input
    of all experts on the Triton kernel, grad_weight on the Triton grouped weight gradient,
    fwd+bwd against the per-expert emulation."""
    dev = _fp8_gpu()
    pytest.importorskip("triton")
    from lowprec.fp8.gemm import grouped as grouped_gemm, grouped_triton, grouped_wgrad

    assert grouped_triton.self_check(dev) and grouped_wgrad.self_check(dev)  # before counting launches
    calls, wgrads = [], []
    real, real_wgrad = grouped_triton.mm, grouped_wgrad.mm_into
    monkeypatch.setattr(grouped_gemm, "native_grouped_available", lambda device: False)
    monkeypatch.setattr(grouped_triton, "mm", lambda a, b, out, *packed: calls.append(out) or real(a, b, out, *packed))
    monkeypatch.setattr(grouped_wgrad, "mm_into", lambda *a: wgrads.append(1) or real_wgrad(*a))
    _grouped_fwd_bwd_against_the_emulation(name, dev)
    assert len(calls) == 2 and wgrads == [1]  # output, grad_input, grad_weight; emulate: the per-expert loop


# --- lowprec's Triton grouped weight gradient (fp8/gemm/grouped_wgrad.py) on hardware ----------------
@pytest.mark.parametrize("gran,dy_dtype", [("tensor", torch.float8_e5m2), ("axis", torch.float8_e4m3fn)])
def test_triton_grouped_wgrad_matches_the_loop_on_cuda(gran, dy_dtype):
    """Every expert's weight gradient in one launch (ragged groups over the 64-row steps, empty
    experts, the fused casts' transposed layouts) against one torch._scaled_mm per expert into
    its float32 slice (the loop grouped_fn runs without it) and the float32 emulation: within the
    self-check's bound (2**-7 max |ref|) and > 40 dB; an empty expert's gradient is zeros."""
    dev = _fp8_gpu()
    pytest.importorskip("triton")
    from lowprec.fp8.gemm import grouped_wgrad

    assert grouped_wgrad.self_check(dev)
    torch.manual_seed(0)
    counts, n, k = (300, 0, 77, 1, 512, 129, 0), 768, 1024
    dy = [fp8.quantize(torch.randn(c, n, device=dev), dy_dtype, gran, dim=0) if c else None for c in counts]
    x = [
        fp8.quantize(torch.randn(c, k, device=dev) * 3, torch.float8_e4m3fn, gran, dim=0) if c else None for c in counts
    ]
    assert grouped_wgrad.supported(dy, x)
    _wgrad_against_the_loop(grouped_wgrad.mm_into, dy, x, n, k, dev)


def _wgrad_against_the_loop(run, dy, x, n, k, dev):
    """``run(dy, x, out)`` (one launch) against one ``scaled_mm`` per expert into float32 and the
    float32 emulation: within 2**-7 max |ref| and > 40 dB, every element written, the second
    expert (empty) zeros."""
    from lowprec.fp8.gemm import grouped_wgrad

    got = torch.full((len(dy), n, k), float("nan"), device=dev)
    run(dy, x, got)
    loop = torch.zeros_like(got)
    for e, (d, g) in enumerate(zip(dy, x)):
        if d is not None:
            loop[e] = fp8.scaled_mm(d.t(), g, torch.float32)
    emulated = grouped_wgrad.loop_reference(dy, x, n, k)
    assert not got.isnan().any() and torch.equal(got[1], torch.zeros(n, k, device=dev))
    assert (got - loop).abs().max() <= 2.0**-7 * loop.abs().max()
    assert sqnr(emulated, got) > 40 and sqnr(loop, got) > 40


def test_triton_grouped_block_wgrad_matches_the_loop_on_cuda():
    """The block mode (the blockwise recipe's 128 x 1 tiles along each group's tokens): every
    expert's weight gradient in one launch (ragged groups across 128-row tiles, empty experts, the
    fused casts' transposed layouts) against the per-expert blockwise GEMM (``scaled_mm``: cuBLAS on
    sm_90, the Triton blockwise GEMM elsewhere) and the float32 emulation: within 2**-7 max |ref|
    and > 40 dB; an empty expert's gradient is zeros."""
    dev = _fp8_gpu()
    pytest.importorskip("triton")
    from lowprec.fp8.gemm import grouped_wgrad

    assert grouped_wgrad.self_check(dev)
    torch.manual_seed(0)
    counts, n, k = (300, 0, 77, 1, 512, 129, 0), 768, 1024

    def cast(c, cols, s):
        return fp8.quantize(torch.randn(c, cols, device=dev) * s, torch.float8_e4m3fn, "block", block=(128, 1))

    dy = [cast(c, n, 1) if c else None for c in counts]
    x = [cast(c, k, 3) if c else None for c in counts]
    assert grouped_wgrad.block_supported(dy, x)
    _wgrad_against_the_loop(grouped_wgrad.block_mm_into, dy, x, n, k, dev)


def test_blockwise_grouped_experts_on_cublas_per_expert_on_sm90(monkeypatch):
    """sm_90 with groups cuBLAS takes (multiples of 16 rows): output and grad_input on torch's
    blockwise GEMM per expert, each writing its rows of one buffer; grad_input's B an expert's
    columns of the one-pass transposed weight cast (leading dimension E*N, not copied);
    grad_weight one Triton launch. fwd+bwd against the per-expert emulation."""
    dev = _fp8_gpu()
    pytest.importorskip("triton")
    from lowprec.fp8.gemm import block, grouped as grouped_gemm

    if torch.cuda.get_device_capability(dev) != (9, 0) or not block.self_check(dev):
        pytest.skip("torch's blockwise GEMM runs on sm_90 only")
    rows = []
    real = grouped_gemm.per_expert_into
    monkeypatch.setattr(grouped_gemm, "per_expert_into", lambda live, *a: rows.append(len(live)) or real(live, *a))
    _grouped_fwd_bwd_against_the_emulation("blockwise", dev, counts=(128, 0, 256, 32))  # multiples of 16
    assert rows == [3, 3]  # output, grad_input; emulate: the per-expert loop


def _grouped_fwd_bwd_against_the_emulation(name, dev, counts=(200, 0, 333, 19)):
    """A grouped GEMM fwd+bwd with ``gemm="auto"`` against ``gemm="emulate"`` (the per-expert
    loop): output and both gradients > 35 dB."""
    from lowprec.fp8.modules.grouped import Float8GroupedGemm

    torch.manual_seed(0)
    k, n = 512, 384
    x, w = torch.randn(sum(counts), k, device=dev), torch.randn(len(counts), n, k, device=dev)
    dy = torch.randn(sum(counts), n, device=dev)
    runs = []
    for gemm in ("auto", "emulate"):
        recipe = fp8.Recipe.from_name(name, gemm=gemm)
        xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = Float8GroupedGemm(len(counts), recipe).to(dev)(xt, wt, counts, recipe, torch.float32)
        out.backward(dy)
        runs.append((out.detach(), xt.grad, wt.grad))
    for got, want in zip(*runs):
        assert sqnr(want, got) > 35


@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_grouped_casts_into_one_buffer_on_cuda(name, monkeypatch):
    """The rowwise kinds' axis casts written into one buffer per operand (lowprec::cast_rowwise_into
    for every group and expert; rowwise_with_gw_hp's grad_weight a bf16 GEMM per expert writing
    its float32 slice through torch.mm's out_dtype), bf16 in and out, against the per-expert
    emulation: output and both gradients > 35 dB."""
    dev = _fp8_gpu()
    pytest.importorskip("triton")
    from lowprec.fp8 import kernels
    from lowprec.fp8.modules.grouped import Float8GroupedGemm

    torch.manual_seed(0)
    counts, k, n = (200, 0, 333, 19), 512, 384
    x = torch.randn(sum(counts), k, device=dev).bfloat16()
    w, dy = torch.randn(len(counts), n, k, device=dev), torch.randn(sum(counts), n, device=dev).bfloat16()
    into, runs = [], []
    real = kernels.cast_rowwise_into
    monkeypatch.setattr(kernels, "cast_rowwise_into", lambda *a, **kw: into.append(1) or real(*a, **kw))
    for gemm in ("auto", "emulate"):
        recipe = fp8.Recipe.from_name(name, gemm=gemm)
        xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = Float8GroupedGemm(len(counts), recipe).to(dev)(xt, wt, counts, recipe, torch.bfloat16)
        out.backward(dy)
        runs.append((out.detach().float(), xt.grad.float(), wt.grad))
    assert len(into) == 3 + len(counts) + 3  # x's groups, the experts, dY's groups (auto only)
    assert runs[0][2].dtype == torch.float32 and (runs[0][2][1] == 0).all()
    for got, want in zip(*runs):
        assert sqnr(want, got) > 35


def test_delayed_grouped_state_is_the_per_expert_loops_on_cuda(monkeypatch):
    """Delayed scaling on the one-call grouped path (casts into one buffer per operand, amaxes
    recorded in the same pass) against the per-expert loop (each expert a Linear's fused delayed
    casts), three steps with an empty expert: every state buffer bit for bit (the same amaxes and
    the same update kernel), outputs and gradients > 35 dB (other GEMM kernels)."""
    dev = _fp8_gpu()
    pytest.importorskip("triton")
    from lowprec.fp8.gemm import grouped as grouped_gemm
    from lowprec.fp8.modules.grouped import Float8GroupedGemm

    torch.manual_seed(0)
    recipe = fp8.Recipe.from_name("delayed", amax_history_len=4)
    k, n = 512, 384
    w = torch.randn(4, n, k, device=dev)
    gemms = {on: Float8GroupedGemm(4, recipe).to(dev) for on in (True, False)}
    for counts in ((200, 0, 333, 19), (64, 128, 0, 7), (1, 2, 3, 400)):
        x = torch.randn(sum(counts), k, device=dev) * 4
        dy = torch.randn(sum(counts), n, device=dev)
        runs = {}
        for on, gemm in gemms.items():
            monkeypatch.setattr(grouped_gemm, "single_call_ready", lambda device, on=on: on)
            xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = gemm(xt, wt, counts, recipe, torch.float32)
            out.backward(dy)
            runs[on] = (out.detach(), xt.grad, wt.grad)
        for got, want in zip(runs[True], runs[False]):
            assert sqnr(want, got) > 35
        for name, buf in gemms[False].named_buffers():
            assert torch.equal(getattr(gemms[True], name), buf), name


# --- lowprec's Triton blockwise grouped FP8 GEMM (fp8/gemm/grouped_block_triton.py) on hardware ---
@pytest.mark.parametrize("gemm", ["output", "grad_input"])
def test_triton_block_grouped_gemm_matches_the_dense_block_gemm_on_cuda(gemm):
    """One launch for all experts (ragged groups over the 64-row tiles, empty experts, the
    blockwise casts' CUDA layouts) against the dense Triton blockwise GEMM per expert and the
    float32 emulation: within the self-check's bound (2**-7 max |ref|) and > 40 dB."""
    dev = _fp8_gpu()
    pytest.importorskip("triton")
    from lowprec.fp8.cast.block_cast import quantize_square_transposed
    from lowprec.fp8.cast.quantize import dequantize, quantize_blockwise
    from lowprec.fp8.gemm import block_triton, grouped_block_triton

    assert grouped_block_triton.self_check(dev) and block_triton.self_check(dev)
    torch.manual_seed(0)
    e4m3 = torch.float8_e4m3fn
    counts, k, n = (300, 0, 77, 1, 512, 129, 0), 1024, 768
    groups = [quantize_blockwise(torch.randn(c, k, device=dev) * 3, e4m3, (1, 128)) if c else None for c in counts]
    if gemm == "output":  # W_e^T: (N, K) weights in 128x128 blocks, transposed
        experts = [quantize_blockwise(torch.randn(n, k, device=dev), e4m3, (128, 128)).t() for _ in counts]
    else:  # W_e contracting its rows, written transposed by the fused cast (as grad_input reads it)
        experts = [quantize_square_transposed(torch.randn(k, n, device=dev), e4m3, 128, True) for _ in counts]
    assert grouped_block_triton.supported(groups, experts)
    got = grouped_block_triton.mm(groups, experts, torch.bfloat16).float()
    live = [(g, w) for g, w in zip(groups, experts) if g is not None]
    dense = torch.cat([block_triton.mm(g, w, torch.bfloat16) for g, w in live]).float()
    emulated = torch.cat([dequantize(g) @ dequantize(w) for g, w in live])
    assert got.shape == dense.shape == (sum(counts), n)
    assert (got - dense).abs().max() <= 2.0**-7 * dense.abs().max()
    assert sqnr(emulated, got) > 40 and sqnr(dense, got) > 40


def test_blockwise_grouped_experts_on_the_triton_gemm_on_cuda(monkeypatch):
    """The blockwise kind's grouped experts: output and grad_input of all experts on the Triton
    blockwise grouped GEMM (one launch each), fwd+bwd against the per-expert emulation."""
    dev = _fp8_gpu()
    pytest.importorskip("triton")
    from lowprec.fp8.gemm import grouped_block_triton

    from lowprec.fp8.gemm import grouped_wgrad

    calls, wgrads = [], []
    real, real_wgrad = grouped_block_triton.mm, grouped_wgrad.block_mm_into
    monkeypatch.setattr(grouped_block_triton, "mm", lambda a, b, out: calls.append(out) or real(a, b, out))
    monkeypatch.setattr(grouped_wgrad, "block_mm_into", lambda *a: wgrads.append(1) or real_wgrad(*a))
    assert grouped_wgrad.self_check(dev)  # before counting launches
    _grouped_fwd_bwd_against_the_emulation("blockwise", dev)
    assert len(calls) == 2  # output and grad_input; emulate: the per-expert loop
    assert wgrads == [1]  # grad_weight of all experts in one launch
