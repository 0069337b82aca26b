"""Offline report of a distgrad JSONL run log: plots, an HTML page, a text summary and a verdict.

One streaming pass (:func:`analyze`) reads the log (rotated files included, see
:func:`distgrad.export.jsonl.read_jsonl`) one record at a time and keeps only bounded state:

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

Spikes: taken from the records (``record.spikes.flagged``, the verdict of distgrad's online
detectors on each sampled step) when any record of the run carries detector output;
otherwise computed here by :class:`RollingMadSpikes`, a rolling median / MAD rule on the grad norm
and on the loss (see its docstring).

Problems (the verdict names the first one, in file order):

* ``nonfinite_grad``: a NaN/Inf gradient element on a step that was *not* an fp16 overflow handled
  by the loss scaler (overflow steps are expected under dynamic loss scaling and only counted);
* ``nonfinite_loss``: a NaN/Inf loss;
* ``replica_mismatch``: replicated gradients differed across ranks;
* ``overflow_streak``: at least ``overflow_streak_limit`` consecutive fp16 overflow steps (the
  loss scale is collapsing);
* ``nonfinite_unsampled``: a NaN/Inf gradient on a step that was not sampled (``interval`` > 1),
  flagged by the instrument in the next sampled step's record;
* ``missing_records``: records lost from the log (the detail names each gap);
* ``malformed_lines``: a torn or otherwise malformed line (skipped);
* training health, judged by :mod:`~distgrad.report.verdict`: ``divergence``, ``loss_spike``,
  ``grad_norm_spike``, ``dead_adapter``, ``never_updated``, ``vanishing``, ``stall``,
  ``no_progress``, ``loss_scale_collapse`` (each names its step, what to do and its section of
  docs/runbook.md).

Modules: :mod:`~distgrad.naming.layers` (name -> layer), :mod:`~distgrad.report.downsample`,
:mod:`~distgrad.report.spikes`, :mod:`~distgrad.report.analysis` (the streaming pass),
:mod:`~distgrad.report.signals` (the packed signals' series and FINDINGS: advice with a
recommendation and a runbook link each, not problems), :mod:`~distgrad.report.text` (summary),
:mod:`~distgrad.report.plots` and
:mod:`~distgrad.report.page` (PNG files and ``report.html``).
"""

from distgrad.naming.layers import LayerIndex, layer_of, layer_sort_key  # noqa: F401
from distgrad.report.analysis import ANOMALY_LABELS, MAX_MARKERS, Problem, RunAnalysis, RunAnalyzer, analyze  # noqa: F401
from distgrad.report.downsample import Downsampled, Downsampler  # noqa: F401
from distgrad.report.page import ReportResult, write_report  # noqa: F401
from distgrad.report.spikes import RollingMadSpikes  # noqa: F401
from distgrad.report.text import format_summary, worst_layers  # noqa: F401

__all__ = ["analyze", "RunAnalyzer", "RunAnalysis", "Problem", "ANOMALY_LABELS", "MAX_MARKERS", "format_summary",
           "worst_layers", "write_report", "ReportResult", "Downsampler", "Downsampled", "LayerIndex", "layer_of",
           "layer_sort_key", "RollingMadSpikes"]
