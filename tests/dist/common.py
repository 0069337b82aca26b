"""Shared pieces of the multi-rank test drivers: a small model with awkward shapes, deterministic
per-(step, micro-batch, rank) data, and float64 reference statistics of full gradients."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyModel(nn.Module):
    """Embedding -> 2 blocks -> tied head. Shapes chosen so that several parameters have an
    element count not divisible by 2 (35, 7, 5, 13*7, ...), one parameter is frozen
    (``frozen.weight``, must never appear), and the head is tied to the embedding (counted once).
    Input: float features [B, 7]; target: class indices [B] in [0, 13)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)  # weight 35, bias 5: odd
        self.frozen = nn.Linear(5, 5, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(5), nn.Linear(5, 9), nn.GELU(), nn.Linear(9, 5))
                                     for _ in range(2)])
        self.emb = nn.Embedding(13, 5)
        self.head = nn.Linear(5, 13, bias=False)
        self.head.weight = self.emb.weight  # tied: 65 elements, odd

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.inp(x))
        h = h + self.emb(y % 13)
        for b in self.blocks:
            h = h + b(h)
        logits = self.head(h)
        return F.cross_entropy(logits.float(), y)


def batch_for(step: int, micro: int, rank: int, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic batch for (step, micro-batch, rank): x float32 [batch, 7], y int64 [batch]."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(batch, 7, generator=g) * 2.0
    y = torch.randint(0, 13, (batch,), generator=g)
    return x, y


def full_stats(grads: dict[str, torch.Tensor | None]) -> dict[str, dict[str, float]]:
    """Reference statistics of full gradients, each computed directly in float64 with torch
    (a different code path from distgrad's packed sufficient statistics)."""
    out = {}
    for name, g in grads.items():
        if g is None:
            out[name] = None
            continue
        g = g.double().reshape(-1)
        fin = torch.isfinite(g)
        out[name] = {
            "numel": g.numel(),
            "norm": torch.linalg.vector_norm(g).item(),
            "mean": g.mean().item(),
            "std": g.std(correction=0).item(),
            "min": g.min().item(),
            "max": g.max().item(),
            "abs_max": g.abs().max().item(),
            "nan": int(torch.isnan(g).sum()),
            "inf": int(torch.isinf(g).sum()),
            "zeros": int((g == 0).sum()),
            "rms": (g[fin].pow(2).mean().sqrt().item() if fin.any() else 0.0),
        }
    return out


def reference_b(ref_model: nn.Module, gas: int, world: int) -> tuple[dict, float]:
    """float64 gradients of step 0 averaged over every rank's micro-batches, and the mean loss."""
    ref_model.zero_grad()
    n, loss_sum = 0, 0.0
    for r in range(world):
        for micro in range(gas):
            x, y = batch_for(0, micro, r)
            loss = ref_model(x.double(), y)
            loss.backward()
            loss_sum += loss.item()
            n += 1
    grads = {name: (p.grad / n).reshape(-1) for name, p in ref_model.named_parameters() if p.requires_grad}
    return full_stats(grads), loss_sum / n


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts calls of the tensor methods that wait for the device (``.cpu()``, ``.item()``,
    ``.tolist()``, truth and number conversions) in ``self.n``; used by the tests that assert a
    path makes no host sync."""

    SYNCING = {"cpu", "item", "tolist", "__bool__", "__float__", "__int__", "__index__"}

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SYNCING:
            self.n += 1
        return func(*args, **(kwargs or {}))
