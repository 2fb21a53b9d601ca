"""Stress: N consecutive 2-process ``lowprec launch --cpu --num_processes 2`` runs (not in CI).

    python benchmarks/stress/launch_stress.py --launches 200 --out benchmarks/results/launch_stress.json

Each launch runs benchmarks/stress/tiny_accelerator.py (an Accelerator script: prepare, four
steps, end_training, one JSON per rank). A launch fails when it exits non-zero or leaves a rank's
JSON missing; an exit 0 that printed lowprec's "killed by SIGABRT ... after the work finished"
warning is counted apart (the torch/gloo exit race, docs/LOG.md, "abort" (2026-11-26)). The JSON is rewritten
after every launch, so a stopped run still leaves its count. ``--worker_exit finalize`` sets
LOWPREC_WORKER_EXIT=finalize (ordinary interpreter exit: the race can fire, the marker decides).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "tiny_accelerator.py")
WARNING = "killed by SIGABRT at interpreter exit, after the work finished"


def launch(extra_flags: list[str], env: dict) -> dict:
    out = tempfile.mkdtemp(prefix="lowprec-stress-")
    cmd = [
        sys.executable,
        "-m",
        "lowprec.cli.main",
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        *extra_flags,
        SCRIPT,
        out,
    ]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", str(e.stderr or "")
    outputs = all(os.path.exists(os.path.join(out, f"rank{r}.json")) for r in (0, 1))
    shutil.rmtree(out, ignore_errors=True)
    lines = [ln for ln in err.splitlines() if ln.startswith("lowprec:")]
    return {
        "rc": rc,
        "outputs": outputs,
        "abort_warning": WARNING in err,
        "s": round(time.monotonic() - t0, 1),
        "lowprec_lines": lines,
        "terminate_seen": "terminate called" in err,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--fsdp2", action="store_true", help="--use_fsdp --fsdp_version 2 instead of DDP")
    ap.add_argument("--worker_exit", choices=["fast", "finalize"], default="fast")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", LOWPREC_WORKER_EXIT=args.worker_exit)
    flags = ["--use_fsdp", "--fsdp_version", "2"] if args.fsdp2 else []
    import torch

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = []
    for i in range(args.launches):
        r = launch(flags, env)
        runs.append(r)
        failed = [x for x in runs if x["rc"] != 0 or not x["outputs"]]
        summary = {
            "command": f"lowprec launch --cpu --num_processes 2 {' '.join(flags)} benchmarks/stress/tiny_accelerator.py OUT",
            "date": f"{started} - {time.strftime('%H:%M UTC', time.gmtime())}",
            "torch": torch.__version__,
            "device": "cpu",
            "worker_exit": args.worker_exit,
            "launches_planned": args.launches,
            "launches_done": len(runs),
            "failures": len(failed),
            "exit0_with_abort_warning": sum(x["abort_warning"] for x in runs),
            "terminate_seen": sum(x["terminate_seen"] for x in runs),
            "mean_s": round(sum(x["s"] for x in runs) / len(runs), 1),
            "failed_runs": [dict(x, index=j) for j, x in enumerate(runs) if x["rc"] != 0 or not x["outputs"]],
        }
        with open(args.out + ".tmp", "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
        print(
            f"{i}: rc={r['rc']} outputs={r['outputs']} warning={r['abort_warning']} {r['s']}s "
            f"(failures so far {len(failed)})",
            flush=True,
        )


if __name__ == "__main__":
    main()
