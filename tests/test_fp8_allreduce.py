"""FP8 gradient all-reduce on 2 CPU processes (gloo): accuracy, overflow, NaN, DDP, bytes.

One 2-process job (fork, a free port on 127.0.0.1) runs every scenario and saves its results;
the tests below assert on them. Documented tolerance (docs/LOG.md, optim entry): each element is the
mean of per-rank values rounded to E4M3 (half-ulp 2^-4 relative) plus one rounding of the FP8
sum, so |out - ref| <= 2^-4 * (mean_r |g_r| + |ref|) + one E4M3 subnormal step of the tensor.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from lowprec.distributed import FP8AllReduceState, fp8_all_reduce_, register_fp8_allreduce
from lowprec.optim import apply_opt_level
from torchrun_util import free_port as _free_port, spawn_ranks

WORLD = 2
NUMELS = [1000, 37, 513, 1]
MAGNITUDES = [1e-3, 1.0, 1e2, 5.0]


def _bucket(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.cat([torch.randn(n, generator=g) * m for n, m in zip(NUMELS, MAGNITUDES)])


def _mean_fp32(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y)
    return y / WORLD


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    if dist.is_initialized():  # forked from a test process that holds a group
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    res = {}
    # 1. accuracy on a multi-tensor bucket with very different magnitudes
    x = _bucket(rank)
    st = FP8AllReduceState()
    res["ref"] = _mean_fp32(x)
    res["out"] = fp8_all_reduce_(x.clone(), NUMELS, st)
    res["counters"] = st.counters()
    # bf16 bucket: output written back in bf16
    res["out_bf16"] = fp8_all_reduce_(_bucket(rank).bfloat16(), NUMELS, FP8AllReduceState())

    # 2. large gradients: a plain fp32 sum of two 3e38 overflows to inf; ours must not
    big = torch.full((64,), 3.0e38) * (1 + 0.01 * torch.arange(64) / 64)
    big[::2] *= -1
    res["big"] = fp8_all_reduce_(big.clone(), None, FP8AllReduceState())
    res["big_fp32"] = _mean_fp32(big)
    res["big_ref"] = big.double()  # identical on both ranks: mean = itself

    # 3. NaN / inf on one rank only, in tensor 0 resp. 2
    y = _bucket(rank)
    if rank == 1:
        y[5] = float("nan")
        y[1000 + 37 + 7] = float("inf")
    res["nan"] = fp8_all_reduce_(y, NUMELS, FP8AllReduceState(fp8_dtype=torch.float8_e5m2))

    # 4. DDP with the hook vs a fp32 average of the same gradients
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    state = register_fp8_allreduce(ddp)
    g = torch.Generator().manual_seed(rank)
    data = torch.randn(16, 12, generator=g)
    ddp(data).pow(2).mean().backward()  # first step: DDP then rebuilds its buckets
    model.zero_grad()
    state.reset_counters()
    ddp(data).pow(2).mean().backward()
    res["ddp_grads"] = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 3))
    plain(data).pow(2).mean().backward()
    res["ddp_ref"] = [_mean_fp32(p.grad) for p in plain.parameters()]
    res["ddp_counters"] = state.counters()
    res["ddp_numel"] = sum(p.numel() for p in model.parameters())

    # 5. apply_opt_level on a DDP model: O2 = FP8 all-reduce hook + FP8AdamW; replicas (their
    #    weights and their stochastically rounded state) stay bit-identical over steps
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 3))
    ddp2 = nn.parallel.DistributedDataParallel(net)
    ddp2, opt = apply_opt_level(ddp2, torch.optim.AdamW(ddp2.parameters(), lr=1e-2), "O2")
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = ddp2(data).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    res["o2_losses"] = losses
    res["o2_params"] = [p.detach().clone() for p in net.parameters()]
    res["o2_state"] = [opt.state[p]["exp_avg_sq"].clone() for p in net.parameters()]
    res["o2_hook_calls"] = ddp2.lowprec_fp8_allreduce.calls

    # 6. the wrong order (apply_opt_level, then DDP) must fail loudly, not add the local held
    #    gradient to DDP's reduced one
    torch.manual_seed(0)
    net3 = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 3))
    net3, opt3 = apply_opt_level(net3, torch.optim.AdamW(net3.parameters()), "O2")
    ddp3 = nn.parallel.DistributedDataParallel(net3)
    ddp3(data).sum().backward()
    try:
        opt3.step()
        res["wrong_order_error"] = ""
    except ValueError as e:
        res["wrong_order_error"] = str(e)
    torch.save(res, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_allreduce")
    # spawn, not fork: forking a pytest worker that already runs threads (intra-op pools,
    # an earlier test's gloo threads) can deadlock the child on a lock held at fork time
    spawn_ranks(
        _worker,
        (_free_port(), str(out)),
        WORLD,
        port_arg=0,
        done=lambda: all((out / f"rank{r}.pt").is_file() for r in range(WORLD)),
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _tolerance(per_rank: list[torch.Tensor], ref: torch.Tensor) -> torch.Tensor:
    mean_abs = torch.stack([x.abs() for x in per_rank]).mean(0)
    tol = 2.0**-4 * (mean_abs + ref.abs())
    # one E4M3 subnormal step (2^-9 at scale) of each tensor, for values near zero
    floors = [
        torch.full((n,), seg.max().item() * 2.0**-9 / 448.0 * 2)
        for n, seg in zip(NUMELS, torch.split(mean_abs * WORLD, NUMELS))
    ]
    return tol + torch.cat(floors)


def test_matches_fp32_allreduce_within_fp8_tolerance(results):
    per_rank = [_bucket(r) for r in range(WORLD)]
    ref = results[0]["ref"]
    torch.testing.assert_close(ref, sum(per_rank) / WORLD)  # the reference itself is right
    tol = _tolerance(per_rank, ref)
    for r in range(WORLD):
        out = results[r]["out"]
        assert torch.equal(out, results[0]["out"])  # every rank holds the same result
        err = (out - ref).abs()
        assert (err <= tol).all(), (err / tol).max()
        # and it is not trivially loose: normwise error of a few percent, per tensor
        for o, f in zip(torch.split(out, NUMELS), torch.split(ref, NUMELS)):
            if f.numel() > 1:
                assert ((o - f).norm() / f.norm()).item() < 0.06
    out_bf16 = results[0]["out_bf16"]
    assert out_bf16.dtype == torch.bfloat16
    assert ((out_bf16.float() - ref).norm() / ref.norm()).item() < 0.06


def test_large_gradients_do_not_overflow(results):
    for r in range(WORLD):
        assert torch.isinf(results[r]["big_fp32"]).all()  # fp32 sum overflows here
        big = results[r]["big"]
        assert torch.isfinite(big).all()
        rel = ((big.double() - results[r]["big_ref"]).abs() / results[r]["big_ref"].abs()).max()
        assert rel < 2.0**-4


def test_nan_and_inf_are_propagated_not_hidden(results):
    sizes = NUMELS
    for r in range(WORLD):
        t0, t1, t2, t3 = torch.split(results[r]["nan"], sizes)
        assert torch.isnan(t0).all() and torch.isnan(t2).all()  # whole tensors, every rank
        assert torch.isfinite(t1).all() and torch.isfinite(t3).all()  # the others untouched


def test_ddp_hook_matches_fp32_gradients(results):
    for r in range(WORLD):
        c = results[r]["ddp_counters"]
        assert c["calls"] >= 1 and c["numel"] == results[r]["ddp_numel"]  # all went through us
        for g, ref in zip(results[r]["ddp_grads"], results[r]["ddp_ref"]):
            assert ((g - ref).norm() / ref.norm()).item() < 0.06
        for g0, g1 in zip(results[0]["ddp_grads"], results[1]["ddp_grads"]):
            assert torch.equal(g0, g1)  # replicas stay identical


def test_o2_on_ddp_keeps_replicas_identical(results):
    r0, r1 = results
    assert r0["o2_hook_calls"] >= 3  # the FP8 all-reduce ran every step
    assert r0["o2_losses"][-1] < r0["o2_losses"][0]
    for a, b in zip(r0["o2_params"], r1["o2_params"]):
        assert torch.equal(a, b)
    for a, b in zip(r0["o2_state"], r1["o2_state"]):
        assert torch.equal(a, b)


def test_ddp_wrapped_after_apply_opt_level_is_a_clear_error(results):
    for r in range(WORLD):
        msg = results[r]["wrong_order_error"]
        assert "DistributedDataParallel" in msg and "apply_opt_level" in msg


def test_bytes_on_the_wire_are_half_of_bf16(results):
    for key in ("counters", "ddp_counters"):
        c = results[0][key]
        assert c["fp8_payload_bytes"] <= c["bf16_bytes"] // 2 + WORLD
        assert c["fp8_payload_bytes"] * 4 <= c["fp32_bytes"] + 4 * WORLD
        # the amax exchange adds 4 bytes per tensor per hop
        assert c["fp8_bytes"] == c["fp8_payload_bytes"] + c["amax_bytes"]
    c = results[0]["counters"]
    assert c["amax_bytes"] == 4 * len(NUMELS)  # ring, 2 ranks: (W-1)/W * 2 * 4 bytes * T


def test_bad_dtype_and_non_ddp_model_are_user_errors():
    with pytest.raises(ValueError, match="fp8_dtype"):
        FP8AllReduceState(fp8_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_fp8_allreduce(nn.Linear(2, 2))
