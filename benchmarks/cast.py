"""GB/s of the fused FP8 cast (Triton) against the torch path, eager and compiled.

    PYTHONPATH=src python3 benchmarks/cast.py            # 16384x4096, 16384x14336 bf16 (CUDA)
    PYTHONPATH=src python3 benchmarks/cast.py --sweep    # also every tile shape of the kernel
    PYTHONPATH=src python3 benchmarks/cast.py --tiny     # CPU smoke run of the torch path

What is timed, per shape, for E4M3 with a given per-tensor scale (delayed scaling's cast):

* ``cast_transpose_amax``: FP8 tensor + its transpose + amax (what Float8Linear's input needs
  for the output GEMM, the weight-gradient GEMM and the amax a delayed scale needs), Triton one pass vs
  ``reference.cast_transpose_amax`` in eager and under ``torch.compile``;
* ``cast_amax``: the same without the transpose;
* ``cast_rowwise``: per-row scales computed and applied (rowwise recipe).

GB/s counts the bytes a single pass must move (read the input once, write each output once),
the same for every implementation, so the numbers compare time; ``pct_of_hbm_peak`` divides
by 3.35 TB/s (H100 SXM; H200 4.8 TB/s: see the device string), and ``fraction_of_copy`` by
the GB/s of a plain device-to-device copy of the same input, measured first (``op: copy``).
Results go to benchmarks/results/cast.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_name, time_fn, write_json  # noqa: E402

from lowprec.fp8 import E4M3, kernels  # noqa: E402
from lowprec.fp8.kernels import reference  # noqa: E402

SHAPES = [(16384, 4096), (16384, 14336)]
TINY = [(256, 512), (130, 70)]
TILES = [(32, 32, 2), (32, 64, 4), (64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8)]
HBM_PEAK = {"H100": 3.35e12, "H200": 4.8e12}


def nominal_bytes(op: str, m: int, n: int, in_bytes: int) -> int:
    fp8_out = {"cast_transpose_amax": 2, "cast_amax": 1, "cast_rowwise": 1}[op]
    return m * n * (in_bytes + fp8_out) + (4 * m if op == "cast_rowwise" else 4)


def implementations(op: str, device: torch.device, modes: list[str]):
    """name -> callable(x, scale) for one op: torch eager, torch compiled, Triton."""
    ref = getattr(reference, op)
    call = (lambda f: lambda x, s: f(x, E4M3)) if op == "cast_rowwise" else (lambda f: lambda x, s: f(x, s, E4M3))
    out = {}
    if "eager" in modes:
        out["torch_eager"] = call(ref)
    if "compile" in modes:
        out["torch_compile"] = call(torch.compile(ref, fullgraph=True))
    if "triton" in modes and kernels.available(device):
        from lowprec.fp8.kernels import ops

        out["triton"] = call(getattr(ops, op))
    return out


def check(op: str, got, x: torch.Tensor, scale: torch.Tensor) -> bool:
    """The timed result equals the eager torch path (bit for bit)."""
    want = reference.cast_rowwise(x, E4M3) if op == "cast_rowwise" else getattr(reference, op)(x, scale, E4M3)
    return all(
        torch.equal(g.view(torch.uint8), w.view(torch.uint8)) if g.element_size() == 1 else torch.equal(g, w)
        for g, w in zip(got, want)
    )


def copy_bandwidth(x: torch.Tensor, device: torch.device, warmup: int, iters: int, results: list) -> float:
    """GB/s of a device-to-device copy of ``x`` (bytes read + written): the bandwidth a cast can
    hope for on this device, measured rather than taken from a datasheet. Appended to ``results``."""
    y = torch.empty_like(x)
    ms = time_fn(lambda: y.copy_(x), device, warmup, iters)
    gbs = 2 * x.numel() * x.element_size() / ms / 1e6
    results.append(
        {
            "op": "copy",
            "M": x.shape[0],
            "N": x.shape[1],
            "impl": "torch copy_",
            "input": str(x.dtype)[6:],
            "ms": round(ms, 4),
            "GBps": round(gbs, 1),
        }
    )
    print(f"{'copy':20s} {x.shape[0]}x{x.shape[1]:<6d} {'torch copy_':14s} {ms:.3f} ms {gbs:.0f} GB/s")
    return gbs


def sweep_tiles(x, scale, device, iters, warmup):
    from lowprec.fp8.kernels import ops

    m, n = x.shape
    rows = []
    for tile in TILES:
        q = torch.empty((m, n), dtype=torch.uint8, device=device)
        qt = torch.empty((n, m), dtype=torch.uint8, device=device)
        ab = torch.zeros((), dtype=torch.int32, device=device)
        ms = time_fn(
            lambda q=q, qt=qt, ab=ab, tile=tile: ops.launch_cast(x, scale, E4M3, q, qt, ab, tile=tile),
            device,
            warmup,
            iters,
        )
        gbs = nominal_bytes("cast_transpose_amax", m, n, x.element_size()) / ms / 1e6
        rows.append({"M": m, "N": n, "tile": list(tile), "ms": round(ms, 4), "GBps": round(gbs, 1)})
        print(f"  tile {tile}: {ms:.3f} ms {gbs:.0f} GB/s")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes; on CPU the torch path only (smoke run)")
    p.add_argument("--ops", default="cast_transpose_amax,cast_amax,cast_rowwise")
    p.add_argument("--modes", default="eager,compile,triton", help="subset of eager,compile,triton")
    p.add_argument("--sweep", action="store_true", help="also time every tile shape of the Triton kernel")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cast.json)")
    a = p.parse_args(argv)
    os.environ.setdefault("LOWPREC_TRITON_KERNELS", "1")  # the kernels are opt-in; this measures them
    cuda = torch.cuda.is_available()
    if not cuda and not a.tiny:
        print(
            "benchmarks/cast.py times Triton kernels and needs a CUDA GPU; use --tiny for a CPU smoke run of the torch path"
        )
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not cuda:
        modes = [m for m in modes if m == "eager"] or ["eager"]
    shapes = TINY if a.tiny else SHAPES
    peak = next((v for k, v in HBM_PEAK.items() if cuda and k in torch.cuda.get_device_name(device)), None)
    results, sweeps = [], []
    for m, n in shapes:
        torch.manual_seed(0)
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        scale = torch.tensor(448.0 / 8.0, device=device)
        copy_gbs = copy_bandwidth(x, device, a.warmup, a.iters, results)
        for op in [o.strip() for o in a.ops.split(",") if o.strip()]:
            for name, fn in implementations(op, device, modes).items():
                row = {"op": op, "M": m, "N": n, "impl": name, "input": "bfloat16", "fp8": "e4m3fn"}
                try:
                    row["exact"] = check(op, fn(x, scale), x, scale)
                    ms = time_fn(lambda fn=fn, x=x, scale=scale: fn(x, scale), device, a.warmup, a.iters)
                    gbs = nominal_bytes(op, m, n, x.element_size()) / ms / 1e6
                    row.update(ms=round(ms, 4), GBps=round(gbs, 1))
                    if peak:
                        row["pct_of_hbm_peak"] = round(100 * gbs * 1e9 / peak, 1)
                    row["fraction_of_copy"] = round(gbs / copy_gbs, 3)
                except Exception as e:  # noqa: BLE001 - record and go on to the next variant
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                results.append(row)
                print(
                    f"{op:20s} {m}x{n:<6d} {name:14s} "
                    + (
                        f"{row['ms']:.3f} ms {row['GBps']:.0f} GB/s exact={row['exact']}"
                        if "ms" in row
                        else row["error"]
                    )
                )
        if a.sweep and "triton" in modes and kernels.available(device):
            sweeps += sweep_tiles(x, scale, device, a.iters, a.warmup)
        # rewritten after each shape: a run stopped at a time budget keeps the shapes it finished
        save(results, sweeps, device, a.out, complete=(m, n) == shapes[-1])
    return 0


def save(results: list, sweeps: list, device: torch.device, out: str | None, complete: bool) -> None:
    payload = {
        "device": device_name(device),
        "triton": kernels.available(device),
        "results": results,
        "complete": complete,
    }
    if sweeps:
        payload["tile_sweep"] = sweeps
    write_json(payload, out, "cast.json")


if __name__ == "__main__":
    sys.exit(main())
