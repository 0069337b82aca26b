"""Bounded-memory downsampling of a stream of per-step columns (see :class:`Downsampler`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Downsampled:
    """Result of :class:`Downsampler`: ``B`` buckets (B <= max_buckets) of ``C`` columns.

    Attributes:
        step_first, step_last: int64 ``[B]``, first/last step of each bucket.
        records: int64 ``[B]``, records in each bucket (all equal but the last).
        min, max, last: float64 ``[B, C]``: min/max of the finite values (NaN if none) and the
            last value (finite or NaN) of each column in each bucket.
        counts: float64 ``[B, K]``: per-bucket sums of the count columns.
        width: records per full bucket.
    """

    step_first: np.ndarray
    step_last: np.ndarray
    records: np.ndarray
    min: np.ndarray
    max: np.ndarray
    last: np.ndarray
    counts: np.ndarray
    width: int

    @property
    def x(self) -> np.ndarray:
        """Plot abscissa: bucket mid-step (float64 ``[B]``)."""
        return (self.step_first + self.step_last) / 2.0


class Downsampler:
    """Streaming min/max/last downsampling of a multi-column series into <= ``max_buckets`` buckets.

    Args:
        n_cols: value columns (can grow with :meth:`grow`).
        n_counts: count columns summed per bucket (can grow with :meth:`grow`).
        max_buckets: even number >= 2 of buckets kept.

    Raises:
        ValueError: if ``max_buckets`` is odd or < 2.
    """

    def __init__(self, n_cols: int, n_counts: int = 0, max_buckets: int = 1024) -> None:
        if max_buckets < 2 or max_buckets % 2:
            raise ValueError(f"max_buckets must be an even number >= 2, got {max_buckets}")
        self.max_buckets = max_buckets
        self.width = 1
        self.n = 0
        self.n_cols = n_cols
        self.n_counts = n_counts
        B = max_buckets
        self._mn = np.full((B, n_cols), np.nan)
        self._mx = np.full((B, n_cols), np.nan)
        self._last = np.full((B, n_cols), np.nan)
        self._cnt = np.zeros((B, n_counts))
        self._s0 = np.zeros(B, np.int64)
        self._s1 = np.zeros(B, np.int64)
        self._rec = np.zeros(B, np.int64)
        self._k = 0
        self._cmn = np.full(n_cols, np.nan)
        self._cmx = np.full(n_cols, np.nan)
        self._clast = np.full(n_cols, np.nan)
        self._ccnt = np.zeros(n_counts)
        self._cs0 = self._cs1 = 0

    def grow(self, n_cols: int, n_counts: int | None = None) -> None:
        """Widen to ``n_cols`` value columns (and ``n_counts`` count columns); new ones are NaN/0."""
        if n_cols > self.n_cols:
            extra = n_cols - self.n_cols
            pad = ((0, 0), (0, extra))
            self._mn = np.pad(self._mn, pad, constant_values=np.nan)
            self._mx = np.pad(self._mx, pad, constant_values=np.nan)
            self._last = np.pad(self._last, pad, constant_values=np.nan)
            self._cmn = np.pad(self._cmn, (0, extra), constant_values=np.nan)
            self._cmx = np.pad(self._cmx, (0, extra), constant_values=np.nan)
            self._clast = np.pad(self._clast, (0, extra), constant_values=np.nan)
            self.n_cols = n_cols
        if n_counts is not None and n_counts > self.n_counts:
            extra = n_counts - self.n_counts
            self._cnt = np.pad(self._cnt, ((0, 0), (0, extra)))
            self._ccnt = np.pad(self._ccnt, (0, extra))
            self.n_counts = n_counts

    def add(self, step: int, values: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Add one record: ``values`` float ``[n_cols]`` (non-finite allowed), ``counts`` ``[n_counts]``."""
        fin = np.where(np.isfinite(values), values, np.nan)
        if self._k == 0:
            self._cmn[:] = fin
            self._cmx[:] = fin
            self._ccnt[:] = 0.0
            self._cs0 = step
        else:
            np.fmin(self._cmn, fin, out=self._cmn)
            np.fmax(self._cmx, fin, out=self._cmx)
        self._clast[:] = values
        if counts is not None:
            self._ccnt += counts
        self._cs1 = step
        self._k += 1
        if self._k == self.width:
            self._store()

    def _store(self) -> None:
        i = self.n
        self._mn[i] = self._cmn
        self._mx[i] = self._cmx
        self._last[i] = self._clast
        self._cnt[i] = self._ccnt
        self._s0[i] = self._cs0
        self._s1[i] = self._cs1
        self._rec[i] = self._k
        self.n += 1
        self._k = 0
        if self.n == self.max_buckets:
            h = self.max_buckets // 2
            self._mn[:h] = np.fmin(self._mn[0::2], self._mn[1::2])
            self._mx[:h] = np.fmax(self._mx[0::2], self._mx[1::2])
            self._last[:h] = self._last[1::2]
            self._cnt[:h] = self._cnt[0::2] + self._cnt[1::2]
            self._s0[:h] = self._s0[0::2]
            self._s1[:h] = self._s1[1::2]
            self._rec[:h] = self._rec[0::2] + self._rec[1::2]
            self._mn[h:] = np.nan
            self._mx[h:] = np.nan
            self._last[h:] = np.nan
            self._cnt[h:] = 0.0
            self.n = h
            self.width *= 2

    def result(self) -> Downsampled:
        """Snapshot of the buckets, the partly filled last bucket included (copies)."""
        n = self.n
        mn, mx, last, cnt = self._mn[:n], self._mx[:n], self._last[:n], self._cnt[:n]
        s0, s1, rec = self._s0[:n], self._s1[:n], self._rec[:n]
        if self._k:
            mn = np.vstack([mn, self._cmn[None]])
            mx = np.vstack([mx, self._cmx[None]])
            last = np.vstack([last, self._clast[None]])
            cnt = np.vstack([cnt, self._ccnt[None]])
            s0 = np.append(s0, self._cs0)
            s1 = np.append(s1, self._cs1)
            rec = np.append(rec, self._k)
        return Downsampled(s0.copy(), s1.copy(), rec.copy(), mn.copy(), mx.copy(), last.copy(), cnt.copy(), self.width)
