"""The spike detectors of :mod:`distgrad.diagnostics.detectors` (and the paging
:class:`~distgrad.diagnostics.robust_spike.RobustJumpDetector`) run together on one named series, with
spike counters per detector (the ``detector`` label of ``distgrad_{loss,grad_norm}_spikes_total``).
"""

from __future__ import annotations

import math
from typing import Any

from distgrad.diagnostics.detectors import (
    DETECTOR_LABELS,
    DetectorResult,
    EmaZScoreDetector,
    WindowSpikeDetector,
    _as_float,
)

_NAN = float("nan")


class SpikeMonitor:
    """Both detectors on one named series (``"loss"``, ``"grad_norm"``) with spike counters.

    Args:
        name: series name, used as the key in :meth:`summary` (e.g. ``distgrad_<name>_zscore``).
        ema: an :class:`EmaZScoreDetector` (default-configured one when None).
        window: a :class:`WindowSpikeDetector` (default-configured one when None).
        robust: a :class:`distgrad.diagnostics.robust_spike.RobustJumpDetector` (default-configured one
            when None; False: none, the monitor then runs and reports ``ema`` and ``window`` only).

    Attributes:
        spikes: ``{"ema": int, "window": int}`` spikes detected since creation (the
            ``distgrad_<name>_spikes_total{detector}`` counters).
        last: ``{"ema": DetectorResult, "window": DetectorResult}`` of the last update.
        last_spike_step: ``{"ema": int | None, "window": int | None}`` step of the last spike
            (the ``step`` passed to :meth:`update`, or the update index when none was given).
        n_nonfinite: non-finite values seen (skipped by both detectors).
    """

    def __init__(
        self,
        name: str,
        ema: EmaZScoreDetector | None = None,
        window: WindowSpikeDetector | None = None,
        robust: Any = None,
    ) -> None:
        from distgrad.diagnostics.robust_spike import RobustJumpDetector  # imports this module

        self.name = str(name)
        self.detectors: dict[str, Any] = {
            "ema": ema if ema is not None else EmaZScoreDetector(),
            "window": window if window is not None else WindowSpikeDetector(),
        }
        if robust is not False:  # False: without the robust detector (e.g. loss components)
            self.detectors["robust"] = robust if robust is not None else RobustJumpDetector()
        self.labels = tuple(k for k in DETECTOR_LABELS if k in self.detectors)
        self.spikes = {k: 0 for k in self.labels}
        self.last = {k: DetectorResult(_NAN, False) for k in self.labels}
        self.last_spike_step: dict[str, int | None] = {k: None for k in self.labels}
        self.n_updates = 0
        self.n_nonfinite = 0

    def update(self, value: float | None, step: int | None = None) -> dict[str, DetectorResult]:
        """Feed one sample to both detectors.

        Args:
            value: the sample; None (series not observed this step) is ignored like NaN.
            step: optimizer step, recorded in :attr:`last_spike_step`.

        Returns:
            ``{"ema": DetectorResult, "window": DetectorResult}``.
        """
        x = _NAN if value is None else _as_float(value)
        idx = self.n_updates if step is None else int(step)
        self.n_updates += 1
        if not math.isfinite(x):
            self.n_nonfinite += 1
        out: dict[str, DetectorResult] = {}
        for label in self.labels:
            r = self.detectors[label].update(x)
            out[label] = r
            if r.is_spike:
                self.spikes[label] += 1
                self.last_spike_step[label] = idx
        self.last = out
        return out

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable view of the last update (the record carries
        :class:`distgrad.record.Spikes`)::

            {"zscore": {"ema": float, "window": float},
             "spike": {"ema": bool, "window": bool},
             "spikes_total": {"ema": int, "window": int},
             "spike_score": {"ema": float, "window": float}}
        """
        return {
            "zscore": {k: self.last[k].score for k in self.labels},
            "spike": {k: self.last[k].is_spike for k in self.labels},
            "spikes_total": dict(self.spikes),
            "spike_score": {k: self.detectors[k].spike_score for k in self.labels},
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state of both detectors and the counters."""
        return {
            "name": self.name,
            "detectors": {k: d.state_dict() for k, d in self.detectors.items()},
            "spikes": dict(self.spikes),
            "last_spike_step": dict(self.last_spike_step),
            "n_updates": self.n_updates,
            "n_nonfinite": self.n_nonfinite,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (missing detectors keep their current state)."""
        for k, dsd in sd.get("detectors", {}).items():
            if k in self.detectors:
                self.detectors[k].load_state_dict(dsd)
        self.spikes.update({k: int(v) for k, v in sd.get("spikes", {}).items() if k in self.spikes})
        self.last_spike_step.update(
            {k: (None if v is None else int(v)) for k, v in sd.get("last_spike_step", {}).items()
             if k in self.last_spike_step}
        )
        self.n_updates = int(sd.get("n_updates", 0))
        self.n_nonfinite = int(sd.get("n_nonfinite", 0))
