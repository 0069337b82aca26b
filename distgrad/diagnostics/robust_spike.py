"""A paging spike detector for positive training series (loss, global gradient norm) that works
from the first tens of steps: robust statistics of a short, detrended window of log values.

Why another detector: OLMo's window test (:class:`distgrad.diagnostics.detectors.WindowSpikeDetector`, 128
values, 6 population standard deviations) cannot fire before its window is full, and its
standard deviation is inflated by the early descent of the loss still in the window, so a
one-rank garbage batch that doubles the global loss at step 150 scores about 5 sigma and does
not page. ZClip's EMA z-score fires on ~1-2 % of healthy samples (too often to page).

Test, for each positive finite value ``x`` with ``h`` the logs of the previous (at most
``window``) positive finite values, at positions ``0 .. n-1``:

1. trend: the Theil-Sen line of ``h`` (slope = median of the pairwise slopes, intercept =
   median of ``h_i - slope * i``; Sen 1968, Theil 1950), robust to the spikes in the window;
2. prediction ``p = intercept + slope * n`` (the next position), residuals ``r_i`` of ``h``;
3. spread ``s = max(1.4826 * MAD(r), min_spread)`` (MAD: median absolute deviation from the
   median; 1.4826 makes it a standard-deviation estimate for Gaussian noise);
4. score ``z = (log x - p) / s``; a spike iff ``n >= min_samples`` and ``z > k`` and
   ``log x - p > log(min_ratio)``, i.e. the value is both ``k`` robust deviations above the
   trend and at least ``min_ratio`` times the predicted value.

Every tested value, spikes included, then enters the window (the median and MAD ignore a few
outliers, so a spike neither masks the next one nor echoes). Work on logs makes the test
scale-free and treats a doubling the same at loss 0.5 and 5. Non-positive and non-finite
values are skipped (state unchanged, result ``(nan, False)``): non-finite values are counted
by distgrad's non-finite accounting, and a series that can be negative (e.g. a DPO margin)
is not what this detector is for.

Defaults (``window`` 24, ``min_samples`` 8, ``k`` 6, ``min_ratio`` 1.5) were tuned on the
healthy and faulty runs of ``tests/test_causes.py``: no spike on a 300-step healthy run, the
one-rank garbage batch (global loss x2) and a 100x learning-rate blow-up caught on their step
or the next; unit tests in ``tests/test_robust_spike.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from distgrad.diagnostics.detectors import DetectorResult, _as_float, _HistoryMixin

__all__ = ["RobustJumpDetector"]

_NAN = float("nan")


def theil_sen(y: np.ndarray) -> tuple[float, float]:
    """``(intercept, slope)`` of the Theil-Sen line through ``(i, y[i])``, ``len(y) >= 2``."""
    n = len(y)
    i, j = np.triu_indices(n, k=1)
    slope = float(np.median((y[j] - y[i]) / (j - i)))
    return float(np.median(y - slope * np.arange(n))), slope


class RobustJumpDetector(_HistoryMixin):
    """Theil-Sen detrended, MAD-scaled jump test on the log of a positive series (see the
    module docstring for the rule and the source of its defaults).

    Args:
        window: previous values forming the reference (>= 3).
        k: threshold in robust standard deviations (> 0).
        min_ratio: the value must also be at least this many times the trend's prediction
            (> 1); guards against a tiny spread on a very smooth series.
        min_samples: values needed before testing, in [3, window].
        min_spread: floor of the robust spread, in log units (> 0; 0.01 is a 1 % change).
        rate_window: samples over which :attr:`spike_score` is computed.

    Raises:
        ValueError: on out-of-range arguments.
    """

    def __init__(self, window: int = 24, k: float = 6.0, min_ratio: float = 1.5, min_samples: int = 8,
                 min_spread: float = 0.01, rate_window: int = 1000) -> None:
        if int(window) < 3:
            raise ValueError(f"window must be >= 3, got {window}")
        if not (k > 0 and math.isfinite(k)):
            raise ValueError(f"k must be finite and > 0, got {k}")
        if not (min_ratio > 1 and math.isfinite(min_ratio)):
            raise ValueError(f"min_ratio must be finite and > 1, got {min_ratio}")
        if not 3 <= int(min_samples) <= int(window):
            raise ValueError(f"min_samples must be in [3, window={window}], got {min_samples}")
        if not (min_spread > 0 and math.isfinite(min_spread)):
            raise ValueError(f"min_spread must be finite and > 0, got {min_spread}")
        self.window, self.k, self.min_ratio = int(window), float(k), float(min_ratio)
        self.min_samples, self.min_spread = int(min_samples), float(min_spread)
        self._init_rate(rate_window)
        self.reset()

    def update(self, value: float) -> DetectorResult:
        """Test ``value`` against the trend of the previous window, then append its log.

        Returns:
            :class:`DetectorResult`: score ``z`` (robust deviations above the trend), spike
            flag and threshold (the value, in the series' unit, above which this sample would
            have been a spike); score NaN for skipped values and before ``min_samples``.
        """
        x = _as_float(value)
        if not (math.isfinite(x) and x > 0):
            self.n_nonfinite += 1
            return DetectorResult(_NAN, False)
        self.n_seen += 1
        result = self.test(x)
        if len(self._history) >= self.min_samples:
            self._count(result.is_spike)
        self._history.append(math.log(x))
        return result

    def test(self, value: float) -> DetectorResult:
        """What :meth:`update` would return for ``value``, without changing any state (no
        history, no counter): how ``distgrad.diagnostics.action`` decides before the optimizer step, from
        the same window the record's :meth:`update` then uses."""
        x = _as_float(value)
        if not (math.isfinite(x) and x > 0) or len(self._history) < self.min_samples:
            return DetectorResult(_NAN, False)
        lx = math.log(x)
        h = np.fromiter(self._history, dtype=np.float64, count=len(self._history))
        a, b = theil_sen(h)
        pred = a + b * len(h)
        r = h - (a + b * np.arange(len(h)))
        s = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), self.min_spread)
        z = (lx - pred) / s
        margin = max(self.k * s, math.log(self.min_ratio))
        return DetectorResult(z, bool(lx - pred > margin), math.exp(pred + margin))

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (plain Python types); configuration included for reference."""
        return {"kind": "robust", "config": {"window": self.window, "k": self.k, "min_ratio": self.min_ratio,
                                             "min_samples": self.min_samples, "min_spread": self.min_spread},
                **self._history_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the history from :meth:`state_dict` (this instance's configuration is kept).

        Raises:
            ValueError: if ``sd`` is not a robust detector state.
        """
        if sd.get("kind", "robust") != "robust":
            raise ValueError(f"not a RobustJumpDetector state: kind={sd.get('kind')!r}")
        self._load_history_state(sd)
