"""Bytes on the wire per training step: FP8 all-reduce hook vs bf16 and fp32 all-reduce (DDP),
and FSDP2 weight all-gather and gradient reduce-scatter in FP8 vs bf16.

    PYTHONPATH=src python3 benchmarks/comm_bytes.py --tiny          # gloo, CPU, seconds
    PYTHONPATH=src python3 benchmarks/comm_bytes.py --world 4 --model llama-small
    PYTHONPATH=src python3 benchmarks/comm_bytes.py --setups fsdp2 --world 2,4 --fsdp2_recipes tensorwise,delayed,rowwise

Spawns ``--world`` gloo processes on 127.0.0.1, wraps the built-in Llama model in DDP with
``register_fp8_allreduce``, runs one step, and reports the hook's counters (bytes this rank
sent: FP8 payload + amax exchange; bf16/fp32: what a ring all-reduce of the same buckets would
send) and the accuracy of the reduced gradients against an fp32 all-reduce of the same local
gradients (normwise relative error, whole model and worst tensor).

``fsdp2``: the model converted to FP8 (each recipe of ``--fsdp2_recipes``: tensorwise, delayed, rowwise),
each decoder layer and the root sharded with
FSDP2 (bf16 ``param_dtype``), trained 3 steps with the FP8 all-gather off and on
(``lowprec.distributed.fsdp_float8``); the bytes each rank hands the all-gather collective are
counted there (``FSDPModule.set_custom_all_gather``), for the decoder layers (FP8 weights plus
their bf16 norms) and the whole model (the embedding / tied head stays bf16), with the largest
loss difference between the two runs. A third run adds O1's FP8 gradient reduce-scatter
(``lowprec.distributed.fsdp_fp8_reduce_scatter``); the reduce-scatter bytes are counted at
``FSDPModule.set_custom_reduce_scatter`` (FSDP2's own fp32 one in the first run, the FP8 one in
the third; bf16 = what a bf16 reduce-scatter of the same gradients sends).

``tp``: the model in bf16, tensor parallel over all ``--world`` processes (its ``_tp_plan``;
``--world`` must divide its kv heads), one training step with FP8 (tensorwise) and one with
FP8 off, without and with sequence parallelism (``_sp_plan``: block inputs all-gathered in
FP8). Bytes are counted at the collectives (``lowprec.distributed.comm_count.CommBytes``:
every c10d / functional collective, DTensor's own included), per kind and dtype, forward and
backward apart, and as the bytes a ring algorithm sends per process (``ring_bytes``, comparable
across all-reduce / all-gather / reduce-scatter); FP8 travels as uint8 on gloo.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _common import device_name, end_rank, spawn_and_load, write_json  # noqa: E402

from lowprec.distributed import register_fp8_allreduce  # noqa: E402
from lowprec.train.model import build_model  # noqa: E402

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _worker(rank, world, port, model_name, batch, seq, dtype_name, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build_model(model_name)
    ref_model = build_model(model_name)
    ref_model.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = register_fp8_allreduce(ddp, fp8_dtype=DTYPES[dtype_name])
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    for _step in range(2):  # step 0 lets DDP rebuild its buckets; step 1 is measured
        state.reset_counters()
        ddp.zero_grad(set_to_none=True)
        ddp(ids, labels=ids).loss.backward()
    ref_model(ids, labels=ids).loss.backward()
    errs = []
    for p, q in zip(model.parameters(), ref_model.parameters()):
        r = q.grad.clone()
        dist.all_reduce(r)
        r /= world
        errs.append(((p.grad - r).norm() / r.norm().clamp_min(1e-30)).item())
        q.grad = r
    num = sum(((p.grad - q.grad).norm() ** 2).item() for p, q in zip(model.parameters(), ref_model.parameters()))
    den = sum((q.grad.norm() ** 2).item() for q in ref_model.parameters())
    if rank == 0:
        torch.save(
            {
                "counters": state.counters(),
                "rel_err": (num / den) ** 0.5,
                "worst_tensor_rel_err": max(errs),
                "tensors": len(errs),
                "params": sum(p.numel() for p in model.parameters()),
            },
            out,
        )
    dist.destroy_process_group()
    end_rank()


def _fsdp2_run(
    model_name, batch, seq, rank, fp8_all_gather: bool, fp8_reduce_scatter: bool = False, recipe: str = "tensorwise"
) -> tuple[dict, list]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import lowprec.fp8 as fp8
    from lowprec.distributed.fsdp_float8 import (
        enable_fsdp_float8_all_gather,
        install_counting_all_gather,
        precompute_float8_scales_for_fsdp,
    )
    from lowprec.distributed.fsdp_fp8_reduce_scatter import install_counting_reduce_scatter, install_fp8_reduce_scatter

    torch.manual_seed(0)
    model = build_model(model_name)
    fp8.convert(model, recipe=fp8.Recipe.from_name(recipe))
    if fp8_all_gather:
        enable_fsdp_float8_all_gather(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    counters = [install_counting_all_gather(layer) for layer in layers]
    root = install_counting_all_gather(model)  # the root last: its own unit keeps this counter
    for layer, c in zip(layers, counters):
        layer.set_custom_all_gather(c)
    # gradients: FSDP2's own reduce-scatter (fp32 reduce_dtype), counted, or O1's FP8 one
    rs = (install_fp8_reduce_scatter if fp8_reduce_scatter else install_counting_reduce_scatter)(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
        with fp8.autocast():
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if fp8_all_gather:
            precompute_float8_scales_for_fsdp(model)
        losses.append(loss.item())
    layer_bytes = sum(c.input_bytes for c in counters)
    rs_bytes = {k: sum(c.counters[k] for c in rs) for k in ("sent_bytes", "bf16_bytes", "fp32_bytes")}
    return {"layers": layer_bytes, "total": layer_bytes + root.input_bytes, "rs": rs_bytes}, losses


def _fsdp2_worker(rank, world, port, model_name, batch, seq, recipe, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    bf16, bf16_losses = _fsdp2_run(model_name, batch, seq, rank, False, recipe=recipe)
    f8, f8_losses = _fsdp2_run(model_name, batch, seq, rank, True, recipe=recipe)
    o1, o1_losses = _fsdp2_run(model_name, batch, seq, rank, True, fp8_reduce_scatter=True, recipe=recipe)
    if rank == 0:
        torch.save(
            {
                "bf16_layer_bytes": bf16["layers"],
                "fp8_layer_bytes": f8["layers"],
                "bf16_total_bytes": bf16["total"],
                "fp8_total_bytes": f8["total"],
                "max_abs_loss_diff": max(abs(a - b) for a, b in zip(bf16_losses, f8_losses)),
                # reduce-scatter: FSDP2's fp32 one as run, its bf16 equivalent, O1's FP8 one
                "fp32_reduce_scatter_bytes": bf16["rs"]["sent_bytes"],
                "bf16_reduce_scatter_bytes": o1["rs"]["bf16_bytes"],
                "fp8_reduce_scatter_bytes": o1["rs"]["sent_bytes"],
                "max_abs_loss_diff_fp8_reduce_scatter": max(abs(a - b) for a, b in zip(bf16_losses, o1_losses)),
            },
            out,
        )
    dist.destroy_process_group()
    end_rank()


def _tp_worker(rank, world, port, model_name, batch, seq, out):
    import lowprec.fp8 as fp8
    from torch.distributed.device_mesh import init_device_mesh

    from lowprec.distributed.comm_count import CommBytes
    from lowprec.distributed.tensor_parallel import apply_tp_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for sp in (False, True):
        for use_fp8 in (True, False):
            torch.manual_seed(0)
            model = build_model(model_name).to(torch.bfloat16)
            if use_fp8:
                fp8.convert(model, recipe=fp8.Recipe.from_name("tensorwise"))
            apply_tp_plan(model, init_device_mesh("cpu", (world,)), sequence_parallel=sp)
            ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
            fwd, bwd = CommBytes(), CommBytes()
            with fp8.autocast(enabled=use_fp8):
                with fwd:
                    loss = model(ids, labels=ids).loss
            with bwd:
                loss.backward()
            rows.append(
                {
                    "setup": "TP+SP" if sp else "TP",
                    "fp8": use_fp8,
                    "forward": fwd.as_dict(),
                    "backward": bwd.as_dict(),
                    "forward_bytes": sum(map(fwd.total, fwd.as_dict())),
                    "backward_bytes": sum(map(bwd.total, bwd.as_dict())),
                    "loss": loss.item(),
                    "ring_bytes": fwd.ring_bytes(world) + bwd.ring_bytes(world),
                }
            )
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()
    end_rank()


def measure_tp(world: int, model: str, batch: int, seq: int) -> list:
    rows = spawn_and_load(_tp_worker, world, model, batch, seq)
    for r in rows:
        r["world"] = world
        r["step_bytes"] = r["forward_bytes"] + r["backward_bytes"]
    return rows


def measure_fsdp2(world: int, model: str, batch: int, seq: int, recipe: str = "tensorwise") -> dict:
    r = spawn_and_load(_fsdp2_worker, world, model, batch, seq, recipe)
    r["layers_fp8_over_bf16"] = r["fp8_layer_bytes"] / r["bf16_layer_bytes"]
    r["total_fp8_over_bf16"] = r["fp8_total_bytes"] / r["bf16_total_bytes"]
    r["reduce_scatter_fp8_over_bf16"] = r["fp8_reduce_scatter_bytes"] / r["bf16_reduce_scatter_bytes"]
    r["reduce_scatter_fp8_over_fp32"] = r["fp8_reduce_scatter_bytes"] / r["fp32_reduce_scatter_bytes"]
    return r


def measure(world: int, model: str, batch: int, seq: int, dtype_name: str) -> dict:
    r = spawn_and_load(_worker, world, model, batch, seq, dtype_name)
    c = r.pop("counters")
    r.update(c)
    r["fp8_over_bf16"] = c["fp8_bytes"] / c["bf16_bytes"]
    r["fp8_over_fp32"] = c["fp8_bytes"] / c["fp32_bytes"]
    return r


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--world", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtypes", default="e4m3,e5m2")
    ap.add_argument(
        "--setups",
        default="ddp,fsdp2,tp",
        help="ddp (FP8 all-reduce hook), fsdp2 (FP8 all-gather, FP8 reduce-scatter), tp (TP and TP+SP, FP8 vs bf16)",
    )
    ap.add_argument("--tp_world", default="2", help="comma-separated tensor-parallel sizes (divide the kv heads)")
    ap.add_argument("--fsdp2_recipes", default="tensorwise,delayed,rowwise", help="recipes of the fsdp2 setup")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    setups = args.setups.split(",")
    rows, fsdp2_rows, tp_rows = [], [], []
    for w in [int(x) for x in args.tp_world.split(",")] if "tp" in setups else ():
        tp_rows += measure_tp(w, args.model, args.batch, args.seq)
        for r in tp_rows[-4:]:
            gathers = r["forward"].get("all_gather", {})
            print(
                f"{r['setup']} W={w} {'fp8' if r['fp8'] else 'bf16'}: {r['step_bytes']} B handed to collectives "
                f"per rank per step (forward {r['forward_bytes']}, backward {r['backward_bytes']}), "
                f"{r['ring_bytes']} B sent by ring algorithms; forward all-gathers {gathers}",
                flush=True,
            )
    fsdp2_runs = [(w, rc) for w in [int(x) for x in args.world.split(",")] for rc in args.fsdp2_recipes.split(",")]
    for w, rc in fsdp2_runs if "fsdp2" in setups else ():
        r = measure_fsdp2(w, args.model, args.batch, args.seq, rc)
        r.update(world=w, recipe=rc)
        fsdp2_rows.append(r)
        print(
            f"FSDP2 {rc} W={w}: decoder-layer all-gather {r['fp8_layer_bytes']} B (FP8) vs {r['bf16_layer_bytes']} B "
            f"(bf16) per rank over 3 steps = {r['layers_fp8_over_bf16']:.4f}x; whole model "
            f"{r['total_fp8_over_bf16']:.4f}x; max |loss diff| {r['max_abs_loss_diff']:.3g}",
            flush=True,
        )
        print(
            f"FSDP2 {rc} W={w}: gradient reduce-scatter {r['fp8_reduce_scatter_bytes']} B (FP8, O1) vs "
            f"{r['bf16_reduce_scatter_bytes']} B (bf16), {r['fp32_reduce_scatter_bytes']} B (fp32) = "
            f"{r['reduce_scatter_fp8_over_bf16']:.4f}x bf16, {r['reduce_scatter_fp8_over_fp32']:.4f}x fp32; max |loss diff| "
            f"{r['max_abs_loss_diff_fp8_reduce_scatter']:.3g} (FP8 all-gather and reduce-scatter vs neither)",
            flush=True,
        )
    for w in [int(x) for x in args.world.split(",")] if "ddp" in setups else ():
        for dt in args.dtypes.split(","):
            r = measure(w, args.model, args.batch, args.seq, dt)
            r.update(world=w, fp8_dtype=dt)
            rows.append(r)
            print(
                f"W={w} {dt}: fp8 {r['fp8_bytes']} B, bf16 {r['bf16_bytes']} B, fp32 "
                f"{r['fp32_bytes']} B per rank per step; fp8/bf16 {r['fp8_over_bf16']:.4f}; "
                f"grad rel err {r['rel_err']:.4f} (worst tensor {r['worst_tensor_rel_err']:.4f})",
                flush=True,
            )
    result = {
        "device": device_name(torch.device("cpu")),
        "backend": "gloo",
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "rows": rows,
        "fsdp2_all_gather": fsdp2_rows,
        "tensor_parallel": tp_rows,
    }
    write_json(result, args.out, "comm_bytes_cpu.json")
    return result


if __name__ == "__main__":
    main()
