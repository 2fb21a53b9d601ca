"""Optimizer-state bytes per parameter, and peak training memory: bf16 AMP vs FP8 + O2.

    PYTHONPATH=src python3 benchmarks/memory.py --tiny   # seconds on CPU (exercised by a test)
    PYTHONPATH=src python3 benchmarks/memory.py          # GPU: llama-1b, batch 2 x 2048 tokens

Part 1, state bytes: one step of each optimizer on the built-in Llama model, then the bytes
of every state tensor divided by the parameter count. ``moments`` counts m, v and their
scales; ``total`` adds fp32 master copies (only for bf16 parameters) and ``step``.

Part 2, peak memory of training steps (model build, 3 steps of forward, backward, optimizer
step, zero_grad), per variant:

* ``bf16_amp``   fp32 params, ``torch.autocast(bfloat16)``, ``torch.optim.AdamW(foreach=False)``
                 (foreach off: its temporaries would inflate the baseline we compare against);
* ``bf16_amp_o1`` the same plus ``apply_opt_level("O1")``: FP8-held gradients, dequantized
                 back into ``.grad`` just before ``torch.optim.AdamW`` steps;
* ``bf16_amp_o2`` the same plus ``apply_opt_level("O2")``: FP8-held gradients + FP8AdamW;
* ``fp8``        ``lowprec.fp8.convert`` (tensorwise, FP8 activations saved for backward),
                 ``torch.optim.AdamW``;
* ``fp8_o2``     FP8 GEMMs + FP8-saved activations + O2: the configuration with the target
                 (at most 0.65x the peak of ``bf16_amp``);
* ``fp8_o2_bf16w`` the same with bf16 weights and no fp32 master copy (FP8AdamW
                 ``master_weights="stochastic"``: updates written back with stochastic rounding);
* ``mxfp8``, ``nvfp4`` the ``fp8`` variant with the block-scaled recipes (``fp8/modules/mx_linear.py``);
* ``<variant>_acts`` (``fp8_acts``, ``fp8_o2_acts``, ``fp8_o2_bf16w_acts``): the same with
  ``Recipe(fp8_activations=True)``: RMSNorm and SwiGLU keep E4M3 copies for backward too
  (``fp8/modules/activations.py``).

Part 3, saved bytes: what autograd keeps for backward in one forward of the model (Parameters
excluded, they exist anyway), per recipe (``bf16_amp``, each of ``SAVED_RECIPES`` and
``tensorwise+fp8_activations``), and the ratio to ``bf16_amp``: the backward-memory story of each recipe in one number.

GPU: ``torch.cuda.max_memory_allocated`` minus the memory allocated before the variant.
CPU: the profiler's allocator events (``profile_memory=True``), replayed in time order: each
op's own allocations minus frees, so temporaries created and freed inside one op are not seen
(peaks are a slight underestimate, equally for every variant).
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import count_saved_bytes, cpu_alloc_peak, device_name, write_json  # noqa: E402

from lowprec.catalog import RECIPES, Granularity  # noqa: E402
import lowprec.fp8 as fp8  # noqa: E402
from lowprec.optim import FP8AdamW, apply_opt_level  # noqa: E402
from lowprec.optim.fp8_grads import fp8_grad  # noqa: E402
from lowprec.train.model import build_model  # noqa: E402

VARIANTS = (
    "bf16_amp",
    "bf16_amp_o1",
    "bf16_amp_o2",
    "fp8",
    "fp8_o2",
    "fp8_o2_bf16w",
    "mxfp8",
    "nvfp4",
    "fp8_acts",
    "fp8_o2_acts",
    "fp8_o2_bf16w_acts",
)
SAVED_RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4")
_BLOCK_SCALED = tuple(n for n, r in RECIPES.items() if r.granularity is Granularity.MICRO)


def saved_bytes(model_name: str, batch: int, seq: int, device: torch.device) -> dict:
    """Bytes saved for backward by one forward, per recipe (see module docstring, part 3)."""
    out = {}
    for name in ("bf16_amp", *SAVED_RECIPES, "tensorwise+fp8_activations"):
        torch.manual_seed(0)
        with device:
            model = build_model(model_name)
        use_fp8 = name != "bf16_amp"
        if use_fp8:
            recipe, _, acts = name.partition("+")
            fp8.convert(model, fp8.Recipe.from_name(recipe, fp8_activations=bool(acts)))
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16), fp8.autocast(enabled=use_fp8):
            with count_saved_bytes(exclude=list(model.parameters())) as saved:
                loss = model(ids, labels=ids).loss
        loss.backward()
        out[name] = {"bytes": saved["bytes"]}
        del model, loss
    base = out["bf16_amp"]["bytes"]
    for r in out.values():
        r["ratio_vs_bf16_amp"] = r["bytes"] / base
    return out


def _state_bytes(opt: torch.optim.Optimizer, keys: tuple[str, ...] | None) -> int:
    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and (keys is None or k.startswith(keys)):
                total += v.numel() * v.element_size()
    return total


def state_bytes_per_param(model_name: str, device: torch.device, seq: int) -> dict:
    out = {}
    cases = {
        "torch_adamw_fp32_params": (torch.float32, lambda ps: torch.optim.AdamW(ps, foreach=False)),
        "fp8adamw_fp32_params": (torch.float32, lambda ps: FP8AdamW(ps)),
        "fp8adamw_bf16_params": (torch.bfloat16, lambda ps: FP8AdamW(ps)),
        "fp8adamw_bf16_params_no_master": (torch.bfloat16, lambda ps: FP8AdamW(ps, master_weights="stochastic")),
        "fp8adamw_per_tensor_scale": (torch.float32, lambda ps: FP8AdamW(ps, block_size=None)),
    }
    torch.manual_seed(0)
    with device:  # parameters created on the device directly (llama-1b is 5 GB in fp32)
        base = build_model(model_name)
    for name, (dtype, make) in cases.items():
        model = copy.deepcopy(base).to(dtype=dtype)
        opt = make(model.parameters())
        ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device)
        model(ids, labels=ids).loss.backward()
        opt.step()
        n = sum(p.numel() for p in model.parameters())
        out[name] = {
            "params": n,
            "moments_bytes_per_param": _state_bytes(opt, ("exp_avg",)) / n,
            "total_bytes_per_param": _state_bytes(opt, None) / n,
        }
        del model, opt
    return out


def _grad_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
        held = fp8_grad(p)
        if held is not None:
            total += held.nbytes()
    return total


def run_variant(variant: str, model_name: str, batch: int, seq: int, steps: int, device: torch.device) -> dict:
    info: dict = {}
    acts = variant.endswith("_acts")
    variant = variant.removesuffix("_acts")

    def train():
        torch.manual_seed(0)
        with device:
            model = build_model(model_name)
        if variant.endswith("bf16w"):
            model = model.to(torch.bfloat16)
        use_fp8 = variant.startswith("fp8") or variant in _BLOCK_SCALED
        if use_fp8:
            name = variant if variant in _BLOCK_SCALED else "tensorwise"
            recipe = fp8.Recipe.from_name(name, save_fp8_activations=True, fp8_activations=acts)
            info["converted_layers"] = fp8.convert(model, recipe).num_converted
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        if variant.endswith(("o1", "o2")):
            model, opt = apply_opt_level(model, opt, variant[-2:].upper())
        elif variant.endswith("o2_bf16w"):
            model, opt = apply_opt_level(model, opt, "O2", master_weights="stochastic")
        g = torch.Generator(device=device).manual_seed(0)
        for _ in range(steps):
            ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device, generator=g)
            with torch.autocast(device.type, dtype=torch.bfloat16), fp8.autocast(enabled=use_fp8):
                loss = model(ids, labels=ids).loss
            loss.backward()
            info["grad_bytes_after_backward"] = _grad_bytes(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
        info["final_loss"] = loss.item()
        info["optimizer_state_bytes"] = _state_bytes(opt, None)
        info["params"] = sum(p.numel() for p in model.parameters())

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        train()
        torch.cuda.synchronize(device)
        info["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        info["peak_source"] = "torch.cuda.max_memory_allocated"
    else:
        info["peak_bytes"] = cpu_alloc_peak(train)
        info["peak_source"] = "torch.profiler allocator events (profile_memory=True)"
    return info


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="llama-tiny, 4 x 128 tokens, CPU-sized")
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/memory_<device>.json)")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = args.model or ("llama-tiny" if args.tiny else "llama-1b")
    batch = args.batch or (4 if args.tiny else 2)
    seq = args.seq or (128 if args.tiny else 2048)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {v!r}; choose from {VARIANTS}")

    result = {
        "device": device_name(device),
        "device_type": device.type,
        "model": model,
        "batch": batch,
        "seq": seq,
        "steps": args.steps,
        "state_bytes_per_param": state_bytes_per_param(model, device, min(seq, 64)),
        "peak": {},
    }
    for v in variants:
        result["peak"][v] = run_variant(v, model, batch, seq, args.steps, device)
        print(f"{v:12s} peak {result['peak'][v]['peak_bytes'] / 2**20:9.2f} MiB", flush=True)
    if "bf16_amp" in result["peak"]:
        base = result["peak"]["bf16_amp"]["peak_bytes"]
        result["peak_ratio_vs_bf16_amp"] = {v: r["peak_bytes"] / base for v, r in result["peak"].items()}
    result["saved_bytes"] = saved_bytes(model, batch, seq, device)
    print(
        "saved for backward vs bf16_amp:",
        {k: round(v["ratio_vs_bf16_amp"], 3) for k, v in result["saved_bytes"].items()},
    )
    sb = result["state_bytes_per_param"]
    print(
        "moments bytes/param: torch AdamW %.3f, FP8AdamW %.3f"
        % (
            sb["torch_adamw_fp32_params"]["moments_bytes_per_param"],
            sb["fp8adamw_fp32_params"]["moments_bytes_per_param"],
        )
    )
    if "peak_ratio_vs_bf16_amp" in result:
        print("peak ratio vs bf16_amp:", {k: round(v, 3) for k, v in result["peak_ratio_vs_bf16_amp"].items()})
    write_json(result, args.out, f"memory_{device.type}{'_tiny' if args.tiny else ''}.json")
    return result


if __name__ == "__main__":
    main()
