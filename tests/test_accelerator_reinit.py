"""A new Accelerator after ``end_training`` under ``lowprec launch`` (issue 12); the same launch
checks ``DataLoaderDispatcher`` on 2 processes (one launch for both: launches dominate the cost).

``end_training`` destroys the process group; the next Accelerator creates a new one through
the launcher's store, where the old group's rendezvous keys remain. Before
``lowprec.state.process_group`` gave every later group its own key prefix, a process arriving first
read the other's old gloo address: "Connection refused" or a hang (measured: 2 processes,
12 cycles, failed in the first run; the accelerate_causal_lm example with end_training between
its runs hung once in four).
"""

from __future__ import annotations

import json
import os
import sys

from tests.torchrun_util import run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_accelerator_after_end_training_under_launch(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    env.update(PYTHONPATH=os.path.join(ROOT, "src"), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "lowprec.cli.main",
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        os.path.join(ROOT, "tests", "scripts", "reinit_worker.py"),
        str(tmp_path),
    ]
    run_torchrun(cmd, lambda p: all((tmp_path / f"rank{r}.json").exists() for r in range(2)), env=env, timeout=240)
    for r in range(2):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert report["sums"] == [3.0] * 6 and report["num_processes"] == 2
        # dispatch_batches (Accelerate's default for an IterableDataset on several processes):
        # process 0 reads 3 batches of 3 (the last one of 1) and deals them out; the last step's
        # 1 sample and 1 of the epoch's first make two equal halves (Accelerate's batches, checked
        # against Accelerate 1.15 on 2 CPU processes), and gather_for_metrics drops the filling.
        # Was: [6] on process 0, [0, 1, 2] on process 1, and gloo aborted in gather_for_metrics.
        d = report["dispatch"]
        assert d["type"] == "DataLoaderDispatcher" and d["len"] == 2
        assert d["seen"] == ([[0, 1, 2], [6]] if r == 0 else [[3, 4, 5], [0]])
        assert d["gathered"] == [float(v) for v in range(7)]
