"""Logit gaps of compressed-tensors exports of a tiny trained Llama, one row per recipe (issue 26).

Each recipe (tensorwise, rowwise, blockwise, mxfp8, nvfp4): a Llama of hidden 128, 2 layers,
vocab 256, converted, 3 AdamW steps, exported with ``export_model(..., "compressed-tensors")``
and loaded back through transformers' compressed-tensors integration (decompressed, CPU).
Relative L2 gaps of the logits on 2 x 24 tokens:

* ``loaded_vs_trained_weights``: the loaded export against the trained model's float32 forward
  with its forward weight casts (what the export holds; activations in high precision, as the
  decompressed model runs them);
* ``loaded_vs_training_forward``: against the trained model's own FP8 / FP4 forward (activations
  quantized too, as in training);
* ``quantized_vs_bf16_export``: the export report's gap between the quantized and the bf16 export.

    PYTHONPATH=src python benchmarks/export_gaps.py   # -> benchmarks/results/export_gaps.json (--out to change)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_name, write_json  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.export import export_model  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4")


def _trained(recipe: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4
    )
    model = transformers.LlamaForCausalLM(cfg).float()
    fp8.convert(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _row(recipe: str, out: str) -> dict:
    model = _trained(recipe)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    report = export_model(model, out, "compressed-tensors")
    params = {k: p.detach() for k, p in model.named_parameters()}
    for name in report.quantized:
        params[f"{name}.weight"] = model.get_submodule(name).forward_weight_cast().dequantize(torch.float32)
    qc = transformers.CompressedTensorsConfig(run_compressed=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, quantization_config=qc, dtype=torch.float32)
    with torch.no_grad():
        got = loaded(ids).logits.float()
        model.train()  # the FP8 forward runs in training mode
        training = model(ids).logits.float()
        with fp8.autocast(enabled=False):
            weights = torch.func.functional_call(model, params, (ids,)).logits.float()
    return {
        "recipe": recipe,
        "scheme": report.scheme,
        "trained_scales": report.trained_scales,
        "loaded_vs_trained_weights": _rel(got, weights),
        "loaded_vs_training_forward": _rel(got, training),
        "quantized_vs_bf16_export": report.logit_gap,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/export_gaps.json)")
    args = ap.parse_args()
    rows = []
    for recipe in RECIPES:
        with tempfile.TemporaryDirectory() as d:
            rows.append(_row(recipe, d))
        print(json.dumps(rows[-1]))
    write_json({"device": device_name(torch.device("cpu")), "rows": rows}, args.out, "export_gaps.json")


if __name__ == "__main__":
    main()
