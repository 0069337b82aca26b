"""A non-finite *event* is a streak of consecutive non-finite sampled steps. In fp32/bf16 a NaN
applied by the optimizer spreads into every weight, so later steps of the streak are non-finite
everywhere; what pages must name the streak's first step (where it started). Checked through
Diagnostics and the Prometheus collector with hand-built records."""

from __future__ import annotations

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from distgrad.config import DistgradConfig
from distgrad.diagnostics import Diagnostics
from distgrad.record import ParamStats, RankCount, StepRecord
from distgrad.export.prometheus import PrometheusSink

NAMES = ["embed.weight", "layers.0.w", "layers.1.w", "head.weight"]


def _rec(step, nan_in):
    n = len(NAMES)
    nan = np.array([1.0 if i in nan_in else 0.0 for i in range(n)])
    sumsq = np.where(nan > 0, np.nan, 4.0)
    p = ParamStats(NAMES, numel=[4] * n, sum=[0.0] * n, sumsq=sumsq, nan=nan, inf=[0] * n, zeros=[0] * n,
                   min=np.where(nan > 0, np.nan, -1.0), max=np.where(nan > 0, np.nan, 1.0))
    rows = [RankCount(param=NAMES[i], rank=1, nan=1, inf=0, count=1) for i in nan_in]
    return StepRecord(step, step, float(step), 2, p, float(np.sqrt(np.sum(sumsq))),
                      nonfinite_params=rows if nan_in else None)


def _series(sink, name):
    out = []
    for fam in text_string_to_metric_families(generate_latest(sink.registry).decode()):
        out += [(dict(s.labels), s.value) for s in fam.samples if s.name == name]
    return out


def test_event_is_the_first_step_of_a_streak_and_stays_after_it(caplog):
    diag = Diagnostics(DistgradConfig(), NAMES)
    sink = PrometheusSink("127.0.0.1", 0, {}, 2, serve=False)
    seq = [(4, []), (5, [2]), (6, [0, 1, 2, 3]), (7, [0, 1, 2, 3]), (8, []), (9, [])]
    with caplog.at_level("WARNING", logger="distgrad"):
        for step, bad in seq:
            r = _rec(step, bad)
            diag.on_record(r)
            sink.write(r)
    assert [m for m in caplog.messages if "non-finite gradients" in m] == [caplog.messages[0]]  # once
    assert "step 5" in caplog.messages[0] and "layers.1.w" in caplog.messages[0]
    # where it started: the streak's first step; the backward-order view keeps its old labels under
    # the name of what it is (not an origin)
    assert _series(sink, "distgrad_nonfinite_origin_step") == [({}, 5.0)]
    assert _series(sink, "distgrad_nonfinite_last_param_in_forward_order") == [
        ({"param": "layers.1.w", "layer": "1"}, 5.0)]
    assert _series(sink, "distgrad_nonfinite_params") == [({"param": "layers.1.w", "rank": "1"}, 1.0)]
    # a new streak later is a new event
    r = _rec(10, [0])
    diag.on_record(r)
    sink.write(r)
    assert _series(sink, "distgrad_nonfinite_origin_step") == [({}, 10.0)]
    assert _series(sink, "distgrad_nonfinite_last_param_in_forward_order") == [
        ({"param": "embed.weight", "layer": "other"}, 10.0)]
