"""Curvature along the last update (distgrad/signals/curvature.py) on one process, against the
exact value on a quadratic loss: least squares per layer, whose Hessian is known, so that
``dtheta^T H dtheta / |dtheta|^2`` is computed in float64 from the weights before and after
each update (a different path from distgrad's successive gradients). The multi-rank engines
(ZeRO-2, ZeRO-3, FSDP2): tests/test_noise_scale_multirank.py (one launch of gns_cases.py)."""

from __future__ import annotations

import pytest
import torch

import distgrad
from distgrad.config import ConfigError
from distgrad.record import StepRecord
from tests.closed_forms import LSQ, lsq_curvature, lsq_data


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
