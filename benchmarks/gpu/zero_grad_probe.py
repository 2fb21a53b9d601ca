"""Which layer of torch.compile zeroed the compiled FP8 backward's gradients on CUDA (found, fixed).

The fifth H200 run's ``compile_diag`` found the traced Float8Linear's backward graph reading
``aten.zeros`` where it should read its tangent, under ``aot_eager`` as under Inductor: the
fault was in Dynamo or AOTAutograd, not in code generation or our kernels. This probe narrowed
it (sixth run, 2026-11-28): the ``eager`` backend (Dynamo alone) zeroed them too, a ten-line
autograd.Function around ``torch._scaled_mm`` did not, and Dynamo's graph (kept by the
``capture`` variants) showed why: the traced forward returns every intermediate beside the
result, and the GEMM's identity ``out.to(out_dtype)`` made the result and an intermediate one
tensor in two output slots. ``gemm.as_dtype`` and ``tests/test_fp8_result_identity.py`` are the
fix and its guard. Kept to check a new torch version:

* ``ours_*``: one Float8Linear (tensorwise, traced) under the ``eager`` backend, with and without
  an outer ``torch.autocast``, with telemetry off; ``capture`` keeps Dynamo's graph (with the
  autograd.Function's forward and backward bodies) and AOTAutograd's forward and backward graphs;
* ``toy_*``: a ten-line autograd.Function whose forward is ``torch._scaled_mm`` (or a bf16
  matmul, the control), whose backward is a plain matmul.

Every row: the input and weight gradients' SQNR against eager and their fraction of zeros.

    python benchmarks/gpu/zero_grad_probe.py OUT.json [--device cpu]   # CPU: a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
from _common import collect_rows, device_name  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.fp8.gemm import compile_guard  # noqa: E402
from lowprec.fp8.modules.autocast import torch_autocast_off  # noqa: E402

E4M3 = torch.float8_e4m3fn
GRAPH_CHARS = 30000


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    noise = (ref - got).pow(2).sum()
    return float("inf") if noise == 0 else round(float(10 * torch.log10(ref.pow(2).sum() / noise)), 2)


class ToyFn(torch.autograd.Function):
    """``x @ w.t()`` through ``torch._scaled_mm`` (``mode`` scaled_mm) or a bf16 matmul."""

    @staticmethod
    def forward(ctx, x, w, mode: str):
        ctx.save_for_backward(x, w)
        if mode == "scaled_mm_autocast_off":  # as Float8LinearFn: autocast off inside the forward
            with torch_autocast_off(x.device.type):
                return ToyFn.forward(ctx, x, w, "scaled_mm")
        if mode == "matmul":
            return x.to(torch.bfloat16) @ w.to(torch.bfloat16).t()
        sx = (x.abs().amax().float() / 448.0).clamp(min=1e-12)
        sw = (w.abs().amax().float() / 448.0).clamp(min=1e-12)
        xq, wq = (x / sx).to(E4M3), (w / sw).to(E4M3)
        return torch._scaled_mm(xq, wq.t(), sx, sw, out_dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy.float() @ w.float(), dy.float().t() @ x.float(), None


class Toy(torch.nn.Module):
    def __init__(self, k, n, mode, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k, device=device) / k**0.5)
        self.mode = mode

    def forward(self, x):
        return ToyFn.apply(x, self.weight, self.mode)


class Capture:
    """A backend that keeps Dynamo's graph and AOTAutograd's forward and backward graphs."""

    def __init__(self):
        self.graphs: dict[str, str] = {}

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func

        n = len([k for k in self.graphs if k.startswith("dynamo")])  # one set per graph (breaks)
        self.graphs[f"dynamo_{n}"] = gm.print_readable(print_output=False)[:GRAPH_CHARS]

        def keep(name):
            def compiler(g, _inputs):
                self.graphs[name] = g.print_readable(print_output=False)[:GRAPH_CHARS]
                return make_boxed_func(g.forward)

            return compiler

        return aot_autograd(fw_compiler=keep(f"aot_forward_{n}"), bw_compiler=keep(f"aot_backward_{n}"))(
            gm, example_inputs
        )


def _step(call, layer, x, autocast: bool, device):
    xi = x.clone().requires_grad_()
    with contextlib.ExitStack() as stack:
        if isinstance(layer, fp8.Float8Linear):
            stack.enter_context(fp8.autocast())
        if autocast:
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
        y = call(xi)
    y.float().square().mean().backward()
    out = (xi.grad.float(), layer.weight.grad.float().clone())
    layer.weight.grad = None
    return out


def _layers(kind: str, k: int, n: int, device, telemetry: bool):
    torch.manual_seed(0)
    if kind.startswith("toy"):
        mode = kind.removeprefix("toy_")
        a, b = Toy(k, n, mode, device), Toy(k, n, mode, device)
        b.load_state_dict(a.state_dict())
        return a, b
    rec = fp8.Recipe.from_name("tensorwise")
    base = torch.nn.Linear(k, n, bias=False, device=device)
    pair = []
    for _ in range(2):
        layer = fp8.Float8Linear.from_linear(torch.nn.Linear(k, n, bias=False, device=device), rec)
        layer.load_state_dict(base.state_dict(), strict=False)
        layer.fp8_telemetry = telemetry
        pair.append(layer)
    return pair[0], pair[1]


# (name, layers, backend, outer autocast, telemetry)
VARIANTS = {
    "ours_capture": ("ours", "capture", True, True),
    "ours_eager_backend": ("ours", "eager", True, True),
    "ours_aot_eager_no_autocast": ("ours", "aot_eager", False, True),
    "ours_aot_eager_no_telemetry": ("ours", "aot_eager", True, False),
    "toy_scaled_mm_capture": ("toy_scaled_mm", "capture", True, True),
    "toy_scaled_mm_eager_backend": ("toy_scaled_mm", "eager", True, True),
    "toy_scaled_mm_no_autocast": ("toy_scaled_mm", "aot_eager", False, True),
    "toy_scaled_mm_autocast_off": ("toy_scaled_mm_autocast_off", "aot_eager", True, True),
    "toy_matmul": ("toy_matmul", "aot_eager", True, True),
}


def run_variant(name: str, m: int, k: int, n: int, device) -> dict:
    kind, backend, autocast, telemetry = VARIANTS[name]
    torch._dynamo.reset()
    eager, twin = _layers(kind, k, n, device, telemetry)
    x = torch.randn(m, k, device=device)
    row: dict = {"variant": name, "backend": backend, "autocast": autocast, "shape": [m, k, n]}
    t0 = time.monotonic()
    old = os.environ.get(compile_guard.ENV)
    os.environ[compile_guard.ENV] = "1"
    try:
        want = _step(eager, eager, x, autocast, device)
        cap = Capture() if backend == "capture" else None
        compiled = torch.compile(twin, backend=cap if cap is not None else backend)
        got = _step(compiled, twin, x, autocast, device)
    finally:
        if old is None:
            os.environ.pop(compile_guard.ENV, None)
        else:
            os.environ[compile_guard.ENV] = old
    row["seconds"] = round(time.monotonic() - t0, 1)
    for label, w, g in zip(("grad_input", "grad_weight"), want, got):
        row[label] = {"sqnr_vs_eager_db": _sqnr(w, g), "zero_fraction": round(float((g == 0).float().mean()), 4)}
    if cap is not None:
        row["graphs"] = cap.graphs
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--shape", default="256,512,256", help="M,K,N")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("zero_grad_probe.py: no CUDA device; use --device cpu for the smoke run", file=sys.stderr)
        return 2
    m, k, n = (int(v) for v in a.shape.split(","))
    result = {"device": device_name(device), "torch": torch.__version__, "rows": []}
    jobs = [({"variant": v}, functools.partial(run_variant, v, m, k, n, device)) for v in a.variants.split(",")]
    collect_rows(Path(a.out), result, jobs, hide="graphs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
