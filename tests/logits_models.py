"""Tiny attention models of the logit-precursor tests (tests/test_logits.py,
tests/dist/logits_cases.py): attention blocks that compute their own q, k, v, report them with
:func:`distgrad.signals.logits.observe_attention` and call ``F.scaled_dot_product_attention``
(causal), no QK-norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distgrad.signals import logits as L


class Block(torch.nn.Module):
    """Residual causal self-attention, ``h`` heads of ``d / h``: input and output [B, T, d]."""

    def __init__(self, d=16, h=2):
        super().__init__()
        self.num_heads, self.qk, self.v, self.o = h, torch.nn.Linear(d, 2 * d), torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k = self.qk(x).view(b, t, 2, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        v = self.v(x).view(b, t, self.num_heads, -1).transpose(1, 2)
        L.observe_attention(self, q, k, is_causal=True)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, d))


class SDPAModel(torch.nn.Module):
    """Embedding, ``layers`` :class:`Block` s, output head ``head``: tokens [B, T] (int64) to
    logits [B, T, vocab]."""

    def __init__(self, vocab=23, d=16, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


class PositionalModel(SDPAModel):
    """:class:`SDPAModel` with learned position embeddings (a copy task needs positions)."""

    def __init__(self, vocab=16, d=32, layers=2, t=12):
        super().__init__(vocab, d, layers)
        self.pos = torch.nn.Parameter(torch.randn(t, d) * 0.3)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)
