"""Bit-identity check at model level: llama-tiny at the quickstart's shapes (seq 128, batch 8),
3 AdamW steps per per-tensor/axis/block recipe under bf16 autocast; records every loss, every
gradient and the final state dict (amax histories and scales included), then compares a later
tree with torch.equal. The companion of ``bit_identity.py`` (one Float8Linear, every variant).

    PYTHONPATH=<old tree>/src python benchmarks/bit_identity_model.py save /tmp/model_base.pt
    PYTHONPATH=src python benchmarks/bit_identity_model.py cmp /tmp/model_base.pt

CPU, one thread, ~20 s; exit status 1 on any difference.
"""

import sys

import torch

import lowprec.fp8 as fp8
from lowprec.train.model import build_model

torch.set_num_threads(1)
RECIPES = ["tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise"]
out = {}
for recipe in RECIPES:
    torch.manual_seed(0)
    m = build_model("llama-tiny", max_seq_len=128)
    fp8.convert(m, recipe)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for step in range(3):
        ids = torch.randint(0, 272, (8, 128))
        with fp8.autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        out[f"{recipe}/{step}/loss"] = loss.detach().clone()
        for n, p in m.named_parameters():
            out[f"{recipe}/{step}/g/{n}"] = p.grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for n, t in m.state_dict().items():
        out[f"{recipe}/sd/{n}"] = t.clone()
if sys.argv[1] == "save":
    torch.save(out, sys.argv[2])
    print("saved", len(out), "tensors")
else:
    ref = torch.load(sys.argv[2])
    assert ref.keys() == out.keys()
    bad = [
        k
        for k in ref
        if not (
            torch.equal(ref[k].nan_to_num(1e9), out[k].nan_to_num(1e9)) and torch.equal(ref[k].isnan(), out[k].isnan())
        )
    ]
    for k in bad[:20]:
        print("DIFF", k)
    print("compared", len(ref), "tensors;", len(bad), "differences")
    sys.exit(1 if bad else 0)
