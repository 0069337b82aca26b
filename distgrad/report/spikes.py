"""Spikes in the report: distgrad's online detectors' output read from the records
(:class:`RecordSpikes`), or, when a run carries none, the rolling median / MAD rule
(:class:`RollingMadSpikes`)."""

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


def _spike_metrics(obj: Any) -> set[str]:
    """Metrics (``"grad_norm"``, ``"loss"``) flagged by a ``record.extra["spikes"]`` value.

    Accepted forms: a list of metric names (``["grad_norm"]``), of dicts with a ``metric`` /
    ``series`` / ``name`` / ``kind`` key, a dict ``{metric: truthy}`` (or one dict with a
    ``metric`` key), or ``True`` (meaning the grad norm). Any name containing ``"loss"`` is the
    loss; any other the grad norm.
    """
    names: list[str] = []
    if obj is True:
        names = ["grad_norm"]
    elif isinstance(obj, dict):
        m = next((obj[k] for k in ("metric", "series", "name", "kind") if isinstance(obj.get(k), str)), None)
        if m is not None:
            names = [m]
        else:
            names = [str(k) for k, v in obj.items() if v]
    elif isinstance(obj, (list, tuple)):
        for it in obj:
            if isinstance(it, str):
                names.append(it)
            elif isinstance(it, dict):
                m = next((it[k] for k in ("metric", "series", "name", "kind") if isinstance(it.get(k), str)), None)
                names.append(m if m is not None else "grad_norm")
            elif it:
                names.append("grad_norm")
    return {"loss" if "loss" in n.lower() else "grad_norm" for n in names}


class RecordSpikes:
    """Spikes flagged by distgrad's online detectors, read from ``record.extra``.

    Three encodings are understood (a record may carry any of them):

    * ``extra["spikes"]``: see :func:`_spike_metrics`;
    * ``extra["<series>_spikes_total"] = {detector: int}`` (cumulative counts, as exported by the
      Prometheus sink): a spike whenever any detector's count grew since the previous record
      that carried it (the first such record is the baseline);
    * ``extra["<series>"] = {"spike": {detector: bool}, ...}`` (``SpikeMonitor.summary()``).

    ``<series>`` is ``grad_norm`` or ``loss``. :attr:`seen` becomes True once any record carried
    detector output, which makes the report use these spikes instead of :class:`RollingMadSpikes`.
    """

    SERIES = ("grad_norm", "loss")

    def __init__(self) -> None:
        self.seen = False
        self._prev: dict[str, dict[str, float]] = {}

    def update(self, extra: dict[str, Any]) -> set[str]:
        """Series flagged on this record (subset of ``{"grad_norm", "loss"}``)."""
        out: set[str] = set()
        if "spikes" in extra:
            self.seen = True
            out |= _spike_metrics(extra.get("spikes"))
        for series in self.SERIES:
            tot = extra.get(f"{series}_spikes_total")
            if isinstance(tot, dict):
                self.seen = True
                cur = {str(k): _to_float(v) for k, v in tot.items()}
                prev = self._prev.get(series)
                if prev is not None and any(v > prev.get(k, 0.0) for k, v in cur.items()):
                    out.add(series)
                self._prev[series] = cur
            mon = extra.get(series)
            if isinstance(mon, dict) and isinstance(mon.get("spike"), dict):
                self.seen = True
                if any(bool(v) for v in mon["spike"].values()):
                    out.add(series)
        return out


def _to_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan
