"""Built-in models: a nanoGPT-style character transformer and an MLP classifier."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 103
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128


# name -> GPTConfig overrides
PRESETS = {
    "char-tiny": dict(n_layer=2, n_head=4, n_embd=128),  # ~0.4M parameters: demo and tests
    "char-small": dict(n_layer=4, n_head=4, n_embd=256),  # ~3.2M: communication-bound on slow links
    "char-medium": dict(n_layer=6, n_head=8, n_embd=384),  # ~10.7M
    # byte-level (vocabulary 256), on the python-src corpus (lioncub.apps.train.corpus):
    "byte-30m": dict(n_layer=6, n_head=10, n_embd=640),  # 30,033,920 parameters at block 256
    # GPT-2-small's body (12 layers, 12 heads, 768 wide, untied head): 85,645,824 parameters at block 256,
    # 86,235,648 at 1024. Not GPT-2's 124M: that count is 38.6M of 50,257-token embedding, which bytes do not have
    "byte-gpt2-small": dict(n_layer=12, n_head=12, n_embd=768),
}
# name -> (the dataset it trains on unless told otherwise, its default block size)
DEFAULTS = {
    "char-tiny": ("pydoc-topics", 64), "char-small": ("pydoc-topics", 64), "char-medium": ("pydoc-topics", 64),
    "byte-30m": ("python-src", 256), "byte-gpt2-small": ("python-src", 256), "mlp": ("blobs", 64),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        hidden = 4 * cfg.n_embd
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, hidden), nn.GELU(), nn.Linear(hidden, cfg.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class MLP(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 256, classes: int = 10, depth: int = 2):
        super().__init__()
        layers, d = [], dim
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.GELU()]
            d = hidden
        self.net = nn.Sequential(*layers, nn.Linear(d, classes))

    def forward(self, x, targets=None):
        logits = self.net(x)
        return logits, None if targets is None else F.cross_entropy(logits, targets)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
