"""Online spike detectors for scalar training series (loss, global gradient norm).

Two detectors with the same interface, both host-side, single-process, deterministic (plain
float64 arithmetic, no randomness) and NaN-safe:

* :class:`EmaZScoreDetector` -- the z-score test of ZClip (Kumar, Owen, Roy Chowdhury, Gura,
  "ZClip: Adaptive Spike Mitigation for LLM Pre-Training", arXiv:2504.02507, 2025; reference
  implementation ``bluorion-com/ZClip``, ``zclip/zclip.py``): exponential moving averages of
  the mean and variance, one-sided z-score, warm-up initialisation from the first samples.
* :class:`WindowSpikeDetector` -- the spike test of OLMo 2 (Team OLMo, "2 OLMo 2 Furious",
  arXiv:2501.00656, 2024) as implemented by ``allenai/OLMo-core``'s
  ``StabilityMonitorCallback``: a value is a spike when it exceeds the mean of the previous
  ``window`` values by more than ``k_sigma`` population standard deviations; the "spike score"
  is the fraction of spikes among recent samples.

:class:`~distgrad.diagnostics.spike_monitor.SpikeMonitor` (in its own module) runs both on one
named series and keeps spike counters per detector
(the ``detector`` label of ``distgrad_{loss,grad_norm}_spikes_total`` /
``distgrad_{loss,grad_norm}_zscore``, values in :data:`DETECTOR_LABELS`), with a third, paging
detector, :class:`distgrad.diagnostics.robust_spike.RobustJumpDetector` (``robust``: Theil-Sen detrended,
MAD-scaled jumps of the log value, from the first tens of steps).

Non-finite input (NaN, +/-Inf) is never added to any state: ``update`` returns
``DetectorResult(score=nan, is_spike=False)`` and counts it in ``n_nonfinite`` only. Non-finite
losses and gradient norms are reported by distgrad's non-finite accounting, not as spikes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from distgrad.config.sections import SpikesConfig

#: the defaults below are the configuration's (``spikes`` section): one default per setting
_SPIKES = SpikesConfig()

__all__ = [
    "DETECTOR_LABELS",
    "DetectorResult",
    "EmaZScoreDetector",
    "WindowSpikeDetector",
]

#: Values of the ``detector`` metric label, in the order :class:`SpikeMonitor` runs them.
DETECTOR_LABELS = ("ema", "window", "robust")

_NAN = float("nan")


@dataclass(frozen=True)
class DetectorResult:
    """Outcome of one :meth:`update`.

    Attributes:
        score: z-score of the value against the detector's statistics *before* the value was
            added, ``(value - mean) / std`` (dimensionless, one-sided tests use its sign).
            NaN when the value was non-finite, during warm-up, or when the statistics are
            undefined (e.g. zero spread for :class:`WindowSpikeDetector`).
        is_spike: True when the value was judged a spike.
        threshold: the value above which a sample counts as a spike at this update
            (``mean + k * std``, same unit as the series); NaN when ``score`` is NaN.
    """

    score: float
    is_spike: bool
    threshold: float = _NAN


def _as_float(value: Any) -> float:
    """``float(value)`` for Python/numpy numbers and 1-element tensors; NaN if impossible."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: multi-element tensor
        return _NAN


class _RateMixin:
    """Spike-rate bookkeeping shared by the detectors (OLMo-core's ``SpikeScore``)."""

    rate_window: int
    n_evaluated: int
    n_spikes: int
    _spike_at: deque

    def _init_rate(self, rate_window: int) -> None:
        if int(rate_window) < 1:
            raise ValueError(f"rate_window must be >= 1, got {rate_window}")
        self.rate_window = int(rate_window)
        self.n_evaluated = 0  # samples that went through the test (after warm-up)
        self.n_spikes = 0
        # evaluation indices (0-based, in n_evaluated units) of spikes inside the rate window
        self._spike_at = deque()

    def _count(self, is_spike: bool) -> None:
        if is_spike:
            self.n_spikes += 1
            self._spike_at.append(self.n_evaluated)
        self.n_evaluated += 1
        lo = self.n_evaluated - self.rate_window
        while self._spike_at and self._spike_at[0] < lo:
            self._spike_at.popleft()

    @property
    def spike_score(self) -> float:
        """Fraction of spikes among the last ``rate_window`` evaluated samples, in [0, 1].

        OLMo-core's running ``spike/SpikeScore``: NaN until ``rate_window`` samples have been
        evaluated (warm-up / history-filling samples and non-finite values do not count).
        """
        if self.n_evaluated < self.rate_window:
            return _NAN
        return len(self._spike_at) / self.rate_window

    @property
    def spike_score_total(self) -> float:
        """Spikes / evaluated samples since creation (OLMo-core's ``SpikeScore (total)``);
        NaN before the first evaluated sample."""
        return self.n_spikes / self.n_evaluated if self.n_evaluated else _NAN

    def _rate_state(self) -> dict[str, Any]:
        return {
            "n_evaluated": self.n_evaluated,
            "n_spikes": self.n_spikes,
            "spike_at": list(self._spike_at),
        }

    def _load_rate_state(self, sd: dict[str, Any]) -> None:
        self.n_evaluated = int(sd.get("n_evaluated", 0))
        self.n_spikes = int(sd.get("n_spikes", 0))
        lo = self.n_evaluated - self.rate_window
        self._spike_at = deque(int(i) for i in sd.get("spike_at", []) if int(i) >= lo)


class _HistoryMixin(_RateMixin):
    """The bounded history of the windowed detectors (:class:`WindowSpikeDetector`,
    :class:`~distgrad.diagnostics.robust_spike.RobustJumpDetector`): the last ``window`` values, the samples
    seen and the non-finite ones, their reset and their checkpoint state."""

    window: int
    _history: deque
    n_seen: int
    n_nonfinite: int

    def reset(self) -> None:
        """Forget the history and counters."""
        self._history = deque(maxlen=self.window)
        self.n_seen = 0
        self.n_nonfinite = 0
        self._init_rate(self.rate_window)

    def _history_state(self) -> dict[str, Any]:
        return {"history": list(self._history), "n_seen": self.n_seen, "n_nonfinite": self.n_nonfinite,
                **self._rate_state()}

    def _load_history_state(self, sd: dict[str, Any]) -> None:
        """History (truncated to the newest ``window`` values), counters and spike rate."""
        self._history = deque((float(v) for v in sd.get("history", [])), maxlen=self.window)
        self.n_seen = int(sd.get("n_seen", 0))
        self.n_nonfinite = int(sd.get("n_nonfinite", 0))
        self._load_rate_state(sd)


class EmaZScoreDetector(_RateMixin):
    """ZClip's EMA z-score spike test, used for detection only (nothing is clipped).

    Source: Kumar et al. 2025, "ZClip: Adaptive Spike Mitigation for LLM Pre-Training"
    (arXiv:2504.02507), Algorithm 1, and the reference implementation
    ``bluorion-com/ZClip`` (``zclip/zclip.py``), whose defaults (alpha=0.97, z_thresh=2.5,
    warmup_steps=25, eps=1e-6) are kept.

    Algorithm, for each finite value ``x``:

    1. Warm-up: the first ``warmup`` finite values are only buffered. When the buffer is full
       the statistics are initialised as ZClip does: ``mu = mean(buffer)``,
       ``var = mean((buffer - mu)^2)`` (population variance). Warm-up results have score NaN.
    2. Test against the statistics *before* ``x``: ``sigma = sqrt(var)``,
       ``z = (x - mu) / (sigma + eps)``; spike iff ``z > z_threshold`` (one-sided: drops are
       never spikes).
    3. Update, in ZClip's order (the variance uses the *updated* mean)::

           mu  <- alpha * mu  + (1 - alpha) * x_eff
           var <- alpha * var + (1 - alpha) * (x_eff - mu)^2

       where ``x_eff`` depends on ``on_spike``. ZClip updates its EMA with the *clipped* gradient
       norm so that a spike does not inflate the statistics; this detector does not clip, so its
       default ``on_spike="clip"`` does the analogue: ``x_eff = mu + z_threshold * sigma``
       (old ``mu``/``sigma``) when ``x`` is a spike, ``x_eff = x`` otherwise. (ZClip's own
       zscore mode with ``adaptive_scaling`` clips to ``mu + z_thr^2 * sigma / z``; this
       detector uses the boundary of the non-spike region, which is ZClip's ``percentile``-mode
       clip value.) ``on_spike="skip"`` leaves the statistics unchanged on a spike (ZClip's
       ``skip_update_on_spike=True``); ``on_spike="raw"`` updates with ``x`` itself.

    Non-finite values are skipped entirely (state unchanged, result ``(nan, False)``).

    False-positive rate: with the default 2.5 sigma and a ~33-sample EMA memory, a *stationary*
    noisy series (lognormal, 10% spread) fires on ~1-2% of samples (Gaussian tail 0.6%, plus the
    noise of the EMA variance and the skew); series with a downward trend (loss, gradient norm
    in early training) fire far less. ZClip tolerates this because it only clips; for alerting,
    prefer :class:`WindowSpikeDetector` or raise ``z_threshold``.

    Args:
        alpha: EMA smoothing factor in (0, 1); the effective memory is ~``1/(1-alpha)`` samples.
        z_threshold: spike threshold on the z-score (> 0, in standard deviations).
        warmup: number of finite samples used to initialise the statistics (>= 1).
        eps: added to ``sigma`` in the z-score denominator (same unit as the series), as in
            ZClip. It is absolute: for series whose spread is far below ``eps`` it damps z.
        on_spike: ``"clip"`` (default), ``"skip"`` or ``"raw"``, see above.
        rate_window: samples over which :attr:`spike_score` is computed.

    Raises:
        ValueError: on out-of-range arguments.
    """

    def __init__(
        self,
        alpha: float = _SPIKES.ema_alpha,
        z_threshold: float = _SPIKES.ema_z,
        warmup: int = _SPIKES.ema_warmup,
        eps: float = 1e-6,
        on_spike: str = "clip",
        rate_window: int = 1000,
    ) -> None:
        if not (0.0 < alpha < 1.0):
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if not (z_threshold > 0.0 and math.isfinite(z_threshold)):
            raise ValueError(f"z_threshold must be finite and > 0, got {z_threshold}")
        if int(warmup) < 1:
            raise ValueError(f"warmup must be >= 1, got {warmup}")
        if not (eps >= 0.0 and math.isfinite(eps)):
            raise ValueError(f"eps must be finite and >= 0, got {eps}")
        if on_spike not in ("clip", "skip", "raw"):
            raise ValueError(f"on_spike must be 'clip', 'skip' or 'raw', got {on_spike!r}")
        self.alpha = float(alpha)
        self.z_threshold = float(z_threshold)
        self.warmup = int(warmup)
        self.eps = float(eps)
        self.on_spike = on_spike
        self._init_rate(rate_window)
        self.reset()

    def reset(self) -> None:
        """Forget all statistics and counters (back to the start of warm-up)."""
        self._buffer: list[float] = []
        self.initialized = False
        self.mean = _NAN
        self.var = _NAN
        self.n_seen = 0  # finite samples consumed, warm-up included
        self.n_nonfinite = 0
        self._init_rate(self.rate_window)

    @property
    def std(self) -> float:
        """Current EMA standard deviation ``sqrt(var)`` (NaN during warm-up)."""
        return math.sqrt(self.var) if self.initialized else _NAN

    def update(self, value: float) -> DetectorResult:
        """Test ``value`` and fold it into the statistics.

        Args:
            value: the new sample (Python/numpy float or a 1-element tensor).

        Returns:
            :class:`DetectorResult`; score NaN during warm-up and for non-finite values.
        """
        x = _as_float(value)
        if not math.isfinite(x):
            self.n_nonfinite += 1
            return DetectorResult(_NAN, False)
        self.n_seen += 1
        if not self.initialized:
            self._buffer.append(x)
            if len(self._buffer) >= self.warmup:
                buf = np.asarray(self._buffer, dtype=np.float64)
                self.mean = float(buf.mean())
                self.var = float(np.mean((buf - self.mean) ** 2))
                self.initialized = True
                self._buffer = []
            return DetectorResult(_NAN, False)

        mu, sigma = self.mean, math.sqrt(self.var)
        z = (x - mu) / (sigma + self.eps)
        boundary = mu + self.z_threshold * sigma
        spike = bool(z > self.z_threshold)
        self._count(spike)
        if spike and self.on_spike == "skip":
            return DetectorResult(z, True, boundary)
        x_eff = boundary if (spike and self.on_spike == "clip") else x
        a = self.alpha
        self.mean = a * mu + (1.0 - a) * x_eff
        self.var = a * self.var + (1.0 - a) * (x_eff - self.mean) ** 2
        return DetectorResult(z, spike, boundary)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (plain Python types); configuration included for reference."""
        return {
            "kind": "ema",
            "config": {
                "alpha": self.alpha,
                "z_threshold": self.z_threshold,
                "warmup": self.warmup,
                "eps": self.eps,
                "on_spike": self.on_spike,
                "rate_window": self.rate_window,
            },
            "buffer": list(self._buffer),
            "initialized": self.initialized,
            "mean": self.mean,
            "var": self.var,
            "n_seen": self.n_seen,
            "n_nonfinite": self.n_nonfinite,
            **self._rate_state(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the statistics from :meth:`state_dict`; this instance's configuration
        (alpha, threshold, ...) is kept.

        Raises:
            ValueError: if ``sd`` is not an EMA detector state.
        """
        if sd.get("kind", "ema") != "ema":
            raise ValueError(f"not an EmaZScoreDetector state: kind={sd.get('kind')!r}")
        self._buffer = [float(v) for v in sd.get("buffer", [])]
        self.initialized = bool(sd.get("initialized", False))
        self.mean = float(sd.get("mean", _NAN))
        self.var = float(sd.get("var", _NAN))
        self.n_seen = int(sd.get("n_seen", 0))
        self.n_nonfinite = int(sd.get("n_nonfinite", 0))
        if not self.initialized and len(self._buffer) >= self.warmup:
            # the saved buffer already fills this instance's (smaller) warm-up
            buf, self._buffer = self._buffer, []
            self.n_seen -= len(buf)
            for v in buf:
                self.update(v)
        self._load_rate_state(sd)


class WindowSpikeDetector(_HistoryMixin):
    """OLMo 2's rolling-window spike test.

    Source: Team OLMo, "2 OLMo 2 Furious" (arXiv:2501.00656), whose stability analysis counts
    loss / gradient-norm spikes as values more than 6 standard deviations above the mean of the
    preceding 128 values, as implemented in ``allenai/OLMo-core``
    (``train/callbacks/stability_monitor.py``, ``StabilityMonitorCallback``: ``window_size=128``,
    ``threshold_std=6.0``, population std, no test until the window is full, no spike when
    std < 1e-10, every finite value -- spikes included -- appended to the history).

    For each finite ``x``, with ``h`` the previous (at most ``window``) finite values:
    ``m = mean(h)``, ``s = sqrt(mean((h - m)^2))``; score ``(x - m) / s``; spike iff
    ``len(h) >= min_samples`` and ``s >= min_std`` and ``x > m + k_sigma * s``. Then ``x`` is
    appended to ``h`` (the oldest value drops out). Because spikes enter the history, one spike
    raises ``s`` for the next ``window`` samples (which keeps echoes from being counted).

    Non-finite values are skipped entirely (state unchanged, result ``(nan, False)``).

    Args:
        window: number of previous values forming the reference (>= 2).
        k_sigma: threshold in population standard deviations (> 0).
        min_samples: values needed in the history before testing; default ``window``
            (OLMo-core tests only with a full window). Must be in [2, window].
        min_std: spreads below this (same unit as the series) make the test undefined: score
            NaN, no spike (OLMo-core: 1e-10).
        rate_window: samples over which :attr:`spike_score` is computed (OLMo-core's
            ``rolling_window``, default 10000 there; 1000 here because distgrad samples steps).

    Raises:
        ValueError: on out-of-range arguments.
    """

    def __init__(
        self,
        window: int = _SPIKES.window,
        k_sigma: float = _SPIKES.window_sigma,
        min_samples: int | None = None,
        min_std: float = 1e-10,
        rate_window: int = 1000,
    ) -> None:
        if int(window) < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not (k_sigma > 0.0 and math.isfinite(k_sigma)):
            raise ValueError(f"k_sigma must be finite and > 0, got {k_sigma}")
        ms = int(window) if min_samples is None else int(min_samples)
        if not (2 <= ms <= int(window)):
            raise ValueError(f"min_samples must be in [2, window={window}], got {min_samples}")
        if not (min_std >= 0.0 and math.isfinite(min_std)):
            raise ValueError(f"min_std must be finite and >= 0, got {min_std}")
        self.window = int(window)
        self.k_sigma = float(k_sigma)
        self.min_samples = ms
        self.min_std = float(min_std)
        self._init_rate(rate_window)
        self.reset()

    @property
    def history(self) -> list[float]:
        """The reference values (oldest first), a copy."""
        return list(self._history)

    def update(self, value: float) -> DetectorResult:
        """Test ``value`` against the previous window, then append it.

        Args:
            value: the new sample (Python/numpy float or a 1-element tensor).

        Returns:
            :class:`DetectorResult`; score NaN for non-finite values, while fewer than
            ``min_samples`` values are held, and when the spread is below ``min_std``.
        """
        x = _as_float(value)
        if not math.isfinite(x):
            self.n_nonfinite += 1
            return DetectorResult(_NAN, False)
        self.n_seen += 1
        result = DetectorResult(_NAN, False)
        if len(self._history) >= self.min_samples:
            h = np.fromiter(self._history, dtype=np.float64, count=len(self._history))
            m = float(h.mean())
            s = math.sqrt(float(np.mean((h - m) ** 2)))
            if s >= self.min_std and s > 0.0:
                z = (x - m) / s
                thr = m + self.k_sigma * s
                spike = bool(x > thr)
                result = DetectorResult(z, spike, thr)
            self._count(result.is_spike)
        self._history.append(x)
        return result

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (plain Python types); configuration included for reference."""
        return {
            "kind": "window",
            "config": {
                "window": self.window,
                "k_sigma": self.k_sigma,
                "min_samples": self.min_samples,
                "min_std": self.min_std,
                "rate_window": self.rate_window,
            },
            **self._history_state(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the history from :meth:`state_dict`; this instance's configuration is kept
        (a longer saved history is truncated to the newest ``window`` values).

        Raises:
            ValueError: if ``sd`` is not a window detector state.
        """
        if sd.get("kind", "window") != "window":
            raise ValueError(f"not a WindowSpikeDetector state: kind={sd.get('kind')!r}")
        self._load_history_state(sd)
