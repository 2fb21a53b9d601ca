"""Tensor parallel FP8 (Float8ColwiseParallel / Float8RowwiseParallel on DTensor), alone and
composed with FSDP2 on a 2-D (dp, tp) mesh, and sequence parallelism with FP8 block inputs
(PrepareFloat8ModuleInput): 4 CPU processes (gloo), one launch.

Rank 0 also trains the same model in one process (fp32 weights, bf16 autocast). Measured
tolerances (max |loss diff| vs one process, 5 steps of the MLP at loss ~2.05, 3 steps of the
built-in llama-tiny (2 layers) at loss ~5.6, gradients clipped to norm 0.5 by the Accelerator's
clip_grad_norm, whose total norm is within 4.6e-3 of one process's, 2e-2 asserted):

=====================================  ========  =========
run                                    measured  asserted
=====================================  ========  =========
MLP, TP tp=4                           8.3e-4    3e-3
MLP, FSDP2+TP (dp=2 x tp=2)            4.1e-3    1e-2
MLP, TP+SP tp=4 (Float8Colwise gather) 8.3e-4    3e-3
llama, TP+SP tp=2                      7.2e-4    3e-3
llama, FSDP2+TP (dp=2 x tp=2)          1.4e-3    1e-2
llama, FSDP2+TP+SP (dp=2 x tp=2)       1.5e-3    1e-2
=====================================  ========  =========

The scales are the whole tensors' (tp_linear.py; the FP8 sequence gather casts each slice with
the whole input's scale, so those FP8 values are bitwise one process's); what differs is the
order of the bf16 sums (rowwise partial sums, reduce-scatter), the per-shard scale of the
colwise output gradient and, under FSDP2, weights rounded to bf16 (param_dtype) before their
FP8 cast. Bytes: in a bf16 model the forward all-gathers of the block inputs carry FP8 (uint8
on gloo): exactly half the bytes of the same run with FP8 off (counted at the collective,
lowprec.distributed.comm_count; measured 24576 vs 49152 B per rank per step); layer 0's
attention input (its q_proj stays high precision: convert's skip_first_last) and the LM head's
are gathered in bf16 in both. Also: Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
gives each rank the (dp_shard, tp) torch_device_mesh and its ranks in it.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

from tests.torchrun_util import free_port, run_torchrun

WORKER = textwrap.dedent(
    '''
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    import lowprec.fp8 as fp8
    from lowprec.distributed.tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.up, self.down, self.out = nn.Linear(16, 32), nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 8)

        def forward(self, x):
            return self.out(torch.relu(self.down(torch.relu(self.up(torch.relu(self.inp(x)))))))

    PLAN = {"up": Float8ColwiseParallel(), "down": Float8RowwiseParallel()}
    # torchao's style of sequence parallelism on the colwise layer itself: rows (dim 0 here) sharded
    # between the layers, gathered in FP8 by Float8ColwiseParallel(input_layouts=Shard(0))
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput
    SP_PLAN = {"inp": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=True),
               "up": Float8ColwiseParallel(input_layouts=Shard(0)), "down": Float8RowwiseParallel(output_layouts=Shard(0)),
               "out": PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_output=True)}

    from lowprec.distributed.comm_count import CommBytes
    SENT = CommBytes()  # the forward collectives of every MLP run

    MESHES = {}  # one mesh per shape, shared by the runs: each new mesh is four new gloo groups

    def mesh_of(dp, tp):
        if (dp, tp) not in MESHES:
            MESHES[dp, tp] = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        return MESHES[dp, tp]

    def run(dp=1, tp=1, sp=False):
        torch.manual_seed(0)
        model = MLP()
        fp8.convert(model, recipe=fp8.Recipe.from_name("tensorwise"))  # up, down (first/last stay bf16)
        mesh = None
        if tp > 1:
            mesh = mesh_of(dp, tp)
            parallelize_module(model, mesh["tp"], SP_PLAN if sp else PLAN)  # FP8 first, then TP, then FSDP2
        if dp > 1:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        part = mesh["dp"].get_local_rank() if dp > 1 else 0
        losses = []
        for _ in range(5):
            x = torch.randn(16, 16, generator=g)
            y = x[:, :8].argmax(1)  # learnable labels: the loss must fall
            xs, ys = x.chunk(dp)[part], y.chunk(dp)[part]  # each dp rank its half of the batch
            with fp8.autocast(), torch.autocast("cpu", dtype=torch.bfloat16), SENT:
                loss = nn.functional.cross_entropy(model(xs).float(), ys)
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            if dp > 1:  # the loss of the whole batch: the mean over the dp ranks' equal halves
                dist.all_reduce(mean, group=mesh["dp"].get_group())
                mean /= dp
            losses.append(mean.item())
        return losses

    def llama(dp=1, tp=1, sp=False, fsdp=False, steps=3, dtype=torch.float32, fp8_on=True, moves=None, move_at=0):
        """llama-tiny (2 layers, tp <= n_kv_heads = 2); without FSDP2 every dp group trains
        the same batch (a replica), with it each dp rank its half. ``moves``: {layer: GEMMs to
        move to high precision ("layer": all)}, applied before step ``move_at`` (as the guard)."""
        from lowprec.distributed.comm_count import CommBytes
        from lowprec.distributed.tensor_parallel import apply_tp_plan
        from lowprec.train.model import build_model
        from lowprec.utils.distributed import clip_grad_norm

        torch.manual_seed(0)
        model = build_model("llama-tiny", n_layers=2).to(dtype)
        fp8.convert(model, recipe=fp8.Recipe.from_name("tensorwise"))
        mesh = mesh_of(dp, tp) if tp > 1 else None
        if tp > 1:
            apply_tp_plan(model, mesh["tp"], sequence_parallel=sp)
        if fsdp:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
            fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        part = mesh["dp"].get_local_rank() if fsdp else 0
        losses, sent, norms = [], CommBytes(), []
        for step in range(steps):
            for name, gemms in (moves or {}).items():
                if step == move_at:
                    layer = model.get_submodule(name)
                    if gemms == "layer":
                        layer.high_precision = True
                    else:
                        layer.set_high_precision_gemms(gemms)
            ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=g)
            ids = ids.chunk(dp)[part] if fsdp else ids
            with fp8.autocast(enabled=fp8_on), torch.autocast("cpu", dtype=torch.bfloat16):
                with sent:  # the forward's collectives
                    loss = model(ids, labels=ids).loss
            loss.backward()
            # the Accelerator's clipping over gradients on two meshes (FSDP2's 1-D embedding, 2-D
            # Linears and norms) or on a mesh and none (TP alone): its norm must be one process's
            norms.append(clip_grad_norm(model.parameters(), 0.5).item())
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            if fsdp:
                dist.all_reduce(mean, group=mesh["dp"].get_group())
                mean /= dp
            losses.append(mean.item())
        return losses, sent.as_dict(), norms

    report = {"tp": run(tp=4), "fsdp_tp": run(dp=2, tp=2)}
    SENT.bytes.clear()
    report["tp_sp"] = run(tp=4, sp=True)
    report["bytes_mlp_sp"] = SENT.as_dict()
    report["llama_tp_sp"], _, report["norms_tp_sp"] = llama(dp=2, tp=2, sp=True)
    report["llama_fsdp_tp"], _, report["norms_fsdp_tp"] = llama(dp=2, tp=2, fsdp=True)
    report["llama_fsdp_tp_sp"], _, report["norms_fsdp_tp_sp"] = llama(dp=2, tp=2, sp=True, fsdp=True)
    report["bytes_fp8"] = llama(dp=2, tp=2, sp=True, steps=1, dtype=torch.bfloat16)[1]
    report["bytes_bf16"] = llama(dp=2, tp=2, sp=True, steps=1, dtype=torch.bfloat16, fp8_on=False)[1]
    # GEMMs moved to high precision (as the FP8 guard moves them): a colwise layer whose fprop or
    # wgrad reads the gathered input gets it in bf16, from the step of the move on
    sp_moved = dict(dp=2, tp=2, sp=True, dtype=torch.bfloat16)
    k, gate, up = (f"model.layers.1.{n}" for n in ("self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"))
    report["bytes_moved_layer"] = llama(steps=2, moves={k: "layer"}, move_at=1, **sp_moved)[1]
    report["bytes_moved_wgrad"] = llama(steps=1, moves={gate: ["wgrad"]}, **sp_moved)[1]
    report["bytes_moved_dgrad"] = llama(steps=1, moves={up: ["dgrad"]}, **sp_moved)[1]
    # Accelerate's surface for the same 2-D mesh: Accelerator(parallelism_config=...).torch_device_mesh
    from lowprec import Accelerator, ParallelismConfig
    from lowprec.utils import FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(), parallelism_config=ParallelismConfig(tp_size=2))
    mesh = acc.torch_device_mesh
    report["mesh"] = [mesh.mesh.tolist(), list(mesh.mesh_dim_names), acc.tensor_parallel_rank, acc.data_parallel_shard_rank]
    if rank == 0:
        report["single"] = run()
        report["llama_single"], _, report["norms_single"] = llama()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    '''
)


def test_tensor_parallel_and_fsdp2_tp_follow_one_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env.update(PYTHONPATH=os.pathsep.join([src, env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "lowprec.cli._torchrun",
        "--nproc_per_node",
        "4",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "lowprec.cli._worker",
        str(script),
        str(tmp_path),
    ]
    run_torchrun(cmd, lambda p: all((tmp_path / f"rank{r}.json").exists() for r in range(4)), env=env, timeout=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    single = reports[0]["single"]
    for rep in reports:
        for run, tol in (("tp", 3e-3), ("fsdp_tp", 1e-2), ("tp_sp", 3e-3)):
            assert max(abs(a - b) for a, b in zip(rep[run], single)) < tol, (run, rep[run], single)
        assert rep["tp"] == reports[0]["tp"] and rep["tp_sp"] == reports[0]["tp_sp"]  # the same (replicated) loss
        # up's input gathered in FP8 (5 steps x 4 of 16 x 32 rows per rank); out's input in bf16
        assert rep["bytes_mlp_sp"]["all_gather"] == {"uint8": 5 * 4 * 32, "bfloat16": 5 * 4 * 32 * 2}, rep
        for run, tol in (("llama_tp_sp", 3e-3), ("llama_fsdp_tp", 1e-2), ("llama_fsdp_tp_sp", 1e-2)):
            assert max(abs(a - b) for a, b in zip(rep[run], reports[0]["llama_single"])) < tol, (run, rep[run])
        assert rep["llama_tp_sp"] == reports[0]["llama_tp_sp"]
        for run in ("tp_sp", "fsdp_tp", "fsdp_tp_sp"):  # clipped (0.5) in every step, with one process's norm
            ref = reports[0]["norms_single"]
            assert min(ref) > 0.5 and all(abs(a / b - 1) < 2e-2 for a, b in zip(rep[f"norms_{run}"], ref)), (run, rep)
    for r, rep in enumerate(reports):  # (dp_shard, tp) = (2, 2): ranks 0,1 one tensor-parallel group
        assert rep["mesh"] == [[[0, 1], [2, 3]], ["dp_shard", "tp"], r % 2, r // 2]
    for rep in reports:
        # the block inputs' all-gathers: FP8 (uint8 on gloo), half of the bf16 run's bytes; the LM
        # head's input is gathered in bf16 in both runs
        f8, bf = rep["bytes_fp8"]["all_gather"], rep["bytes_bf16"]["all_gather"]
        assert set(bf) == {"bfloat16"} and f8["uint8"] > 0
        assert 2 * f8["uint8"] == bf["bfloat16"] - f8["bfloat16"], (f8, bf)
        # 3 gathers in FP8 (layer 0's MLP, layer 1's attention and MLP), 2 of the same size in bf16
        # (layer 0's attention, whose high-precision q_proj reads the input too; the LM head)
        assert 3 * f8["bfloat16"] == 4 * f8["uint8"], f8
        # k_proj of layer 1 (not the module's first FP8 layer) moved before step 2: that step gathers layer 1's attention input in
        # bf16 (2 of G bytes in FP8, 3 of 2G in bf16; step 1 as above: 3 and 2)
        ml = rep["bytes_moved_layer"]["all_gather"]
        assert 3 * ml["uint8"] == 5 * f8["uint8"] and ml["bfloat16"] == 2 * f8["bfloat16"] + f8["uint8"] // 3 * 2, ml
        # gate_proj's wgrad moved: layer 1's MLP input in bf16; up_proj's dgrad (reads no input): FP8 still
        mw = rep["bytes_moved_wgrad"]["all_gather"]
        assert 3 * mw["uint8"] == 2 * f8["uint8"] and mw["bfloat16"] == f8["bfloat16"] + f8["uint8"] // 3 * 2, mw
        assert rep["bytes_moved_dgrad"]["all_gather"] == f8, rep["bytes_moved_dgrad"]
    assert single[-1] < single[0]
