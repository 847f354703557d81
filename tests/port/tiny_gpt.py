"""A GPT-like model small enough for two CPU ranks in a test: token and
position embeddings, one pre-norm attention block, the output layer tied to
the token embedding (as nanoGPT ties ``wte`` and ``lm_head``)."""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, BLOCK, WIDTH = 48, 8, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(BLOCK, WIDTH)
        self.block = Block()
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.block(self.wte(idx) + self.wpe(pos))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(rank, step, rows=4):
    """Each rank its own tokens, the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, VOCAB, (rows, BLOCK + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def param_groups(params, weight_decay=0.1):
    """nanoGPT's rule: decay matrices and embeddings, not biases and norms."""
    params = list(params)
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
