"""Worker for test_accelerator_reinit.py: create an Accelerator, end training, create another,
CYCLES times, with the processes arriving at each new group at different times (the order that
used to read the other process's old gloo address). The first Accelerator also reads an
IterableDataset (dispatched from process 0: a stream cannot be sharded by index). Writes
rank<r>.json when done."""

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, IterableDataset

from lowprec import Accelerator


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(7.0).view(7, 1))

    def __len__(self):
        return 7


CYCLES = 6
out = sys.argv[1]
sums = []
for i in range(CYCLES):
    acc = Accelerator(cpu=True)
    if i == 0:
        loader = acc.prepare(DataLoader(Stream(), batch_size=3))
        seen, gathered = [], []
        for x in loader:
            seen.append(x.view(-1).tolist())
            gathered += acc.gather_for_metrics(x).view(-1).tolist()
        dispatch = {"type": type(loader).__name__, "len": len(loader), "seen": seen, "gathered": gathered}
    sums.append(acc.reduce(torch.ones(1) * (acc.process_index + 1), "sum").item())
    acc.end_training()
    if acc.process_index == i % 2:  # the other process reaches the next rendezvous first
        time.sleep(0.3)
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump({"sums": sums, "num_processes": acc.num_processes, "dispatch": dispatch}, f)
