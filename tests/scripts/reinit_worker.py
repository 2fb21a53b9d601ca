"""Worker for test_accelerator_reinit.py: create an Accelerator, end training, create another,
CYCLES times, with the processes arriving at each new group at different times (the order that
used to read the other process's old gloo address). Writes rank<r>.json when done."""

import json
import os
import sys
import time

import torch

from lowprec import Accelerator

CYCLES = 6
out = sys.argv[1]
sums = []
for i in range(CYCLES):
    acc = Accelerator(cpu=True)
    sums.append(acc.reduce(torch.ones(1) * (acc.process_index + 1), "sum").item())
    acc.end_training()
    if acc.process_index == i % 2:  # the other process reaches the next rendezvous first
        time.sleep(0.3)
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump({"sums": sums, "num_processes": acc.num_processes}, f)
