"""One rank of tests/test_msamp_deepspeed.py: MS-AMP O2 (lowprec's FP8AdamW) under DeepSpeed ZeRO.

Usage (under torchrun, DS_ACCELERATOR=cpu): ``msamp_deepspeed_worker.py STAGE OUT_DIR``.
Trains a small MLP through ``lowprec.Accelerator`` with ``MSAMPRecipeKwargs(opt_level="O2")``
and ``DeepSpeedPlugin(zero_stage=STAGE)``, saves at step ``SAVE_AT``, resumes in a fresh
Accelerator and writes what it saw (losses, the optimizer DeepSpeed steps, its state dtypes)
to ``OUT_DIR/rank{r}.json``; the test makes the assertions.

Every rank gets the same batches. Why: ZeRO-1/2 checkpoints hold rank 0's module buffers only,
and the FP8 scaling state (amax histories) lives in buffers that DeepSpeed does not keep in step
across ranks; with per-rank data, rank 1 would resume with rank 0's scales (docs/LOG.md, dsopt entry).
Identical data keeps those buffers identical, so the resume check isolates the optimizer state.
"""

import json
import os
import sys

import torch
from torch import nn

from lowprec import Accelerator
from lowprec.optim import block_segments
from lowprec.utils import DeepSpeedPlugin, MSAMPRecipeKwargs, set_seed

STEPS, SAVE_AT = 12, 7
MAX_NORM = 0.5


def make(stage: int):
    set_seed(5)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    acc = Accelerator(
        mixed_precision="fp8",
        deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage),
        kwargs_handlers=[MSAMPRecipeKwargs(opt_level="O2")],
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def batches():
    """Two fixed batches, cycled: the loss falls clearly within a dozen steps."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 32, generator=g).repeat(STEPS // 2 + 1, 1, 1)
    return x, (x[..., :16] * 3).argmax(-1)


def train(acc, model, opt, start, stop, path=None, norms=None):
    xs, ys = batches()
    losses = []
    for step in range(start, stop):
        loss = nn.functional.cross_entropy(model(xs[step]), ys[step])
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), MAX_NORM)  # DeepSpeed clips the partitions FP8AdamW reads
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if norms is not None:  # the norm before clipping, as DeepSpeed computed it in its step
            norms.append(float(model.get_global_grad_norm()))
        if step + 1 == SAVE_AT and path is not None:
            acc.save_state(path)
    return losses


def describe(model) -> dict:
    """What DeepSpeed actually steps: its ZeRO optimizer wraps ours (``.optimizer``)."""
    client = model.optimizer.optimizer
    states = [st for st in client.state.values() if st]
    return {
        "zero_stage": model.zero_optimization_stage(),
        "ds_optimizer": type(model.optimizer).__name__,
        "client_optimizer": type(client).__name__,
        # ZeRO-3 puts each flat partition into param_groups only for the duration of its step
        "state_param_dims": sorted({p.dim() for p in client.state}),
        "state_param_dtypes": sorted({str(p.dtype) for p in client.state}),
        "state_dtypes": sorted(
            {f"{k}:{v.dtype}" for st in states for k, v in st.items() if isinstance(v, torch.Tensor)}
        ),
        "state_elems": sum(st["exp_avg"].numel() for st in states),
        "state_bytes": sum(
            v.numel() * v.element_size() for st in states for v in st.values() if isinstance(v, torch.Tensor)
        ),
        "model_param_dtypes": sorted({str(p.dtype) for p in model.module.parameters()}),
        "segments": [list(block_segments(p) or ()) for p in client.state],
        "model_numel": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.module.parameters()),
    }


def main() -> None:
    stage, out_dir = int(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    acc, model, opt = make(stage)
    path = os.path.join(out_dir, "ckpt")
    report = {
        "distributed_type": str(acc.distributed_type),
        "num_processes": acc.num_processes,
        "backend_info": {k: str(v) for k, v in acc.fp8_backend_info.items() if k != "recipe"},
    }
    report["grad_norms"] = []
    report["losses"] = train(acc, model, opt, 0, STEPS, path=path, norms=report["grad_norms"])
    report.update(describe(model))
    acc2, model2, opt2 = make(stage)
    acc2.load_state(path)
    report["resumed"] = train(acc2, model2, opt2, SAVE_AT, STEPS)
    report["resumed_state_dtypes"] = describe(model2)["state_dtypes"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    acc2.end_training()


if __name__ == "__main__":
    main()
