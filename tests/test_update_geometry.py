"""Update geometry for any optimizer (distgrad/signals/update.py) on one process: the applied
update's RMS, update/weight ratio, spectral norm and the Muon / Adafactor extras against float64
recomputations from copies of the parameters taken around each optimizer step (and, for
Adafactor, from its state through the full factored matrix). The multi-rank engines (DDP, FSDP2,
ZeRO-2): tests/test_update_geometry_multirank.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import distgrad
from distgrad.record import StepRecord
from tests.reference import adafactor_trace


class TwoLayers(nn.Module):
    """Two linear layers (layer labels "0" and "1")."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 12, bias=bias), nn.Linear(12, 5, bias=bias)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x)))


def _model(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return TwoLayers(bias)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    if name == "muon":
        return torch.optim.Muon(params, lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    raise ValueError(name)


def _w64(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().clone() for k, v in m.named_parameters()}


def _run(opt_name: str, steps: int = 6, async_records: str = "off", **cfg):
    m = _model(bias=opt_name != "muon")  # torch.optim.Muon steps matrices only
    opt = _optimizer(opt_name, m.parameters())
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False},
                             update_geometry={"enabled": True, **cfg}, statistics={"async_records": async_records})
    recs: list = []
    dg.add_hook(recs.append)
    torch.manual_seed(1)
    x, y = torch.randn(16, 6), torch.randn(16, 5)
    weights, lrs, traces = [_w64(m)], [], []
    for _ in range(steps):
        nn.functional.mse_loss(m(x), y).backward()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad()
        weights.append(_w64(m))
        if opt_name == "adafactor":
            traces.append(adafactor_trace(opt))
    dg.close()
    assert dg.counters["internal_errors"] == 0
    return m, opt, dg, recs, weights, lrs, traces


@pytest.mark.parametrize("opt_name,async_records", [("adamw", "off"), ("adamw", "on"), ("sgd", "off"),
                                                    ("muon", "off"), ("adafactor", "off")])
def test_applied_update_matches_the_float64_update_of_the_parameter_copies(opt_name, async_records):
    m, opt, dg, recs, weights, lrs, traces = _run(opt_name, async_records=async_records)
    assert [r.step for r in recs] == list(range(6))
    assert recs[0].update_geometry is None  # the first record has no previous update
    for rec in recs[1:]:
        u = rec.update_geometry
        t = u.step
        assert t == rec.step - 1 and u.applied and u.optimizer == type(opt).__name__
        before, after = weights[t], weights[t + 1]
        d = {k: after[k] - before[k] for k in before}
        for k in d:
            assert u.param_update_rms[k] == pytest.approx(float(d[k].pow(2).mean().sqrt()), rel=1e-5)
            assert u.param_update_ratio[k] == pytest.approx(float(d[k].norm() / before[k].norm()), rel=1e-5)
        layers = {lk: [k for k in d if k.startswith(f"layers.{lk}.")] for lk in ("0", "1")}
        assert sorted(u.layer_update_rms) == sorted(layers)
        for lk, ks in layers.items():
            dsq = sum(float(d[k].pow(2).sum()) for k in ks)
            assert u.layer_update_rms[lk] == pytest.approx(math.sqrt(dsq / sum(d[k].numel() for k in ks)), rel=1e-5)
            wsq = sum(float(before[k].pow(2).sum()) for k in ks)
            assert u.layer_update_ratio[lk] == pytest.approx(math.sqrt(dsq / wsq), rel=1e-5)
        dsq = sum(float(x.pow(2).sum()) for x in d.values())
        assert u.update_rms == pytest.approx(math.sqrt(dsq / sum(x.numel() for x in d.values())), rel=1e-5)
        assert u.update_ratio == pytest.approx(math.sqrt(dsq / sum(float(x.pow(2).sum()) for x in before.values())),
                                               rel=1e-5)
        if opt_name == "muon":  # the orthogonalised step W_after - (1 - lr wd) W_before, over lr
            lr, wd = lrs[t], 0.1
            st = [after[k] - (1 - lr * wd) * before[k] for k in d]
            rms = math.sqrt(sum(float(s.pow(2).sum()) for s in st) / sum(s.numel() for s in st)) / lr
            assert u.muon_rms_per_lr == pytest.approx(rms, rel=1e-4)
            assert u.muon_rms_ratio == pytest.approx(rms / 0.2, rel=1e-4)
            assert 0.6 < u.muon_rms_ratio < 1.2  # Newton-Schulz singular values ~[0.7, 1.1]
        else:
            assert u.muon_rms_per_lr is None and u.muon_rms_ratio is None
        if opt_name == "adafactor":
            assert u.adafactor_trace == pytest.approx(traces[t], rel=1e-6)
        else:
            assert u.adafactor_trace is None
        assert not u.param_update_spectral  # opt-in
        assert StepRecord.from_dict(rec.to_dict()).update_geometry == u


class FixedStep(torch.optim.Optimizer):
    """Adds a fixed matrix to each parameter (a constant update whose spectral norm is known)."""

    def __init__(self, params, steps: dict[int, torch.Tensor]) -> None:
        super().__init__(params, {"lr": 1.0})
        self.steps = steps

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(self.steps[id(p)])


def test_spectral_norm_is_a_lower_bound_that_converges_on_a_fixed_update():
    m = _model()
    torch.manual_seed(3)
    steps = {id(p): 1e-3 * torch.randn_like(p) for p in m.parameters()}
    opt = FixedStep(m.parameters(), steps)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False},
                             update_geometry={"enabled": True, "spectral": True}, statistics={"async_records": "off"})
    recs: list = []
    dg.add_hook(recs.append)
    x = torch.randn(4, 6)
    for _ in range(30):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
    state = dg.signals.signals[[s.name for s in dg.signals.signals].index("update_geometry")].state_dict()
    dg.close()
    sigma = {n: float(torch.linalg.matrix_norm(steps[id(p)].double(), ord=2)) for n, p in m.named_parameters()
             if p.dim() == 2}
    for rec in recs[1:]:
        sp = rec.update_geometry.param_update_spectral
        assert sorted(sp) == sorted(sigma)
        for k in sp:
            assert sp[k] <= sigma[k] * (1 + 1e-4)  # a lower bound at every step
    last = recs[-1].update_geometry
    for k in sigma:
        # the float32 difference of the weights carries ~1e-5 relative noise on a 1e-3 step
        assert last.param_update_spectral[k] == pytest.approx(sigma[k], rel=1e-3)
        assert abs(recs[3].update_geometry.param_update_spectral[k] - sigma[k]) > abs(
            last.param_update_spectral[k] - sigma[k])  # it converges from the random start
    assert last.layer_update_spectral == {"0": last.param_update_spectral["layers.0.weight"],
                                          "1": last.param_update_spectral["layers.1.weight"]}
    assert len(state["v"]) == 2 and len(state["v"][0]) == 6 and len(state["u"][0]) == 12  # checkpointed vectors


def test_update_geometry_is_off_by_default_and_absent_on_a_skipped_first_record():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"})
    assert "update_geometry" not in {s.name for s in dg.signals.signals}
    m(torch.randn(2, 6)).sum().backward()
    opt.step()
    dg.close()
    assert dg.last_record.update_geometry is None


def test_spectral_alone_is_refused_naming_the_switch():
    """``update_geometry.spectral: true`` without ``update_geometry.enabled`` measured nothing, with
    no word: a new user reading "spectral: true for the spectral norm" set only that key. It is
    refused at instrument() naming the key that is missing; with both it is accepted."""
    from distgrad.config import ConfigError

    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"'update_geometry.spectral'.*update_geometry.enabled: true"):
        distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, update_geometry={"spectral": True})
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False},
                             update_geometry={"enabled": True, "spectral": True})
    assert "update_geometry" in {s.name for s in dg.signals.signals}
    dg.close()
