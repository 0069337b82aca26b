"""The detection policy (distgrad/diagnostics/incidents.py): what opens an incident, on synthetic
series whose answer is known in closed form, and one decision online and offline on a real run:
the served state the alert rules read, the JSONL record and ``distgrad summary``'s verdict name
the same incident, step, value and component (a loss-component weight raised 1000x by a schedule
bug), and a healthy run has none. Multi-rank cases (a garbage batch on one rank, a learning-rate
blow-up, 300 healthy steps) are in tests/test_causes.py."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
import torch.nn as nn
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import distgrad
from distgrad.config import ConfigError, DistgradConfig
from distgrad.diagnostics.incidents import IncidentPolicy
from distgrad.report import analyze
from distgrad.export.jsonl import read_jsonl
from distgrad.export.prometheus import PrometheusSink

CFG = DistgradConfig().incidents


def _noise(n: int, seed: int, scale: float = 0.05) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-scale, scale, n)


def _feed(pol: IncidentPolicy, losses, gns=None, **per_step) -> list:
    opened = []
    for i, loss in enumerate(losses):
        kw = {k: v[i] for k, v in per_step.items()}
        inc = pol.update(i, float(loss), float(gns[i]) if gns is not None else 1.0, **kw)
        opened += inc.opened
    return opened


def test_a_spike_that_recovers_opens_nothing():
    """Loss 3x its level for divergence_steps - 1 sampled steps, then back: an annotation only."""
    base = 2.0 + _noise(100, 0)
    loss = base.copy()
    loss[40:40 + CFG.divergence_steps - 1] *= 3.0
    assert _feed(IncidentPolicy(CFG), loss) == []


def test_a_loss_that_stays_up_is_a_divergence_named_at_its_spike():
    """Loss 3x from step 40 on: a divergence decided divergence_steps sampled steps later, named
    at step 40 with the loss there, the level = the median of the level_window losses before it."""
    base = 2.0 + _noise(100, 1)
    loss = base.copy()
    loss[40:] *= 3.0
    pol = IncidentPolicy(CFG)
    opened = _feed(pol, loss)
    assert [(i.kind, i.step, i.decided) for i in opened] == [("divergence", 40, 40 + CFG.divergence_steps - 1)]
    inc = opened[0]
    assert inc.value == loss[40]
    assert inc.level == statistics.median(loss[40 - CFG.level_window:40].tolist())
    assert inc.level_step == 39 and inc.rank is None and inc.component is None
    assert f"diverged at step 40: {loss[40]:.4g}" in inc.detail
    assert pol.total == {"divergence": 1, "bad_batch": 0, "spike_burst": 0}


def test_a_slow_drift_is_a_divergence_by_the_rolling_median():
    """No single jump: the loss falls, then climbs 3% per step; the drift rule opens when the
    rolling median of drift_window losses exceeds its minimum by more than max(min, first)."""
    loss = np.concatenate([np.linspace(3.0, 1.0, 60), 1.0 * 1.03 ** np.arange(1, 80)])
    opened = _feed(IncidentPolicy(CFG), loss)
    assert [i.kind for i in opened] == ["divergence"]
    w = CFG.drift_window
    meds = [statistics.median(loss[k - w + 1:k + 1].tolist()) for k in range(w - 1, len(loss))]
    first, want = meds[0], None
    for k, m in enumerate(meds):
        best = min(meds[:k + 1])
        if m - best > max(abs(best), abs(first)):
            want = k + w - 1
            break
    assert opened[0].step == want and opened[0].value == meds[want - w + 1]


def test_component_whose_weighted_contribution_rose_is_named():
    """A schedule bug raises the weight of 'aux' 1000x at step 50: its value does not move, its
    weighted contribution goes from 0.005 to 5 and the loss diverges; 'aux' is named."""
    n = 90
    lm = 2.0 + _noise(n, 2)
    aux = 0.5 + _noise(n, 3, 0.01)
    w = np.where(np.arange(n) >= 50, 10.0, 0.01)
    loss = lm + w * aux
    comps = [{"aux": float(w[i] * aux[i]), "lm": float(lm[i])} for i in range(n)]
    opened = _feed(IncidentPolicy(CFG), loss, components=comps)
    assert [(i.kind, i.step, i.component) for i in opened] == [("divergence", 50, "aux")]
    assert "loss component 'aux'" in opened[0].detail


def test_bad_batch_needs_the_rank_outlier_and_the_grad_norm_jump():
    """Rank 2's loss 4x the others' at step 60: with the gradient norm 1.5x its median it is a bad
    batch on rank 2 at step 60; with the gradient norm unmoved it is not; a 2.5x gradient norm
    with balanced ranks is not either."""
    n, world = 100, 4
    rng = np.random.default_rng(4)
    ranks = (2.0 + rng.uniform(-0.2, 0.2, (n, world))).tolist()
    ranks[60][2] *= 4.0
    loss = [float(np.mean(r)) for r in ranks]
    gn = 1.0 + _noise(n, 5)
    jump = gn.copy()
    jump[60] *= 1.5
    opened = _feed(IncidentPolicy(CFG), loss, jump, rank_losses=ranks)
    assert [(i.kind, i.step, i.rank) for i in opened] == [("bad_batch", 60, 2)]
    others = statistics.median(ranks[60][r] for r in (0, 1, 3))
    assert opened[0].value == ranks[60][2] and opened[0].level == others
    assert opened[0].grad_norm == jump[60]
    assert _feed(IncidentPolicy(CFG), loss, gn, rank_losses=ranks) == []
    balanced = (2.0 + rng.uniform(-0.2, 0.2, (n, world))).tolist()
    healthy_jump = gn.copy()
    healthy_jump[60] *= 2.5
    assert _feed(IncidentPolicy(CFG), [float(np.mean(r)) for r in balanced], healthy_jump,
                 rank_losses=balanced) == []


def test_spike_burst_counts_robust_spikes_within_the_window():
    """burst_spikes (4) robust spikes within burst_window (25) sampled steps: isolated spikes (10,
    40) and three close ones (100, 110, 120) open nothing; 200, 205, 212, 220 open a spike_burst
    named at 220, first step 200."""
    assert (CFG.burst_spikes, CFG.burst_window) == (4, 25)
    n = 300
    loss = 2.0 + _noise(n, 6)
    at = (10, 40, 100, 110, 120, 200, 205, 212, 220)
    spikes = [("grad_norm",) if i in at else () for i in range(n)]
    gn = np.where([bool(s) for s in spikes], 3.0, 1.0)
    opened = _feed(IncidentPolicy(CFG), loss, gn, robust_spikes=spikes)
    assert [(i.kind, i.step, i.first_step, i.value, i.series) for i in opened] == [
        ("spike_burst", 220, 200, 3.0, "grad_norm")]


def test_policy_state_survives_a_checkpoint_mid_excursion():
    base = 2.0 + _noise(100, 7)
    loss = base.copy()
    loss[40:] *= 3.0
    a = IncidentPolicy(CFG)
    _feed(a, loss[:42])
    b = IncidentPolicy(CFG)
    b.load_state_dict(__import__("json").loads(__import__("json").dumps(a.state_dict())))
    for i in range(42, 100):
        ra, rb = a.update(i, float(loss[i]), 1.0), b.update(i, float(loss[i]), 1.0)
        assert ra.to_dict() == rb.to_dict()
    assert a.total["divergence"] == 1


def test_config_keys_are_checked():
    with pytest.raises(ConfigError, match="incidents.level_min"):
        DistgradConfig(incidents={"level_min": 20, "level_window": 16})
    with pytest.raises(ConfigError, match="incidents.divergence_factor"):
        DistgradConfig(incidents={"divergence_factor": 1.0})


# ------------------------------------------------------------------ one decision, online and offline
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).squeeze(-1)


def _run(tmp_path, bug_step: int | None, steps: int = 70):
    """SGD on a noisy linear teacher; loss = mse + w * aux with aux = mean(out^2) and w = 0.01,
    raised 1000x from ``bug_step`` (a weight-schedule bug). Returns the JSONL path and what the
    exporter serves from the last record."""
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.02)
    path = tmp_path / "run.jsonl"
    inst = distgrad.instrument(net, optimizer=opt, exporter={"enabled": False}, sinks={"jsonl": {"path": str(path)}})
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(8, generator=g)
    for step in range(steps):
        x = torch.randn(32, 8, generator=g)
        y = x @ teacher + 0.05 * torch.randn(32, generator=g)
        out = net(x)
        w = 10.0 if bug_step is not None and step >= bug_step else 0.01
        mse, aux = ((out - y) ** 2).mean(), (out ** 2).mean()
        loss = mse + w * aux
        inst.observe_loss(loss, components={"mse": mse, "aux": aux}, weights={"aux": w})
        loss.backward()
        opt.step()
        opt.zero_grad()
    sink = PrometheusSink("127.0.0.1", 0, {"engine": "local", "version": "0"}, 1, serve=False)
    sink.write(inst.last_record)
    inst.close()
    served = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(generate_latest(sink.registry).decode()) for s in f.samples}
    return path, served


def test_weight_schedule_bug_pages_and_the_verdict_says_the_same(tmp_path):
    path, served = _run(tmp_path, bug_step=40)
    recs = list(read_jsonl(path))
    opened = [i for r in recs for i in r.incidents.opened]
    div = [i for i in opened if i.kind == "divergence"]
    assert len(div) == 1
    inc = div[0]
    losses = {r.step: r.loss for r in recs}
    # named at the bug's step, with the loss there, decided divergence_steps sampled steps later
    assert inc.step == 40 and inc.value == losses[40] and inc.decided == 40 + CFG.divergence_steps - 1
    assert inc.component == "aux" and inc.value > CFG.divergence_factor * inc.level
    # the state the alert rules read
    assert served[("distgrad_incidents_total", (("incident", "divergence"),))] == 1.0
    assert served[("distgrad_incident_step", (("incident", "divergence"),))] == 40.0
    assert served[("distgrad_incident_value", (("incident", "divergence"),))] == pytest.approx(losses[40], rel=1e-12)
    assert served[("distgrad_incident_component", (("component", "aux"), ("incident", "divergence")))] == 1.0
    # the offline verdict: the same incident, step and text
    a = analyze(path)
    p = {q.kind: q for q in a.problems}["divergence"]
    assert p.step == 40 and p.detail.startswith(inc.detail) and "runbook.md#verdict-divergence" in p.detail
    # the component's spike detectors watch its weighted contribution: they flag the bug's step
    assert "aux" in next(r for r in recs if r.step == 40).loss_components.flagged


def test_healthy_run_has_no_incident_and_is_healthy(tmp_path):
    path, served = _run(tmp_path, bug_step=None)
    recs = list(read_jsonl(path))
    assert all(r.incidents is not None and r.incidents.opened == [] for r in recs)
    assert {k[1][0][1]: v for k, v in served.items() if k[0] == "distgrad_incidents_total"} == {
        "divergence": 0.0, "bad_batch": 0.0, "spike_burst": 0.0}
    assert not any(k[0].startswith("distgrad_incident_") for k in served)
    assert analyze(path).healthy
