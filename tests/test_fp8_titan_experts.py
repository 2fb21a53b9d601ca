"""torchtitan-style ``GroupedExperts`` (three 3-D Parameters ``w1``, ``w3`` (E, hidden, dim) and ``w2``
(E, dim, hidden), called with tokens already grouped by expert: ``experts(x, num_tokens_per_expert)``,
rows past the counted ones being padding) in FP8 through ``fp8.convert``.

torchtitan is not installed here; ``GroupedExperts`` and ``MoE`` below follow its
``torchtitan/models/moe/moe.py`` (parameter names and shapes, the call, the for-loop path's padding,
the router's ``histc`` counts as floats, the token reorder) in our own words.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowprec.fp8 as fp8
from lowprec.fp8.modules.experts import Float8Experts, experts_layout
from tests.conftest import sqnr
from tests.test_fp8_experts import assert_own_forward_unless_fp8

DIM, HIDDEN, EXPERTS, TOP_K = 64, 128, 8, 2


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) * hidden_dim**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * dim**-0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = [int(c) for c in num_tokens_per_expert.tolist()]
        used = sum(counts)
        outs = []
        for e, xe in enumerate(torch.split(x[:used], counts)):
            h = F.silu(xe @ self.w1[e].t()) * (xe @ self.w3[e].t())
            outs.append(h @ self.w2[e].t())
        out = torch.cat(outs)
        return torch.vstack((out, out.new_zeros(x.shape[0] - used, out.shape[-1])))


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x):
        scores = F.softmax(self.gate(x).float(), dim=1)
        top, idx = torch.topk(scores, k=self.top_k, dim=1)
        counts = torch.histc(idx.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        return top, idx, counts


class MoE(nn.Module):
    """Router, reorder (stable by expert), experts, scores after the experts, scatter back."""

    def __init__(self):
        super().__init__()
        self.router = Router(DIM, EXPERTS, TOP_K)
        self.experts = GroupedExperts(DIM, HIDDEN, EXPERTS)

    def forward(self, x):
        b, s, d = x.shape
        x = x.reshape(-1, d)
        top, idx, counts = self.router(x)
        order = torch.argsort(idx.view(-1), stable=True)
        rows = self.experts(x[order // TOP_K], counts)
        rows = rows * top.view(-1)[order].unsqueeze(-1).to(rows.dtype)
        out = torch.zeros_like(x).index_add(0, order // TOP_K, rows.to(x.dtype))
        return out.view(b, s, d)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoE()
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def _block(seed=0):
    torch.manual_seed(seed)
    return Block()


def test_the_layout_is_recognised_and_anything_else_is_not():
    layout = experts_layout(GroupedExperts(DIM, HIDDEN, EXPERTS))
    assert layout is not None and layout.grouped and layout.projections == ("w1", "w3", "w2")
    assert layout.dims(GroupedExperts(DIM, HIDDEN, EXPERTS), "w2") == (HIDDEN, DIM)

    class NoCounts(GroupedExperts):
        def forward(self, x):  # not torchtitan's call
            return x

    bad = GroupedExperts(DIM, HIDDEN, EXPERTS)
    bad.w3 = nn.Parameter(torch.zeros(EXPERTS, HIDDEN + 16, DIM))
    assert experts_layout(NoCounts(DIM, HIDDEN, EXPERTS)) is None and experts_layout(bad) is None


def test_conversion_keeps_parameters_keys_and_class_and_the_router_stays():
    block = _block()
    keys, params = set(block.state_dict()), {id(p) for p in block.parameters()}
    report = fp8.convert(block, "tensorwise", skip_first_last=False)
    assert isinstance(block.moe.experts, Float8Experts) and isinstance(block.moe.experts, GroupedExperts)
    assert [(n, e, [p for p, *_ in ps]) for n, e, ps in report.experts] == [
        ("moe.experts", EXPERTS, ["w1", "w3", "w2"])
    ]
    assert isinstance(block.moe.router.gate, nn.Linear) and not isinstance(block.moe.router.gate, fp8.Float8Linear)
    assert set(block.state_dict()) == keys and {id(p) for p in block.parameters()} == params
    fp8.unconvert(block)
    assert type(block.moe.experts) is GroupedExperts


@pytest.mark.parametrize("name", list(fp8.RECIPE_NAMES))
def test_grouped_experts_against_float64(seed, name):
    torch.manual_seed(seed)
    block = MoE()  # no FP8 layer before the router: its top-k choices are the float64 reference's
    ref = copy.deepcopy(block).double()
    fp8.convert(block, name, skip_first_last=False)
    x, dy = torch.randn(2, 16, DIM), torch.randn(2, 16, DIM)
    xs = [x.clone().requires_grad_(), x.double().requires_grad_()]
    outs = [m(xi) for m, xi in zip((block, ref), xs)]
    for o in outs:
        o.backward(dy.to(o.dtype))
    assert torch.equal(block.experts.tokens_per_expert.sum(), torch.tensor(2 * 16 * TOP_K))
    floor_out, floor_grad = (9, 7) if name == "nvfp4" else (21, 18)
    assert sqnr(outs[1], outs[0]) >= floor_out, f"output {sqnr(outs[1], outs[0]):.1f} dB"
    assert sqnr(xs[1].grad, xs[0].grad) >= floor_grad
    named = dict(ref.named_parameters())
    for n in ("experts.w1", "experts.w2", "experts.w3"):
        got, want = dict(block.named_parameters())[n].grad, named[n].grad
        assert sqnr(want, got) >= floor_grad, f"{n}: {sqnr(want, got):.1f} dB"


def test_padding_rows_give_zeros_and_no_gradient(seed):
    experts = GroupedExperts(DIM, HIDDEN, EXPERTS)
    holder = nn.Sequential()
    holder.add_module("experts", experts)
    fp8.convert(holder, "rowwise", skip_first_last=False)
    counts = torch.tensor([3.0, 0, 5, 1, 0, 0, 7, 2])  # histc gives floats
    x = torch.randn(int(counts.sum()) + 6, DIM, requires_grad=True)
    out = holder.experts(x, counts)
    assert out.shape == (x.shape[0], DIM) and torch.count_nonzero(out[-6:]) == 0
    out.sum().backward()
    assert torch.count_nonzero(x.grad[-6:]) == 0 and torch.count_nonzero(x.grad[:-6]) > 0
    with pytest.raises(ValueError, match="num_tokens_per_expert has 8 counts summing to 19 for 8 experts and 10 rows"):
        holder.experts(x[:10], counts + torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]))


def test_fp8_off_and_eval_run_the_class_own_forward(seed):
    block = _block(seed)
    ref = copy.deepcopy(block)
    fp8.convert(block, "tensorwise", skip_first_last=False)
    assert_own_forward_unless_fp8(block, ref, torch.randn(2, 8, DIM))


def test_skip_patterns_reach_each_projection():
    block = _block()
    report = fp8.convert(block, "tensorwise", skip_first_last=False, skip_patterns=("router", "w2"))
    assert set(block.moe.experts.fp8_gemms()) == {"w1", "w3"}
    assert ("moe.experts.w2", "name matches 'w2'") in report.skipped


def test_trains_in_fp8_close_to_high_precision(seed):
    losses = {}
    for name in ("bf16", "tensorwise"):
        block = _block(seed)
        if name != "bf16":
            fp8.convert(block, name, skip_first_last=False)
        opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        target = nn.Linear(DIM, DIM)
        torch.nn.init.normal_(target.weight, std=DIM**-0.5, generator=gen)
        curve = []
        for _ in range(20):
            x = torch.randn(4, 16, DIM, generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(block(x).float(), target(x).detach())
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
        losses[name] = curve
    assert losses["tensorwise"][-1] < 0.8 * losses["tensorwise"][0]
    assert abs(losses["tensorwise"][-1] / losses["bf16"][-1] - 1) < 0.05, losses


def test_lowprec_expert_parallel_refuses_it(monkeypatch):
    from lowprec.distributed import expert_parallel

    block = _block()
    fp8.convert(block, "tensorwise", skip_first_last=False)
    monkeypatch.setattr(expert_parallel.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(expert_parallel.dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match="tokens already grouped .*torchtitan's own expert parallelism"):
        expert_parallel.apply_expert_parallel(block, ep_size=1, group=object())
