"""Spikes in the report: distgrad's online detectors' output read from the records
(``record.spikes.flagged``, see :mod:`distgrad.report.analysis`), or, when a run carries none,
the rolling median / MAD rule (:class:`RollingMadSpikes`)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any


class RollingMadSpikes:
    """Upward-spike rule on a stream: rolling median / MAD of the previous ``window`` finite values.

    A finite value ``x`` is a spike when at least ``min_history`` earlier finite values exist and

        x - median > k * max(1.4826 * MAD, rel_floor * |median|)

    where median and MAD (median absolute deviation; 1.4826 * MAD estimates the standard
    deviation of normal data) are taken over the last ``window`` finite values before ``x``
    (spikes included -- the median is robust to them). ``rel_floor`` keeps a flat series from
    flagging tiny wiggles. To bound cost the median and MAD are refreshed every ``refresh``
    values (they lag by fewer than ``refresh`` samples). Non-finite values are never spikes and
    are not added to the window (they are counted as non-finite elsewhere).

    Defaults: ``window=100, k=6.0, rel_floor=0.05, min_history=20, refresh=8``.
    """

    def __init__(self, window: int = 100, k: float = 6.0, rel_floor: float = 0.05,
                 min_history: int = 20, refresh: int = 8) -> None:
        self.window = window
        self.k = k
        self.rel_floor = rel_floor
        self.min_history = min_history
        self.refresh = max(1, refresh)
        self._buf: deque[float] = deque(maxlen=window)
        self._since = self.refresh
        self._thr = math.inf

    def update(self, x: float | None) -> bool:
        """Feed the next value; True if it is a spike."""
        if x is None or not math.isfinite(x):
            return False
        spike = False
        if len(self._buf) >= self.min_history:
            if self._since >= self.refresh:
                med = statistics.median(self._buf)
                mad = statistics.median([abs(v - med) for v in self._buf])
                self._thr = med + self.k * max(1.4826 * mad, self.rel_floor * abs(med))
                self._since = 0
            spike = x > self._thr
        self._buf.append(x)
        self._since += 1
        return spike


def _to_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan
