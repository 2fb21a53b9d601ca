"""``Accelerator.join_uneven_inputs`` over 2 CPU processes (gloo, DDP; ranks forked after one torch
import, tests/fork_ranks.py): 5 batches of one sample, ``even_batches=False``, so rank 0 runs 3
steps and rank 1 runs 2. Inside the block the process that runs out of batches shadows DDP's
collectives (torch's ``Join``); any other per-step collective mismatches them. The non-finite
guard's all-reduce at each optimizer step was one: gloo aborted the job (``Received data size
doesn't match expected size``) on every use. The guard now decides without a collective there
(DDP leaves the same gradients everywhere; a non-finite loss reaches them as NaN), so the job ends,
both processes hold the same weights, and a step whose loss is inf on one process is skipped on
every process."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from torchrun_util import run_ranks

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from lowprec import Accelerator, DataLoaderConfiguration

    out_dir, mp = sys.argv[1], sys.argv[2]
    cfg = DataLoaderConfiguration(even_batches=False)
    acc = Accelerator(cpu=True, mixed_precision=mp, dataloader_config=cfg)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.full((16,), float(i)), torch.tensor([float(i)])) for i in range(5)]
    model, opt, dl = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=1))
    seen = []
    with acc.join_uneven_inputs([model]):
        for x, y in dl:
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            if float(y) == 2.0:  # rank 0's second batch: rank 1's step alongside must skip too
                loss = loss + float("inf")
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            seen.append([float(y), opt.step_was_skipped])
    w = torch.cat([p.detach().float().flatten() for p in acc.unwrap_model(model).parameters()])
    report = {"seen": seen, "w": w.tolist(), "agree_after": acc.nonfinite.ranks_agree}
    with open(os.path.join(out_dir, f"{mp}_rank{acc.process_index}.json"), "w") as f:
        json.dump(report, f)
    acc.end_training()
    """
)


@pytest.mark.parametrize("mixed_precision", ["no", "fp8"])
def test_join_uneven_inputs_under_ddp_runs_every_batch_and_keeps_the_processes_equal(tmp_path, mixed_precision):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env.update(PYTHONPATH=os.pathsep.join([src, env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    out = [tmp_path / f"{mixed_precision}_rank{r}.json" for r in (0, 1)]
    run_ranks(str(script), [str(tmp_path), mixed_precision], 2, env, lambda: all(p.exists() for p in out), 240)
    r0, r1 = (json.loads(p.read_text()) for p in out)
    assert r0["seen"] == [[0.0, False], [2.0, True], [4.0, False]]
    assert r1["seen"] == [[1.0, False], [3.0, True]]
    assert r0["w"] == r1["w"]
    assert not r0["agree_after"]  # the guard all-reduces again after the block
