"""FP8 exports as frozen FP8 bases, and merge_lora onto them, on a tiny trained Llama (issue 26).

Each case (hf-fp8 blockwise; compressed-tensors tensorwise, rowwise, blockwise): the model of
``export_gaps.py`` (hidden 128, 2 layers, vocab 256, converted, 3 AdamW steps) exported, loaded
with ``load_fp8_base``, LoRA r=8 on q/v/up_proj trained 4 AdamW steps (lr 1e-2) on 2 x 24
tokens, then merged with ``merge_lora_fp8_base`` and the merged directory loaded by transformers
(dequantized, CPU). Relative L2 gaps of the logits on those tokens:

* ``bytes_per_param``: resident bytes of the FP8 layers (E4M3 bytes + float32 scales) per weight;
* ``base_vs_training_forward``: the base's FP8 forward against the trained model's FP8 forward
  (non-FP8 parameters rounded to bf16 as the export stores them);
* ``merged_vs_unmerged``: the merged FP8 directory against base + adapter in high precision (the
  re-quantization of the merged layers), next to ``base_vs_unmerged`` (the adapter's effect) and
  the export's own ``export_gap`` (every FP8 layer rounded once, against the bf16 export).

    PYTHONPATH=src python benchmarks/fp8_base_gaps.py   # -> benchmarks/results/fp8_base_gaps.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import peft
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_name, write_json  # noqa: E402
from export_gaps import _rel, _trained  # noqa: E402

import lowprec.fp8 as fp8  # noqa: E402
from lowprec.export import export_model, load_fp8_base  # noqa: E402
from lowprec.export.fp8_merge import merge_lora_fp8_base  # noqa: E402

CASES = (("blockwise", "hf-fp8"), ("tensorwise", "compressed-tensors"), ("rowwise", "compressed-tensors"))
CASES += (("blockwise", "compressed-tensors"),)


def _dequantized(path: str, fmt: str) -> torch.nn.Module:
    qc = transformers.FineGrainedFP8Config(dequantize=True) if fmt == "hf-fp8" else None
    qc = qc or transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, dtype=torch.float32)


def _row(recipe: str, fmt: str, d: str) -> dict:
    model = _trained(recipe)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    report = export_model(model, f"{d}/base", fmt)
    base = load_fp8_base(f"{d}/base")
    layers = [m for m in base.modules() if isinstance(m, fp8.Float8BaseLinear)]
    resident = sum(m.weight.nbytes + m.weight_scale_bits.nbytes for m in layers)
    with torch.no_grad():
        for m in model.modules():  # the export stores what is not FP8 in bf16
            if not isinstance(m, fp8.Float8Linear):
                for p in m.parameters(recurse=False):
                    p.copy_(p.bfloat16())
        model.train()
        base.train()
        forward_gap = _rel(base(ids).logits.float(), model(ids).logits.float())
    lora = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = lora(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 4))
    with torch.no_grad(), fp8.autocast(enabled=False):
        unmerged = lora(ids).logits.float()
        with lora.disable_adapter():
            base_only = lora(ids).logits.float()
    merge = merge_lora_fp8_base(lora, f"{d}/merged")
    with torch.no_grad():
        merged = _dequantized(f"{d}/merged", fmt)(ids).logits.float()
    return {
        "format": fmt,
        "recipe": recipe,
        "scheme": report.scheme,
        "bytes_per_param": resident / sum(m.weight.numel() for m in layers),
        "base_vs_training_forward": forward_gap,
        "lora_losses": losses,
        "merged_layers": len(merge.merged),
        "unchanged_layers": len(merge.unchanged),
        "merged_vs_unmerged": _rel(merged, unmerged),
        "base_vs_unmerged": _rel(base_only, unmerged),
        "export_gap": report.logit_gap,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/fp8_base_gaps.json)")
    args = ap.parse_args()
    rows = []
    for recipe, fmt in CASES:
        with tempfile.TemporaryDirectory() as d:
            rows.append(_row(recipe, fmt, d))
        print(json.dumps(rows[-1]))
    write_json({"device": device_name(torch.device("cpu")), "rows": rows}, args.out, "fp8_base_gaps.json")


if __name__ == "__main__":
    main()
