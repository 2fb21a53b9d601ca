"""Sharded FSDP2 checkpoints (torch.distributed.checkpoint) that change the process count.

A run on 4 CPU processes (gloo) saves a SHARDED_STATE_DICT checkpoint after 3 of 6 steps (FP8
delayed scaling with amax agreement, AdamW) and resumes from it in the same processes
(bitwise); runs on 2 processes and on 1 resume from the same files. The global batch (8) is
kept, so every run sees the same samples at each step; the losses continue within 1e-3
(FSDP2's reduce-scatter sums in another order on another world size, nothing else differs). A run
with another ``amax_history_len`` is refused naming that setting.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.torchrun_util import run_ranks

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from lowprec import Accelerator
    from lowprec.kwargs import FullyShardedDataParallelPlugin, NativeRecipeKwargs
    from lowprec.utils import set_seed

    mode, out_dir = sys.argv[1], sys.argv[2]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    ckpt = os.path.join(out_dir, "ckpt")

    def make():
        set_seed(5)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
        kind = "FULL_STATE_DICT" if mode == "from_plain" else "SHARDED_STATE_DICT"
        plugin = None if mode == "plain" else FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind)
        history = 8 if mode == "longer" else 4  # "longer": a resume with another amax_history_len
        recipe = NativeRecipeKwargs(recipe="delayed", overrides={"amax_history_len": history})
        acc = Accelerator(mixed_precision="fp8", fsdp_plugin=plugin, kwargs_handlers=[recipe])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(48, 16, generator=g)
        y = (x[:, :8] * 2).argmax(1)
        dl = DataLoader(TensorDataset(x, y), batch_size=8 // world, shuffle=False)
        return (acc, *acc.prepare(model, opt, dl))

    def train(acc, model, opt, dl, steps, save_at=None):
        losses = []
        for xb, yb in dl:
            loss = nn.functional.cross_entropy(model(xb), yb)
            acc.backward(loss)
            opt.step(); opt.zero_grad()
            losses.append(acc.reduce(loss.detach(), "mean").item())
            if len(losses) == save_at:
                acc.save_state(ckpt)
            if len(losses) == steps:
                break
        return losses

    report = {}
    if mode in ("save", "plain"):
        report["losses"] = train(*make(), 6, save_at=3)
    acc, model, opt, dl = make()
    if mode == "longer":
        from lowprec.errors import CheckpointError

        try:
            acc.load_state(ckpt)
        except CheckpointError as e:
            report["refused"] = str(e)
        with open(os.path.join(out_dir, f"{mode}_rank{rank}.json"), "w") as f:
            json.dump(report, f)
        sys.exit(0)
    acc.load_state(ckpt)
    moments = [getattr(opt, "optimizer", opt).state[p]["exp_avg"] for p in model.parameters()]
    report["moments"] = [float(getattr(m, "full_tensor", lambda: m)().sum()) for m in moments]  # whole, in order
    report["resumed"] = train(acc, model, opt, dl, 3)
    report["files"] = sorted(os.listdir(ckpt))
    with open(os.path.join(out_dir, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    acc.end_training()
    """
)


def launch(tmp_path, mode: str, nproc: int, worker: str = WORKER, fsdp_env: bool = True) -> dict:
    """Run ``worker`` on ``nproc`` processes; returns the JSON its rank 0 wrote (``<mode>_rank0.json``)."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env.update(PYTHONPATH=os.pathsep.join([src, env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    if fsdp_env:
        env.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    # ranks forked after one torch import, without torchrun (tests/fork_ranks.py)
    run_ranks(str(script), [mode, str(tmp_path)], nproc, env, lambda: (tmp_path / f"{mode}_rank0.json").exists())
    return json.loads((tmp_path / f"{mode}_rank0.json").read_text())


def test_sharded_checkpoint_reshards_4_to_2_to_1(tmp_path):
    saved = launch(tmp_path, "save", 4)
    assert saved["resumed"] == saved["losses"][3:]  # same world size: bitwise
    assert "sharded_0" in saved["files"] and "model_0.safetensors" not in saved["files"]
    for mode, nproc in (("two", 2), ("one", 1)):
        resumed = launch(tmp_path, mode, nproc)["resumed"]
        assert max(abs(a - b) for a, b in zip(resumed, saved["losses"][3:])) < 1e-3, (mode, resumed, saved)
    # the sharded reader checks the histories' length too: one line naming the setting
    refused = launch(tmp_path, "longer", 1).get("refused", "")
    assert "amax histories are 4 long" in refused and "amax_history_len=4" in refused, refused


def test_a_checkpoint_of_one_plain_process_resumes_under_fsdp2(tmp_path):
    """save_state on one process without FSDP (the optimizer file keys states by parameter index,
    ``Optimizer.state_dict``'s numbering) and load_state on 2 FSDP2 processes (which key them by
    parameter name): the indices map to names in the order the optimizer's param_groups list the
    parameters, each process takes its shards: every parameter's AdamW moment, gathered, is the
    one the plain run loads, and the losses continue the uninterrupted run within 3e-3 (measured
    1.2e-3 at loss ~2: FSDP2 computes in bf16). Was: KeyError 'state.0.step' on every rank."""
    saved = launch(tmp_path, "plain", 1, fsdp_env=False)
    assert "model_0.safetensors" in saved["files"] and "sharded_0" not in saved["files"]
    fsdp = launch(tmp_path, "from_plain", 2)
    assert fsdp["moments"] == pytest.approx(saved["moments"], rel=1e-6)
    assert max(abs(a - b) for a, b in zip(fsdp["resumed"], saved["losses"][3:])) < 3e-3, (fsdp, saved)


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    # DCP reads .metadata with pickle.load; lowprec's reader builds DCP's metadata classes only
    import pickle

    from lowprec.checkpoint.sharded import SafeFileSystemReader
    from lowprec.errors import CheckpointError

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "ran"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="not DCP metadata.*system"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not (tmp_path / "ran").exists()
