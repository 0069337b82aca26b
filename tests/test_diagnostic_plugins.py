"""Diagnostics as plug-ins: a failing plug-in is counted and never stops the others, and the
whole diagnostic state (detectors' windows / EMA / warm-up, health streaks, non-finite event)
survives a JSON checkpoint exactly: after a restore, the detectors give the same results as
without the interruption. Single process; the 2-rank restart through a DeepSpeed checkpoint is
in tests/test_diagnostics_multirank.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import distgrad
from distgrad.config import DistgradConfig
from distgrad.diagnostics import (REGISTRY, Diagnostic, Diagnostics, HealthDiagnostic, SpikeDiagnostic,
                                  register)
from distgrad.record import ParamStats, RankCount, StepRecord

NAMES = ["embed.weight", "layers.0.w", "layers.1.w", "head.weight"]
CFG = dict(spikes={"ema_warmup": 5, "window": 6}, health={"patience": 2, "vanish_threshold": 1e-3, "explode_threshold": 50.0})


def _rec(step: int, rng: np.random.Generator, scale: float = 1.0, dead: bool = False, nan: bool = False) -> StepRecord:
    n = len(NAMES)
    sumsq = rng.uniform(0.5, 1.5, n) * scale ** 2
    if dead:
        sumsq[1] = 0.0
    nanc = np.zeros(n)
    if nan:
        nanc[2], sumsq[2] = 1.0, np.nan
    p = ParamStats(NAMES, numel=[4] * n, sum=[0.0] * n, sumsq=sumsq, nan=nanc, inf=[0] * n, zeros=[0] * n,
                   min=[-1.0] * n, max=[1.0] * n)
    return StepRecord(step, step, float(step), 2, p, float(np.sqrt(sumsq.sum())), loss=2.0 + rng.normal() * 0.05,
                      nonfinite_params=[RankCount("layers.1.w", 1, 1, 0, 1)] if nan else None)


def _script(n: int) -> list[StepRecord]:
    """Grad norms with a spike at 14, a dead parameter from 9 to 12, a NaN at 17."""
    rng = np.random.default_rng(5)
    return [_rec(t, rng, scale=30.0 if t == 14 else 1.0, dead=9 <= t <= 12, nan=t == 17) for t in range(n)]


def _out(r: StepRecord) -> str:
    """The diagnostic outputs of a record, as JSON text (so that NaN compares equal)."""
    d = r.to_dict()
    return json.dumps({k: d[k] for k in ("spikes", "health", "aggregates", "provenance", "nonfinite_event")})


def test_restored_diagnostics_continue_exactly_where_they_stopped():
    cfg = DistgradConfig(**CFG)
    recs, recs2, fresh_recs = _script(24), _script(24), _script(24)
    ref = Diagnostics(cfg, NAMES)
    for r in recs:
        ref.on_record(r)
    for cut in (3, 8, 10, 17):  # mid warm-up, after it, inside a health streak, on the NaN event
        a = Diagnostics(cfg, NAMES)
        for r in recs2[:cut]:
            a.on_record(r)
        state = json.loads(json.dumps(a.state_dict()))  # through JSON, as a checkpoint would
        b = Diagnostics(cfg, NAMES)
        b.load_state_dict(state)
        later = _script(24)[cut:]
        for r in later:
            b.on_record(r)
        assert [_out(r) for r in later] == [_out(r) for r in recs[cut:]], cut
    # control: without the state the detectors start a new warm-up (so the test can fail)
    c = Diagnostics(cfg, NAMES)
    for r in fresh_recs[10:]:
        c.on_record(r)
    assert math.isnan(fresh_recs[10].spikes.zscore["grad_norm"]["ema"])
    assert not math.isnan(recs[10].spikes.zscore["grad_norm"]["ema"])
    assert recs[14].spikes.flagged == ["grad_norm"] and recs[23].spikes.total["grad_norm"]["ema"] == 1
    assert recs[10].health.vanishing == ["layers.0.w"]  # 2nd dead sample: flagged (patience 2)


class _Boom(Diagnostic):
    name = "boom"

    def on_record(self, rec: StepRecord) -> None:
        raise RuntimeError("plug-in bug")


def test_a_failing_plugin_is_reported_and_the_others_run():
    where: list[str] = []

    def on_error(w: str) -> None:
        where.append(w)

    d = Diagnostics(DistgradConfig(**CFG), NAMES, plugins=[_Boom, SpikeDiagnostic, HealthDiagnostic],
                    on_error=on_error)
    r = _script(1)[0]
    d.on_record(r)
    assert where == ["diagnostic boom (on_record)"]
    assert r.spikes is not None and r.health is not None and r.aggregates is None  # not in this list


def test_instrument_counts_a_failing_plugin_as_internal_error_and_keeps_going():
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False})
    try:
        dg.diagnostics.plugins.insert(0, _Boom(dg.diagnostics.ctx))
        for _ in range(2):
            m(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert dg.counters["internal_errors"] == 2
        assert dg.last_record.spikes is not None and dg.last_record.aggregates is not None
    finally:
        dg.close()


def test_register_rejects_a_nameless_or_taken_name():
    class NoName(Diagnostic):
        pass

    class Dup(Diagnostic):
        name = "spikes"

    n = len(REGISTRY)
    for cls in (NoName, Dup):
        with pytest.raises(ValueError, match="empty or already registered"):
            register(cls)
    assert len(REGISTRY) == n


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, on purpose
def test_instrument_state_round_trip_and_refusals(tmp_path):
    torch.manual_seed(0)

    def run(dg, m, opt, steps):
        for _ in range(steps):
            dg.observe_loss(m(torch.randn(5, 4)).pow(2).mean())
            m(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    m = nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, spikes={"ema_warmup": 3, "window": 4})
    try:
        run(dg, m, opt, 6)
        sd = dg.state_dict()
        assert json.loads(json.dumps(sd)).keys() == sd.keys()  # JSON-serialisable
        assert sd["counters"]["sampled_steps"] == 6 and sd["version"] == 1
        assert sd["diagnostics"]["plugins"]["spikes"]["grad_norm"]["detectors"]["ema"]["initialized"]
    finally:
        dg.close()
    m2 = nn.Linear(4, 3)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.01)
    dg2 = distgrad.instrument(m2, optimizer=opt2, exporter={"enabled": False}, spikes={"ema_warmup": 3, "window": 4})
    try:
        # the documented carriers: torch.save / torch.load (weights_only default) and DCP (one JSON string)
        torch.save({"distgrad": sd}, tmp_path / "ckpt.pt")
        assert json.dumps(torch.load(tmp_path / "ckpt.pt")["distgrad"]) == json.dumps(sd)
        import torch.distributed.checkpoint as dcp

        dcp.save({"distgrad": json.dumps(sd)}, checkpoint_id=str(tmp_path / "dcp"))
        holder = {"distgrad": ""}
        dcp.load(holder, checkpoint_id=str(tmp_path / "dcp"))
        dg2.load_state_dict(json.loads(holder["distgrad"]))
        assert dg2.counters["sampled_steps"] == 6
        assert dg2.diagnostics.monitors["grad_norm"].state_dict() == dg.diagnostics.monitors["grad_norm"].state_dict()
        with pytest.raises(ValueError, match="Instrument.state_dict"):
            dg2.load_state_dict({"counters": {}})
        with pytest.raises(ValueError, match="version 99"):
            dg2.load_state_dict({**sd, "version": 99})
        with pytest.raises(ValueError, match="7 trainable parameter tensors"):
            dg2.load_state_dict({**sd, "n_params": 7})
        bad = json.loads(json.dumps(sd))
        bad["diagnostics"]["plugins"]["health"] = {"nope": 1}
        with pytest.raises(ValueError, match="plug-in 'health'"):
            dg2.load_state_dict(bad)
    finally:
        dg2.close()
