"""FP8 across ranks under FSDP2 (2 CPU processes, gloo, one launch for every check):

* amax agreement (delayed scaling, ``reduce_amax``): every rank ends each step with the same
  amax histories and scales, through one all-reduce per optimizer step; the weight amax is the
  amax of the whole weight; with ``reduce_amax=False`` the ranks' scales differ (per-rank data);
* FSDP2 FP8 all-gather (tensorwise, and delayed with an interval of 2): the losses (and delayed's
  histories and scales) equal the run without it bitwise (with activation checkpointing of the
  FP8 units too), and the
  all-gathers of the FP8 layers move at most 0.52x the bytes of bf16, counted at the collective.

Each rank writes what it saw to a JSON file; the assertions are made here.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

from tests.torchrun_util import free_port, run_torchrun

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    import lowprec.fp8 as fp8
    from lowprec import Accelerator
    from lowprec.kwargs import FullyShardedDataParallelPlugin, NativeRecipeKwargs
    from lowprec.distributed.fsdp_float8 import install_counting_all_gather

    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    calls = []
    _all_reduce = dist.all_reduce
    def counting_all_reduce(*a, **k):  # counts the collectives issued inside opt.step()
        calls.append(1)
        return _all_reduce(*a, **k)

    class Net(nn.Sequential):  # activation checkpointing of the FP8 units when asked
        def forward(self, x):
            for i, m in enumerate(self):
                x = fp8.checkpoint(m, x) if self.ckpt and i in (2, 4) else m(x)
            return x

    def run(recipe, steps=4, ckpt=False, skew=False, width=32, **handler):
        gather = handler.get("enable_fsdp_float8_all_gather", False)
        torch.manual_seed(0)
        w = width  # mxfp8's gather needs 32-row blocks per rank: 64 wide
        model = Net(nn.Linear(16, w), nn.GELU(), nn.Linear(w, w), nn.GELU(), nn.Linear(w, w),
                    nn.GELU(), nn.Linear(w, 8))
        if skew:  # rank 0's rows (the first half) 8x larger: a column's amax is not its shard's
            with torch.no_grad():
                for i in (2, 4):
                    model[i].weight[:16] *= 8
        model.ckpt = ckpt
        # one FSDP2 unit per 32x32 Linear (the FP8 ones; the first and last stay bf16, in the root)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000)
        acc = Accelerator(mixed_precision="fp8", fsdp_plugin=plugin,
                          kwargs_handlers=[NativeRecipeKwargs(recipe=recipe, **handler)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        units = {name: install_counting_all_gather(m) for name, m in model.named_children() if name in ("2", "4")}
        layers = [m for m in model.modules() if isinstance(m, fp8.Float8Linear)]
        g = torch.Generator().manual_seed(100 + rank)  # other data on each rank
        rep = {"losses": [], "scales": [], "opt_step_all_reduces": []}
        for step in range(steps):
            x = torch.randn(16, 16, generator=g) * (1 + 3 * rank)
            y = torch.randint(0, 8, (16,), generator=g)
            loss = nn.functional.cross_entropy(model(x).float(), y)
            if step == 0 and recipe == "delayed" and not gather:  # the weight amax: of the whole (unsharded) weight
                rep["weight_amax"] = [[float(m.fp8_amax_history_weight[0]),
                                       float(m.weight.full_tensor().to(torch.bfloat16).abs().max())] for m in layers]
            acc.backward(loss)
            dist.all_reduce = counting_all_reduce
            calls.clear()
            opt.step()
            dist.all_reduce = _all_reduce
            opt.zero_grad()
            rep["opt_step_all_reduces"].append(len(calls))
            rep["losses"].append(loss.item())
            if recipe == "delayed":
                rep["scales"].append([[float(getattr(m, f"fp8_scale_{o}")) for o in ("input", "weight", "grad_output")]
                                      + getattr(m, "fp8_amax_history_grad_output")[:3].tolist() for m in layers])
        rep["gather_bytes"] = {k: c.input_bytes for k, c in units.items()}
        rep["weight_elems"] = {k: model[int(k)].weight.numel() for k in units}
        return rep

    report = {
        "reduce": run("delayed", overrides={"amax_history_len": 4, "reduce_amax": True}),
        "per_rank": run("delayed", overrides={"amax_history_len": 4, "reduce_amax": False}),
        "bf16_gather": run("tensorwise"),
        "fp8_gather": run("tensorwise", enable_fsdp_float8_all_gather=True),
        "fp8_gather_ckpt": run("tensorwise", ckpt=True, enable_fsdp_float8_all_gather=True),
        # delayed: scales refreshed every 2nd step (interval), so a stale and a fresh scale both occur
        "delayed_bf16": run("delayed", steps=5, overrides={"amax_history_len": 4, "interval": 2}),
        "delayed_gather": run("delayed", steps=5, overrides={"amax_history_len": 4, "interval": 2},
                              enable_fsdp_float8_all_gather=True),
        "delayed_gather_ckpt": run("delayed", steps=5, ckpt=True, overrides={"amax_history_len": 4, "interval": 2},
                                   enable_fsdp_float8_all_gather=True),
        # rowwise: per-row scales gathered with the rows; backward re-gathers with column scales
        **{f"{r}_{mode}": run(r, steps=3, ckpt=ckpt, skew=True, enable_fsdp_float8_all_gather=gather,
                              width=64 if r == "mxfp8" else 32,
                              overrides={"block_size": 16} if r == "blockwise" else {})
           for r in ("rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")
           for mode, ckpt, gather in (("bf16", False, False), ("gather", False, True), ("gather_ckpt", True, True))},
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    """
)


def launch(tmp_path) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")  # `lowprec launch --use_fsdp`
    cmd = [
        sys.executable,
        "-m",
        "lowprec.cli._torchrun",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "lowprec.cli._worker",
        str(script),
        str(tmp_path),
    ]
    run_torchrun(cmd, lambda p: all((tmp_path / f"rank{r}.json").exists() for r in range(2)), env=env, timeout=240)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_fsdp2_amax_agreement_and_fp8_all_gather(tmp_path):
    r0, r1 = launch(tmp_path)

    # amax agreement: same scales and histories on both ranks after every optimizer step,
    # from one all-reduce per step (Accelerator: backend.after_optimizer_step)
    assert r0["reduce"]["scales"] == r1["reduce"]["scales"]
    # (the optimizer step's own collectives, e.g. the non-finite check, are in both runs)
    extra = [a - b for a, b in zip(r0["reduce"]["opt_step_all_reduces"], r0["per_rank"]["opt_step_all_reduces"])]
    assert extra == [1, 1, 1, 1]
    for rep in (r0["reduce"], r1["reduce"]):
        for recorded, whole in rep["weight_amax"]:  # FSDP2: the whole weight's amax, not a shard's
            assert recorded == whole
    # the ranks see other data: without the reduction their scales part
    assert r0["per_rank"]["scales"] != r1["per_rank"]["scales"]
    assert r0["per_rank"]["losses"][0] == r0["reduce"]["losses"][0]  # step 0 casts with current amaxes

    # FP8 all-gather: the same GEMMs (same scale, elementwise cast) -> bitwise equal losses, with
    # activation checkpointing too (the recompute reads the same gathered FP8 weight)
    for r in (r0, r1):
        assert r["fp8_gather"]["losses"] == r["bf16_gather"]["losses"]
        assert r["fp8_gather_ckpt"]["losses"] == r["bf16_gather"]["losses"]
        extra = [
            a - b for a, b in zip(r["fp8_gather"]["opt_step_all_reduces"], r["bf16_gather"]["opt_step_all_reduces"])
        ]
        assert extra == [1, 1, 1, 1]  # one batched scale reduction for all weights
        for unit, fp8_bytes in r["fp8_gather"]["gather_bytes"].items():
            bf16_bytes = r["bf16_gather"]["gather_bytes"][unit]
            # weight (32x32) + bias (32) per unit: FP8 weight bytes, bf16 bias bytes
            assert fp8_bytes / bf16_bytes <= 0.52, (unit, fp8_bytes, bf16_bytes)
            assert bf16_bytes > 0

    # delayed with the FP8 all-gather: each shard cast before the gather with the scale the forward
    # takes from the history -> the same losses, histories and scales bitwise, on both ranks
    for r in (r0, r1):
        base = r["delayed_bf16"]
        for run in ("delayed_gather", "delayed_gather_ckpt"):
            assert r[run]["losses"] == base["losses"], run
            assert r[run]["scales"] == base["scales"], run
            for unit, fp8_bytes in r[run]["gather_bytes"].items():
                assert fp8_bytes / base["gather_bytes"][unit] <= 0.52, (run, unit)
    assert r0["delayed_gather"]["scales"] == r1["delayed_gather"]["scales"]

    # rowwise (and rowwise_with_gw_hp, whose grad_input reads a tensorwise weight): the same bits
    for r in (r0, r1):
        for recipe in ("rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8"):  # blockwise: 16x16 tiles here
            base = r[f"{recipe}_bf16"]
            for run in ("gather", "gather_ckpt"):
                got = r[f"{recipe}_{run}"]
                assert got["losses"] == base["losses"], (recipe, run)
                for unit, fp8_bytes in got["gather_bytes"].items():
                    # + one float32 scale per row (32 rows of 32): 4/32 of the weight's FP8 bytes;
                    # blockwise: one per 16x16 tile
                    assert fp8_bytes / base["gather_bytes"][unit] <= 0.58, (recipe, run, unit)
