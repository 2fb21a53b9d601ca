"""Expert parallelism with FP8 dispatch (lowprec.distributed.expert_parallel) on gloo: 2 CPU
processes (one launch: tensorwise and rowwise, FP8 and bf16 payloads) and one 4-process launch
(tensorwise), against the same model in one process.

Each rank builds ``builtin:moe-tiny`` (2 layers, 8 experts, top-2, dim 128) in float32 from one
seed, converts it to FP8, shards its experts, and trains 3 AdamW steps on its part of a batch;
the single-process run (on every rank, cheap) trains the whole batch. The loss is the token
sum over the whole batch / its token count (so the ranks' losses add up to one process's; the
routers' load-balancing loss, a product of batch means, is left out). Non-expert gradients are
all-reduced (SUM) by the worker, as data parallelism would; expert gradients come out of the
all-to-alls already summed over every rank's tokens. Asserted: the first step's logits and
every parameter's gradient (experts: the rank's slice of one process's) to within 1e-3 of
their largest magnitude, and the 3 losses within 3e-3 (the TP tests' tolerance,
test_tensor_parallel_fp8.py); measured values in docs/LOG.md (2026-11-28). Bytes: the dispatch
all-to-all (uint8 under FP8, bfloat16 under ``payload="bf16"``; the combine runs in float32,
the counts in int64) counted by lowprec.distributed.comm_count over the forward.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import textwrap

import pytest
import torch

from tests.torchrun_util import run_ranks

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import lowprec.fp8 as fp8
    from lowprec.distributed.comm_count import CommBytes
    from lowprec.distributed.expert_parallel import apply_expert_parallel
    from lowprec.train.model import build_model

    out_dir, recipes, payloads = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    STEPS, BATCH, SEQ = 3, 2 * world, 32

    def make(recipe):
        torch.manual_seed(0)
        m = build_model("moe-tiny", n_layers=2)
        # the experts only: tensorwise Linears under data parallelism cast each rank's half of the
        # batch with its own scale (data parallelism's difference, not expert parallelism's)
        fp8.convert(m, recipe=fp8.Recipe.from_name(recipe), module_filter=lambda mod, fqn: "experts" in fqn)
        return m

    def batches():
        g = torch.Generator().manual_seed(1)
        return [torch.randint(0, 272, (BATCH, SEQ), generator=g) for _ in range(STEPS)]

    def loss_of(model, ids, total):
        logits = model(ids).logits
        tok = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1), reduction="sum")
        return tok / total, logits

    def train(model, ep, payload="fp8"):
        if ep:  # "fp8", "bf16", or payload:combine ("fp8:fp8", "bf16:bf16")
            wire, _, back = payload.partition(":")
            apply_expert_parallel(model, ep_size=world, payload=wire, combine=back or "hp")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, first, sent, sent_bwd = [], None, CommBytes(), CommBytes()
        for step, ids in enumerate(batches()):
            total = ids.shape[0] * (ids.shape[1] - 1)
            part = ids.chunk(world)[rank] if ep else ids
            with fp8.autocast():
                if step == 0:
                    with sent:
                        loss, logits = loss_of(model, part, total)
                else:
                    loss, logits = loss_of(model, part, total)
            if step == 0:
                with sent_bwd:
                    loss.backward()
            else:
                loss.backward()
            if ep:
                for n, p in model.named_parameters():
                    if "experts" not in n and p.grad is not None:
                        dist.all_reduce(p.grad)
                full = loss.detach().clone()
                dist.all_reduce(full)
                loss = full
            if step == 0:
                first = (logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, first, (sent, sent_bwd)

    result = {}
    for recipe in recipes:
        ref_losses, (ref_logits, ref_grads), _ = train(make(recipe), ep=False)
        for payload in payloads:
            losses, (logits, grads), sent = train(make(recipe), ep=True, payload=payload)
            local = 8 // world
            err, scale = {}, {}
            err["logits"] = (logits - ref_logits.chunk(world)[rank]).abs().max().item()
            scale["logits"] = ref_logits.abs().max().item()
            for n, g in grads.items():
                r = ref_grads[n]
                if "experts" in n:
                    r = r[rank * local : (rank + 1) * local]
                assert g.shape == r.shape, (n, g.shape, r.shape)
                err[n] = (g - r).abs().max().item()
                scale[n] = r.abs().max().item()
            result[f"{recipe}/{payload}"] = dict(
                losses=losses, ref_losses=ref_losses, err=err, scale=scale, bytes=sent[0].as_dict(), bytes_bwd=sent[1].as_dict()
            )
    def hf_experts(model_name, recipe, ep, skewed=False):
        # the fused experts of a tiny transformers model, called as its MoE block calls them,
        # on random routing: 16 tokens per rank under ep, all 16 * world in one process
        from tests.tiny_moe import build, moe_block

        block = moe_block(build(model_name))
        fp8.convert(block, recipe=fp8.Recipe.from_name(recipe), skip_first_last=False)
        if ep:
            apply_expert_parallel(block, ep_size=world)
        experts = block.experts
        g = torch.Generator().manual_seed(2)
        n = 16 * world
        h = torch.randn(n, 64, generator=g)
        # skewed: every token on experts 0-3 (rank 0's), so rank 1's experts run nothing
        idx = torch.stack([torch.randperm(4 if skewed else 8, generator=g)[:2] for _ in range(n)])
        w = torch.rand(n, 2, generator=g).softmax(-1)
        dy = torch.randn(n, 64, generator=g)
        if ep:
            h, idx, w, dy = (t.chunk(world)[rank] for t in (h, idx, w, dy))
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        with fp8.autocast():
            out = experts(h, idx, w)
        out.backward(dy)
        grads = {"out": out.detach(), "hidden": h.grad, "weights": w.grad}
        grads.update({k: p.grad for k, p in experts.named_parameters()})
        return grads

    if "hf" in sys.argv[4:]:
        local = 8 // world
        for model_name, recipe, skewed in [
            (m, r, False) for m in ("mixtral", "gpt_oss") for r in ("tensorwise", "rowwise")
        ] + [("mixtral", "tensorwise", True)]:
            ref, got = hf_experts(model_name, recipe, False, skewed), hf_experts(model_name, recipe, True, skewed)
            err, scale = {}, {}
            for k, v in got.items():
                r = ref[k]
                r = r[rank * local : (rank + 1) * local] if k not in ("out", "hidden", "weights") else r.chunk(world)[rank]
                v = torch.zeros_like(r) if v is None else v  # skewed: no token reached these experts
                assert v.shape == r.shape, (k, v.shape, r.shape)
                err[k], scale[k] = (v - r).abs().max().item(), r.abs().max().item()
            result[f"{model_name}/{recipe}" + ("/skewed" if skewed else "")] = dict(err=err, scale=scale)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    """
)


# the Accelerator workers' common part: moe-tiny (2 layers, no load-balancing loss), rowwise on
# the whole model (Linears and experts), the batches
ACCEL_PRELUDE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import lowprec.fp8 as fp8
    from lowprec import Accelerator, ParallelismConfig
    from lowprec.train.model import build_model

    out_dir = sys.argv[1]

    def make():
        torch.manual_seed(0)
        m = build_model("moe-tiny", n_layers=2, router_aux_loss_coef=0.0)
        fp8.convert(m, recipe=fp8.Recipe.from_name("rowwise"))  # the whole model: Linears and experts
        return m

    def batches(steps=3):
        g = torch.Generator().manual_seed(1)
        return [torch.randint(0, 272, (4, 32), generator=g) for _ in range(steps)]

    def save_spoil_load(acc, inner, inner_opt):
        # save_state (the whole experts and their whole AdamW moments), spoil the weights and the
        # moments, load_state: whether each rank got its own values back (DTensors compared whole)
        def snapshot():
            full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            return [full(p) for p in inner.parameters()], [
                {k: full(v) for k, v in inner_opt.state[p].items()} for p in inner.parameters()
            ]
        w0, s0 = snapshot()
        acc.save_state(f"{out_dir}/ckpt")
        with torch.no_grad():
            for p in inner.parameters():
                p.add_(1.0)
            for st in inner_opt.state.values():
                for v in st.values():
                    v.add_(1.0)
        acc.load_state(f"{out_dir}/ckpt")
        w1, s1 = snapshot()
        return all(torch.equal(a, b) for a, b in zip(w0, w1)) and all(
            a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(s0, s1)
        )
    """
)


ACCEL_WORKER = ACCEL_PRELUDE + textwrap.dedent(
    """
    # one process, the whole batch
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref, ref_norms = [], []
    for ids in batches():
        with fp8.autocast():
            loss = model(ids, labels=ids).loss
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())

    ep = int(sys.argv[4]) if len(sys.argv) > 4 else 2  # fewer than the processes: expert replicas
    acc = Accelerator(parallelism_config=ParallelismConfig(expert_parallel_degree=ep))
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    rank, world = acc.process_index, acc.num_processes
    local = 8 // ep  # experts per process; this process holds experts local * (rank % ep) ...
    got, norms = [], []
    for ids in batches():
        with fp8.autocast():
            loss = model(ids.chunk(world)[rank], labels=ids.chunk(world)[rank]).loss
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        got.append(acc.reduce(loss.detach(), "mean").item())
    inner = acc.unwrap_model(model)
    shapes = {n: list(p.shape) for n, p in inner.named_parameters() if "experts" in n}
    # the whole experts in the full state dict (all-gathered), and back: each rank its slice
    from lowprec.distributed.expert_parallel import apply_expert_parallel
    full = acc.get_state_dict(model)
    fresh = make()
    apply_expert_parallel(fresh, ep_size=ep, group=acc.parallelism_config.ep_group())
    fresh.load_state_dict(full)
    own = dict(inner.named_parameters())
    round_trip = all(torch.equal(p, own[n]) for n, p in fresh.named_parameters())
    key = "model.layers.1.mlp.experts.down_proj"
    first = local * (rank % ep)
    gathered = list(full[key].shape) == [8, 128, 192] and torch.equal(full[key][first : first + local], own[key])
    # the replicas (the same place in another expert-parallel group) hold equal experts after training
    import torch.distributed as dist
    mine = torch.cat([p.detach().reshape(-1) for n, p in inner.named_parameters() if ".experts." in n])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    replicas_equal = all(torch.equal(every[r], mine) for r in range(rank % ep, world, ep))
    restored = save_spoil_load(acc, inner, opt.optimizer)
    from safetensors.torch import load_file
    moments = {tuple(v.shape) for k, v in load_file(f"{out_dir}/ckpt/optimizer_0.safetensors").items() if k.endswith("/exp_avg")}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(dict(ref=ref, got=got, ref_norms=ref_norms, norms=norms, shapes=shapes, round_trip=round_trip,
                       gathered=gathered, restored=restored, whole_moments=(8, 384, 128) in moments,
                       replicas_equal=replicas_equal), f)
    acc.wait_for_everyone()
    """
)


def test_accelerator_ep_size_trains_as_one_process(tmp_path):
    """Accelerator(parallelism_config=ParallelismConfig(expert_parallel_degree=2)), the alias of
    ep_size: the experts sharded after conversion, the rest under DDP (its averaging; expert
    gradients scaled to match), clip_grad_norm_ over every rank's experts, get_state_dict with
    the whole experts (all-gathered) that load back as each rank's slice; save_state with the
    whole experts and their whole AdamW moments, load_state giving each rank its slices back.
    rowwise, the whole model in FP8 (row scales: a Linear's forward does not depend on the batch
    split)."""
    _check_accelerator_run(_run(tmp_path, 2, [], [], script=ACCEL_WORKER), 4)


def test_accelerator_expert_replicas_train_as_one_process(tmp_path):
    """4 processes, ep_size 2: two expert-parallel groups (ranks 0-1, 2-3), each holding every
    expert once and dispatching its own tokens; the expert gradients averaged over the replicas
    (ranks 0 and 2, 1 and 3) after each backward. Against one process on the whole batch, as
    above: losses, clipped norms, the whole experts gathered and loaded back, save / load_state;
    the replicas' experts equal after training."""
    _check_accelerator_run(_run(tmp_path, 4, [], [], "2", script=ACCEL_WORKER), 4)


def _check_accelerator_run(outs, local):
    for res in outs:
        assert res["shapes"]["model.layers.0.mlp.experts.gate_up_proj"] == [local, 384, 128]
        assert res["gathered"] and res["round_trip"] and res["restored"] and res["whole_moments"]
        assert res["replicas_equal"]
        for a, b in zip(res["got"], res["ref"]):
            assert abs(a - b) <= 3e-3, (res["got"], res["ref"])
        for a, b in zip(res["norms"], res["ref_norms"]):
            assert abs(a - b) <= 2e-2 * b, (res["norms"], res["ref_norms"])


FSDP_WORKER = ACCEL_PRELUDE + textwrap.dedent(
    """
    from lowprec.kwargs import FullyShardedDataParallelPlugin

    combine = sys.argv[3] or "hp"

    def run(acc, model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if acc is not None:
            model, opt = acc.prepare(model, opt)
        rank, world = (acc.process_index, acc.num_processes) if acc is not None else (0, 1)
        losses, norms = [], []
        for ids in batches(4):
            part = ids.chunk(world)[rank]
            with fp8.autocast():
                loss = model(part, labels=part).loss
            if acc is None:
                loss.backward()
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
            else:
                acc.backward(loss)
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item() if acc is None else acc.reduce(loss.detach(), "mean").item())
        return model, opt, losses, norms

    _, _, ref, ref_norms = run(None, make())  # one process, the whole batch, no FSDP2
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    ep = int(sys.argv[4]) if len(sys.argv) > 4 else int(os.environ["WORLD_SIZE"])  # fewer: expert replicas
    acc = Accelerator(fsdp_plugin=plugin, parallelism_config=ParallelismConfig(ep_size=ep, ep_combine=combine))
    model, opt, got, norms = run(acc, make())
    from torch.distributed.fsdp import FSDPModule
    inner = acc.unwrap_model(model)
    kinds = {n: type(p).__name__ for n, p in inner.named_parameters()}
    full = acc.get_state_dict(model)  # every rank takes part; rank 0 holds the whole model
    key = "model.layers.1.mlp.experts.down_proj"
    gathered = list(full[key].shape) if key in full else None
    local, first = 8 // ep, 8 // ep * (acc.process_index % ep)
    own = dict(inner.named_parameters())[key].detach()
    same = bool(torch.equal(full[key][first : first + local], own)) if key in full else None
    restored = save_spoil_load(acc, inner, opt.optimizer)  # FULL_STATE_DICT
    import dataclasses
    acc.state.fsdp_plugin = dataclasses.replace(acc.state.fsdp_plugin, state_dict_type="SHARDED_STATE_DICT")
    try:  # a sharded checkpoint cannot tell the ranks' experts apart (same names): one error
        acc.save_state(f"{out_dir}/sharded")
        refused = False
    except ValueError as exc:
        refused = "SHARDED_STATE_DICT" in str(exc) and "ep_size" in str(exc)
    with open(f"{out_dir}/rank{acc.process_index}.json", "w") as f:
        json.dump(dict(ref=ref, got=got, ref_norms=ref_norms, norms=norms, kinds=kinds, gathered=gathered, same=same,
                       fsdp=isinstance(model, FSDPModule), restored=restored, refused=refused), f)
    acc.wait_for_everyone()
    """
)


@pytest.mark.parametrize("nproc, combine, ep", [(2, "hp", 2), (4, "hp", 4), (2, "fp8", 2), (4, "hp", 2)])
def test_fsdp2_for_the_rest_trains_as_one_process(tmp_path, nproc, combine, ep):
    """ParallelismConfig(ep_size=world) with FSDP2 (each decoder layer and the root sharded) for
    the non-expert weights: the experts are FSDP2's ignored parameters (plain, each rank its
    slice), the rest DTensors; 4 AdamW steps with clipping at 0.5 against one process on the whole
    batch without FSDP2 (rowwise, whole model FP8); get_state_dict gives rank 0 every expert;
    save_state / load_state (FULL_STATE_DICT) restore weights and moments after spoiling them;
    under SHARDED_STATE_DICT save_state is one error. ep 2 of 4 processes: expert replicas, FSDP2
    sharding the rest over all four."""
    outs = _run(tmp_path, nproc, [], [combine], str(ep), script=FSDP_WORKER)
    for rank, res in enumerate(outs):
        assert res["fsdp"] and res["restored"] and res["refused"]
        kinds = res["kinds"]
        assert {k for k, v in kinds.items() if v != "DTensor"} == {k for k in kinds if ".experts." in k}, kinds
        for a, b in zip(res["got"], res["ref"]):
            assert abs(a - b) <= 3e-3, (res["got"], res["ref"])
        for a, b in zip(res["norms"], res["ref_norms"]):
            assert abs(a - b) <= 2e-2 * b, (res["norms"], res["ref_norms"])
        if rank == 0:
            assert res["gathered"] == [8, 128, 192] and res["same"]


def _run(tmp_path, nproc, recipes, payloads, *extra, script=WORKER):
    text = script
    script = tmp_path / "worker.py"
    script.write_text(text)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), root, env.get("PYTHONPATH", "")])
    files = [tmp_path / f"rank{r}.json" for r in range(nproc)]
    run_ranks(
        str(script),
        [str(tmp_path), ",".join(recipes), ",".join(payloads), *extra],
        nproc,
        env,
        lambda: all(f.exists() for f in files),
    )
    return [json.loads(f.read_text()) for f in files]


def _check_equal(res, tol=1e-3, loss_tol=3e-3):
    for name, e in res["err"].items():
        assert e <= tol * max(res["scale"][name], 1e-6), (name, e, res["scale"][name])
    for a, b in zip(res["losses"], res["ref_losses"]):
        assert abs(a - b) <= loss_tol, (res["losses"], res["ref_losses"])
    assert res["losses"][-1] < res["losses"][0]  # it trains


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    extra = ["hf"] if importlib.util.find_spec("transformers") else []
    payloads = ["fp8", "bf16", "fp8:fp8", "bf16:bf16"]  # dispatch[:combine] wire formats
    return _run(tmp_path_factory.mktemp("ep2"), 2, ["tensorwise", "rowwise"], payloads, *extra)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_two_processes_match_one(two, recipe):
    for rank in two:
        _check_equal(rank[f"{recipe}/fp8"])


@pytest.mark.parametrize(
    "model, recipe",
    [(m, r) for m in ("mixtral", "gpt_oss") for r in ("tensorwise", "rowwise")] + [("mixtral", "tensorwise/skewed")],
)
def test_transformers_fused_experts_match_one_process(two, model, recipe):
    """Mixtral's experts and gpt-oss's (transposed weights, biases, clamped GLU) called directly:
    output, input and routing-weight gradients, weight and bias gradients. ``skewed``: every
    token routed to rank 0's experts (rank 1 still runs both backward all-to-alls)."""
    pytest.importorskip("transformers")
    for rank in two:
        res = rank[f"{model}/{recipe}"]
        assert set(res["err"]) >= {"out", "hidden", "weights", "gate_up_proj", "down_proj"}
        for name, e in res["err"].items():
            assert e <= 1e-3 * max(res["scale"][name], 1e-6), (model, recipe, name, e, res["scale"][name])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_dispatch_bytes_at_most_052_of_bf16(two, recipe):
    for rank in two:
        fp8_bytes = rank[f"{recipe}/fp8"]["bytes"]["all_to_all"]
        bf16_bytes = rank[f"{recipe}/bf16"]["bytes"]["all_to_all"]
        assert "bfloat16" not in fp8_bytes and "uint8" not in bf16_bytes
        # the same rows cross (the routing is the same run's): FP8 + scales vs bf16
        assert fp8_bytes["uint8"] <= 0.52 * bf16_bytes["bfloat16"], (fp8_bytes, bf16_bytes)
        assert fp8_bytes["uint8"] >= 0.5 * bf16_bytes["bfloat16"]  # every row did cross
        # backward: the gradient all-to-all to the owners (FP8 + scales vs bf16); the dispatch's
        # gradient back to the senders travels in the input's dtype (float32) in both runs
        fp8_bwd = rank[f"{recipe}/fp8"]["bytes_bwd"]["all_to_all"]
        bf16_bwd = rank[f"{recipe}/bf16"]["bytes_bwd"]["all_to_all"]
        assert "bfloat16" not in fp8_bwd and fp8_bwd["uint8"] <= 0.52 * bf16_bwd["bfloat16"], (fp8_bwd, bf16_bwd)


def _check_losses(res, loss_tol=3e-3):
    """An FP8 combine (``combine="fp8"``) rounds the expert outputs once more than one process
    does, which flips near-tie routes in later layers (as the bf16 payload does): the losses
    are compared, not the gradients element by element."""
    for a, b in zip(res["losses"], res["ref_losses"]):
        assert abs(a - b) <= loss_tol, (res["losses"], res["ref_losses"])
    assert res["losses"][-1] < res["losses"][0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_combine_two_processes_losses_match_one(two, recipe):
    for rank in two:
        _check_losses(rank[f"{recipe}/fp8:fp8"])


def _combine_bytes(res, payload, dtype, direction):
    """The combine's bytes (forward; backward: the dispatch gradient back): the run's all-to-all
    bytes of ``dtype`` minus the same dispatch run without it (``fp8`` / ``bf16``)."""
    base = payload.partition(":")[0]
    return res[f"{payload}"][direction]["all_to_all"][dtype] - res[base][direction]["all_to_all"].get(dtype, 0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_combine_bytes_at_most_052_of_bf16(two, recipe):
    """The combine all-to-all (expert outputs back to their tokens' ranks) and its backward
    counterpart (the dispatch gradient back): E4M3 + a float32 scale per row vs bf16."""
    for rank in two:
        res = {k.partition("/")[2]: v for k, v in rank.items() if k.startswith(recipe + "/")}
        assert set(res["fp8:fp8"]["bytes"]["all_to_all"]) == {"uint8", "int64"}  # no high-precision rows
        for direction in ("bytes", "bytes_bwd"):
            f8 = _combine_bytes(res, "fp8:fp8", "uint8", direction)
            bf = _combine_bytes(res, "bf16:bf16", "bfloat16", direction)
            assert 0.5 * bf < f8 <= 0.52 * bf, (direction, f8, bf)


def test_four_processes_match_one(tmp_path):
    for rank in _run(tmp_path, 4, ["tensorwise"], ["fp8", "fp8:fp8"]):
        _check_equal(rank["tensorwise/fp8"])
        _check_losses(rank["tensorwise/fp8:fp8"])


# ------------------------------------------------------------------ bad inputs (one process)
def test_expert_count_not_divisible_is_one_value_error():
    from lowprec.distributed.expert_parallel import check_expert_parallel

    with pytest.raises(ValueError, match=r"ep_size=3 does not divide the model's 8 experts; set ep_size"):
        check_expert_parallel(8, 3)
    check_expert_parallel(8, 4)


def test_model_without_fp8_experts_is_refused():
    from lowprec.distributed.expert_parallel import apply_expert_parallel
    from lowprec.train.model import build_model

    with pytest.raises(ValueError, match="no FP8 expert modules.*set ep_size to 1"):
        apply_expert_parallel(build_model("moe-tiny", n_layers=1), ep_size=2)


def test_unsupported_recipe_falls_back_to_bf16_with_one_log_line(caplog):
    from lowprec import logs
    from lowprec.distributed import expert_parallel as ep
    from lowprec.fp8.recipes import Recipe

    logs._LOGGED.clear()  # expert parallelism logs through logs.log_once
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        for _ in range(2):
            wire = ep._wire_for(Recipe.from_name("delayed"), True, "x", "fp8")
    assert wire.mode == "hp" and wire.dtype == torch.bfloat16
    lines = [r.getMessage() for r in caplog.records if "expert parallelism" in r.getMessage()]
    assert len(lines) == 1 and "'delayed'" in lines[0], lines
    for name, mode in (("tensorwise", "tensor"), ("rowwise", "axis")):
        assert ep._wire_for(Recipe.from_name(name), True, "x", "fp8").mode == mode


def test_parallelism_config_ep_size_and_its_alias():
    from lowprec.parallelism_config import ParallelismConfig
    from lowprec.utils.parallelism import for_accelerator

    assert ParallelismConfig(ep_size=2).expert_parallel_degree == 2
    pc = ParallelismConfig(expert_parallel_degree=4)
    assert pc.ep_size == 4 and pc.ep_enabled and not ParallelismConfig().ep_enabled
    with pytest.raises(ValueError, match=r"ep_size=2, expert_parallel_degree=4\): two names"):
        ParallelismConfig(ep_size=2, expert_parallel_degree=4)
    with pytest.raises(ValueError, match=r"ep_size=2, tp_size=2\): expert parallelism with tensor"):
        ParallelismConfig(ep_size=2, tp_size=2)
    with pytest.raises(ValueError, match=r"ep_size=0"):
        ParallelismConfig(ep_size=0)
    with pytest.raises(ValueError, match=r"ep_size=2\) does not divide the 3 data-parallel processes"):
        ParallelismConfig(ep_size=2).resolve(3)
    with pytest.raises(ValueError, match="ep_size 2 runs the non-expert weights under DDP or FSDP2 .* got DEEPSPEED"):
        for_accelerator(ParallelismConfig(ep_size=2), 2, "DEEPSPEED")
    assert for_accelerator(ParallelismConfig(ep_size=2), 2, "FSDP").ep_enabled  # FSDP2 for the rest
    assert for_accelerator(ParallelismConfig(ep_size=2), 4, "MULTI_CPU").ep_enabled  # two replicas of 2
    with pytest.raises(ValueError, match=r"ep_size=4\) does not divide the 6 data-parallel processes"):
        for_accelerator(ParallelismConfig(ep_size=4), 6, "MULTI_CPU")


def test_combine_wire_formats_and_a_bad_value():
    """``combine``: the rows' own dtype (the default), bf16, or E4M3 row-scaled while FP8 is on;
    the row-scaled round trip is one E4M3 rounding per element (a relative error <= 2^-4)."""
    from lowprec.distributed import expert_parallel as ep
    from lowprec.fp8.recipes import Recipe
    from lowprec.train.model import build_model

    state = ep.ExpertParallelState(None, 2, 0, 8, 4)
    recipe = Recipe.from_name("tensorwise")
    assert state.combine == "hp" and ep._combine_wire(recipe, state) == ep._Wire("hp", None)
    state.combine = "bf16"
    assert ep._combine_wire(recipe, state) == ep._Wire("hp", torch.bfloat16)
    state.combine = "fp8"
    wire = ep._combine_wire(recipe, state)
    assert wire.mode == "row" and wire.dtype == torch.float8_e4m3fn
    assert ep._combine_wire(None, state).mode == "hp"  # FP8 off: nothing in FP8
    rows = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [1e-3, 1.0, 1e3, 0.0, 7.0]
    ).unsqueeze(1)
    buf, _ = ep._encode(rows, torch.zeros(5, dtype=torch.int64), wire, state)
    assert buf.dtype == torch.uint8 and buf.shape == (5, 16 + 4)
    back = ep._decode(buf, None, None, wire, 16)
    assert torch.all((back - rows).abs() <= 2.0**-4 * rows.abs()) and torch.equal(back[3], rows[3])
    with pytest.raises(ValueError, match=r"combine='fp16'\): one of hp, bf16, fp8"):
        ep.apply_expert_parallel(build_model("moe-tiny", n_layers=1), ep_size=2, combine="fp16")
