"""Write an FP8 base and its bf16 upcast, for ``examples/hf/compare_fp8_base.yaml`` (a LoRA on an
hf-fp8 base against the same LoRA on the bf16-upcast base, through ``lowprec compare``)::

    python examples/make_fp8_bases.py outputs/fp8-bases
    lowprec compare examples/hf/compare_fp8_base.yaml

``OUT/hf-fp8``: the tiny Llama of ``make_tiny_llama.py`` (pre-trained on the bundled notes),
converted with the blockwise recipe and exported by ``lowprec.export.export_model`` to hf-fp8
(E4M3, 128x128 blocks, the recipe's power-of-two scales: the trained scales). ``OUT/bf16``: that
checkpoint loaded as an FP8 base and every FP8 layer upcast (``q * scale``) to a plain bf16
transformers model, as one upcasts an FP8 release to fine-tune it; with power-of-two scales the
upcast is exact (checked), so the two bases hold the same weights and only the FP8 GEMMs differ.
Both get the tokenizer.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_llama import make_model, make_tokenizer, pretrain  # noqa: E402


def upcast(fp8_dir: str, out: str) -> int:
    """``fp8_dir`` loaded as an FP8 base, each FP8 layer as a dense bf16 one, saved to ``out``;
    returns how many layers were upcast (each checked exact against its float32 dequantization)."""
    import torch

    from lowprec.export import load_fp8_base
    from lowprec.export.fp8_merge_dense import dense_layer
    from lowprec.fp8 import Float8BaseLinear

    model = load_fp8_base(fp8_dir, torch.bfloat16)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Float8BaseLinear)]
    for name, m in layers:
        w = m.fp8_weight().dequantize(torch.float32)
        if not torch.equal(w.bfloat16().float(), w):
            raise SystemExit(f"{name}: its dequantized weight is not exact in bf16 (scales not powers of two)")
        model.set_submodule(name, dense_layer(m, w.bfloat16(), own_layout=True))
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    delattr(model, "lowprec_fp8_base")  # the loader's FP8 format note: no longer an FP8 model
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    return len(layers)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 16)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--pretrain_steps", type=int, default=100, help="steps of pre-training on the notes (0: random)")
    args = ap.parse_args(argv)

    import lowprec.fp8 as fp8
    from lowprec.export import export_model

    tokenizer = make_tokenizer()
    model = make_model(tokenizer, "llama", args.hidden, args.layers)
    if args.pretrain_steps:
        losses = pretrain(model, tokenizer, args.pretrain_steps)
        print(f"pre-trained {args.pretrain_steps} steps: loss {losses[0]:.2f} -> {sum(losses[-10:]) / 10:.2f}")
    fp8.convert(model, "blockwise")
    fp8_dir, bf16_dir = os.path.join(args.out_dir, "hf-fp8"), os.path.join(args.out_dir, "bf16")
    report = export_model(model, fp8_dir, "hf-fp8")
    n = upcast(fp8_dir, bf16_dir)
    for d in (fp8_dir, bf16_dir):
        tokenizer.save_pretrained(d)
    print(f"{fp8_dir}: {report.format}, {len(report.quantized)} FP8 layers, trained scales {report.trained_scales}")
    print(f"{bf16_dir}: the same model with its {n} FP8 layers upcast to bf16 (exact)")


if __name__ == "__main__":
    main()
