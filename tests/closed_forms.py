"""Small problems whose answer is known in closed form, shared by the one-process signal tests
and the multi-rank driver tests/dist/gns_cases.py: least squares (the curvature along an update
is an exact quadratic form) and a model whose per-sample gradient is its input (the noise scale's
|G|^2 and tr(C) are known)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn


class LSQ(nn.Module):
    """Two independent least-squares layers: loss = sum_l 0.5 mean_i |W_l x_li + b_l - y_li|^2.
    Per layer the Hessian in (W_l, b_l) is mean_i [x_li; 1][x_li; 1]^T (for each output row),
    so dtheta^T H dtheta = mean_i |dW_l x_li + db_l|^2."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(5, 3), nn.Linear(4, 2)])

    def forward(self, x0, y0, x1, y1) -> torch.Tensor:
        return sum(0.5 * (lay(x) - y).pow(2).sum(1).mean() for lay, x, y in zip(self.layers, (x0, x1), (y0, y1)))


def lsq_data(rank: int = 0):
    """Fixed full-batch data (the same every step: the gradient is a function of the weights)."""
    g = torch.Generator().manual_seed(11 + rank)
    return (torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g),
            torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))


def lsq_curvature(before: dict, after: dict, data_per_rank: list) -> tuple[dict, float]:
    """Exact per-layer and total ``dtheta^T H dtheta / |dtheta|^2`` (float64) from the full
    weights before and after an update; the loss is the mean over ranks of each rank's loss."""
    num, den = {}, {}
    for li, (xi, key) in enumerate(((0, "0"), (2, "1"))):
        dW = after[f"layers.{li}.weight"].double() - before[f"layers.{li}.weight"].double()
        db = after[f"layers.{li}.bias"].double() - before[f"layers.{li}.bias"].double()
        quad = np.mean([(d[xi].double() @ dW.T + db).pow(2).sum(1).mean().item() for d in data_per_rank])
        num[key], den[key] = quad, dW.pow(2).sum().item() + db.pow(2).sum().item()
    return {k: num[k] / den[k] for k in num}, sum(num.values()) / sum(den.values())


class Dot(nn.Module):
    """loss_i = w . z_i: the per-sample gradient is the input z_i itself."""

    def __init__(self, d1: int, d2: int) -> None:
        super().__init__()
        self.a = nn.Linear(d1, 1, bias=False)
        self.b = nn.Linear(d2, 1, bias=False)
        self.d1 = d1

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (self.a(z[:, :self.d1]) + self.b(z[:, self.d1:])).mean()


def known_covariance(d: int = 10):
    """Mean G and diagonal covariance C of the per-sample gradient; B_simple = tr(C) / |G|^2."""
    G = torch.linspace(-0.6, 0.9, d)
    C = torch.linspace(0.2, 1.4, d)
    return G, C, float(C.sum() / G.pow(2).sum())


def ratio_and_stderr(tr: np.ndarray, g2: np.ndarray, weights: np.ndarray | None = None) -> tuple[float, float]:
    """Weighted ratio of means sum(w tr) / sum(w g2) and its delta-method standard error
    sqrt(sum(w^2 (tr - R g2)^2)) / sum(w g2) (the steps are independent)."""
    w = np.ones_like(tr) if weights is None else weights
    r = float((w * tr).sum() / (w * g2).sum())
    resid = tr - r * g2
    return r, float(np.sqrt((w ** 2 * resid ** 2).sum()) / (w * g2).sum())
