"""Bit-identity check for refactors of Float8Linear: records, for every recipe, the outputs, all
gradients and all buffers (amax histories, scales, step counters, telemetry) over four steps,
in fp32 and under bf16 autocast, with and without fp8.checkpoint and telemetry, for the
reuse-relevant variants (save_fp8_activations off, each GEMM overridden to high precision,
input-only / weight-only gradients), then compares a later tree with torch.equal.

    PYTHONPATH=<old tree>/src python benchmarks/bit_identity.py save /tmp/base.pt
    PYTHONPATH=src python benchmarks/bit_identity.py cmp /tmp/base.pt            # torch path
    PYTHONPATH=src python benchmarks/bit_identity.py cmp /tmp/base.pt --fused    # fused paths
    ... --recipes tensorwise,mxfp8                                              # a subset
    PYTHONPATH=src python benchmarks/bit_identity.py cmp /tmp/base.pt --force_recompute_fp8_weight_in_bwd true
                                      # the weight re-cast in backward against a record that kept it

Every recipe of ``lowprec.catalog.RECIPES`` by default (mxfp8 and nvfp4 run their block-scaled
path, ``fp8/modules/mx_linear.py``); a recipe that reads ``scale_rounding`` also runs with ``floor``.

``--fused`` runs the CUDA code paths (fused casts, delayed scaling inside the casts) on CPU
with the kernels' torch reference standing in for Triton (same values by its contract).
CPU, ~30 s for the five FP8 recipes (more with mxfp8/nvfp4); exit status 1 on any difference.
"""

import argparse
import itertools
import sys
import torch
import lowprec.fp8 as fp8
import lowprec.fp8.kernels as K
from lowprec.catalog import RECIPES as CATALOG
from lowprec.fp8.kernels import reference
from lowprec.fp8.modules.linear import Float8Linear

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("mode", choices=["save", "cmp"], help="save a record, or compare this tree with one")
ap.add_argument("path", help="the record (.pt)")
ap.add_argument("--fused", action="store_true", help="the CUDA code paths, torch reference for the kernels")
ap.add_argument("--recipes", default=",".join(CATALOG), help="comma-separated recipe names (default: all)")
ap.add_argument(
    "--force_recompute_fp8_weight_in_bwd",
    choices=["auto", "true", "false"],
    default="auto",
    help="the Recipe field (auto: the default, which keeps the FP8 weight here: nothing is sharded)",
)
args = ap.parse_args()
torch.set_num_threads(1)
RECIPES = args.recipes.split(",")
RECOMPUTE = {"auto": None, "true": True, "false": False}[args.force_recompute_fp8_weight_in_bwd]
VARIANTS = {
    "plain": {},
    "no_save_fp8": {"save_fp8_activations": False},
    "olp_f": {"override_linear_precision": (True, False, False)},
    "olp_d": {"override_linear_precision": (False, True, False)},
    "olp_w": {"override_linear_precision": (False, False, True)},
}
GRADS = ["both", "x_only", "w_only"]


def variants(name):
    extra = ["floor"] if "scale_rounding" in CATALOG[name].reads else []
    return list(VARIANTS) + extra


def run(name, variant, grads, autocast, ckpt, telemetry):
    torch.manual_seed(0)
    knobs = {"scale_rounding": "floor"} if variant == "floor" else VARIANTS[variant]
    try:
        recipe = fp8.Recipe.from_name(
            name, **knobs, **({"interval": 2, "amax_history_len": 3} if name == "delayed" else {})
        )
        if RECOMPUTE is not None:
            recipe = recipe.replace(force_recompute_fp8_weight_in_bwd=RECOMPUTE)
    except ValueError:  # a variant the recipe refuses (nvfp4 without save_fp8_activations)
        return None
    lin = torch.nn.Linear(256, 128)
    m = Float8Linear.from_linear(lin, recipe)
    m.fp8_telemetry = telemetry
    m.weight.requires_grad_(grads != "x_only")
    rec = {}
    for step in range(4):
        x = (torch.randn(3, 64, 256) * (10 ** (step - 1))).requires_grad_(grads != "w_only")
        if step == 2:
            x = x.detach().clone()
            x[0, 0, :5] = 0
            x.requires_grad_(grads != "w_only")
        with fp8.autocast(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = fp8.checkpoint(m, x) if ckpt else m(x)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        rec[f"{step}/y"] = y.detach().clone()
        if x.grad is not None:
            rec[f"{step}/gx"] = x.grad.clone()
        for n, p in m.named_parameters():
            if p.grad is not None:
                rec[f"{step}/g{n}"] = p.grad.clone()
                p.grad = None
        for n, b in m.named_buffers():
            rec[f"{step}/buf_{n}"] = b.clone()
    return rec


FUSED = args.fused
if FUSED:  # the fused (Triton) code paths, with the torch reference standing in for the kernels
    K.available = lambda device, op=None, x=None: True
    K._ops = lambda: reference
out = {}
for name, variant, grads, ac, ck, tel in (
    (n, *rest)
    for n in RECIPES
    for rest in itertools.product(variants(n), GRADS, [False, True], [False, True], [False, True])
):
    if (ck or tel) and (variant != "plain" or grads != "both"):
        continue
    key = f"{name}|{variant}|{grads}|ac={ac}|ck={ck}|tel={tel}"
    rec = run(name, variant, grads, ac, ck, tel)
    if rec is not None:
        out[key] = rec
if args.mode == "save":
    torch.save(out, args.path)
    print("saved", len(out), "configs", sum(len(v) for v in out.values()), "tensors")
else:
    ref = torch.load(args.path, weights_only=True)  # tensors in dicts: nothing executed
    bad = 0
    assert ref.keys() == out.keys()
    for k in ref:
        if ref[k].keys() != out[k].keys():
            print("KEYS differ", k, set(ref[k]) ^ set(out[k]))
            bad += 1
            continue
        for t in ref[k]:
            a, b = ref[k][t], out[k][t]
            if not (
                a.dtype == b.dtype
                and torch.equal(a.nan_to_num(1e9), b.nan_to_num(1e9))
                and torch.equal(a.isnan(), b.isnan())
            ):
                print("DIFF", k, t)
                bad += 1
    print("compared", len(ref), "configs", sum(len(v) for v in ref.values()), "tensors;", bad, "differences")
    sys.exit(1 if bad else 0)
