"""One rank of tests/test_zero3_saved_weights.py's 2-process check: trains bf16 and, per recipe,
``force_recompute_fp8_weight_in_bwd`` auto and off under ZeRO-3 (other data on each rank) and
writes what it saw to ``OUT_DIR/rank<R>.json``."""

import json
import os
import sys

import torch

from tests.test_zero3_saved_weights import _train

out_dir = sys.argv[1]
rank = int(os.environ["RANK"])
seed = 1 + rank  # other data on each rank
report = {"bf16_held": _train(None, data_seed=seed)["held"], "world": int(os.environ["WORLD_SIZE"])}
for recipe in ("delayed", "tensorwise", "nvfp4"):
    auto, off = _train(recipe, data_seed=seed), _train(recipe, recompute=False, data_seed=seed)
    report["partition_numel"] = auto["partitions"][0].numel()
    same = all(torch.equal(a, b) for a, b in zip(auto["partitions"], off["partitions"]))
    report[recipe] = {
        "auto": {"held": auto["held"], "losses": auto["losses"]},
        "off": {"held": off["held"], "losses": off["losses"]},
        "same_partitions": same,
    }
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
