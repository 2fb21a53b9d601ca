"""Expert-parallel checkpoints (lowprec.distributed.expert_parallel, lowprec.checkpoint): the whole
experts, their FP8 scaling state and their AdamW moments in a checkpoint, each rank's slice on
load on any process count (a multi-process save / load on gloo, the workers of
test_expert_parallel.py), and the optimizer-state shares refused rather than cut into other
experts (single-process, the collectives stood in for)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.test_expert_parallel import ACCEL_PRELUDE, _run

RESHARD_WORKER = ACCEL_PRELUDE + textwrap.dedent(
    """
    # save: 2 AdamW steps under ep_size = world, then save_state; load: a fresh model on this
    # process count loads it, compared with the files: each rank's slice of every expert tensor
    # (weights, delayed scaling's per-expert amax histories and scales) and of every expert's
    # AdamW moments, everything else whole
    from safetensors.torch import load_file
    from lowprec.checkpoint.serialization import load_optimizer
    from lowprec.distributed.expert_parallel import expert_parallel_names

    mode, ckpt, world = sys.argv[4], sys.argv[5], int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = build_model("moe-tiny", n_layers=2, router_aux_loss_coef=0.0)
    fp8.convert(model, recipe=fp8.Recipe.from_name("delayed"))  # per-expert histories
    acc = Accelerator(parallelism_config=ParallelismConfig(ep_size=world) if world > 1 else None)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    rank, inner = acc.process_index, acc.unwrap_model(model)
    out = {}
    if mode == "save":
        for ids in batches(2):
            part = ids.chunk(world)[rank]
            with fp8.autocast():
                loss = model(part, labels=part).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        acc.save_state(ckpt)
    else:
        acc.load_state(ckpt)
        experts, local = set(expert_parallel_names(inner)), 8 // world
        mine = lambda name, v, dims: v[rank * local : (rank + 1) * local] if name in experts and v.dim() == dims else v
        saved, own = load_file(f"{ckpt}/model_0.safetensors"), inner.state_dict()
        # every tensor of the file (the tied lm_head.weight is written once, as the embedding)
        out["model"] = set(own) - set(saved) == {"lm_head.weight"} and all(
            torch.equal(own[k], mine(k, v, v.dim())) for k, v in saved.items()
        )
        history = "model.layers.1.mlp.experts.fp8_down_proj.fp8_amax_history_input"
        out["histories"] = bool(saved[history].amax(1).gt(0).all())  # every expert saw tokens
        names = {id(p): n for n, p in inner.named_parameters()}
        params = [p for g in opt.optimizer.param_groups for p in g["params"]]
        states = load_optimizer(f"{ckpt}/optimizer_0")["state"]
        checked = []
        for i, p in enumerate(params):
            live, name = opt.optimizer.state[p], names[id(p)]
            want = {k: mine(name, v, p.dim()) for k, v in states[str(i) if str(i) in states else i].items()}
            assert live.keys() == want.keys(), (name, live.keys(), want.keys())
            checked.append(all(torch.equal(live[k], want[k].to(live[k].dtype)) for k in want))
            if name.endswith("experts.gate_up_proj"):
                out.setdefault("expert_moments", []).append(list(live["exp_avg"].shape))
        out["optimizer"] = all(checked) and len(checked) == len(params)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    acc.wait_for_everyone()
    """
)


def test_ep_checkpoint_loads_on_another_process_count(tmp_path):
    """save_state under ep_size 2 (delayed scaling: per-expert amax histories), load_state on 4
    processes (ep_size 4) and on 1 (no expert parallelism): every rank holds exactly its slice of
    the saved experts, their FP8 scaling state and their AdamW moments, the rest as saved."""
    ckpt = str(tmp_path / "ckpt")
    for name, nproc, mode in (("save", 2, "save"), ("four", 4, "load"), ("one", 1, "load")):
        (tmp_path / name).mkdir()
        outs = _run(tmp_path / name, nproc, [], [], mode, ckpt, script=RESHARD_WORKER)
        if mode == "load":
            assert all(r["model"] and r["optimizer"] and r["histories"] for r in outs), outs
            assert all(r["expert_moments"] == [[8 // nproc, 384, 128]] * 2 for r in outs), outs


def test_an_expert_missing_from_the_saved_optimizer_state_is_an_error_not_a_silent_loss(monkeypatch):
    """Under FSDP2 the optimizer state is keyed by parameter name; if the names being saved are
    not the model's (a wrapper, a compiled model's ``_orig_mod.``), the experts' moments would be
    left out of the checkpoint without a word. One process's collective stood in for."""
    from lowprec.distributed import expert_parallel as ep

    monkeypatch.setattr(ep.dist, "all_gather", lambda parts, local, group=None: parts[0].copy_(local))
    monkeypatch.setattr(ep.dist, "get_world_size", lambda group=None: 1)
    model = torch.nn.Linear(4, 4, bias=False)
    model.weight._lowprec_ep_group = None  # as _shard marks an expert parameter
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    moments = dict(opt.state[model.weight])
    ok = {"state": {"weight": dict(moments)}, "param_groups": []}
    assert ep.gather_expert_optimizer_state(opt, ok, model)["state"]["weight"]["exp_avg"].shape == (4, 4)
    renamed = {"state": {"_orig_mod.weight": dict(moments)}, "param_groups": []}
    with pytest.raises(RuntimeError, match="has no entry 'weight' for a sharded expert parameter"):
        ep.gather_expert_optimizer_state(opt, renamed, model)
    assert ep.gather_expert_optimizer_state(opt, {"state": {}}, model) == {"state": {}}  # FSDP2: ranks > 0


def test_moments_of_another_expert_count_are_an_error_not_cut_into_other_experts(monkeypatch):
    """slice_expert_optimizer_state on rank 1 of 2 (4 experts, 2 here): the whole moments give
    this rank experts 2-3, its own slice stays as it is, a state of 3 experts (one process's
    slice saved by another count) is one error naming the parameter. Collectives stood in for."""
    from lowprec.distributed import expert_parallel as ep

    monkeypatch.setattr(ep.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(ep.dist, "get_rank", lambda group=None: 1)
    model = torch.nn.Linear(4, 2, bias=False)  # weight (2, 4): this rank's 2 of 4 experts
    model.weight._lowprec_ep_group = None  # as _shard marks an expert parameter
    opt = torch.optim.AdamW(model.parameters())
    whole = torch.arange(16.0).reshape(4, 4)

    def state(moments):
        return {"state": {0: {"step": torch.tensor(3.0), "exp_avg": moments}}, "param_groups": []}

    got = ep.slice_expert_optimizer_state(opt, state(whole))["state"][0]
    assert torch.equal(got["exp_avg"], whole[2:]) and got["step"] == 3
    assert torch.equal(ep.slice_expert_optimizer_state(opt, state(whole[:2]))["state"][0]["exp_avg"], whole[:2])
    with pytest.raises(ValueError, match=r"'exp_avg' of expert parameter 0 holds 3 experts; the model has 4 \(2 on"):
        ep.slice_expert_optimizer_state(opt, state(whole[:3]))


def test_moments_of_another_share_of_the_experts_are_refused_without_expert_parallelism():
    """One process without expert parallelism loading AdamW moments of half the experts (one rank's
    share, kept per process by an earlier lowprec): a ValueError naming the state before any step,
    not a failure at the first step; states of other ranks (a factored moment) are not compared."""
    from lowprec.utils.distributed import load_full_optimizer_state_dict

    w = torch.nn.Parameter(torch.randn(8, 6, 4))
    opt = torch.optim.AdamW([w])
    w.grad = torch.randn_like(w)
    opt.step()
    sd = opt.state_dict()
    whole = {k: v.clone() for k, v in sd["state"][0].items()}
    sd["state"][0]["exp_avg"] = whole["exp_avg"][:4].clone()
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 is \(4, 6, 4\), the parameter is \(8, 6, 4\)"):
        load_full_optimizer_state_dict(None, opt, sd)
    sd["state"][0] = {**whole, "row_factor": torch.ones(8)}  # another rank: not compared
    load_full_optimizer_state_dict(None, opt, sd)
    assert torch.equal(opt.state[w]["exp_avg"], whole["exp_avg"])
