import json
import math
import statistics

import numpy as np
import pytest

from distgrad.diagnostics.detectors import (
    DETECTOR_LABELS,
    DetectorResult,
    EmaZScoreDetector,
    WindowSpikeDetector,
)
from distgrad.diagnostics.spike_monitor import SpikeMonitor


def healthy_series(seed: int, n: int = 400) -> np.ndarray:
    """Lognormal noise (5% spread) around a decaying trend, like an early-training grad norm."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return (1.0 + 2.0 * np.exp(-t / 150.0)) * np.exp(0.05 * rng.standard_normal(n))


def ema_reference(x: np.ndarray, alpha: float, warmup: int, eps: float) -> np.ndarray:
    """ZClip's recursion (no spikes) in closed form: mu_k and var_k as exponentially weighted
    sums with explicit weight matrices, instead of the step-by-step update."""
    x = np.asarray(x, dtype=np.float64)
    w0 = x[:warmup]
    mu0 = w0.sum() / warmup
    var0 = ((w0 - mu0) ** 2).sum() / warmup
    y = x[warmup:]
    n = len(y)
    k = np.arange(1, n + 1)
    # L[k-1, i-1] = alpha^(k-i) for i <= k
    expo = k[:, None] - k[None, :]
    L = np.where(expo >= 0, alpha ** np.maximum(expo, 0), 0.0)
    mu = alpha**k * mu0 + (1 - alpha) * (L @ y)  # mu_1..mu_n
    var = alpha**k * var0 + (1 - alpha) * (L @ ((y - mu) ** 2))
    mu_prev = np.concatenate([[mu0], mu[:-1]])
    var_prev = np.concatenate([[var0], var[:-1]])
    z = (y - mu_prev) / (np.sqrt(var_prev) + eps)
    return np.concatenate([np.full(warmup, np.nan), z])


def test_ema_scores_match_closed_form_reference():
    x = healthy_series(0)
    det = EmaZScoreDetector(alpha=0.97, z_threshold=2.5, warmup=25)
    res = [det.update(v) for v in x]
    got = np.array([r.score for r in res])
    ref = ema_reference(x, 0.97, 25, 1e-6)
    assert not any(r.is_spike for r in res)
    assert np.all(np.isnan(got[:25]))
    np.testing.assert_allclose(got[25:], ref[25:], rtol=1e-10, atol=1e-12)


def test_window_scores_match_explicit_windows():
    x = healthy_series(1, n=300)
    det = WindowSpikeDetector(window=128, k_sigma=6.0)
    got = [det.update(v) for v in x]
    for i, r in enumerate(got):
        if i < 128:
            assert math.isnan(r.score) and not r.is_spike
            continue
        win = [float(v) for v in x[i - 128 : i]]
        m = statistics.fmean(win)
        s = statistics.pstdev(win)
        assert r.score == pytest.approx((x[i] - m) / s, rel=1e-10)
        assert r.threshold == pytest.approx(m + 6.0 * s, rel=1e-12)
        assert r.is_spike == (x[i] > m + 6.0 * s)
    assert det.history == pytest.approx(list(x[-128:]))


@pytest.mark.parametrize("seed", range(5))
def test_spike_injection_fires_once_at_the_step(seed):
    x = healthy_series(seed)
    spike_at = 250
    x[spike_at] *= 100.0
    ema, win = EmaZScoreDetector(), WindowSpikeDetector()
    mon = SpikeMonitor("grad_norm")
    ema_hits = [i for i, v in enumerate(x) if ema.update(v).is_spike]
    win_hits = [i for i, v in enumerate(x) if win.update(v).is_spike]
    for i, v in enumerate(x):
        mon.update(v, step=1000 + i)
    assert ema_hits == [spike_at]
    assert win_hits == [spike_at]
    assert mon.spikes == {"ema": 1, "window": 1, "robust": 1}
    assert mon.last_spike_step == {"ema": 1000 + spike_at, "window": 1000 + spike_at, "robust": 1000 + spike_at}


def test_ema_spike_updates_with_boundary_value():
    x = healthy_series(2, n=100)
    det = EmaZScoreDetector(alpha=0.9, z_threshold=2.5, warmup=10)
    for v in x:
        det.update(v)
    mu, var = det.mean, det.var
    sigma = math.sqrt(var)
    r = det.update(mu + 1000 * sigma)
    assert r.is_spike
    assert r.score == pytest.approx(1000 * sigma / (sigma + 1e-6), rel=1e-12)
    b = mu + 2.5 * sigma
    assert r.threshold == pytest.approx(b, rel=1e-15)
    mu_new = 0.9 * mu + 0.1 * b
    assert det.mean == pytest.approx(mu_new, rel=1e-15)
    assert det.var == pytest.approx(0.9 * var + 0.1 * (b - mu_new) ** 2, rel=1e-13)


def test_ema_on_spike_skip_and_raw():
    x = healthy_series(3, n=60)
    skip = EmaZScoreDetector(warmup=10, on_spike="skip")
    raw = EmaZScoreDetector(warmup=10, on_spike="raw")
    for v in x:
        skip.update(v)
        raw.update(v)
    before = skip.state_dict()
    big = skip.mean * 100
    assert skip.update(big).is_spike
    after = skip.state_dict()
    assert (after["mean"], after["var"]) == (before["mean"], before["var"])
    mu = raw.mean
    assert raw.update(big).is_spike
    assert raw.mean == pytest.approx(0.97 * mu + 0.03 * big)


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), float("-inf"), None, np.float32("nan")]
)
@pytest.mark.parametrize("phase", [5, 60, 200])
def test_nonfinite_does_not_change_state(bad, phase):
    x = healthy_series(4)
    for det in (EmaZScoreDetector(), WindowSpikeDetector(window=32)):
        for v in x[:phase]:
            det.update(v)
        before = json.dumps(det.state_dict())
        r = det.update(bad)
        assert math.isnan(r.score) and r.is_spike is False
        sd = det.state_dict()
        assert sd.pop("n_nonfinite") == json.loads(before).pop("n_nonfinite") + 1
        b = json.loads(before)
        b.pop("n_nonfinite")
        assert json.loads(json.dumps(sd)) == b


def test_detection_still_works_after_nan():
    x = healthy_series(5).astype(object)
    x[200] = float("nan")
    x[201] = float("inf")
    x[230] = float(x[230]) * 100
    for det in (EmaZScoreDetector(), WindowSpikeDetector()):
        hits = [i for i, v in enumerate(x) if det.update(v).is_spike]
        assert hits == [230]
        assert det.n_nonfinite == 2


def test_warmup_suppresses():
    x = list(healthy_series(6, n=60))
    x[10] *= 1000  # inside warm-up
    ema = EmaZScoreDetector(warmup=25)
    res = [ema.update(v) for v in x]
    assert all(math.isnan(r.score) and not r.is_spike for r in res[:25])
    assert ema.initialized and ema.n_evaluated == 35
    win = WindowSpikeDetector(window=128, min_samples=20)
    res = [win.update(v) for v in x]
    assert not any(r.is_spike for r in res[:20])
    assert math.isnan(res[19].score) and not math.isnan(res[20].score)
    # the warm-up spike inflated the statistics, documented behaviour: no later alarm either
    assert not any(r.is_spike for r in res)


def test_window_zero_spread_is_undefined():
    det = WindowSpikeDetector(window=8)
    for _ in range(8):
        det.update(1.0)
    r = det.update(100.0)
    assert math.isnan(r.score) and not r.is_spike


def test_state_dict_roundtrip_continues_identically():
    x = healthy_series(7)
    x[300] *= 50
    for make in (EmaZScoreDetector, lambda: WindowSpikeDetector(window=64)):
        a = make()
        for v in x[:150]:
            a.update(v)
        b = make()
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        ra = [a.update(v) for v in x[150:]]
        rb = [b.update(v) for v in x[150:]]
        assert [(r.score, r.is_spike) for r in ra] == [(r.score, r.is_spike) for r in rb]
        assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError):
        EmaZScoreDetector().load_state_dict(WindowSpikeDetector().state_dict())


def test_ema_load_with_smaller_warmup_initialises():
    x = healthy_series(8, n=20)
    a = EmaZScoreDetector(warmup=25)
    for v in x:
        a.update(v)
    b = EmaZScoreDetector(warmup=10)
    b.load_state_dict(a.state_dict())
    assert b.initialized and b.n_seen == 20


def test_spike_score_rolling_fraction():
    det = WindowSpikeDetector(window=16, k_sigma=3.0, rate_window=50)
    rng = np.random.default_rng(9)
    x = 1.0 + 0.01 * rng.standard_normal(300)
    spikes = {40, 60, 200}
    for i in spikes:
        x[i] = 10.0
    flags = [det.update(v).is_spike for v in x]
    assert [i for i, f in enumerate(flags) if f] == sorted(spikes)
    # evaluated samples start at index 16; the last 50 evaluated are indices 250..299
    assert det.spike_score == 0.0
    assert det.spike_score_total == pytest.approx(3 / (300 - 16))
    det2 = WindowSpikeDetector(window=16, k_sigma=3.0, rate_window=50)
    for v in x[:230]:
        det2.update(v)
    assert det2.spike_score == pytest.approx(1 / 50)  # only the spike at 200 in 180..229
    assert math.isnan(WindowSpikeDetector().spike_score)


def test_monitor_summary_and_state():
    mon = SpikeMonitor(
        "loss", ema=EmaZScoreDetector(warmup=5), window=WindowSpikeDetector(window=8)
    )
    x = healthy_series(10, n=40)
    x[30] *= 100
    for i, v in enumerate(x):
        out = mon.update(v)
        assert set(out) == set(DETECTOR_LABELS)
        assert all(isinstance(r, DetectorResult) for r in out.values())
    mon.update(None)
    assert mon.n_nonfinite == 1
    s = mon.summary()
    json.dumps(s)
    assert s["spikes_total"] == mon.spikes and mon.spikes["ema"] >= 1 and mon.spikes["window"] >= 1
    assert mon.last_spike_step["window"] == 30
    m2 = SpikeMonitor("loss", ema=EmaZScoreDetector(warmup=5), window=WindowSpikeDetector(window=8))
    m2.load_state_dict(json.loads(json.dumps(mon.state_dict())))
    assert m2.state_dict() == mon.state_dict()


def test_tensor_input_and_validation():
    torch = pytest.importorskip("torch")
    det = EmaZScoreDetector(warmup=1)
    det.update(torch.tensor(2.0))
    assert det.mean == 2.0
    assert math.isnan(det.update(torch.tensor([1.0, 2.0])).score)  # not a scalar: skipped
    for kw in ({"alpha": 1.0}, {"z_threshold": 0}, {"warmup": 0}, {"on_spike": "x"}, {"eps": -1}):
        with pytest.raises(ValueError):
            EmaZScoreDetector(**kw)
    for kw in ({"window": 1}, {"k_sigma": -1}, {"min_samples": 1}, {"window": 8, "min_samples": 9}):
        with pytest.raises(ValueError):
            WindowSpikeDetector(**kw)
