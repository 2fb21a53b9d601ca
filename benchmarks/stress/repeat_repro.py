"""Run the exit-abort reproducer N times per mode and count the exits (not in CI).

    python benchmarks/stress/repeat_repro.py --runs 20 --modes fsdp2 nowait nowait+os_exit [--out results.json]

Each run: ``python -m torch.distributed.run --standalone --nproc_per_node 2
benchmarks/stress/gloo_exit_abort.py --mode M`` with OMP_NUM_THREADS=1 and
PYTHONFAULTHANDLER=1 (a SIGABRT prints every Python thread's stack). Records each run's exit
code, whether both ranks printed "done", and whether "terminate called" appeared.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def one(mode: str, extra_env: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **extra_env)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(HERE, "gloo_exit_abort.py"),
        "--mode",
        mode.split("+")[0],
    ]
    cmd += ["--os_exit"] if mode.endswith("+os_exit") else []
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = p.stdout + p.stderr
    return {
        "rc": p.returncode,
        "done": out.count(" done"),
        "terminate": "terminate called" in out,
        "s": round(time.monotonic() - t0, 1),
        "tail": out[-1500:] if p.returncode else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--modes", nargs="+", default=["fsdp2"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    for mode in args.modes:
        runs = []
        for i in range(args.runs):
            r = one(mode, {})
            runs.append(r)
            print(f"{mode} {i}: rc={r['rc']} done={r['done']} terminate={r['terminate']} {r['s']}s", flush=True)
            if r["rc"]:
                print(r["tail"], flush=True)
        results[mode] = {
            "runs": len(runs),
            "failed": sum(r["rc"] != 0 for r in runs),
            "aborted_after_done": sum(r["rc"] != 0 and r["done"] == 2 for r in runs),
            "details": runs,
        }
        print(mode, {k: v for k, v in results[mode].items() if k != "details"}, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
