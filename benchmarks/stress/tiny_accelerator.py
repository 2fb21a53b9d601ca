"""A small Accelerator script for the launch stress test (benchmarks/stress/launch_stress.py).

    lowprec launch --cpu --num_processes 2 benchmarks/stress/tiny_accelerator.py OUT_DIR

Four steps of a tiny MLP through ``Accelerator.prepare`` (DDP on gloo under the launcher, or
FSDP2 with ``--use_fsdp --fsdp_version 2``), ``end_training``, then each rank writes
``OUT_DIR/rank<R>.json`` with its last loss: the output the run must leave behind.
"""

import json
import os
import sys

import torch

from lowprec import Accelerator

out_dir = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
accelerator = Accelerator()
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(4):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step + 100 * accelerator.process_index))
    loss = model(x).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
last = accelerator.reduce(loss.detach(), "mean").item()
rank = accelerator.process_index
accelerator.end_training()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "loss": last}, f)
