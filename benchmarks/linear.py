"""Float8Linear fwd+bwd against nn.Linear in bf16, per recipe, eager and compiled.

    PYTHONPATH=src python3 benchmarks/linear.py            # Llama-3-8B shapes, M=16384 (GPU)
    PYTHONPATH=src python3 benchmarks/linear.py --tiny     # seconds on CPU (exercised by a test)

For each (M, K, N) and each variant (bf16 baseline, every lowprec recipe, torchao's
Float8Linear tensorwise/rowwise when torchao imports) it reports the median fwd+bwd time, the
speedup over bf16 in the same mode, and the bytes autograd saves for backward (Parameters
excluded: they exist anyway). Baseline: nn.Linear with float32 master weights under
torch.autocast(bfloat16), the standard AMP setting. Input: random N(0,1), fresh per shape.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import count_saved_bytes, device_name, time_fn, write_json  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402

LLAMA3_8B = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (16384, 4096, 1024)]
SMALL = [(4096, 1024, 1024), (4096, 2048, 2048)]
TINY = [(256, 128, 256), (128, 256, 64)]


def _torchao_variants():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return {}

    def make(name):
        def build(lin):
            holder = nn.Sequential(lin)
            convert_to_float8_training(holder, config=Float8LinearConfig.from_recipe_name(name))
            return holder[0]

        return build

    return {"torchao_tensorwise": make("tensorwise"), "torchao_rowwise": make("rowwise")}


def _variants(recipes):
    out = {"bf16": (lambda lin: lin, False)}
    for name in recipes:
        out[name] = ((lambda lin, n=name: fp8.Float8Linear.from_linear(lin, fp8.Recipe.from_name(n))), True)
    for name, build in _torchao_variants().items():
        out[name] = (build, False)
    return out


def bench_shape(m, k, n, device, recipes, modes, iters, warmup, compile_backend="inductor"):
    base = nn.Linear(k, n, bias=False, device=device)
    x = torch.randn(m, k, device=device, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    rows = []
    for vname, (build, use_lowprec_autocast) in _variants(recipes).items():
        layer = build(copy.deepcopy(base))
        for mode in modes:
            fn_layer = torch.compile(layer, backend=compile_backend) if mode == "compiled" else layer

            def step(fn_layer=fn_layer, layer=layer, use_lowprec_autocast=use_lowprec_autocast):
                with fp8.autocast(enabled=use_lowprec_autocast), torch.autocast(device.type, dtype=torch.bfloat16):
                    y = fn_layer(x)
                y.backward(g)
                x.grad = None
                layer.weight.grad = None

            try:
                ms = time_fn(step, device, warmup=warmup, iters=iters)
                row = {"M": m, "K": k, "N": n, "variant": vname, "mode": mode, "ms": ms}
                if mode == "eager":  # saved-tensor hooks see eager autograd only
                    with fp8.autocast(enabled=use_lowprec_autocast), torch.autocast(device.type, dtype=torch.bfloat16):
                        with count_saved_bytes(exclude=[layer.weight]) as saved:
                            y = layer(x)
                    y.backward(g)
                    x.grad = None
                    layer.weight.grad = None
                    row["saved_bytes"] = saved["bytes"]
                rows.append(row)
            except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
                rows.append(
                    {"M": m, "K": k, "N": n, "variant": vname, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]}
                )
    base_ms = {r["mode"]: r["ms"] for r in rows if r["variant"] == "bf16" and "ms" in r}
    base_saved = next((r["saved_bytes"] for r in rows if r["variant"] == "bf16" and "saved_bytes" in r), None)  # eager
    for r in rows:
        if "ms" in r and r["mode"] in base_ms:
            r["speedup_vs_bf16"] = base_ms[r["mode"]] / r["ms"]
        if "saved_bytes" in r and base_saved:
            r["saved_bytes_vs_bf16"] = r["saved_bytes"] / base_saved
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small shapes, few iterations (CPU smoke run)")
    p.add_argument("--recipes", default=",".join(fp8.RECIPE_NAMES))
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--small", action="store_true", help="add small shapes to the Llama-3-8B ones")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/linear_<device>.json)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = TINY if args.tiny else LLAMA3_8B + (SMALL if args.small else [])
    iters = args.iters or (3 if args.tiny else 20)
    warmup = 1 if args.tiny else 5
    torch.manual_seed(0)
    rows = []
    for m, k, n in shapes:
        rows += bench_shape(m, k, n, device, args.recipes.split(","), args.modes.split(","), iters, warmup)
    header = f"{'M':>6} {'K':>6} {'N':>6} {'variant':<20} {'mode':<9} {'ms':>9} {'x bf16':>7} {'saved/bf16':>10}"
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['M']:>6} {r['K']:>6} {r['N']:>6} {r['variant']:<20} {r['mode']:<9} ERROR {r['error'][:60]}")
            continue
        print(
            f"{r['M']:>6} {r['K']:>6} {r['N']:>6} {r['variant']:<20} {r['mode']:<9} {r['ms']:>9.3f} "
            f"{r.get('speedup_vs_bf16', float('nan')):>7.2f} {r.get('saved_bytes_vs_bf16', float('nan')):>10.3f}"
        )
    print("saved/bf16: bytes autograd keeps for backward, measured in eager mode (nan for compiled rows)")
    tag = "tiny" if args.tiny else device.type
    return write_json(
        {"benchmark": "linear", "device": device_name(device), "tiny": args.tiny, "results": rows},
        args.out,
        f"linear_{tag}.json",
    )


if __name__ == "__main__":
    main()
