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


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_compiled_matches_eager_on_cuda(recipe):
    dev = _fp8_gpu()
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 4096, device=dev)
    a = fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name(recipe))
    b = torch.compile(
        fp8.Float8Linear.from_linear(torch.nn.Linear(4096, 4096, device=dev), fp8.Recipe.from_name(recipe)),
        fullgraph=True,
    )
    b._orig_mod.load_state_dict(a.state_dict())
    x = torch.randn(2048, 4096, device=dev)
    with fp8.autocast(), torch.autocast("cuda", dtype=torch.bfloat16):
        ya, yb = a(x), b(x)
    assert sqnr(ya.float(), yb.float()) > 35


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
