"""Curvature along the last update (distgrad/signals/curvature.py) on one process, against the
exact value on a quadratic loss: least squares per layer, whose Hessian is known, so that
``dtheta^T H dtheta / |dtheta|^2`` is computed in float64 from the weights before and after
each update (a different path from distgrad's successive gradients). The multi-rank engines
(ZeRO-2, ZeRO-3, FSDP2): tests/test_noise_scale_multirank.py (one launch of gns_cases.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import distgrad
from distgrad.config import ConfigError
from distgrad.record import StepRecord


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


@pytest.mark.parametrize("opt_name,async_records", [("sgd", "off"), ("adamw", "off"), ("adamw", "on")])
def test_curvature_is_the_exact_quadratic_form_along_each_update(opt_name, async_records):
    torch.manual_seed(0)
    m = LSQ()
    opt = (torch.optim.SGD(m.parameters(), lr=0.2) if opt_name == "sgd"
           else torch.optim.AdamW(m.parameters(), lr=0.05))
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, curvature={"enabled": True},
                             statistics={"async_records": async_records})
    recs = []
    dg.add_hook(recs.append)
    data = lsq_data()
    weights = [{k: v.detach().clone() for k, v in m.state_dict().items()}]
    for _ in range(5):
        m(*data).backward()
        opt.step()
        opt.zero_grad()
        weights.append({k: v.detach().clone() for k, v in m.state_dict().items()})
    dg.close()
    assert [r.step for r in recs] == list(range(5))
    assert recs[0].curvature is None  # no previous update
    for rec in recs[1:]:
        t = rec.step
        layer, total = lsq_curvature(weights[t - 1], weights[t], [data])
        c = rec.curvature
        assert sorted(c.layer) == ["0", "1"]
        for k in layer:
            assert c.layer[k] == pytest.approx(layer[k], rel=1e-5)
        assert c.total == pytest.approx(total, rel=1e-5)
        assert StepRecord.from_dict(rec.to_dict()).curvature == c
    assert dg.counters["internal_errors"] == 0


def test_curvature_needs_interval_1_and_is_off_by_default():
    m = LSQ()
    with pytest.raises(ConfigError, match="curvature.enabled.*sampling.interval: 1"):
        distgrad.instrument(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), exporter={"enabled": False},
                            curvature={"enabled": True}, sampling={"interval": 2})
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"})
    assert not {s.name for s in dg.signals.signals} & {"curvature", "noise_scale"}  # off unless asked for
    m(*lsq_data()).backward()
    opt.step()
    dg.close()
    assert dg.last_record.curvature is None and dg.last_record.noise_scale is None
