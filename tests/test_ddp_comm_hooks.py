"""Accelerate's DDP communication hooks (``DistributedDataParallelKwargs(comm_hook=, comm_wrapper=,
comm_state_option=)``, ``DDPCommunicationHookType``) and ``LocalSGD``, on 2 CPU processes (gloo;
ranks forked after one torch import, tests/fork_ranks.py). Both were missing: the handler refused
``comm_hook`` (TypeError) and ``lowprec.local_sgd`` did not exist. The same script on Accelerate
1.15 gave the same losses and weights to 5 decimals (no hook, FP16 hook, LocalSGD;
docs/LOG.md, 2026-11-29)."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

from lowprec.kwargs import DDPCommunicationHookType, DistributedDataParallelKwargs
from torchrun_util import run_ranks

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from lowprec import Accelerator
    from lowprec.kwargs import MSAMPRecipeKwargs
    from lowprec.local_sgd import LocalSGD
    from lowprec.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, set_seed

    out_dir = sys.argv[1]
    report = {}

    def run(name, handlers, local_sgd_steps=0, mp="no"):
        set_seed(0)
        acc = Accelerator(cpu=True, kwargs_handlers=handlers, mixed_precision=mp)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
        dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
        try:
            model, opt, dl = acc.prepare(model, opt, dl)
        except ValueError as e:
            report[name] = {"refused": str(e)}
            return
        hooks = [(getattr(h, "__name__", type(h).__name__), type(s).__name__) for h, s in model._comm_hooks]
        weights = []
        local = LocalSGD(accelerator=acc, model=model, local_sgd_steps=local_sgd_steps or 1, enabled=bool(local_sgd_steps))
        with local:
            for xb, yb in dl:
                acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
                opt.step()
                opt.zero_grad()
                local.step()
                weights.append(acc.unwrap_model(model)[0].weight.flatten().tolist())
        report[name] = {"hooks": hooks, "weights": weights}

    run("plain", [])
    run("fp16", [DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)])
    power = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    run("power_sgd", [DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="fp16", comm_state_option=power)])
    run("local_sgd", [], local_sgd_steps=2)
    run("fp8_allreduce", [DistributedDataParallelKwargs(comm_hook="fp16"), MSAMPRecipeKwargs(opt_level="O1")], mp="fp8")
    with open(os.path.join(out_dir, f"rank{int(os.environ['RANK'])}.json"), "w") as f:
        json.dump(report, f)
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("comm_hooks")
    (tmp / "worker.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env.update(PYTHONPATH=os.pathsep.join([src, env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    out = [tmp / f"rank{r}.json" for r in (0, 1)]
    run_ranks(str(tmp / "worker.py"), [str(tmp)], 2, env, lambda: all(p.exists() for p in out), 300)
    return [json.loads(p.read_text()) for p in out]


def test_comm_hooks_are_registered_and_keep_the_processes_equal(ranks):
    r0, r1 = ranks
    assert r0["plain"]["hooks"] == []
    assert r0["fp16"]["hooks"] == [["fp16_compress_hook", "NoneType"]]
    assert r0["power_sgd"]["hooks"] == [["fp16_compress_wrapper_hook", "PowerSGDState"]]
    for name in ("plain", "fp16", "power_sgd"):
        assert r0[name]["weights"] == r1[name]["weights"], name
    # the FP16 hook rounds the all-reduced gradients: another (close) result
    assert r0["fp16"]["weights"] != r0["plain"]["weights"]
    assert max(abs(a - b) for a, b in zip(r0["fp16"]["weights"][-1], r0["plain"]["weights"][-1])) < 1e-2


def test_local_sgd_averages_the_processes_every_k_steps(ranks):
    w0, w1 = ranks[0]["local_sgd"]["weights"], ranks[1]["local_sgd"]["weights"]
    assert len(w0) == 4
    for step, (a, b) in enumerate(zip(w0, w1), start=1):
        assert (a == b) == (step % 2 == 0), step  # apart between averages, equal after each


def test_fp8_allreduce_beside_a_comm_hook_is_one_clear_error(ranks):
    msg = ranks[0]["fp8_allreduce"]["refused"]
    assert "FP8 gradient all-reduce" in msg and "fp16_compress_hook" in msg and "drop comm_hook" in msg


def test_handler_values_are_checked_where_they_are_given():
    assert DistributedDataParallelKwargs(comm_hook="bf16").comm_hook is DDPCommunicationHookType.BF16
    assert "comm_hook" not in DistributedDataParallelKwargs(comm_hook="fp16").to_kwargs()  # not a DDP argument
    with pytest.raises(ValueError, match="comm_hook='fp8'.*'power_sgd'"):
        DistributedDataParallelKwargs(comm_hook="fp8")
    with pytest.raises(ValueError, match="comm_wrapper='power_sgd'"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="power_sgd")
    with pytest.raises(ValueError, match="drop comm_wrapper"):
        DistributedDataParallelKwargs(comm_hook="fp16", comm_wrapper="bf16").register_comm_hook(torch.nn.Linear(1, 1))


def test_local_sgd_is_refused_where_processes_hold_parts_of_the_model():
    from lowprec.local_sgd import LocalSGD

    class Acc:
        distributed_type = __import__("lowprec").DistributedType.FSDP
        num_processes = 2

    with pytest.raises(ValueError, match="use it with DDP"):
        LocalSGD(accelerator=Acc(), model=torch.nn.Linear(1, 1), local_sgd_steps=2)
    Acc.distributed_type = __import__("lowprec").DistributedType.NO
    with LocalSGD(accelerator=Acc(), model=torch.nn.Linear(1, 1), local_sgd_steps=2) as one:  # one process: nothing
        one.step()
    with pytest.raises(ValueError, match="local_sgd_steps=0"):
        LocalSGD(accelerator=Acc(), model=torch.nn.Linear(1, 1), local_sgd_steps=0)
