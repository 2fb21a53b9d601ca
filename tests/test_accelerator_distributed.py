"""The Accelerator under torchrun with 2 CPU processes (gloo): DDP and FSDP2.

One launch per distributed type (DDP, FSDP2, DeepSpeed ZeRO-3 when installed) runs every check (launches dominate the cost). Each rank writes
what it saw to a JSON file; the assertions are made here. Checks: the user's recipe reaches every
FP8 layer and the FP8 region is entered on that path (Accelerate loses the TE recipe under FSDP2
and DeepSpeed: bugs 2 and 3), the optimizer holds the final (sharded) parameters, gather_for_metrics
drops padding, and save_state/load_state resumes with identical losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.torchrun_util import free_port, run_torchrun

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lowprec.fp8 as fp8
    from lowprec import Accelerator
    from lowprec.utils import MSAMPRecipeKwargs, TERecipeKwargs, set_seed

    mode, out_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])

    def make():
        set_seed(11)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
        # FSDP2 and DeepSpeed come from the launch contract's variables (see launch() below)
        plugin, ds = None, None
        recipe = (MSAMPRecipeKwargs(opt_level="O2") if mode == "ddp_o2"
                  else TERecipeKwargs(amax_history_len=8, amax_compute_algo="max", margin=1))
        acc = Accelerator(mixed_precision="fp8", fsdp_plugin=plugin, deepspeed_plugin=ds, kwargs_handlers=[recipe])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(40, 32, generator=g)
        y = (x[:, :16] * 3).argmax(1)
        dl = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
        model, opt, dl = acc.prepare(model, opt, dl)
        return acc, model, opt, dl, y

    def train(acc, model, opt, dl, steps, save_at=None, path=None):
        losses, done = [], 0
        while done < steps:
            for xb, yb in dl:
                loss = nn.functional.cross_entropy(model(xb), yb)
                acc.backward(loss)
                acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step(); opt.zero_grad()
                losses.append(acc.reduce(loss.detach(), "mean").item())
                done += 1
                if done == save_at:
                    acc.save_state(path)
                if done == steps:
                    break
        return losses

    acc, model, opt, dl, labels = make()
    report = {"distributed_type": acc.distributed_type, "num_processes": acc.num_processes}
    inner = acc.unwrap_model(model)
    layers = [m for m in inner.modules() if isinstance(m, fp8.Float8Linear)]
    report["recipes"] = [(m.recipe.scaling, m.recipe.amax_history_len, m.recipe.amax_compute_algo, m.recipe.margin)
                         for m in layers]
    region = []
    for m in layers:
        m.register_forward_hook(lambda mod, i, o: region.append(fp8.fp8_enabled()))
    report["opt_is_model"] = mode.startswith("zero") or ({id(p) for g in opt.param_groups for p in g["params"]}
                                                         == {id(p) for p in model.parameters()})
    report["param_types"] = sorted({type(p.data).__name__ for p in model.parameters()})
    report["optimizer"] = type(getattr(opt, "optimizer", opt)).__name__
    report["zero_stage"] = model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None
    report["fp8_allreduce"] = getattr(model, "lowprec_fp8_allreduce", None) is not None

    path = os.path.join(out_dir, "ckpt")
    report["losses"] = train(acc, model, opt, dl, 14, save_at=8, path=path)
    report["fp8_region"] = sorted(set(region))

    # gather_for_metrics: 40 samples / (4 x 2) per step -> padding-free; use 36 to force padding
    eval_dl = acc.prepare(DataLoader(TensorDataset(torch.arange(36)), batch_size=4))
    seen = torch.cat([acc.gather_for_metrics(b[0]) for b in eval_dl])
    report["gathered"] = seen.tolist()

    acc.save_model(model, os.path.join(out_dir, "plain"))

    acc2, model2, opt2, dl2, _ = make()
    acc2.load_state(path)
    report["resumed"] = train(acc2, model2, opt2, dl2, 6)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    acc2.end_training()
    """
)


def launch(tmp_path, mode: str) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["DS_ACCELERATOR"] = "cpu"
    # what `lowprec launch --use_fsdp` / `--use_deepspeed --zero_stage 3` export
    if mode == "fsdp2":
        env.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    if mode.startswith("zero"):
        env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE=mode[-1])
    cmd = [
        sys.executable,
        "-m",
        "lowprec.cli._torchrun",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "lowprec.cli._worker",
        str(script),
        mode,
        str(tmp_path),
    ]
    run_torchrun(cmd, lambda p: all((tmp_path / f"rank{r}.json").exists() for r in range(2)), env=env, timeout=180)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


@pytest.mark.parametrize(
    "mode, dtype",
    [
        ("ddp", "MULTI_CPU"),
        ("fsdp2", "FSDP"),
        ("ddp_o2", "MULTI_CPU"),
        pytest.param(
            "zero3", "DEEPSPEED", marks=pytest.mark.skipif(not has_deepspeed(), reason="DeepSpeed is an optional extra")
        ),
    ],
)
def test_distributed_path(tmp_path, mode, dtype):
    reports = launch(tmp_path, mode)
    for rep in reports:
        assert rep["distributed_type"] == dtype and rep["num_processes"] == 2
        # the recipe reaches every FP8 layer (the first and last included, TE's rule) ...
        expected = ["delayed", 1024, "max", 0] if mode == "ddp_o2" else ["delayed", 8, "max", 1]
        assert rep["recipes"] == [expected] * 3
        if mode == "ddp_o2":  # MS-AMP O2 on lowprec: FP8/FP16 Adam state, FP8 gradient all-reduce
            assert rep["optimizer"] == "FP8AdamW" and rep["fp8_allreduce"]
        # ... and the FP8 region is entered on this path
        assert rep["fp8_region"] == [True]
        assert rep["opt_is_model"]
        assert rep["gathered"] == list(range(36))
        # resumed from step 8: identical losses for steps 9-14
        assert rep["resumed"] == rep["losses"][8:]
    assert reports[0]["losses"] == reports[1]["losses"]
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]
    if mode == "fsdp2":
        assert reports[0]["param_types"] == ["DTensor"]
    if mode == "zero3":
        assert reports[0]["zero_stage"] == 3
    plain = os.listdir(tmp_path / "plain")
    assert plain == ["model.safetensors"]
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "plain" / "model.safetensors")))
    assert keys == {f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")}


ONE_PROCESS_DS = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from lowprec import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = DataLoader(TensorDataset(torch.randn(32, 16), torch.randn(32, 16)), batch_size=8)
    model, opt, dl = acc.prepare(model, opt, dl)
    losses = []
    for xb, yb in dl:
        loss = nn.functional.mse_loss(model(xb).float(), yb)
        acc.backward(loss); opt.step(); opt.zero_grad()
        losses.append(loss.item())
    report = {"distributed_type": str(acc.distributed_type), "num_processes": acc.num_processes,
              "zero_stage": model.zero_optimization_stage(), "losses": losses}
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
    acc.end_training()
    """
)


@pytest.mark.skipif(not has_deepspeed(), reason="DeepSpeed is an optional extra")
def test_lowprec_launch_runs_deepspeed_on_one_process(tmp_path):
    """``lowprec launch --mixed_precision fp8 --use_deepspeed --zero_stage 2 script.py`` without
    --num_processes ended in DeepSpeed's ``AssertionError: DeepSpeed requires the LOCAL_RANK
    environment variable``, exit 1: the launch now exports what torchrun would for one process
    (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT) and the
    script trains under ZeRO-2 on one process."""
    script = tmp_path / "one.py"
    script.write_text(ONE_PROCESS_DS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    env = {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env.update(PYTHONPATH=src, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", LOWPREC_CONFIG_HOME=str(tmp_path / "home"))
    launch = [sys.executable, "-m", "lowprec.cli.main", "launch", "--mixed_precision", "fp8", "--use_deepspeed"]
    launch += ["--zero_stage", "2"]
    proc = subprocess.run([*launch, str(script), str(tmp_path / "r.json")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["distributed_type"].endswith("DEEPSPEED") and report["num_processes"] == 1
    assert report["zero_stage"] == 2 and len(report["losses"]) == 4
    dry = subprocess.run([*launch, "--dry_run", str(script)], env=env, capture_output=True, text=True).stdout
    for line in ("RANK=0", "LOCAL_RANK=0", "WORLD_SIZE=1", "LOCAL_WORLD_SIZE=1", "MASTER_ADDR=127.0.0.1"):
        assert f"export {line}\n" in dry, dry
    assert "export MASTER_PORT=" in dry
