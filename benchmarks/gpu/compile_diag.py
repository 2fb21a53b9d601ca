"""Compiled FP8 backward against eager on CUDA, taken apart: which change brings the gradients back.

Runs four and five on the H200 (torch 2.11) found a compiled Float8Linear's gradients all zeros
while eager was right; this script showed the zeros under ``aot_eager`` as under Inductor, and
``zero_grad_probe.py`` found the cause (an identity ``.to`` at the end of the GEMM: see
``gemm.as_dtype``). It stays in the GPU command as the first place a regression would show: for
each recipe and variant, the SQNR of the output and both gradients against eager and how many of
their values are zero:

* ``inductor``: as users compile;
* ``aot_eager``: Dynamo + AOTAutograd, no Inductor code;
* ``inductor_no_triton``: ``LOWPREC_DISABLE_TRITON=1`` (are the fused casts involved?);
* ``inductor_no_donated``: AOTAutograd's donated buffers off;
* ``inductor_no_fast_accum``: ``use_fast_accum=False`` in the forward too.

The Inductor variant's generated code (forward and backward) is kept in the JSON, truncated.

    python benchmarks/gpu/compile_diag.py OUT.json [--device cpu --variants aot_eager]  # CPU: smoke
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
from lowprec.fp8.kernels import select  # noqa: E402

VARIANTS = ("inductor", "aot_eager", "inductor_no_triton", "inductor_no_donated", "inductor_no_fast_accum")
CODE_CHARS = 60000


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    noise = (ref - got).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.pow(2).sum() / noise))


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _step(call, layer, x, device):
    xi = x.clone().requires_grad_()
    with fp8.autocast(), torch.autocast(device.type, dtype=torch.bfloat16):
        y = call(xi)
    y.float().square().mean().backward()
    out = (y.detach().float(), xi.grad.float(), layer.weight.grad.float().clone())
    layer.weight.grad = None
    return out


def run_variant(variant, recipe, m, k, n, device) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    rec = fp8.Recipe.from_name(recipe)
    if variant == "inductor_no_fast_accum":
        rec = rec.replace(use_fast_accum=False)
    base = torch.nn.Linear(k, n, bias=False, device=device)
    eager = fp8.Float8Linear.from_linear(torch.nn.Linear(k, n, bias=False, device=device), rec)
    twin = fp8.Float8Linear.from_linear(torch.nn.Linear(k, n, bias=False, device=device), rec)
    for layer in (eager, twin):
        layer.load_state_dict(base.state_dict(), strict=False)
    backend = "aot_eager" if variant == "aot_eager" else "inductor"
    env = {compile_guard.ENV: "1"}  # traced (the default; set in case the caller's environment has 0)
    if variant == "inductor_no_triton":
        env[select.DISABLE_ENV] = "1"
    x = torch.randn(m, k, device=device)
    row: dict = {"variant": variant, "recipe": recipe, "backend": backend, "shape": [m, k, n]}
    t0 = time.monotonic()
    with _env(**env), contextlib.ExitStack() as stack:
        if variant == "inductor_no_donated":
            import torch._functorch.config as fconfig

            stack.enter_context(fconfig.patch(donated_buffer=False))
        want = _step(eager, eager, x, device)
        compiled = torch.compile(twin, backend=backend)
        code: list[str] = []
        if variant == "inductor":
            from torch._inductor.utils import run_and_get_code

            got, code = run_and_get_code(_step, compiled, twin, x, device)
        else:
            got = _step(compiled, twin, x, device)
    row["seconds"] = round(time.monotonic() - t0, 1)
    for name, w, g in zip(("output", "grad_input", "grad_weight"), want, got):
        row[name] = {
            "sqnr_vs_eager_db": round(_sqnr(w, g), 2),
            "zero_fraction": round(float((g == 0).float().mean()), 4),
            "eager_zero_fraction": round(float((w == 0).float().mean()), 4),
            "absmax": float(g.abs().max()),
            "eager_absmax": float(w.abs().max()),
        }
    if code:
        row["inductor_code"] = [c[:CODE_CHARS] for c in code]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--recipes", default="tensorwise,rowwise,delayed,blockwise")
    p.add_argument("--variants", default="inductor,aot_eager", help=f"of {','.join(VARIANTS)}")
    p.add_argument("--shape", default="2048,4096,2048", help="M,K,N")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("compile_diag.py: no CUDA device; use --device cpu for the smoke run", file=sys.stderr)
        return 2
    m, k, n = (int(v) for v in a.shape.split(","))
    import torch._inductor.config as iconfig

    iconfig.force_disable_caches = True  # every variant compiled afresh, under its own settings
    result = {"device": device_name(device), "torch": torch.__version__, "rows": []}
    jobs = [
        ({"variant": v, "recipe": r}, functools.partial(run_variant, v, r, m, k, n, device))
        for r in a.recipes.split(",")
        for v in a.variants.split(",")
    ]
    collect_rows(Path(a.out), result, jobs, hide="inductor_code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
