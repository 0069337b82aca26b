"""TensorBoard sink: scalars and per-layer gradient-norm histograms of each sampled step.

Everything is derived from the statistics already in the :class:`~distgrad.record.StepRecord`
(no extra pass over gradients, no device work): per-parameter norms are ``sqrt(sumsq)``, a
layer's norm is the root-sum-square of its parameters' norms, and each layer histogram is the
distribution of its parameters' norms, bucketed on the host with :func:`numpy.histogram` and
written with ``SummaryWriter.add_histogram_raw``.

Tags written (``global_step`` = ``record.step``):

=================================  ================================================================
``grad/norm``                      global L2 norm (NaN/Inf kept as such)
``grad/nonfinite_elements``        NaN + Inf gradient elements of the step
``grad/nonfinite_params``          parameters holding a NaN/Inf element
``train/loss``                     loss (only when known)
``train/loss_scale``               fp16 dynamic loss scale (only with a scaler)
``train/overflow``                 1 on an fp16 overflow step, else 0 (only with a scaler)
``train/step_applied``             0 when the optimizer skipped the update
``counters/<name>``                every entry of ``record.counters``
``layer_grad_norm/<layer>``        per-layer norm (root-sum-square of parameter norms)
``layer_grad_nonfinite/<layer>``   NaN + Inf elements in the layer
``layer_param_norms/<layer>``      histogram of the layer's per-parameter norms (finite ones)
``grad_log2_abs/<layer>``          with ``histogram.enabled``: histogram of log2|g| of the layer's
                                   finite non-zero gradient elements (exact counts, see below)
``grad_log2_abs/global``           the same over the whole model
``grad/underflow_ratio``           with ``histogram.enabled``: underflow elements / all elements
=================================  ================================================================

The ``grad_log2_abs`` histograms are the record's :class:`~distgrad.signals.histogram.GradHistogramSignal.Part`
bins, written as they are (no re-binning): one bucket per exponent bin ``[e - s, e + 1 - s)`` of
the unscaled gradient (``s = log2`` of the fp16 loss scale, 0 otherwise), the ``below`` count in
one bucket ``[lo - 1 - s, lo - s)`` and the ``above`` count in one bucket ``[hi - s, hi + 1 - s)``
(values beyond the fixed range are piled at its ends). ``sum`` and ``sum_squares`` of the summary
use the bucket midpoints (TensorBoard displays neither).

Requires the ``tensorboard`` package (``pip install distgrad[report]``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from distgrad.export.base import Sink
from distgrad.naming.layers import LayerIndex
from distgrad.record import StepRecord


def _norm_histogram(norms: np.ndarray, max_bins: int) -> tuple[list[float], list[float]] | None:
    """``(bucket_limits, bucket_counts)`` for TensorBoard from finite values, or None if none.

    TensorBoard stores only the right edge of each bucket; like torch's own ``make_histogram``
    an empty bucket whose limit is the left edge is prepended so the range start is kept.
    """
    v = norms[np.isfinite(norms)]
    if v.size == 0:
        return None
    lo, hi = float(v.min()), float(v.max())
    if hi <= lo:  # one distinct value: one narrow bucket ending at it (numpy would pad by +/-0.5)
        return [lo, hi], [0.0, float(v.size)]
    bins = int(max(1, min(max_bins, v.size)))
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
    limits = [float(edges[0])] + [float(e) for e in edges[1:]]
    bucket_counts = [0.0] + [float(c) for c in counts]
    return limits, bucket_counts


def log2_histogram(h: Any, j: int) -> dict[str, Any] | None:
    """``add_histogram_raw`` arguments (``min``, ``max``, ``num``, ``sum``, ``sum_squares``,
    ``bucket_limits``, ``bucket_counts``) of layer ``j`` of a
    :class:`~distgrad.signals.histogram.GradHistogramSignal.Part`: log2|g| of its finite non-zero elements
    (unscaled), buckets as in the module docstring; None when it has no such element."""
    edges = h.log2_edges()  # [n + 1], unscaled
    lefts = np.concatenate([[edges[0] - 1.0], edges[:-1], [edges[-1]]])
    counts = np.asarray([h.below[j], *h.counts[j], h.above[j]], dtype=np.float64)
    num = float(counts.sum())
    if num == 0:
        return None
    rights = lefts + 1.0
    hit = np.flatnonzero(counts)
    mid = lefts + 0.5
    # TensorBoard keeps right edges only: an empty bucket ending at the first left edge keeps the start
    return {"min": float(lefts[hit[0]]), "max": float(rights[hit[-1]]), "num": num,
            "sum": float(np.dot(counts, mid)), "sum_squares": float(np.dot(counts, mid * mid)),
            "bucket_limits": [float(lefts[0])] + rights.tolist(), "bucket_counts": [0.0] + counts.tolist()}


class TensorBoardSink(Sink):
    """Write each sampled step to a TensorBoard event file under ``log_dir``.

    Args:
        log_dir: directory of the event files (created if missing).
        histograms: write the per-layer histograms of parameter gradient norms (default True).
        layer_scalars: write per-layer scalar norms and non-finite counts (default True).
        max_bins: at most this many histogram buckets per layer (default 30).
        flush_secs: how often the background writer flushes to disk, seconds (default 10).
        max_queue: events buffered before a forced flush (default 1000).
        naming_rules: user naming rules ``(regex, layer_template, module_kind)`` for the layer
            labels (the configuration's ``naming.rules``), as for :func:`distgrad.naming.classify.classify`.

    Raises:
        ImportError: if ``torch.utils.tensorboard`` cannot be imported (the ``tensorboard``
            package is missing); install ``distgrad[report]``.

    ``write`` raises ``ValueError`` after ``close``.
    """

    name = "tensorboard"

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        histograms: bool = True,
        layer_scalars: bool = True,
        max_bins: int = 30,
        flush_secs: int = 10,
        max_queue: int = 1000,
        naming_rules: Sequence[tuple[str, str, str]] = (),
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "TensorBoardSink needs the 'tensorboard' package: pip install 'distgrad[report]'"
            ) from e
        self.log_dir = os.fspath(log_dir)
        self.histograms = bool(histograms)
        self.layer_scalars = bool(layer_scalars)
        self.max_bins = int(max_bins)
        self._writer: Any = SummaryWriter(log_dir=self.log_dir, flush_secs=flush_secs, max_queue=max_queue)
        if naming_rules:
            from distgrad.naming.classify import classify

            rules = tuple(naming_rules)
            self._layers = LayerIndex(lambda name: classify(name, rules))
        else:
            self._layers = LayerIndex()
        self._closed = False

    def write(self, record: StepRecord) -> None:
        """Add the scalars and histograms of ``record`` at ``global_step=record.step``."""
        if self._closed:
            raise ValueError("TensorBoardSink is closed")
        w = self._writer
        step = int(record.step)
        wt = float(record.timestamp) if record.timestamp else None
        p = record.params

        def scalar(tag: str, value: float) -> None:
            w.add_scalar(tag, float(value), global_step=step, walltime=wt)

        scalar("grad/norm", record.grad_norm)
        nonfinite = p.nonfinite
        scalar("grad/nonfinite_elements", float(nonfinite.sum()))
        scalar("grad/nonfinite_params", float(np.count_nonzero(nonfinite)))
        if record.loss is not None:
            scalar("train/loss", record.loss)
        if record.loss_scale is not None:
            scalar("train/loss_scale", record.loss_scale)
        if record.overflow is not None:
            scalar("train/overflow", 1.0 if record.overflow else 0.0)
        scalar("train/step_applied", 1.0 if record.step_applied else 0.0)
        for k in sorted(record.counters):
            scalar(f"counters/{k}", record.counters[k])

        gh = record.grad_histogram
        if gh is not None:
            tot = gh.total()
            scalar("grad/underflow_ratio", tot.underflow_ratio()["global"])
            if self.histograms:
                for part in (gh, tot):
                    for j, layer in enumerate(part.layers):
                        raw = log2_histogram(part, j)
                        if raw is not None:
                            w.add_histogram_raw(f"grad_log2_abs/{layer}", **raw, global_step=step, walltime=wt)
        if not (self.layer_scalars or self.histograms) or not p.names:
            return
        idx = self._layers.map(p.names)
        present = self._layers.present(p.names)
        layers = self._layers.layers
        L = len(layers)
        norms = p.norm
        if self.layer_scalars:
            layer_norm, layer_nf = self._layers.norms_and_nonfinite(p)
            for j in present:
                scalar(f"layer_grad_norm/{layers[j]}", float(layer_norm[j]))
                scalar(f"layer_grad_nonfinite/{layers[j]}", layer_nf[j])
        if self.histograms:
            order = np.argsort(idx, kind="stable")
            bounds = np.searchsorted(idx[order], np.arange(L + 1))
            for j in present:
                members = norms[order[bounds[j]:bounds[j + 1]]]
                h = _norm_histogram(members, self.max_bins)
                if h is None:
                    continue
                v = members[np.isfinite(members)]
                w.add_histogram_raw(
                    f"layer_param_norms/{layers[j]}",
                    min=float(v.min()),
                    max=float(v.max()),
                    num=int(v.size),
                    sum=float(v.sum()),
                    sum_squares=float(np.dot(v, v)),
                    bucket_limits=h[0],
                    bucket_counts=h[1],
                    global_step=step,
                    walltime=wt,
                )

    def flush(self) -> None:
        """Write pending events to disk now."""
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
