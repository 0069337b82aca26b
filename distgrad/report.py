"""Offline report of a distgrad JSONL run log: plots, an HTML page, a text summary and a verdict.

One streaming pass (:func:`analyze`) reads the log (rotated files included, see
:func:`distgrad.sinks.jsonl.read_jsonl`) one record at a time and keeps only bounded state:

* run-level scalars (loss, global grad norm, loss scale) and per-layer gradient norms are
  **downsampled** by :class:`Downsampler`: consecutive records are grouped into at most
  ``max_points`` buckets of equal record count; each bucket keeps the min, the max and the last
  value of every column (non-finite values excluded from min/max, counted separately). When all
  buckets are full, neighbours are merged pairwise and the bucket width doubles, so the number
  of steps need not be known in advance. A spike is the max of its bucket and therefore always
  survives downsampling; the plotted line is the last value of each bucket and the shaded band
  the min..max range.
* per-layer aggregates only (largest finite norm and its step, last norm, non-finite element
  and step counts), never per-parameter histories;
* the first occurrence of each problem kind, counts of every anomaly, and at most
  :data:`MAX_MARKERS` spike markers (the first ones; the counts stay exact).

Memory is ``O(max_points * layers)`` and time is linear in the file size, whatever the number
of steps (100k steps x thousands of parameters is fine). Plots need matplotlib (object-oriented
``Figure`` + Agg canvas, no pyplot and no global backend switch; imported only by
:func:`write_report`); :func:`analyze` and :func:`format_summary` need numpy only.

Spikes: taken from the records (``extra["spikes"]`` and the other encodings of distgrad's online
detectors listed in :class:`RecordSpikes`) when any record of the run carries detector output;
otherwise computed here by :class:`RollingMadSpikes`, a rolling median / MAD rule on the grad norm
and on the loss (see its docstring).

Problems (the verdict names the first one, in file order):

* ``nonfinite_grad``: a NaN/Inf gradient element on a step that was *not* an fp16 overflow handled
  by the loss scaler (overflow steps are expected under dynamic loss scaling and only counted);
* ``nonfinite_loss``: a NaN/Inf loss;
* ``replica_mismatch``: replicated gradients differed across ranks;
* ``overflow_streak``: at least ``overflow_streak_limit`` consecutive fp16 overflow steps (the
  loss scale is collapsing).
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import re
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from distgrad.record import StepRecord

#: At most this many spike markers / example steps are kept (the first ones); counts stay exact.
MAX_MARKERS = 10_000

# --------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------

_INT_RE = re.compile(r"[./]")


def _load_classify() -> Callable[[str], Any] | None:
    try:
        from distgrad.naming import classify  # type: ignore[attr-defined]
    except Exception:  # not written yet, or broken: fall back
        return None
    return classify


def layer_of(name: str, classify: Callable[[str], Any] | None = None) -> str:
    """Layer label of parameter ``name``.

    Uses ``distgrad.naming.classify(name).layer`` when that module is importable (pass
    ``classify`` to avoid the import look-up); otherwise -- or when it fails or returns no
    layer -- the first all-digit component of the dotted/slashed path
    (``"model.layers.12.mlp.w"`` -> ``"12"``), else ``"other"``. Always a ``str``.
    """
    if classify is None:
        classify = _load_classify()
    if classify is not None:
        try:
            layer = classify(name).layer
        except Exception:
            layer = None
        if layer is not None and layer != "":
            return str(layer)
    for part in _INT_RE.split(name):
        if part.isdigit():
            return str(int(part))
    return "other"


_SPECIAL_ORDER = {"embed": 0, "norm": 3, "final_norm": 3, "head": 4, "other": 6}
_BLOCK_LABEL_RE = re.compile(r"(?:(enc|dec)\.)?(\d+)")


def layer_sort_key(layer: str) -> tuple[int, int, int, str]:
    """Sort key for layer labels: ``embed``, blocks by number (``enc.N`` before ``dec.N``),
    ``norm``, ``head``, any other label alphabetically, ``other`` last."""
    m = _BLOCK_LABEL_RE.fullmatch(layer)
    if m:
        return (1 if m.group(1) != "dec" else 2, {"enc": 0, None: 1}.get(m.group(1), 2), int(m.group(2)), "")
    if layer in _SPECIAL_ORDER:
        return (_SPECIAL_ORDER[layer], 0, 0, layer)
    return (5, 0, 0, layer)


class LayerIndex:
    """Stable mapping of parameter names to layer columns, cached per distinct names list.

    ``layers`` lists every layer label seen so far, in first-seen order (column order);
    :meth:`map` gives the column of each name. Looking the same names list up again costs one
    tuple hash. At most 64 distinct names lists are cached (the cache is reset beyond).
    """

    def __init__(self, classify: Callable[[str], Any] | None = None) -> None:
        self._classify = classify if classify is not None else _load_classify()
        self.layers: list[str] = []
        self._col: dict[str, int] = {}
        self._cache: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}

    def _lookup(self, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        key = tuple(names)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= 64:
                self._cache.clear()
            cols = []
            for n in key:
                layer = layer_of(n, self._classify) if self._classify else layer_of(n, _no_classify)
                c = self._col.get(layer)
                if c is None:
                    c = self._col[layer] = len(self.layers)
                    self.layers.append(layer)
                cols.append(c)
            idx = np.asarray(cols, dtype=np.int64)
            hit = self._cache[key] = (idx, np.unique(idx))
        return hit

    def map(self, names: Sequence[str]) -> np.ndarray:
        """int64 array ``[len(names)]``: the layer column of each parameter."""
        return self._lookup(names)[0]

    def present(self, names: Sequence[str]) -> np.ndarray:
        """Sorted int64 array of the layer columns that ``names`` populate."""
        return self._lookup(names)[1]


class _NoClassify:
    layer = None


def _no_classify(name: str) -> _NoClassify:
    return _NoClassify()


# --------------------------------------------------------------------------------------------
# downsampling
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# spikes
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# analysis
# --------------------------------------------------------------------------------------------


@dataclass
class Problem:
    """One detected problem.

    Attributes:
        kind: ``nonfinite_grad``, ``nonfinite_loss``, ``replica_mismatch`` or ``overflow_streak``.
        step: optimizer step where it (first) happened.
        param: parameter name, when one is implicated (else None).
        layer: that parameter's layer label (else None).
        ranks: implicated ranks (may be empty when unknown).
        detail: one-line human-readable description (no trailing period).
    """

    kind: str
    step: int
    param: str | None = None
    layer: str | None = None
    ranks: list[int] = field(default_factory=list)
    detail: str = ""


ANOMALY_LABELS = {
    "nonfinite_steps": "non-finite gradient steps",
    "nonfinite_grad": "  of which not fp16 overflows",
    "nonfinite_loss": "non-finite loss steps",
    "overflow_steps": "fp16 overflow steps",
    "skipped_steps": "skipped optimizer steps",
    "replica_mismatch": "replica mismatch steps",
    "grad_norm_spikes": "grad-norm spikes",
    "loss_spikes": "loss spikes",
}


@dataclass
class RunAnalysis:
    """Bounded summary of a run, produced by :func:`analyze` (see the module docstring).

    Attributes:
        path: the log analysed.
        n_records: sampled steps read.
        first_step, last_step: first/last optimizer step (None when the log is empty).
        world_size: ranks of the last record.
        last: the last record's ``loss``, ``grad_norm``, ``loss_scale`` (``None`` when absent).
        counters: ``counters`` of the last record.
        counts: anomaly name (keys of :data:`ANOMALY_LABELS`) -> number of sampled steps.
        first_step_of: anomaly name -> first step it occurred.
        max_overflow_streak: longest run of consecutive overflow steps.
        problems: first :class:`Problem` of each kind, in order of occurrence.
        layers: layer labels, sorted with :func:`layer_sort_key`.
        layer_max_norm, layer_max_norm_step, layer_last_norm, layer_nonfinite_elems,
            layer_nonfinite_steps: float64/int64 arrays aligned with ``layers`` (NaN max/last
            when the layer never had a finite norm).
        scalars: downsampled columns ``loss, grad_norm, loss_scale``; counts
            ``overflow, nonfinite_grad (non-overflow), skipped``.
        layer_norms: downsampled per-layer norms (columns aligned with ``layers``); counts = steps
            with a non-finite element in the layer.
        update_ratio: downsampled per-layer max update-to-weight ratio, or None if never present.
        spikes: up to :data:`MAX_MARKERS` ``(step, metric, value)`` with metric ``grad_norm``/``loss``.
        spikes_source: ``"record"`` (from ``extra["spikes"]``) or ``"rolling-mad"`` (computed).
    """

    path: str
    n_records: int
    first_step: int | None
    last_step: int | None
    world_size: int | None
    last: dict[str, float | None]
    counters: dict[str, int]
    counts: dict[str, int]
    first_step_of: dict[str, int]
    max_overflow_streak: int
    problems: list[Problem]
    layers: list[str]
    layer_max_norm: np.ndarray
    layer_max_norm_step: np.ndarray
    layer_last_norm: np.ndarray
    layer_nonfinite_elems: np.ndarray
    layer_nonfinite_steps: np.ndarray
    scalars: Downsampled
    layer_norms: Downsampled
    update_ratio: Downsampled | None
    spikes: list[tuple[int, str, float]]
    spikes_source: str

    @property
    def healthy(self) -> bool:
        """True when no :class:`Problem` was found (spikes and handled overflows are not problems)."""
        return not self.problems

    @property
    def first_problem(self) -> Problem | None:
        return self.problems[0] if self.problems else None

    def verdict(self) -> str:
        """One-paragraph verdict: ``HEALTHY: ...`` or ``PROBLEM at step S: ...`` (the first problem)."""
        if self.n_records == 0:
            return "EMPTY: the log holds no sampled steps"
        span = f"{self.n_records} sampled steps ({self.first_step}..{self.last_step})"
        c = self.counts
        notes = []
        for k in ("overflow_steps", "skipped_steps", "grad_norm_spikes", "loss_spikes"):
            if c.get(k):
                notes.append(f"{c[k]} {ANOMALY_LABELS[k]}")
        if self.healthy:
            tail = ("; noted: " + ", ".join(notes)) if notes else ""
            return f"HEALTHY: {span}, no non-finite gradient or loss, no replica mismatch{tail}"
        p = self.problems[0]
        text = f"PROBLEM at step {p.step}: {p.detail}"
        if len(self.problems) > 1:
            others = ", ".join(f"{q.kind} at step {q.step}" for q in self.problems[1:])
            text += f". Later: {others}"
        return text + f". ({span})"


class RunAnalyzer:
    """Incremental form of :func:`analyze`: :meth:`add` every record in order, then :meth:`finish`.

    Args:
        path: label stored in the result.
        max_points: downsampling buckets (even, >= 2).
        overflow_streak_limit: consecutive fp16 overflow steps that make an ``overflow_streak``
            problem (default 20).
        spike_detector: factory of the fallback spike rule (default :class:`RollingMadSpikes`).
    """

    def __init__(self, path: str = "", max_points: int = 1024, overflow_streak_limit: int = 20,
                 spike_detector: Callable[[], RollingMadSpikes] = RollingMadSpikes) -> None:
        self.path = path
        self.overflow_streak_limit = overflow_streak_limit
        self._li = LayerIndex()
        self._n = 0
        self._first_step: int | None = None
        self._last: StepRecord | None = None
        self._counts = {k: 0 for k in ANOMALY_LABELS}
        self._first_of: dict[str, int] = {}
        self._problems: dict[str, Problem] = {}
        self._streak = 0
        self._streak_start = 0
        self._max_streak = 0
        self._scal = Downsampler(3, 3, max_points)
        self._lay = Downsampler(0, 0, max_points)
        self._upd: Downsampler | None = None
        self._max_points = max_points
        L = 0
        self._lmax = np.zeros(L)
        self._lmax_step = np.zeros(L, np.int64)
        self._llast = np.zeros(L)
        self._lnf = np.zeros(L)
        self._lnf_steps = np.zeros(L, np.int64)
        self._seen_layer = np.zeros(L, bool)
        self._det = {"grad_norm": spike_detector(), "loss": spike_detector()}
        self._spikes_rec: list[tuple[int, str, float]] = []
        self._spikes_mad: list[tuple[int, str, float]] = []
        self._n_spk_rec = {"grad_norm": 0, "loss": 0}
        self._n_spk_mad = {"grad_norm": 0, "loss": 0}
        self._rec_spikes = RecordSpikes()
        self._mask_src: np.ndarray | None = None
        self._mask = np.zeros(0, bool)
        self._mask_all = True

    def _grow(self) -> None:
        L = len(self._li.layers)
        if L == self._lmax.size:
            return
        extra = L - self._lmax.size
        self._lmax = np.pad(self._lmax, (0, extra), constant_values=np.nan)
        self._lmax_step = np.pad(self._lmax_step, (0, extra), constant_values=-1)
        self._llast = np.pad(self._llast, (0, extra), constant_values=np.nan)
        self._lnf = np.pad(self._lnf, (0, extra))
        self._lnf_steps = np.pad(self._lnf_steps, (0, extra))
        self._seen_layer = np.pad(self._seen_layer, (0, extra))
        self._lay.grow(L, L)
        if self._upd is not None:
            self._upd.grow(L)

    def _count(self, key: str, step: int) -> None:
        self._counts[key] += 1
        self._first_of.setdefault(key, step)

    def _problem(self, p: Problem) -> None:
        self._problems.setdefault(p.kind, p)

    def add(self, r: StepRecord) -> None:
        """Fold one record in (records must come in file order)."""
        step = int(r.step)
        if self._first_step is None:
            self._first_step = step
        self._n += 1
        self._last = r
        p = r.params
        idx = self._li.map(p.names)
        present = self._li.present(p.names)
        self._grow()
        L = len(self._li.layers)

        nf = p.nonfinite
        gn = float(r.grad_norm)
        grad_nonfinite = bool(nf.any()) or not math.isfinite(gn)  # == r.nonfinite
        overflow = r.overflow is True
        loss = float(r.loss) if r.loss is not None else math.nan

        # ---- anomalies and problems
        if grad_nonfinite:
            self._count("nonfinite_steps", step)
        if overflow:
            self._count("overflow_steps", step)
            if self._streak == 0:
                self._streak_start = step
            self._streak += 1
            self._max_streak = max(self._max_streak, self._streak)
            if self._streak == self.overflow_streak_limit:
                self._problem(Problem("overflow_streak", step, detail=(
                    f"fp16 overflow on {self._streak} consecutive sampled steps "
                    f"(steps {self._streak_start}..{step}, loss scale now {r.loss_scale!r}): "
                    f"the loss scale is collapsing")))
        else:
            self._streak = 0
        if not r.step_applied:
            self._count("skipped_steps", step)
        if grad_nonfinite and not overflow:
            self._count("nonfinite_grad", step)
            if "nonfinite_grad" not in self._problems:
                self._problem(self._nonfinite_problem(r, idx))
        if r.loss is not None and not math.isfinite(loss):
            self._count("nonfinite_loss", step)
            self._problem(Problem("nonfinite_loss", step, ranks=list(r.nonfinite_ranks),
                                  detail=f"non-finite loss ({loss!r})"))
        if r.replica_mismatch_ranks:
            self._count("replica_mismatch", step)
            ranks = sorted(int(x) for x in r.replica_mismatch_ranks)
            self._problem(Problem("replica_mismatch", step, ranks=ranks, detail=(
                f"replicated gradients differ across ranks; disagreeing rank(s) {ranks}")))

        # ---- spikes (both sources; which one is reported is decided in finish())
        for metric, v in (("grad_norm", gn), ("loss", loss if r.loss is not None else None)):
            if self._det[metric].update(v):
                self._n_spk_mad[metric] += 1
                if len(self._spikes_mad) < MAX_MARKERS:
                    self._spikes_mad.append((step, metric, float(v)))
        if r.extra:
            for metric in sorted(self._rec_spikes.update(r.extra)):
                self._n_spk_rec[metric] += 1
                if len(self._spikes_rec) < MAX_MARKERS:
                    self._spikes_rec.append((step, metric, gn if metric == "grad_norm" else loss))

        # ---- downsampled scalars
        ls = float(r.loss_scale) if r.loss_scale is not None else math.nan
        self._scal.add(step, np.array([loss, gn, ls]),
                       np.array([1.0 if overflow else 0.0, 1.0 if grad_nonfinite and not overflow else 0.0,
                                 0.0 if r.step_applied else 1.0]))

        # ---- per-layer aggregates
        if L:
            with np.errstate(invalid="ignore"):
                lnorm = np.sqrt(np.bincount(idx, weights=p.sumsq, minlength=L))
            lnf = np.bincount(idx, weights=nf, minlength=L)
            if self._mask_src is not present or self._mask.size != L:
                self._mask = np.zeros(L, bool)
                self._mask[present] = True
                self._mask_all = bool(self._mask.all())
                self._mask_src = present  # reference held: identity check is safe
            mask = self._mask
            vals = lnorm if self._mask_all else np.where(mask, lnorm, np.nan)
            self._lay.add(step, vals, (lnf > 0).astype(np.float64))
            fin = np.isfinite(vals)
            better = fin & ~(vals <= self._lmax)  # NaN current max compares False -> better
            self._lmax[better] = vals[better]
            self._lmax_step[better] = step
            self._llast[mask] = vals[mask]
            self._lnf += lnf
            self._lnf_steps += lnf > 0
            self._seen_layer |= mask

        # ---- update-to-weight ratios
        ur = r.extra.get("update_ratio")
        if isinstance(ur, dict) and ur:
            names = list(ur.keys())
            uidx = self._li.map(names)
            self._grow()
            L = len(self._li.layers)
            if self._upd is None:
                self._upd = Downsampler(L, 0, self._max_points)
            ratios = np.asarray([_to_float(v) for v in ur.values()], dtype=np.float64)
            lmax = np.full(L, -np.inf)
            np.maximum.at(lmax, uidx, np.where(np.isfinite(ratios), ratios, -np.inf))
            lmax[~np.isfinite(lmax)] = np.nan
            self._upd.add(step, lmax)
        elif self._upd is not None:
            self._upd.add(step, np.full(self._upd.n_cols, np.nan))

    def _nonfinite_problem(self, r: StepRecord, idx: np.ndarray) -> Problem:
        """Parameter and ranks of a non-finite step.

        Parameter: ``extra["provenance"]["first_param"]`` when present, else -- the origin rule of
        :mod:`distgrad.flight_recorder` -- the non-finite parameter that comes *last* in the
        record's (registration = forward) order. Ranks: ``record.nonfinite_ranks`` plus the ranks
        that ``extra["provenance"]["params"]`` (``{"name", "nan", "inf", "ranks"}`` rows) or
        ``extra["nonfinite_params"]`` (``{"param", "rank", ...}`` rows) give for that parameter.
        """
        p = r.params
        nf = p.nonfinite
        prov = r.extra.get("provenance") if isinstance(r.extra.get("provenance"), dict) else None
        name: str | None = None
        if prov and isinstance(prov.get("first_param"), str):
            name = prov["first_param"]
        if name is None:
            hit = np.flatnonzero(nf > 0)
            if hit.size:
                name = p.names[int(hit[-1])]
        ranks = {int(x) for x in r.nonfinite_ranks}
        rows: list[Any] = []
        if prov and isinstance(prov.get("params"), list):
            rows += [e for e in prov["params"] if isinstance(e, dict) and e.get("name") == name]
        if isinstance(r.extra.get("nonfinite_params"), list):
            rows += [e for e in r.extra["nonfinite_params"] if isinstance(e, dict) and e.get("param") == name]
        for e in rows:
            if isinstance(e.get("ranks"), list):
                ranks.update(int(x) for x in e["ranks"])
            if isinstance(e.get("rank"), (int, float)):
                ranks.add(int(e["rank"]))
        ranks = sorted(ranks)
        n_params = int(np.count_nonzero(nf > 0))
        if name is not None:
            layer = self._li.layers[int(idx[p.names.index(name)])] if name in p.names else layer_of(name)
            try:
                j = p.index(name)
                counts = f"{int(p.nan[j])} NaN / {int(p.inf[j])} Inf elements"
            except KeyError:
                counts = "element counts unknown"
            detail = (f"first non-finite gradient in parameter '{name}' (layer {layer}), {counts}, "
                      f"rank(s) {ranks if ranks else 'unknown'}; {n_params} parameter(s) non-finite on this step")
        else:
            layer = None
            detail = (f"non-finite global grad norm ({r.grad_norm!r}) with no per-parameter count; "
                      f"rank(s) {ranks if ranks else 'unknown'}")
        return Problem("nonfinite_grad", int(r.step), name, layer, ranks, detail)

    def finish(self) -> RunAnalysis:
        """The :class:`RunAnalysis` of everything added so far (layers sorted)."""
        order = sorted(range(len(self._li.layers)), key=lambda j: layer_sort_key(self._li.layers[j]))
        o = np.asarray(order, dtype=np.int64)
        layers = [self._li.layers[j] for j in order]
        lay = self._lay.result()
        lay = Downsampled(lay.step_first, lay.step_last, lay.records, lay.min[:, o], lay.max[:, o],
                          lay.last[:, o], lay.counts[:, o], lay.width)
        upd = None
        if self._upd is not None:
            u = self._upd.result()
            upd = Downsampled(u.step_first, u.step_last, u.records, u.min[:, o], u.max[:, o],
                              u.last[:, o], u.counts, u.width)
        counts = dict(self._counts)
        if self._rec_spikes.seen:
            spikes, src = self._spikes_rec, "record"
            counts["grad_norm_spikes"] = self._n_spk_rec["grad_norm"]
            counts["loss_spikes"] = self._n_spk_rec["loss"]
        else:
            spikes, src = self._spikes_mad, "rolling-mad"
            counts["grad_norm_spikes"] = self._n_spk_mad["grad_norm"]
            counts["loss_spikes"] = self._n_spk_mad["loss"]
        first_of = dict(self._first_of)
        for m in ("grad_norm", "loss"):
            s = next((st for st, mm, _ in spikes if mm == m), None)
            if s is not None:
                first_of[f"{m}_spikes"] = s
        r = self._last
        problems = sorted(self._problems.values(), key=lambda q: (q.step, list(self._problems).index(q.kind)))
        return RunAnalysis(
            path=self.path,
            n_records=self._n,
            first_step=self._first_step,
            last_step=int(r.step) if r is not None else None,
            world_size=int(r.world_size) if r is not None else None,
            last={
                "loss": r.loss if r is not None else None,
                "grad_norm": float(r.grad_norm) if r is not None else None,
                "loss_scale": r.loss_scale if r is not None else None,
            },
            counters=dict(r.counters) if r is not None else {},
            counts=counts,
            first_step_of=first_of,
            max_overflow_streak=self._max_streak,
            problems=problems,
            layers=layers,
            layer_max_norm=self._lmax[o].copy(),
            layer_max_norm_step=self._lmax_step[o].copy(),
            layer_last_norm=self._llast[o].copy(),
            layer_nonfinite_elems=self._lnf[o].copy(),
            layer_nonfinite_steps=self._lnf_steps[o].copy(),
            scalars=self._scal.result(),
            layer_norms=lay,
            update_ratio=upd,
            spikes=list(spikes),
            spikes_source=src,
        )


def _to_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def analyze(path: str | os.PathLike[str], *, max_points: int = 1024, include_rotated: bool = True,
            overflow_streak_limit: int = 20) -> RunAnalysis:
    """Stream a JSONL run log once and return its bounded :class:`RunAnalysis`.

    Args:
        path: the run log written by :class:`distgrad.sinks.jsonl.JsonlSink` (``run.jsonl``).
        max_points: downsampling buckets for plots (even, >= 2; default 1024).
        include_rotated: also read the rotated ``path.N`` files, oldest first (default True).
        overflow_streak_limit: see :class:`RunAnalyzer`.

    Malformed lines in the middle of the log are skipped and counted (``bad_lines`` and
    ``first_bad_line`` on the result); steps that go back (another run appended to the same file)
    are counted in ``restarts``. :func:`format_summary` reports both.

    Raises:
        FileNotFoundError: no log at ``path``.
        ValueError: ``max_points`` invalid.
    """
    from distgrad.sinks.jsonl import read_jsonl

    an = RunAnalyzer(os.fspath(path), max_points=max_points, overflow_streak_limit=overflow_streak_limit)
    bad: list[str] = []
    restarts, prev = 0, None
    for rec in read_jsonl(path, include_rotated=include_rotated, on_bad_line=bad.append):
        if prev is not None and rec.step <= prev:
            restarts += 1  # the step went back: another run appended to the same file
        prev = rec.step
        an.add(rec)
    res = an.finish()
    res.bad_lines, res.first_bad_line, res.restarts = len(bad), (bad[0] if bad else None), restarts
    return res


# --------------------------------------------------------------------------------------------
# text summary
# --------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return repr(v)
        return f"{v:.6g}"
    return str(v)


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    rows = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return out


def worst_layers(a: RunAnalysis, top: int = 10) -> list[int]:
    """Indices into ``a.layers`` of the ``top`` worst layers: non-finite ones first (most
    non-finite steps), then by largest finite grad norm over the run."""
    def key(j: int) -> tuple[float, float]:
        m = a.layer_max_norm[j]
        return (-float(a.layer_nonfinite_steps[j]), -(m if math.isfinite(m) else -math.inf))
    return sorted(range(len(a.layers)), key=key)[:max(0, top)]


def format_summary(a: RunAnalysis, top: int = 10) -> str:
    """Plain-text summary: run line, last step, verdict, anomaly counts, worst layers."""
    out = [f"distgrad summary: {a.path}"]
    if a.n_records == 0:
        out.append("verdict: " + a.verdict())
        return "\n".join(out) + "\n"
    out.append(f"records: {a.n_records} sampled steps, steps {a.first_step}..{a.last_step}, world size {a.world_size}")
    out.append(f"last step: {a.last_step}  loss {_fmt(a.last['loss'])}  grad norm {_fmt(a.last['grad_norm'])}"
               f"  loss scale {_fmt(a.last['loss_scale'])}")
    out.append("verdict: " + a.verdict())
    if getattr(a, "bad_lines", 0):
        out.append(f"warning: skipped {a.bad_lines} malformed line(s); first: {a.first_bad_line}")
    if getattr(a, "restarts", 0):
        out.append(f"warning: the optimizer step went back {a.restarts} time(s): several runs were "
                   "appended to this file; use one jsonl_path per run")
    out.append("")
    rows = [(ANOMALY_LABELS[k], a.counts.get(k, 0), a.first_step_of.get(k)) for k in ANOMALY_LABELS]
    rows.append(("longest overflow streak", a.max_overflow_streak, None))
    for k in ("internal_errors", "replica_mismatch", "nonfinite_steps", "overflow_steps", "skipped_steps",
              "sampled_steps"):
        if k in a.counters:
            rows.append((f"counter {k} (last record)", a.counters[k], None))
    out += _table(("anomaly", "count", "first step"), rows)
    out.append(f"(spikes: {'from the records' if a.spikes_source == 'record' else 'rolling median/MAD rule'})")
    out.append("")
    idx = worst_layers(a, top)
    out.append(f"worst layers (of {len(a.layers)}) by non-finite steps, then max grad norm")
    out += _table(("layer", "max norm", "at step", "last norm", "non-finite elems", "non-finite steps"),
                  [(a.layers[j], float(a.layer_max_norm[j]),
                    int(a.layer_max_norm_step[j]) if a.layer_max_norm_step[j] >= 0 else None,
                    float(a.layer_last_norm[j]), int(a.layer_nonfinite_elems[j]), int(a.layer_nonfinite_steps[j]))
                   for j in idx])
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# plots and HTML
# --------------------------------------------------------------------------------------------


@dataclass
class ReportResult:
    """Files written by :func:`write_report` and the analysis behind them."""

    out_dir: Path
    html: Path
    pngs: list[Path]
    analysis: RunAnalysis


def _log10(a: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.log10(a)
    r[~np.isfinite(r)] = np.nan
    return r


def _mark_buckets(ax: Any, ds: Downsampled, col: int, color: str, label: str) -> None:
    hit = ds.counts[:, col] > 0
    if hit.any():
        ax.vlines(ds.x[hit], 0, 1, transform=ax.get_xaxis_transform(), colors=color, alpha=0.5,
                  linewidth=1.0, label=label)


def _plot_series(ax: Any, ds: Downsampled, col: int, color: str, label: str) -> bool:
    x = ds.x
    mn, mx, last = ds.min[:, col], ds.max[:, col], ds.last[:, col]
    if not np.isfinite(mx).any():
        return False
    if ds.width > 1:
        ax.fill_between(x, mn, mx, color=color, alpha=0.25, linewidth=0, label=f"{label} min..max per bucket")
    ax.plot(x, np.where(np.isfinite(last), last, np.nan), color=color, linewidth=0.9, label=label)
    return True


def _heatmap(fig: Any, ax: Any, data: np.ndarray, ds: Downsampled, layers: list[str], cbar_label: str,
             bad: np.ndarray | None = None) -> None:
    import matplotlib.colors as mcolors

    edges = np.append(ds.step_first, ds.step_last[-1] + 1).astype(np.float64)
    if not np.all(np.diff(edges) > 0):  # restarted run: steps not increasing -> index axis
        edges = np.arange(len(ds.step_first) + 1, dtype=np.float64)
        ax.set_xlabel("bucket (steps not monotonic)")
    else:
        ax.set_xlabel("optimizer step")
    yedges = np.arange(len(layers) + 1) - 0.5
    m = ax.pcolormesh(edges, yedges, np.ma.masked_invalid(data.T), cmap="viridis", shading="flat")
    fig.colorbar(m, ax=ax, label=cbar_label)
    if bad is not None and bad.any():
        cmap = mcolors.ListedColormap(["red"])
        ax.pcolormesh(edges, yedges, np.ma.masked_where(~bad.T, np.ones_like(data.T)), cmap=cmap, shading="flat")
    n = len(layers)
    stride = max(1, int(math.ceil(n / 40)))
    ticks = list(range(0, n, stride))
    ax.set_yticks(ticks)
    ax.set_yticklabels([layers[t] for t in ticks], fontsize=7)
    ax.set_ylabel("layer")
    ax.set_ylim(n - 0.5, -0.5)


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=7)


def _save(fig: Any, path: Path) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    data = buf.getvalue()
    path.write_bytes(data)
    return data


def write_report(path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, max_points: int = 1024,
                 title: str | None = None, include_rotated: bool = True,
                 analysis: RunAnalysis | None = None) -> ReportResult:
    """Analyse a JSONL run log and write PNG plots plus one self-contained ``report.html``.

    Files in ``out_dir`` (created if missing): ``loss_grad_norm.png``, ``layer_grad_norm.png``
    (heatmap, log10), ``layer_nonfinite.png``, and when the run has them ``loss_scale.png``
    (fp16) and ``update_ratio.png``; ``report.html`` embeds them as base64 and starts with the
    verdict; ``summary.txt`` holds :func:`format_summary`.

    Args:
        path: run log (see :func:`analyze`).
        out_dir: output directory.
        max_points: downsampling buckets (plot resolution).
        title: page title (default: the log's file name).
        include_rotated: read rotated files too.
        analysis: reuse an existing analysis instead of reading ``path`` again.

    Raises:
        ImportError: matplotlib is missing (``pip install 'distgrad[report]'``).
        FileNotFoundError, ValueError: as :func:`analyze`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def subplots(nrows: int = 1, ncols: int = 1, **kw: Any) -> tuple[Any, Any]:
        # object-oriented Agg figures: no pyplot, no global backend switch, nothing left open
        fig = Figure(figsize=kw.pop("figsize", None))
        FigureCanvasAgg(fig)
        return fig, fig.subplots(nrows, ncols, **kw)

    a = analysis if analysis is not None else analyze(path, max_points=max_points, include_rotated=include_rotated)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images: list[tuple[str, str, bytes]] = []  # (file, caption, png)
    notes: list[str] = []
    s = a.scalars
    bucket_note = (f"Each plotted point covers {s.width} consecutive sampled step(s); line = last value of the "
                   f"bucket, band = min..max within it, so spikes survive downsampling."
                   if a.n_records else "")

    if a.n_records:
        # 1. loss and grad norm with spikes and non-finite steps
        fig, axes = subplots(2, 1, figsize=(11, 6.5), sharex=True)
        for ax, col, metric, color, label in ((axes[0], 0, "loss", "tab:blue", "loss"),
                                              (axes[1], 1, "grad_norm", "tab:green", "global grad norm")):
            if not _plot_series(ax, s, col, color, label):
                ax.text(0.5, 0.5, f"no finite {label} recorded", ha="center", va="center", transform=ax.transAxes)
            pts = [(st, v) for st, m, v in a.spikes if m == metric and v is not None and math.isfinite(v)]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker="x", color="red", zorder=5, s=30,
                           label=f"spike ({'detector' if a.spikes_source == 'record' else 'rolling median/MAD'})")
            _mark_buckets(ax, s, 1, "magenta", "non-finite gradient (not overflow)")
            ax.set_ylabel(label)
            if col == 1:
                v = s.max[:, 1]
                if np.isfinite(v).any() and np.nanmin(s.min[:, 1]) > 0:
                    ax.set_yscale("log")
            _legend(ax)
            ax.grid(alpha=0.3)
        axes[1].set_xlabel("optimizer step")
        fig.suptitle("Loss and global gradient norm")
        fig.tight_layout()
        images.append(("loss_grad_norm.png", "Loss and global gradient norm. Red x: spikes; magenta lines: "
                       "non-finite gradients outside fp16 overflows.", _save(fig, out / "loss_grad_norm.png")))

        # 2. loss scale and overflow steps
        if np.isfinite(s.max[:, 2]).any():
            fig, axes = subplots(2, 1, figsize=(11, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
            _plot_series(axes[0], s, 2, "tab:purple", "loss scale")
            axes[0].set_yscale("log", base=2)
            axes[0].set_ylabel("loss scale")
            _mark_buckets(axes[0], s, 0, "red", "overflow step(s)")
            _legend(axes[0])
            axes[0].grid(alpha=0.3)
            widths = np.maximum(s.step_last - s.step_first + 1, 1)
            axes[1].bar(s.step_first, s.counts[:, 0], width=widths, align="edge", color="red")
            axes[1].set_ylabel("overflows")
            axes[1].set_xlabel("optimizer step")
            fig.suptitle(f"fp16 loss scale ({a.counts['overflow_steps']} overflow steps, "
                         f"longest streak {a.max_overflow_streak})")
            fig.tight_layout()
            images.append(("loss_scale.png", "Dynamic loss scale; bottom: overflow steps per bucket.",
                           _save(fig, out / "loss_scale.png")))
        else:
            notes.append("No fp16 loss scale in this run (bf16/fp32): loss-scale plot omitted.")

        # 3. per-layer grad-norm heatmap
        L = len(a.layers)
        if L:
            ln = a.layer_norms
            fig, ax = subplots(figsize=(11, min(2.5 + 0.18 * L, 30)))
            _heatmap(fig, ax, _log10(ln.max), ln, a.layers, "log10(max layer grad norm in bucket)",
                     bad=ln.counts > 0)
            ax.set_title("Per-layer gradient norm (log10 of bucket max); red: non-finite")
            fig.tight_layout()
            images.append(("layer_grad_norm.png", "Per-layer gradient norm, log10 of the max within each bucket "
                           "of steps; red cells hold a non-finite gradient.", _save(fig, out / "layer_grad_norm.png")))

            # 4. per-layer non-finite counts
            fig, axes = subplots(2, 1, figsize=(11, 5.5), sharex=True)
            xs = np.arange(L)
            axes[0].bar(xs, a.layer_nonfinite_elems, color="red")
            axes[0].set_ylabel("non-finite elements")
            if a.layer_nonfinite_elems.max() > 0:
                axes[0].set_yscale("log")
            axes[1].bar(xs, a.layer_nonfinite_steps, color="darkred")
            axes[1].set_ylabel("steps affected")
            stride = max(1, int(math.ceil(L / 60)))
            axes[1].set_xticks(xs[::stride])
            axes[1].set_xticklabels([a.layers[j] for j in xs[::stride]], rotation=90, fontsize=7)
            axes[1].set_xlabel("layer")
            total = int(a.layer_nonfinite_elems.sum())
            fig.suptitle(f"Per-layer non-finite gradient elements (total {total})")
            fig.tight_layout()
            images.append(("layer_nonfinite.png", "NaN+Inf gradient elements per layer over the run, and the "
                           "number of sampled steps on which the layer had any.", _save(fig, out / "layer_nonfinite.png")))

        # 5. update-to-weight ratio
        if a.update_ratio is not None and np.isfinite(a.update_ratio.max).any():
            u = a.update_ratio
            fig, ax = subplots(figsize=(11, min(2.5 + 0.18 * L, 30)))
            _heatmap(fig, ax, _log10(u.max), u, a.layers, "log10(max update/weight ratio)")
            ax.set_title("Update-to-weight ratio ||dw||/||w|| (max over the layer's parameters, bucket max)")
            fig.tight_layout()
            images.append(("update_ratio.png", "Update-to-weight ratio per layer (log10; about -3 is typical "
                           "for Adam at a sane learning rate).", _save(fig, out / "update_ratio.png")))
        else:
            notes.append("No update-to-weight ratios in the records: plot omitted.")

    summary = format_summary(a)
    (out / "summary.txt").write_text(summary, encoding="utf-8")
    verdict = a.verdict()
    ok = a.healthy and a.n_records > 0
    title = title or f"distgrad report: {Path(os.fspath(path)).name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1150px;margin:1em auto;padding:0 1em}"
        ".verdict{padding:.8em 1em;border-radius:6px;font-weight:bold}"
        ".ok{background:#e3f6e3;border:1px solid #4a4}.bad{background:#fde4e4;border:1px solid #c33}"
        "pre{background:#f6f6f6;padding:.8em;overflow-x:auto;font-size:12px}img{max-width:100%}"
        "figure{margin:1.5em 0}figcaption{color:#555;font-size:13px}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="verdict {"ok" if ok else "bad"}" id="verdict">{html.escape(verdict)}</p>',
    ]
    if bucket_note:
        parts.append(f"<p>{html.escape(bucket_note)}</p>")
    for n in notes:
        parts.append(f"<p><em>{html.escape(n)}</em></p>")
    for fname, caption, data in images:
        b64 = base64.b64encode(data).decode("ascii")
        parts.append(f'<figure><img alt="{html.escape(fname)}" src="data:image/png;base64,{b64}">'
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append("<h2>Summary</h2>")
    parts.append(f"<pre>{html.escape(summary)}</pre>")
    parts.append("</body></html>")
    html_path = out / "report.html"
    html_path.write_text("\n".join(parts), encoding="utf-8")
    return ReportResult(out, html_path, [out / f for f, _, _ in images], a)
