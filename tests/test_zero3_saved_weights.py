"""DeepSpeed ZeRO-3 keeps no gathered FP8 weight from forward to backward.

One process in-process, and two launched processes (each weight partitioned over both, other
data on each rank: the same checks on every rank), DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``), through the
Accelerator (``mixed_precision="fp8"``, every Linear converted). ZeRO-3 releases each module's
gathered parameters after its forward when told to keep none live (persistence threshold 0,
reuse distance 0, no prefetch): a bf16 run then keeps no weight-sized tensor from forward to backward. The
FP8 recipes whose forward cast also serves grad_input (delayed, tensorwise, nvfp4) keep none
either with ``force_recompute_fp8_weight_in_bwd`` auto (the Parameter carries ZeRO-3's
``ds_id``), one per FP8 layer when forced off, and the two runs train bitwise alike (losses and
this process's weight partitions after 3 optimizer steps).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lowprec import Accelerator
from lowprec.kwargs import NativeRecipeKwargs
from lowprec.utils import DeepSpeedPlugin

DIM, LAYERS = 128, 4


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_process_group():
    """DeepSpeed caches a clone of the world group: one process group for the whole module
    (as tests/test_reliability_deepspeed.py), destroyed after its last test through DeepSpeed,
    which then forgets its clone. A module that ran before in this process may have destroyed
    its group with torch.distributed alone, leaving DeepSpeed a clone of a dead group ("Group ...
    is not registered"): those references are released first, as DeepSpeed's own destroy does."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    if not dist.is_initialized():
        groups._release_process_group_references(None)  # private: what deepspeed.comm's destroy calls
    yield
    if dist.is_initialized():
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()


def _train(recipe: str | None, recompute=None, steps: int = 3, data_seed: int = 1) -> dict:
    torch.manual_seed(0)
    # nothing kept live or prefetched: each module's gathered parameters are released after it
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
    }
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": zero})
    handlers = []
    if recipe is not None:
        over = {"force_recompute_fp8_weight_in_bwd": recompute}
        if recipe == "nvfp4":
            over["high_precision_last"] = 0.0
        handlers = [NativeRecipeKwargs(recipe=recipe, overrides=over, skip_first_last=False)]
    acc = Accelerator(mixed_precision="fp8" if recipe else "bf16", deepspeed_plugin=plugin, kwargs_handlers=handlers)
    # every other layer without a bias (as tests/test_fsdp_saved_weights.py)
    model = nn.Sequential(*[nn.Linear(DIM, DIM, bias=i % 2 == 0) for i in range(LAYERS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    x0 = torch.randn(4, DIM, generator=torch.Generator().manual_seed(data_seed)).to(torch.bfloat16)
    rep: dict = {
        "held": [],
        "losses": [],
        "fp8_layers": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
    }
    saved: list = []
    for _ in range(steps):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(x0.clone().requires_grad_()).float().pow(2).mean()
        live = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in saved}
        rep["held"].append(sum(1 for n in live.values() if n >= DIM * DIM // 2))
        saved.clear()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        rep["losses"].append(loss.item())
    rep["partitions"] = [p.ds_tensor.detach().clone() for p in model.parameters()]
    return rep


def test_zero3_holds_no_gathered_fp8_weight_and_trains_the_same(ds_env):
    assert _train(None)["held"] == [0, 0, 0]  # what ZeRO-3 keeps of a bf16 model: nothing
    for recipe in ("delayed", "tensorwise", "nvfp4"):
        auto, off = _train(recipe), _train(recipe, recompute=False)
        assert auto["fp8_layers"] == LAYERS, recipe
        assert auto["held"] == [0, 0, 0], (recipe, auto["held"])
        assert off["held"] == [LAYERS] * 3, (recipe, off["held"])  # the FP8 copies, one per layer
        assert auto["losses"] == off["losses"], recipe
        assert all(torch.equal(a, b) for a, b in zip(auto["partitions"], off["partitions"])), recipe


def test_zero3_on_two_processes_holds_no_gathered_fp8_weight(tmp_path):
    """The same checks on 2 launched processes (gloo), where ZeRO-3 really partitions each weight
    and gathers it from the other rank for forward and again for backward."""
    import json
    import sys

    from tests.torchrun_util import run_torchrun

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([os.path.join(root, "src"), root, env.get("PYTHONPATH", "")]),
    )
    worker = os.path.join(root, "tests", "scripts", "zero3_saved_worker.py")
    cmd = [sys.executable, "-m", "lowprec.cli.main", "launch", "--cpu", "--num_processes", "2"]
    cmd += ["--main_process_port", "0", worker, str(tmp_path)]
    run_torchrun(cmd, lambda p: all((tmp_path / f"rank{r}.json").exists() for r in range(2)), env=env, timeout=300)
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rep in reps:
        assert rep["bf16_held"] == [0, 0, 0]
        assert rep["world"] == 2 and rep["partition_numel"] == DIM * DIM // 2  # each rank: half a weight
        for recipe in ("delayed", "tensorwise", "nvfp4"):
            r = rep[recipe]
            assert r["auto"]["held"] == [0, 0, 0], (recipe, r["auto"]["held"])
            assert r["off"]["held"] == [LAYERS] * 3, (recipe, r["off"]["held"])
            assert r["auto"]["losses"] == r["off"]["losses"], recipe
            assert r["same_partitions"], recipe
    assert reps[0]["delayed"]["auto"]["losses"] != reps[1]["delayed"]["auto"]["losses"]  # other data per rank
