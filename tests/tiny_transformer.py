"""A small causal transformer for engine tests (the trainer's built-in model has more knobs)."""

import torch
from torch import nn
import torch.nn.functional as F


class TinyBlock(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.up_proj = nn.Linear(d, ffn)
        self.down_proj = nn.Linear(ffn, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o_proj(a)
        return x + self.down_proj(F.gelu(self.up_proj(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, heads: int = 4, ffn: int = 128, seq: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.in_proj = nn.Linear(d, d)  # first Linear: kept in high precision by the default filter
        self.blocks = nn.ModuleList([TinyBlock(d, heads, ffn) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        h = self.in_proj(self.embed(idx) + self.pos[: idx.shape[1]])
        for blk in self.blocks:
            h = blk(h)
        logits = self.lm_head(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def markov_batches(steps: int, batch: int = 16, seq: int = 33, vocab: int = 64, seed: int = 0):
    """Sequences from a fixed random sparse Markov chain: learnable, never memorised."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 3
    probs = torch.softmax(logits, dim=-1)
    for _ in range(steps):
        tok = torch.randint(0, vocab, (batch,), generator=g)
        out = [tok]
        for _ in range(seq - 1):
            tok = torch.multinomial(probs[tok], 1, generator=g).squeeze(1)
            out.append(tok)
        x = torch.stack(out, 1)
        yield x[:, :-1], x[:, 1:]
