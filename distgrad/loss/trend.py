"""Trend of the training loss (its plug-in: :mod:`distgrad.diagnostics.loss`): the ordinary
least-squares slope of the loss against the optimizer step over the last ``trend_window``
steps, per 1000 steps, with its standard error, and a plateau flag.

Fit (textbook simple linear regression, e.g. Montgomery & Runger, "Applied Statistics and
Probability for Engineers", ch. 11): for points ``(x_i, y_i)``, ``i = 1..n`` (x the step, y the
sampled step's loss, non-finite losses left out), ``Sxx = sum (x - mean x)^2``,
``slope = sum (x - mean x)(y - mean y) / Sxx``, residual variance ``s^2 = SSE / (n - 2)``,
``stderr(slope) = sqrt(s^2 / Sxx)``; both multiplied by 1000 (per 1k steps). Fewer than 3 points
(or all at one step): NaN. Computed on the host on every rank from the records (identical on
all ranks; no collective), in float64, centred for accuracy.

Plateau: the window's points span at least ``plateau_fraction`` (0.9) of ``trend_window`` and
``|slope| <= plateau_z * stderr`` (default 2: the slope is within about two standard errors of 0,
i.e. a flat loss cannot be told apart from noise over that span). Memory: one ``(step, loss)``
pair per sampled step in the window.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from distgrad.record import LossTrend


def ols_slope(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``(slope, stderr)`` of the least-squares line of ``y`` on ``x`` (float64 arrays of equal
    length); NaN for fewer than 3 points or no spread in ``x``."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = len(x)
    if n < 3:
        return float("nan"), float("nan")
    xc, yc = x - x.mean(), y - y.mean()
    sxx = float(xc @ xc)
    if sxx <= 0:
        return float("nan"), float("nan")
    slope = float(xc @ yc) / sxx
    sse = float(np.sum((yc - slope * xc) ** 2))
    return slope, math.sqrt(sse / (n - 2) / sxx)


class TrendTracker:
    """The loss trend over a sliding window of optimizer steps.

    Args:
        window: span in optimizer steps (>= 2).
        plateau_z: plateau when ``|slope| <= plateau_z * stderr`` (> 0).
        plateau_fraction: ... and the points span at least this fraction of ``window``.
    """

    def __init__(self, window: int, plateau_z: float = 2.0, plateau_fraction: float = 0.9) -> None:
        self.window, self.z, self.fraction = int(window), float(plateau_z), float(plateau_fraction)
        self.points: deque[tuple[int, float]] = deque()

    def update(self, step: int, loss: float | None) -> LossTrend | None:
        """Add the loss of sampled step ``step`` (None or non-finite: not added) and return the
        trend over ``(step - window, step]``; None while no loss has been seen."""
        if loss is not None and math.isfinite(loss):
            self.points.append((int(step), float(loss)))
        while self.points and self.points[0][0] <= step - self.window:
            self.points.popleft()
        if not self.points:
            return None
        x = np.array([p[0] for p in self.points], dtype=np.float64)
        y = np.array([p[1] for p in self.points], dtype=np.float64)
        slope, se = ols_slope(x, y)
        span = x[-1] - x[0] if len(x) else 0.0
        plateau = bool(math.isfinite(slope) and span >= self.fraction * (self.window - 1)
                       and abs(slope) <= self.z * se)
        return LossTrend(window=self.window, points=len(x), slope_per_1k=slope * 1000.0, stderr_per_1k=se * 1000.0,
                         plateau=plateau)

    def state_dict(self) -> dict[str, Any]:
        """The window's points (for checkpoints)."""
        return {"points": [list(p) for p in self.points]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.points = deque((int(s), float(v)) for s, v in sd.get("points", []))

