"""The peak memory of ``merge_lora_fp8_base`` (issue 26): the dense merge (``stream=False``, the
merge before the streaming one) against the streaming merge, in one file and in shards, to fp8
and to bf16, from an hf-fp8 and a compressed-tensors base.

The model: ``fp8_base_load.py``'s Llama from a config (152M parameters, 83 FP8 layers), exported
unconverted, loaded with ``load_fp8_base`` (the rest in float32, the trainer's default), LoRA r=16
on every decoder Linear (q, k, v, o, gate, up, down: every FP8 layer is merged) with its B
matrices random (``init_lora_weights=False``), so each delta is a full-rank-16 change. Each merge
runs in a fresh process (``--child``); the baseline is taken after the model and its adapters are
built, so the numbers are the merge's own:

* ``rss_anon_peak_delta_bytes``: the peak of anonymous resident memory (``RssAnon`` sampled every
  2 ms) minus the value before the merge;
* ``rss_peak_delta_bytes``: the peak resident set (``VmHWM``, reset before) minus ``VmRSS`` then;
* ``model_resident_bytes``: the FP8 model with its adapters (what the merge starts from);
* ``written_bytes``: the files' total size.

    PYTHONPATH=src python benchmarks/fp8_merge_peak.py --repeats 3   # -> benchmarks/results/fp8_merge_peak.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_name, rss_peaks, run_child, write_json  # noqa: E402
from fp8_base_load import SHAPE, _export  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES = {"dense": (False, None), "stream": (True, None), "stream_shards_64MB": (True, 64 << 20)}


def _child(base: str, out: str, merge: str, mode: str) -> dict:
    import peft

    from lowprec.export import load_fp8_base
    from lowprec.export.fp8_merge import merge_lora_fp8_base

    torch.manual_seed(0)
    model = load_fp8_base(base, torch.float32)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=16, target_modules=TARGETS, init_lora_weights=False, lora_alpha=16)
    )
    tensors = {t.untyped_storage().data_ptr(): t for t in [*lora.parameters(), *lora.buffers()]}
    resident = sum(t.untyped_storage().nbytes() for t in tensors.values())
    del tensors
    stream, shard = MODES[mode]
    with rss_peaks() as peaks:
        t0 = time.perf_counter()
        report = merge_lora_fp8_base(lora, out, merge, stream=stream, max_shard_bytes=shard)
        seconds = time.perf_counter() - t0
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    return {
        **peaks,
        "model_resident_bytes": resident,
        "merged_layers": len(report.merged),
        "files": len(files),
        "written_bytes": sum(os.path.getsize(os.path.join(out, f)) for f in files),
        "merge_seconds": round(seconds, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/fp8_merge_peak.json)")
    ap.add_argument("--formats", default="hf-fp8,compressed-tensors")
    ap.add_argument("--merges", default="fp8,bf16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per setting (the peaks vary run to run)")
    ap.add_argument("--child", nargs=4, metavar=("BASE", "OUT", "MERGE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    rows = []
    for fmt in args.formats.split(","):
        with tempfile.TemporaryDirectory() as d:
            base = os.path.join(d, "base")
            model = _export(base, fmt)
            for merge in args.merges.split(","):
                for mode in args.modes.split(","):
                    for repeat in range(args.repeats):
                        out = os.path.join(d, f"merged-{merge}-{mode}-{repeat}")
                        row = {"format": fmt, "merge": merge, "mode": mode, "repeat": repeat, **model}
                        row.update(run_child(__file__, base, out, merge, mode))
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                        shutil.rmtree(out)
    write_json(
        {
            "device": device_name(torch.device("cpu")),
            "shape": SHAPE,
            "lora": {"r": 16, "targets": TARGETS, "init_lora_weights": False},
            "base_rest_dtype": "float32",
            "rows": rows,
        },
        args.out,
        "fp8_merge_peak.json",
    )


if __name__ == "__main__":
    main()
