"""Expert parallelism: the combine all-to-all (expert outputs back to their tokens' ranks, and
the dispatch gradient back in backward) in FP8 vs bf16 vs the rows' own dtype; SQNR and bytes.

    PYTHONPATH=src python3 benchmarks/ep_combine.py                 # gloo, CPU, 2 and 4 processes
    PYTHONPATH=src python3 benchmarks/ep_combine.py --world 2 --seeds 2

Spawns ``--world`` gloo processes on 127.0.0.1. Each builds one layer of ``builtin:moe-tiny``'s
experts (8 experts, top-2, dim 128, intermediate 192) in float32 from one seed, converts it to FP8
(``--recipes``), shards it over the processes (``apply_expert_parallel``) and calls it as the MoE
block does on fresh random data per seed (``--tokens`` tokens per rank, hidden ~ N(0, 1), random
top-2 routes, softmax weights, output gradient ~ N(0, 1)), once per ``combine`` setting:
``hp`` (float32 rows), ``bf16`` and ``fp8`` (E4M3 + a float32 scale per row). Reference: the
same experts unconverted in float64 on every rank's tokens in one process. Reported per recipe and
setting (SQNR in dB, all ranks' rows together, mean over seeds): the output and the input /
routing-weight / expert-weight gradients vs float64, the output and input gradient vs the
``bf16`` combine (the error the FP8 combine adds), and the bytes each rank hands the all-to-alls
(``CommBytes``): the dispatch and the gradient to the owners are the same in every setting, and
the ``hp`` combine sends float32 where ``bf16`` sends bf16, so dispatch = 2 bf16 - hp and a
setting's combine bytes = its all-to-all bytes - dispatch (forward and backward apart).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _common import end_rank, spawn_and_load, write_json  # noqa: E402

COMBINES = ("hp", "bf16", "fp8")


def _experts(recipe, ep_world=None, combine="hp"):
    import lowprec.fp8 as fp8
    from lowprec.distributed.expert_parallel import apply_expert_parallel
    from lowprec.train.model import build_model

    torch.manual_seed(0)
    block = build_model("moe-tiny", n_layers=1).model.layers[0].mlp
    if recipe is None:
        return block.double()
    fp8.convert(block, recipe=fp8.Recipe.from_name(recipe), skip_first_last=False)
    if ep_world:
        apply_expert_parallel(block, ep_size=ep_world, combine=combine)
    return block


def _data(seed, n, dim, experts):
    g = torch.Generator().manual_seed(100 + seed)
    h = torch.randn(n, dim, generator=g)
    idx = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(n)])
    w = torch.rand(n, 2, generator=g).softmax(-1)
    dy = torch.randn(n, dim, generator=g)
    return h, idx, w, dy


def _call(block, h, idx, w, dy, use_fp8):
    import lowprec.fp8 as fp8

    from lowprec.distributed.comm_count import CommBytes

    block.zero_grad(set_to_none=True)  # blocks are reused across seeds: no accumulated gradient
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    fwd, bwd = CommBytes(), CommBytes()
    with fp8.autocast(enabled=use_fp8):
        with fwd:
            out = block.experts(h, idx, w)
    with bwd:
        out.backward(dy.to(out.dtype))
    grads = {"out": out.detach(), "hidden": h.grad, "weights": w.grad}
    grads.update({k: p.grad for k, p in block.experts.named_parameters()})
    return grads, fwd.total("all_to_all"), bwd.total("all_to_all")


def _gather(t, world):
    """All ranks' rows (or all experts) of ``t`` on every rank."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _sqnr(x, ref):
    err = (x.double() - ref.double()).pow(2).sum().item()
    sig = ref.double().pow(2).sum().item()
    return 10 * math.log10(sig / err) if err > 0 else float("inf")


def _worker(rank, world, port, recipes, seeds, tokens, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ref_block = _experts(None)
    rows = []
    for recipe in recipes:
        blocks = {c: _experts(recipe, world, c) for c in COMBINES}
        for seed in range(seeds):
            h, idx, w, dy = _data(seed, tokens * world, 128, 8)
            ref, _, _ = _call(ref_block, h.double(), idx, w.double(), dy.double(), False)
            mine = [t.chunk(world)[rank] for t in (h, idx, w, dy)]
            got = {}
            for c, block in blocks.items():
                g, fb, bb = _call(block, *mine, True)
                full = {k: _gather(v, world) for k, v in g.items()}
                got[c] = (full, fb, bb)
            for c, (full, fb, bb) in got.items():
                row = {"recipe": recipe, "seed": seed, "combine": c, "fwd_a2a_bytes": fb, "bwd_a2a_bytes": bb}
                for k, v in full.items():
                    row[f"sqnr_{k}_vs_f64"] = _sqnr(v, ref[k])
                for k in ("out", "hidden"):
                    row[f"sqnr_{k}_vs_bf16_combine"] = _sqnr(full[k], got["bf16"][0][k]) if c != "bf16" else None
                rows.append(row)
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()
    end_rank()


def measure(world: int, recipes: list, seeds: int, tokens: int) -> list:
    rows = spawn_and_load(_worker, world, recipes, seeds, tokens)
    for r in rows:
        r["world"] = world
    return rows


def summarize(rows: list) -> list:
    """Mean over seeds per (world, recipe, combine); combine bytes vs bf16's."""
    keys = sorted({(r["world"], r["recipe"], r["combine"]) for r in rows}, key=str)
    out = []
    for world, recipe, c in keys:
        sel = [r for r in rows if (r["world"], r["recipe"], r["combine"]) == (world, recipe, c)]
        s = {"world": world, "recipe": recipe, "combine": c, "seeds": len(sel)}
        for k in sel[0]:
            if k.startswith("sqnr_") and sel[0][k] is not None:
                s[k] = round(sum(r[k] for r in sel) / len(sel), 2)
        s["fwd_a2a_bytes"] = sum(r["fwd_a2a_bytes"] for r in sel)
        s["bwd_a2a_bytes"] = sum(r["bwd_a2a_bytes"] for r in sel)
        out.append(s)
    for s in out:  # the dispatch (and backward gradient to the owners) is the same in every setting
        hp = next(x for x in out if (x["world"], x["recipe"], x["combine"]) == (s["world"], s["recipe"], "hp"))
        bf = next(x for x in out if (x["world"], x["recipe"], x["combine"]) == (s["world"], s["recipe"], "bf16"))
        # hp's combine is float32 (4 B/elem) and bf16's 2 B/elem: dispatch = 2 * bf16 - hp
        for d in ("fwd", "bwd"):
            dispatch = 2 * bf[f"{d}_a2a_bytes"] - hp[f"{d}_a2a_bytes"]
            s[f"{d}_combine_bytes"] = s[f"{d}_a2a_bytes"] - dispatch
            s[f"{d}_combine_over_bf16"] = round(s[f"{d}_combine_bytes"] / (bf[f"{d}_a2a_bytes"] - dispatch), 4)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default="2,4")
    p.add_argument("--recipes", default="tensorwise,rowwise")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for world in [int(w) for w in args.world.split(",")]:
        rows += measure(world, args.recipes.split(","), args.seeds, args.tokens)
    summary = summarize(rows)
    for s in summary:
        print(
            f"world {s['world']} {s['recipe']:10s} combine {s['combine']:4s}: out vs f64 {s['sqnr_out_vs_f64']:6.2f} dB, "
            f"vs bf16 combine {s.get('sqnr_out_vs_bf16_combine', float('nan')):6.2f} dB; hidden grad vs f64 "
            f"{s['sqnr_hidden_vs_f64']:6.2f} dB; combine bytes fwd {s['fwd_combine_over_bf16']:.4f}x bf16, "
            f"bwd {s['bwd_combine_over_bf16']:.4f}x"
        )
    result = {"device": "cpu (gloo)", "tokens_per_rank": args.tokens, "summary": summary, "rows": rows}
    write_json(result, args.out, "ep_combine_cpu.json")
    return result


if __name__ == "__main__":
    main()
