"""The robust jump detector (distgrad/diagnostics/robust_spike.py) against its definition, recomputed here
with the standard library (pairwise slopes, statistics.median)."""

from __future__ import annotations

import json
import math
import random
import statistics

import numpy as np
import pytest

from distgrad.diagnostics.robust_spike import RobustJumpDetector, theil_sen


def _reference(history: list[float], x: float, k: float, ratio: float, floor: float) -> tuple[float, bool]:
    h = [math.log(v) for v in history]
    n = len(h)
    slope = statistics.median((h[j] - h[i]) / (j - i) for i in range(n) for j in range(i + 1, n))
    a = statistics.median(h[i] - slope * i for i in range(n))
    r = [h[i] - (a + slope * i) for i in range(n)]
    mr = statistics.median(r)
    s = max(1.4826 * statistics.median(abs(v - mr) for v in r), floor)
    d = math.log(x) - (a + slope * n)
    return d / s, d > max(k * s, math.log(ratio))


def test_scores_and_decisions_match_the_definition():
    rnd = random.Random(1)
    xs = [2.0 * math.exp(-0.01 * i) * math.exp(rnd.gauss(0, 0.05)) for i in range(80)]
    xs[50] *= 2.2
    det = RobustJumpDetector(window=24, k=6.0, min_ratio=1.5, min_samples=8)
    for i, x in enumerate(xs):
        r = det.update(x)
        hist = xs[max(0, i - 24):i]
        if len(hist) < 8:
            assert math.isnan(r.score) and not r.is_spike
            continue
        z, spike = _reference(hist, x, 6.0, 1.5, 0.01)
        assert r.score == pytest.approx(z, rel=1e-9)
        assert r.is_spike == spike
    assert det.n_spikes == 1


def test_theil_sen_recovers_a_line_despite_outliers():
    y = np.arange(20) * 0.5 + 3.0
    y[[3, 11]] += 40.0
    a, b = theil_sen(y)
    assert a == pytest.approx(3.0) and b == pytest.approx(0.5)


def test_a_steep_smooth_descent_is_not_a_spike_but_a_doubling_is():
    det = RobustJumpDetector()
    xs = [10.0 * math.exp(-0.08 * i) for i in range(40)]  # loss falling 8 % per step
    assert not any(det.update(x).is_spike for x in xs)
    assert det.update(2.0 * xs[-1] * math.exp(-0.08)).is_spike


def test_nonpositive_and_nonfinite_values_are_skipped_and_state_round_trips():
    det = RobustJumpDetector(min_samples=3)
    for v in (1.0, 1.1, 0.9, 1.0):
        det.update(v)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        r = det.update(bad)
        assert math.isnan(r.score) and not r.is_spike
    assert det.n_nonfinite == 4 and det.n_seen == 4
    other = RobustJumpDetector(min_samples=3)
    other.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert other.update(1.05).score == det.update(1.05).score
    with pytest.raises(ValueError):
        other.load_state_dict({"kind": "window"})
    with pytest.raises(ValueError):
        RobustJumpDetector(min_ratio=1.0)
