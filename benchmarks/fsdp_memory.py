"""Per-rank memory of FSDP2 training vs world size: bf16 and every FP8 recipe, with the FP8 weight
re-cast in backward (``force_recompute_fp8_weight_in_bwd`` auto, the default) and kept (false),
with and without the FP8 all-gather (``<recipe>_fp8_all_gather``) and activation checkpointing of
every decoder layer (``+ckpt``).

    PYTHONPATH=src python benchmarks/fsdp_memory.py                      # llama-tiny, worlds 1, 2, 4
    PYTHONPATH=src python benchmarks/fsdp_memory.py --model llama-small --worlds 1,2,4 --configs bf16,tensorwise
    PYTHONPATH=src python benchmarks/fsdp_memory.py --configs zero3/bf16,zero3/tensorwise:auto,zero3/tensorwise:off

The ``zero3/...`` configurations run DeepSpeed ZeRO-3 instead of FSDP2, through lowprec's
Accelerator (``DeepSpeedPlugin``, DeepSpeed's CPU accelerator), ZeRO told to keep nothing
gathered after a module's forward (persistence threshold 0, reuse distance 0, no prefetch); their
ratios are over ``zero3/bf16``.

Each world size runs as that many gloo processes (forked after one torch import), every rank the
same script: the built-in Llama (``lowprec.train.model``), ``fp8.convert`` with the recipe (the
engine's default filter: first/last Linear and lm_head stay bf16), each decoder layer and the
root ``fully_shard``ed (``reshard_after_forward=True``, ``param_dtype=bf16``, ``reduce_dtype=fp32``),
bf16 autocast, AdamW; 2 training steps of ``batch x seq`` tokens per rank, the second measured.

Per rank and configuration (the JSON keeps every rank's numbers; the tables take the largest):

* ``saved_bytes``, the primary metric, exact: every tensor autograd saved for backward in the
  measured forward (``saved_tensors_hooks``), by distinct storage, counted *after* the forward
  returned (FSDP2 has freed the gathered weights by then: a saved reference to one counts 0) and
  without the local parameter shards (they exist anyway);
* ``unsharded_weight_bytes``: the part of it in tensors shaped like an FP8 layer's whole weight
  (``(N, K)``, ``(K, N)``, or nvfp4's packed FP4 ``(N, K/2)``; the token count, 2 x 96, is none of
  the built-in models' weight dims):
  the FP8 weight copies backward keeps, the issue-29 cost;
* ``resident_bytes``: the local parameter shards and the optimizer state before the step (exact);
  ``after_forward_bytes`` = ``resident_bytes + saved_bytes``: what the rank holds when the
  forward returns, exact, the floor of the step's peak;
* ``peak_step_bytes``: the largest allocation above the step's start during the measured step
  (forward, backward, optimizer step), from ``torch.profiler``'s allocator events replayed in
  time order (``benchmarks/memory.py``'s method: temporaries freed inside one op are missed),
  on the training thread only (gloo's threads excluded: they made identical runs differ by up to
  10%); ``peak_bytes`` = ``resident_bytes + peak_step_bytes``.

``ratios_vs_bf16``: each configuration's ``saved_bytes``, ``after_forward_bytes`` and ``peak_bytes``
over bf16's at the same world size, and for the last two ``..._falls_like_bf16``: whether that
ratio at the largest world size is at most the one at the smallest (issue 29's target: per-rank
memory of FP8 + FSDP2 falls with world size like bf16's). Nothing here is timed.

With several processes the peak is not deterministic (one world size, the same code, three runs:
bf16 279.0 / 282.1 / 291.8 MiB per rank at 4 processes, identical runs at 1): when collectives
complete against the training thread's allocations varies. ``--repeats N`` runs each world size N
times: ``peak_bytes`` is then the median, ``peak_bytes_runs`` every run's and
``peak_bytes_spread`` their (max - min) / median; ``peak_bytes_noise`` is the larger spread of a
configuration and its bf16 at the largest world size, and ``peak_bytes_falls_like_bf16_within_noise``
the target judged with it. A single run's verdict at several processes is within that noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import cpu_alloc_peak, device_name, end_rank, free_port, write_json  # noqa: E402

RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4")
CONFIGS = (
    "bf16",
    "bf16+ckpt",
    "tensorwise:auto+ckpt",
    "tensorwise_fp8_all_gather:auto+ckpt",
    "delayed:auto+ckpt",
    *(
        f"{r}:{opt}"
        for r in (
            *RECIPES,
            *(f"{g}_fp8_all_gather" for g in ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")),
        )
        for opt in ("auto", "off")
    ),
    # DeepSpeed ZeRO-3 (through lowprec's Accelerator, DeepSpeed's CPU accelerator): nothing kept
    # gathered after a module's forward (persistence threshold 0, reuse distance 0, no prefetch)
    "zero3/bf16",
    *(f"zero3/{r}:{opt}" for r in ("delayed", "tensorwise", "nvfp4") for opt in ("auto", "off")),
    *(f"zero3/{r}:auto" for r in ("rowwise", "blockwise", "mxfp8")),
)


def _storages(t: torch.Tensor):
    if hasattr(t, "__tensor_flatten__"):  # a wrapper subclass (FP8 all-gather): its inner tensors
        for name in t.__tensor_flatten__()[0]:
            yield from _storages(getattr(t, name))
    elif t.layout == torch.strided:
        yield t, t.untyped_storage()


def _weight_shapes(model) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """The shapes of an FP8 layer's whole weight, ``(N, K)`` and ``(K, N)``, and of nvfp4's packed
    FP4 weight, ``(N, K/2)`` (matched for the FP4 dtype only: an FP8 ``x^T`` can have that shape)."""
    from lowprec.fp8 import Float8Linear

    shapes, packed = set(), set()
    for m in model.modules():
        if isinstance(m, Float8Linear):
            n, k = m.out_features, m.in_features
            shapes |= {(n, k), (k, n)}
            packed.add((n, k // 2))
    return shapes, packed


def _is_weight(t: torch.Tensor, shapes, packed) -> bool:
    shape = tuple(t.shape)
    return t.dim() == 2 and (shape in shapes or (t.dtype == torch.float4_e2m1fn_x2 and shape in packed))


def _saved_report(saved: list, params: set, shapes, packed) -> dict:
    """Bytes of the distinct storages autograd saved, without the local parameter shards, and
    the part of them shaped like an FP8 layer's whole weight."""
    live: dict[int, int] = {}
    weights: dict[int, int] = {}
    for t in saved:
        if not isinstance(t, torch.Tensor):
            continue
        for inner, st in _storages(t):
            if st._cdata in params:
                continue
            live[st._cdata] = st.nbytes()
            if _is_weight(inner, shapes, packed) and st.nbytes():
                weights[st._cdata] = st.nbytes()
    return {
        "saved_bytes": sum(live.values()),
        "unsharded_weight_bytes": sum(weights.values()),
        "unsharded_weights_held": len(weights),
    }


def _tensor_bytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def run_zero3(config: str, model_name: str, batch: int, seq: int, rank: int) -> dict:
    """One ``zero3/<recipe>:<auto|off>`` configuration: the built-in Llama through lowprec's
    Accelerator with DeepSpeed ZeRO-3 (as ``tests/test_zero3_saved_weights.py``), every Linear
    of the recipe's default filter converted, AdamW; the same measurements as FSDP2's.
    ``resident_bytes``: this rank's bf16 parameter partitions, ZeRO's float32 master partitions
    and the Adam state it holds."""
    import lowprec.fp8 as fp8
    from lowprec import Accelerator
    from lowprec.kwargs import NativeRecipeKwargs
    from lowprec.train.model import build_model
    from lowprec.utils import DeepSpeedPlugin

    recipe_name, _, opt = config.removeprefix("zero3/").partition(":")
    use_fp8 = recipe_name != "bf16"
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
    }
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": zero})
    handlers = []
    if use_fp8:
        handlers = [
            NativeRecipeKwargs(
                recipe=recipe_name, overrides={"force_recompute_fp8_weight_in_bwd": None if opt == "auto" else False}
            )
        ]
    acc = Accelerator(mixed_precision="fp8" if use_fp8 else "bf16", deepspeed_plugin=plugin, kwargs_handlers=handlers)
    torch.manual_seed(0)
    model = build_model(model_name)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optim = acc.prepare(model, optim)
    shapes, packed = _weight_shapes(model)
    g = torch.Generator().manual_seed(100 + rank)
    vocab = model.module.config.vocab_size if hasattr(model, "module") else model.config.vocab_size
    ids = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(2)]
    info: dict = {}

    def step(i: int, measure: bool) -> None:
        saved: list = []
        pack = (lambda t: saved.append(t) or t) if measure else (lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids[i], labels=ids[i]).loss
        if measure:
            params = {p.ds_tensor.untyped_storage()._cdata for p in model.parameters()}
            info.update(_saved_report(saved, params, shapes, packed))
            saved.clear()
        acc.backward(loss)
        optim.step()
        optim.zero_grad()
        info["loss"] = loss.item()

    step(0, measure=False)
    zero_opt = getattr(optim, "optimizer", optim)  # lowprec's wrapper -> DeepSpeed's ZeRO-3 optimizer
    resident = _tensor_bytes(p.ds_tensor for p in model.parameters())
    resident += _tensor_bytes(getattr(zero_opt, "fp32_partitioned_groups_flat", []))
    inner = getattr(zero_opt, "optimizer", None)
    if inner is not None:
        resident += sum(_tensor_bytes(st.values()) for st in inner.state.values())
    info["resident_bytes"] = resident
    info["peak_step_bytes"] = cpu_alloc_peak(lambda: step(1, measure=True), busiest_thread_only=True)
    info["peak_bytes"] = info["resident_bytes"] + info["peak_step_bytes"]
    info["after_forward_bytes"] = info["resident_bytes"] + info["saved_bytes"]
    info["fp8_layers"] = sum(isinstance(m, fp8.Float8Linear) for m in model.modules())
    return info


def run_config(config: str, model_name: str, batch: int, seq: int, rank: int) -> dict:
    if config.startswith("zero3/"):
        return run_zero3(config, model_name, batch, seq, rank)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import lowprec.fp8 as fp8
    from lowprec.distributed.amax_sync import reduce_delayed_amaxes
    from lowprec.distributed.fsdp_float8 import enable_fsdp_float8_all_gather, precompute_float8_scales_for_fsdp
    from lowprec.train.model import LlamaDecoderLayer, build_model

    config, _, extra = config.partition("+")
    recipe_name, _, opt = config.partition(":")
    gather = recipe_name.endswith("_fp8_all_gather")
    recipe_name = recipe_name.removesuffix("_fp8_all_gather")
    torch.manual_seed(0)
    model = build_model(model_name)
    use_fp8 = recipe_name != "bf16"
    if use_fp8:
        recipe = fp8.Recipe.from_name(recipe_name, force_recompute_fp8_weight_in_bwd=None if opt == "auto" else False)
        fp8.convert(model, recipe)
        if gather:
            enable_fsdp_float8_all_gather(model)
    if extra == "ckpt":  # activation checkpointing of every decoder layer (the trainer's key)
        model.gradient_checkpointing_enable()
    shapes, packed = _weight_shapes(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model.modules():
        if isinstance(m, LlamaDecoderLayer):
            fully_shard(m, reshard_after_forward=True, mp_policy=mp)
    fully_shard(model, reshard_after_forward=True, mp_policy=mp)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    g = torch.Generator().manual_seed(100 + rank)
    ids = [torch.randint(0, model.config.vocab_size, (batch, seq), generator=g) for _ in range(2)]
    info: dict = {}

    def step(i: int, measure: bool) -> None:
        if gather:
            precompute_float8_scales_for_fsdp(model)
        saved: list = []
        pack = (lambda t: saved.append(t) or t) if measure else (lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16), fp8.autocast(enabled=use_fp8):
                loss = model(ids[i], labels=ids[i]).loss
        if measure:
            params = {p.to_local().untyped_storage()._cdata for p in model.parameters()}
            info.update(_saved_report(saved, params, shapes, packed))
            saved.clear()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if recipe_name == "delayed":
            reduce_delayed_amaxes(model)
        info["loss"] = loss.item()

    step(0, measure=False)  # optimizer state created; delayed scaling has a history from here on
    resident = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    for st in optim.state.values():
        resident += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    info["resident_bytes"] = resident
    info["after_forward_bytes"] = 0  # set below, once saved_bytes is known
    info["peak_step_bytes"] = cpu_alloc_peak(lambda: step(1, measure=True), busiest_thread_only=True)
    info["peak_bytes"] = info["resident_bytes"] + info["peak_step_bytes"]
    info["after_forward_bytes"] = info["resident_bytes"] + info["saved_bytes"]
    info["fp8_layers"] = sum(isinstance(m, fp8.Float8Linear) for m in model.modules())
    return info


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {c: run_config(c, args.model, args.batch, args.seq, rank) for c in args.configs}
    Path(out_dir, f"world{world}_rank{rank}.json").write_text(json.dumps(out))
    if any(c.startswith("zero3/") for c in args.configs):
        import deepspeed.comm  # DeepSpeed keeps a clone of the group: its destroy releases both

        deepspeed.comm.destroy_process_group()
    else:
        dist.destroy_process_group()
    end_rank()


def _ratios(per_world: dict, configs: list[str], worlds: list[int]) -> dict:
    """Each configuration over its own sharding's bf16 run (``bf16`` for FSDP2, ``zero3/bf16``)."""
    out: dict = {}
    for c in configs:
        base = "zero3/bf16" if c.startswith("zero3/") else "bf16"
        if base not in configs:
            continue
        row: dict = {}
        for key in ("saved_bytes", "after_forward_bytes", "peak_bytes"):
            r = {w: per_world[w][c][key] / per_world[w][base][key] for w in worlds}
            row[key] = {str(w): round(v, 4) for w, v in r.items()}
            if key != "saved_bytes":  # saved bytes do not shard (the same tokens per rank)
                row[f"{key}_falls_like_bf16"] = r[worlds[-1]] <= r[worlds[0]]
            if key == "peak_bytes":  # the run-to-run spread of either peak at the largest world
                last = per_world[worlds[-1]]
                noise = max(last[c].get("peak_bytes_spread", 0.0), last[base].get("peak_bytes_spread", 0.0))
                row["peak_bytes_noise"] = noise
                row["peak_bytes_falls_like_bf16_within_noise"] = r[worlds[-1]] <= r[worlds[0]] + noise
        out[c] = row
    return out


def _over_repeats(runs: list[dict]) -> dict:
    """One world's numbers from its repeats: the exact ones (saved bytes, resident bytes) from the
    first, the peak as the median of the repeats' peaks, with every repeat's peak and their
    spread ((max - min) / median) beside it."""
    out = {c: dict(v) for c, v in runs[0].items()}
    for c, v in out.items():
        peaks = sorted(r[c]["peak_bytes"] for r in runs)
        v["peak_bytes"] = statistics.median(peaks)
        v["peak_bytes_runs"] = peaks
        v["peak_bytes_spread"] = round((peaks[-1] - peaks[0]) / v["peak_bytes"], 4)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--batch", type=int, default=2)
    # 2 x 96 tokens: a token count no weight dim of the built-in models equals (see the module doc)
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"from {', '.join(CONFIGS)}")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/fsdp_memory.json)")
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs per world size; the peak is their median (it varies run to run)"
    )
    args = ap.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    for c in args.configs:
        if c not in CONFIGS:
            ap.error(f"--configs: unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")
    worlds = [int(w) for w in args.worlds.split(",")]

    import torch.multiprocessing as mp

    per_world: dict = {}
    per_rank: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in worlds:
            runs = []
            for _ in range(args.repeats):
                # forked after one torch import (the parent computes nothing before), one thread each
                mp.start_processes(_rank_main, args=(w, free_port(), args, tmp), nprocs=w, start_method="fork")
                ranks = [json.loads(Path(tmp, f"world{w}_rank{r}.json").read_text()) for r in range(w)]
                runs.append({c: {k: max(r[c][k] for r in ranks) for k in ranks[0][c]} for c in args.configs})
            per_rank[str(w)] = ranks  # the last repeat's
            per_world[w] = _over_repeats(runs)
            for c in args.configs:
                v = per_world[w][c]
                print(
                    f"world {w} {c:34s} saved {v['saved_bytes'] / 2**20:8.3f} MiB  unsharded FP8 weights "
                    f"{v['unsharded_weight_bytes'] / 2**20:7.3f} MiB ({v['unsharded_weights_held']:3d})  "
                    f"after forward {v['after_forward_bytes'] / 2**20:8.3f} MiB  peak {v['peak_bytes'] / 2**20:8.3f} MiB",
                    flush=True,
                )
    result = {
        "device": device_name(torch.device("cpu")),
        "machine": f"{os.uname().nodename}, {device_name(torch.device('cpu'))}",
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "worlds": worlds,
        "fsdp": "fully_shard per decoder layer + root, reshard_after_forward=True, param_dtype=bf16",
        "zero3": "lowprec Accelerator + DeepSpeed ZeRO-3 (CPU accelerator), persistence threshold 0, "
        "reuse distance 0, no prefetch, bf16",
        "per_world": {str(w): per_world[w] for w in worlds},
        "per_rank": per_rank,
        "ratios_vs_bf16": _ratios(per_world, args.configs, worlds),
    }
    write_json(result, args.out, "fsdp_memory.json")
    return result


if __name__ == "__main__":
    main()
