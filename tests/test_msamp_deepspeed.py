"""MS-AMP opt levels (lowprec's native O1/O2) under DeepSpeed ZeRO: what composes, what errors.

* O2 + ZeRO 1, 2, 3: the client optimizer DeepSpeed wraps is lowprec.optim.FP8AdamW, stepped on
  ZeRO's flat fp32 partitions. Checked in 2-process torchrun launches (gloo, DS_ACCELERATOR=cpu,
  tests/scripts/msamp_deepspeed_worker.py): the loss falls, the state is FP8/FP16 and
  partitioned, and save_state/load_state resumes with identical losses.
* Flat partitions cost FP8AdamW nothing once the glue marks where each parameter starts
  (blocks restart there): checked in-process against per-parameter FP8AdamW, including the
  case unmarked blocks get wrong (a small parameter next to one 1e5x larger).
* O1 under DeepSpeed, other optimizers under O2, elastic checkpoints: one ValueError each.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch import nn

from lowprec import Accelerator
from lowprec.optim import FP8AdamW, set_block_segments
from lowprec.utils import DeepSpeedPlugin, MSAMPRecipeKwargs
from lowprec.utils.deepspeed import _overlaps, check_client_optimizer
from tests.torchrun_util import free_port, run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "scripts", "msamp_deepspeed_worker.py")
SAVE_AT = 7  # the worker's
ENV = [
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_FP8_BACKEND",
    "ACCELERATE_FP8_OPT_LEVEL",
    "LOWPREC_FP8_RECIPE",
    "LOWPREC_FP8_FALLBACK",
    "WORLD_SIZE",
    "RANK",
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "ACCELERATE_USE_CPU",
]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def launch(tmp_path, stage: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_", "FSDP_"))}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
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
        WORKER,
        str(stage),
        str(tmp_path),
    ]
    run_torchrun(cmd, lambda p: all((tmp_path / f"rank{r}.json").exists() for r in range(2)), env=env, timeout=180)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


# ---------------------------------------------------------------------- O2 composes with ZeRO
@pytest.mark.parametrize(
    "stage, ds_optimizer",
    [
        (1, "DeepSpeedZeroOptimizer"),
        (2, "DeepSpeedZeroOptimizer"),
        (3, "DeepSpeedZeroOptimizer_Stage3"),
    ],
)
def test_o2_trains_under_zero_with_fp8_state_and_exact_resume(tmp_path, stage, ds_optimizer):
    reports = launch(tmp_path, stage)
    for rep in reports:
        assert rep["distributed_type"] == "DEEPSPEED" and rep["num_processes"] == 2
        assert rep["zero_stage"] == stage and rep["ds_optimizer"] == ds_optimizer
        # DeepSpeed steps our optimizer, on its flat fp32 partitions (no extra fp32 master copy)
        assert rep["client_optimizer"] == "FP8AdamW"
        assert rep["state_param_dims"] == [1] and rep["state_param_dtypes"] == ["torch.float32"]
        assert rep["model_param_dtypes"] == ["torch.bfloat16"]
        assert rep["state_dtypes"] == [
            "exp_avg:torch.float8_e4m3fn",
            "exp_avg_scale:torch.float32",
            "exp_avg_sq:torch.float16",
            "exp_avg_sq_scale:torch.float32",
            "step:torch.float32",
        ]
        # partitioned: each rank holds part of the state, 3 bytes + block scales per element (AdamW: 8)
        assert 0 < rep["state_elems"] < rep["model_numel"]
        assert rep["state_bytes"] / rep["state_elems"] < 3.1
        # the FP8 blocks restart at every model parameter inside the partition
        assert len(rep["segments"]) == 1 and len(rep["segments"][0]) >= 3
        assert sum(rep["segments"][0]) == rep["state_elems"]
        assert rep["backend_info"]["applied"] == "True" and "DeepSpeed" in rep["backend_info"]["gradients"]
        # trains (with accelerator.clip_grad_norm_(.., 0.5) binding: DeepSpeed clips the fp32
        # partitions before FP8AdamW reads them), and resumes from step SAVE_AT with identical
        # losses and the same state dtypes
        assert max(rep["grad_norms"]) > 0.5
        assert rep["losses"][-1] < 0.5 * rep["losses"][0]
        assert rep["resumed"] == rep["losses"][SAVE_AT:]
        assert rep["resumed_state_dtypes"] == rep["state_dtypes"]
    assert reports[0]["losses"] == reports[1]["losses"]
    assert sum(r["state_elems"] for r in reports) >= reports[0]["model_numel"]


# ------------------------------------------------------------- FP8AdamW on flat partitions
def _update_sqnr_per_param(
    flat_parts: int | None, seed: int, sizes=(1.0, 1e-2, 1e-3, 0.3), segments: bool = True, steps: int = 30
) -> list[float]:
    """Per-parameter update SQNR (dB, mean of the last 5 steps) of FP8AdamW against fp32 AdamW
    fed the same gradients. ``flat_parts``: None steps each parameter on its own, else the
    parameters are concatenated and split into that many flat partitions, as ZeRO does, with
    the parameter boundaries marked (``segments``) as lowprec's DeepSpeed glue marks them.
    ``sizes``: gradient size of each parameter (the first also has rows 1e2 apart)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 80), (80,), (200, 24), (33,)]
    sizes_n = [int(torch.tensor(s).prod()) for s in shapes]
    total = sum(sizes_n)
    w = torch.randn(total, generator=g) * 0.1
    if flat_parts is None:
        params = [nn.Parameter(t.clone()) for t in w.split(sizes_n)]
    else:
        edge = -(-total // flat_parts)  # not a multiple of the block size: blocks straddle parameters
        params = [nn.Parameter(t.clone()) for t in w.split(edge)]
        for k, p in enumerate(params):
            if segments:
                set_block_segments(p, _overlaps(sizes_n, k * edge, k * edge + p.numel()))
    ref_w = nn.Parameter(w.clone())
    opt = FP8AdamW([{"params": [p]} for p in params], lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW([ref_w], lr=1e-3, weight_decay=0.01)
    bias = torch.randn(total, generator=g) * 0.3
    scale = torch.cat([torch.full((n,), s) for n, s in zip(sizes_n, sizes)])
    scale[: sizes_n[0]] *= torch.logspace(0, -2, 48).repeat_interleave(80)
    out: list[list[float]] = []
    for i in range(steps):
        grad = (bias + torch.randn(total, generator=g)) * scale
        with torch.no_grad():
            ref_w.copy_(torch.cat([p.detach().reshape(-1) for p in params]))
        before = ref_w.detach().clone()
        for p, gp in zip(params, grad.split([p.numel() for p in params])):
            p.grad = gp.clone()
        ref_w.grad = grad.clone()
        opt.step()
        ref.step()
        if i >= steps - 5:
            ours = torch.cat([p.detach().reshape(-1) for p in params]) - before
            theirs = ref_w.detach() - before
            out.append([_sqnr(a, b) for a, b in zip(theirs.split(sizes_n), ours.split(sizes_n))])
    return [sum(col) / len(col) for col in zip(*out)]


def _sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.double(), test.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - test).pow(2).sum().clamp_min(1e-300)))


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_adamw_on_flat_partitions_matches_per_parameter(seed):
    per_param = _update_sqnr_per_param(None, seed)
    for parts in (1, 2):
        flat = _update_sqnr_per_param(parts, seed)
        # E4M3 first moment: ~25 dB per parameter (docs/LOG.md, optim entry), flat or not
        assert min(flat) > 20.0, flat
        assert all(abs(a - b) < 1.0 for a, b in zip(flat, per_param)), (flat, per_param)


def test_segments_keep_a_small_parameter_next_to_a_large_one():
    # the 33-element last parameter has gradients 1e5x smaller than its neighbour: in a block
    # shared with it, its first moment flushes to zero; restarting the blocks at the boundary
    # gives it per-parameter quality back
    sizes = (1.0, 1.0, 1.0, 1e-5)
    per_param = _update_sqnr_per_param(None, 2, sizes)
    marked = _update_sqnr_per_param(1, 2, sizes)
    unmarked = _update_sqnr_per_param(1, 2, sizes, segments=False)
    assert min(per_param) > 20.0 and abs(marked[3] - per_param[3]) < 1.0, (marked, per_param)
    assert unmarked[3] < 10.0, unmarked


def test_block_segments_are_checked():
    p = nn.Parameter(torch.zeros(300))
    with pytest.raises(ValueError, match=r"sum to the parameter's 300 elements \(they sum to 299\)"):
        set_block_segments(p, [200, 99])
    set_block_segments(p, [200, 0, 100])
    opt = FP8AdamW([p])
    p.grad = torch.randn(300)
    opt.step()
    assert opt.state[p]["exp_avg_scale"].shape == (3,)  # 2 blocks for 200 elements, 1 for 100
    set_block_segments(p, [10, 10, 280])  # another layout (5 blocks): the saved scales no longer fit
    with pytest.raises(ValueError, match=r"has 3 block scales but its parameter's segments need 5"):
        opt.step()


def test_overlaps_cut_parameters_at_partition_edges():
    # parameters of 5, 3 and 4 elements, then 4 of alignment padding: partitions of 8 elements
    assert _overlaps([5, 3, 4], 0, 8) == [5, 3]
    assert _overlaps([5, 3, 4], 8, 16) == [4, 4]
    assert _overlaps([5, 0, 3, 4], 3, 10) == [2, 3, 2]


# ---------------------------------------------------------------------- what does not compose
def _prepare(opt_level: str, optimizer_cls=torch.optim.AdamW, **opt_kwargs):
    acc = Accelerator(
        mixed_precision="fp8",
        deepspeed_plugin=DeepSpeedPlugin(zero_stage=2),
        kwargs_handlers=[MSAMPRecipeKwargs(opt_level=opt_level)],
    )
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    return acc.prepare(model, optimizer_cls(model.parameters(), **opt_kwargs))


def test_o1_under_deepspeed_is_an_error_naming_the_fixes():
    with pytest.raises(ValueError) as err:
        _prepare("O1")
    msg = str(err.value)
    assert "opt_level='O1'" in msg and "DeepSpeed" in msg
    assert "opt_level='O2'" in msg and "DDP" in msg and "TERecipeKwargs" in msg


def test_o2_under_deepspeed_needs_adam():
    with pytest.raises(ValueError, match=r"opt_level='O2'.*needs torch.optim.Adam.*got SGD"):
        _prepare("O2", torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"AdamW\(amsgrad=True\); set amsgrad=False"):
        _prepare("O2", torch.optim.AdamW, amsgrad=True)


def test_elastic_checkpoint_is_refused_for_fp8_adamw():
    opt = FP8AdamW([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match=r"elastic_checkpoint=true.*FP8AdamW.*Set elastic_checkpoint to false"):
        check_client_optimizer(opt, {"zero_optimization": {"stage": 2, "elastic_checkpoint": True}})
    check_client_optimizer(opt, {"zero_optimization": {"stage": 2}})  # the default is fine
    plain = torch.optim.AdamW([nn.Parameter(torch.zeros(4))])
    check_client_optimizer(plain, {"zero_optimization": {"elastic_checkpoint": True}})  # not ours to judge


def test_o2_under_deepspeed_scheduler_drives_the_fp8_optimizer(ds_env, recwarn):
    """A scheduler built on the user's AdamW sets the learning rate of the FP8AdamW ZeRO steps."""
    torch.manual_seed(0)
    acc = Accelerator(
        mixed_precision="fp8",
        deepspeed_plugin=DeepSpeedPlugin(zero_stage=2),
        kwargs_handlers=[MSAMPRecipeKwargs(opt_level="O2")],
    )
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 1 else 0.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    x = torch.randn(8, 16)
    for step in range(2):
        before = [p.detach().float().clone() for p in model.parameters()]
        acc.backward(model(x).float().pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
        moved = max((p.float() - b).abs().max().item() for p, b in zip(model.parameters(), before))
        assert (moved > 0) == (step == 0), step  # lr 0 from the second step: nothing moves
        assert [g["lr"] for g in opt.param_groups] == sched.get_last_lr() == [0.0]
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]


def test_a_new_accelerator_after_end_training_runs_deepspeed_again(ds_env):
    """end_training destroys the process group; DeepSpeed's groups cached from it (a clone of the
    world group) made the next engine in the process fail: "Group ... is not registered"."""
    for _ in range(2):
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
        model = nn.Sequential(nn.Linear(16, 8))
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        acc.backward(model(torch.randn(4, 16)).float().pow(2).mean())
        opt.step()
        acc.end_training()
