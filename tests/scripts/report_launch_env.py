"""Test helper run by `lowprec launch`: records what a training process receives.

Usage: report_launch_env.py OUT_DIR [any args...]. Writes OUT_DIR/rank<RANK>.json with the
launch variables, argv and the sum of ranks over a gloo all_reduce when WORLD_SIZE > 1.
If argv contains ``--exit-with N`` the process exits with code N afterwards.
"""

import json
import os
import sys

out_dir, args = sys.argv[1], sys.argv[2:]
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
report = {
    "rank": rank,
    "world_size": world,
    "argv": args,
    "env": {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))},
}
if world > 1:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    report["all_reduce_sum"] = t.item()
    dist.destroy_process_group()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
if "--exit-with" in args:
    sys.exit(int(args[args.index("--exit-with") + 1]))
