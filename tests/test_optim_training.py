"""End to end: O2 (FP8 gradients + FP8AdamW) trains a small transformer like fp32 AdamW,
and a resumed O2 run reproduces the uninterrupted one bit for bit."""

from __future__ import annotations

import io

import torch
import torch.nn as nn

from lowprec.optim import FP8AdamW, apply_opt_level

VOCAB, DIM, SEQ, BATCH = 32, 32, 24, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        layer = nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tok):
        x = self.emb(tok) + self.pos[: tok.shape[1]]
        return self.head(self.norm(self.blocks(x, mask=self.mask, is_causal=True)))


def markov_batches(n, seed):
    """Tokens from a fixed random Markov chain with 3 likely successors per token, so the
    achievable loss (~log 3) is far below the start (log 32)."""
    g = torch.Generator().manual_seed(seed)
    trans = torch.full((VOCAB, VOCAB), 0.02)
    trans.scatter_(1, torch.randint(0, VOCAB, (VOCAB, 3), generator=g), 1.0)
    trans /= trans.sum(1, keepdim=True)
    out = []
    for _ in range(n):
        tok = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for t in range(SEQ):
            tok[:, t + 1] = torch.multinomial(trans[tok[:, t]], 1, generator=g).squeeze(1)
        out.append(tok)
    return out


def _loss(model, tok):
    logits = model(tok[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tok[:, 1:].reshape(-1))


def _train(model, opt, sched, batches):
    losses = []
    for tok in batches:
        opt.zero_grad()
        loss = _loss(model, tok)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _setup(opt_level):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if opt_level:
        model, opt = apply_opt_level(model, opt, opt_level)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched


def test_o2_trains_within_3_percent_of_fp32_adamw():
    batches = markov_batches(70, seed=1)
    ref = _train(*_setup(None), batches)
    o2_model, o2_opt, o2_sched = _setup("O2")
    assert isinstance(o2_opt, FP8AdamW)
    o2 = _train(o2_model, o2_opt, o2_sched, batches)
    ref_final, o2_final = sum(ref[-5:]) / 5, sum(o2[-5:]) / 5
    assert ref_final < 0.75 * ref[0]  # the reference really learned something
    assert abs(o2_final - ref_final) / ref_final < 0.03, (ref_final, o2_final)


def test_resumed_o2_run_reproduces_the_uninterrupted_one():
    batches = markov_batches(12, seed=2)
    model, opt, sched = _setup("O2")
    full = _train(model, opt, sched, batches)
    full_params = [p.detach().clone() for p in model.parameters()]

    model, opt, sched = _setup("O2")
    first = _train(model, opt, sched, batches[:5])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    torch.manual_seed(123)  # a fresh process would start from other weights
    model2, opt2, sched2 = _setup("O2")
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    rest = _train(model2, opt2, sched2, batches[5:])
    assert first + rest == full  # exact, not approximate
    for p, q in zip(full_params, model2.parameters()):
        assert torch.equal(p, q.detach())
