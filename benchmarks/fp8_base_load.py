"""The peak memory of loading an FP8 base (issue 26): ``load_fp8_base``'s direct loader against
transformers' dequantizing loader (``direct=False``, the loader before it), hf-fp8 and
compressed-tensors.

The model: a Llama built from a config (no download; hidden 1024, MLP 2816, 12 layers, 16 heads,
4 KV heads, vocab 8192, untied head, random init in bf16), exported unconverted with each
format's own rule (``export_model``: every decoder Linear in FP8, embeddings and head bf16). Each
load runs in a fresh process (``--child``), which reports:

* ``rss_peak_delta_bytes``: the process's peak resident set during the load (``VmHWM``, reset
  through ``/proc/self/clear_refs`` just before) minus its resident set then; file pages that
  safetensors maps count while resident;
* ``rss_anon_peak_delta_bytes``: the peak of its anonymous resident memory (``RssAnon``, sampled
  every 2 ms by a thread) minus the value before: the memory the load itself allocated, without
  page cache; ``rss_anon_after_delta_bytes`` the same after the load (the C allocator keeps
  some freed memory);
* ``resident_bytes``: the loaded model's parameters and buffers (FP8 bytes, scales, the rest in
  ``dtype``), what a load cannot go below; ``bf16_bytes``: every parameter in bf16.

``_common.cpu_alloc_peak`` is not used: torch.profiler records each safetensors ``get_tensor``
as an allocation the size of the whole file, never freed in its events (a 0.12 GB model load
read as 2 GB, peak = final), for both loaders.

    PYTHONPATH=src python benchmarks/fp8_base_load.py   # -> benchmarks/results/fp8_base_load.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_name, rss_peaks, run_child, write_json  # noqa: E402

SHAPE = dict(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _export(d: str, fmt: str) -> dict:
    import transformers

    from lowprec.export import export_model

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, dtype="bfloat16")).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    report = export_model(model, d, fmt)
    return {"params": params, "fp8_layers": len(report.quantized), "scheme": report.scheme}


def _child(d: str, loader: str, dtype: str) -> dict:
    """One load in this process: its peaks (see the module docstring)."""
    import lowprec.fp8 as fp8
    from lowprec.export import load_fp8_base

    import transformers  # noqa: F401  (imported before the baseline: its import is not the load)

    held: dict = {}
    with rss_peaks() as peaks:
        t0 = time.perf_counter()
        held["m"] = load_fp8_base(d, DTYPES[dtype], direct=loader == "direct")
        seconds = time.perf_counter() - t0
    model = held.pop("m")
    tensors = {t.untyped_storage().data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    layers = [m for m in model.modules() if isinstance(m, fp8.Float8BaseLinear)]
    row = {
        **peaks,
        "resident_bytes": sum(t.untyped_storage().nbytes() for t in tensors.values()),
        "fp8_base_layers": len(layers),
        "load_seconds": round(seconds, 2),
    }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/fp8_base_load.json)")
    ap.add_argument("--formats", default="hf-fp8,compressed-tensors")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--child", nargs=3, metavar=("DIR", "LOADER", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    rows = []
    for fmt in args.formats.split(","):
        with tempfile.TemporaryDirectory() as d:
            model = _export(d, fmt)
            for dtype in args.dtypes.split(","):
                for loader in ("transformers", "direct"):
                    row = {"format": fmt, "dtype": dtype, "loader": loader, **model}
                    row.update(run_child(__file__, d, loader, dtype))
                    row["bf16_bytes"] = 2 * row["params"]
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    write_json(
        {"device": device_name(torch.device("cpu")), "shape": SHAPE, "rows": rows}, args.out, "fp8_base_load.json"
    )


if __name__ == "__main__":
    main()
