"""The tiny decoder of the underflow tests (tests/test_underflow.py, tests/dist/underflow_cases.py):
token embedding, ``layers`` pre-norm MLP blocks (RMSNorm ``ln``, ``up``, GELU, ``down``), a final
RMSNorm ``norm`` and an untied ``lm_head`` (both run in at least float32, autocast off);
``forward(ids, labels)`` returns the mean cross-entropy times ``loss_weight``. Initialised like a
LLaMA (normal, std 0.02). The small
``loss_weight`` stands in for the per-element gradient magnitudes of a large model (a mean over
many tokens, a long accumulation): under fp16 autocast without loss scaling most of the decoder
layers' weight-gradient elements flush to exact zeros, while unused embedding rows are zero in any
precision."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.up, self.down = RMSNorm(d), nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, loss_weight: float = 1e-3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm, self.lm_head = RMSNorm(d), nn.Linear(d, vocab, bias=False)
        self.loss_weight = loss_weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for blk in self.layers:
            x = blk(x)
        dt = torch.promote_types(self.lm_head.weight.dtype, torch.float32)  # fp16 weights (DeepSpeed fp16): fp32
        with torch.autocast(x.device.type, enabled=False):  # the output head in float32 (as many LLM codes)
            logits = F.linear(self.norm(x.to(dt)), self.lm_head.weight.to(dt))
        return self.loss_weight * F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def clone(model: Decoder) -> Decoder:
    """A fresh decoder with ``model``'s weights and dtype (no hook or attribute an engine or
    distgrad put on ``model``)."""
    new = Decoder(len(model.embed.weight), model.embed.weight.shape[1], len(model.layers),
                  loss_weight=model.loss_weight).to(next(model.parameters()).dtype)
    new.load_state_dict(model.state_dict())
    return new
