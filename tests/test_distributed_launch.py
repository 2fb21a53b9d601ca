"""Several machines: two torchrun "nodes" on this machine, each started by
``lowprec launch --num_machines 2 --machine_rank R`` with the rendezvous on 127.0.0.1.

Each node runs one process; they must find each other (static rendezvous on the main process's
address and port), get global ranks 0 and 1 of a world of 2, and complete a gloo all-reduce
across the two nodes (tests/scripts/report_launch_env.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.torchrun_util import free_port

SCRIPT = str(Path(__file__).parent / "scripts" / "report_launch_env.py")


def _launch_nodes(out: Path) -> list[subprocess.CompletedProcess]:
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    src = str(Path(__file__).resolve().parent.parent / "src")
    env.update(PYTHONPATH=os.pathsep.join([src, env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lowprec.cli.main",
                "launch",
                "--cpu",
                "--num_processes",
                "2",
                "--num_machines",
                "2",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
                "--mixed_precision",
                "fp8",
                SCRIPT,
                str(out),
                f"node{rank}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    done = []
    for p in nodes:
        stdout, stderr = p.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


def test_two_nodes_through_lowprec_launch(tmp_path):
    procs = _launch_nodes(tmp_path)
    for p in procs:  # an exit-time abort after the work is done is the launcher's to report (exit 0)
        assert p.returncode == 0, p.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world_size"] == 2 for r in reports)
    assert all(r["all_reduce_sum"] == 3.0 for r in reports)  # 1 + 2: the collective crossed the nodes
    # node R's one process is global rank R; each got the same launch contract
    assert [r["argv"] for r in reports] == [["node0"], ["node1"]]
    # the ACCELERATE_* contract is the same on both nodes (LOWPREC_* hold per-node paths and commands)
    same = [{k: v for k, v in r["env"].items() if k.startswith("ACCELERATE_")} for r in reports]
    assert same[0] == same[1] and len(same[0]) > 1
    assert reports[0]["env"]["ACCELERATE_MIXED_PRECISION"] == "fp8"
