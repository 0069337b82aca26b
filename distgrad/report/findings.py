"""What one pass over a run log found: :class:`Problem` (one finding with its first step) and
:class:`RunAnalysis` (the bounded result of :class:`~distgrad.report.analysis.RunAnalyzer`, with
the verdict text)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from distgrad.report.downsample import Downsampled
from distgrad.report.histogram import HistogramReport
from distgrad.report.loss import LossReport
from distgrad.report.signals import SignalsReport

#: At most this many spike markers / example steps are kept (the first ones); counts stay exact.
MAX_MARKERS = 10_000


@dataclass
class Problem:
    """One detected problem.

    Attributes:
        kind: ``nonfinite_grad``, ``nonfinite_loss``, ``nonfinite_unsampled``,
            ``replica_mismatch``, ``rerun`` (the opt-in rerun attribution's verdict), ``overflow_streak``,
            ``missing_records``, ``malformed_lines``,
            or one of :mod:`distgrad.report.verdict`'s (``divergence``, ``loss_spike``,
            ``grad_norm_spike``, ``dead_adapter``, ``never_updated``, ``vanishing``, ``stall``,
            ``no_progress``, ``loss_scale_collapse``).
        step: optimizer step where it (first) happened.
        param: parameter name, when one is implicated (else None).
        layer: the layer label of ``module`` when set, else of ``param`` (else None).
        ranks: implicated ranks (may be empty when unknown); for a non-finite step, the culprit
            ranks when known (whose own loss / gradient was non-finite before the reduction).
        detail: one-line human-readable description (no trailing period).
        module: for a non-finite step, the module whose forward output first went NaN/Inf in
            the step's forward replay (``culprit_module``), when found (else None).
    """

    kind: str
    step: int
    param: str | None = None
    layer: str | None = None
    ranks: list[int] = field(default_factory=list)
    detail: str = ""
    module: str | None = None


ANOMALY_LABELS = {
    "nonfinite_steps": "non-finite gradient steps",
    "nonfinite_grad": "  of which not fp16 overflows",
    "nonfinite_loss": "non-finite loss steps",
    "nonfinite_unsampled": "non-finite unsampled steps",
    "missing_records": "records missing from the log",
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
        spikes_source: ``"record"`` (from ``record.spikes``) or ``"rolling-mad"`` (computed).
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
    loss: LossReport | None = None  #: components, token losses, trend, per-rank attribution
    signals: SignalsReport | None = None  #: packed signals' series and findings (advice, not problems)
    grad_histogram: HistogramReport | None = None  #: log2|g| distribution (histogram.enabled runs)
    #: malformed lines skipped by :func:`~distgrad.report.analysis.analyze` (0 from a bare
    #: :class:`~distgrad.report.analysis.RunAnalyzer`), the first one's message, and how often the
    #: step went back (several runs appended to one file)
    bad_lines: int = 0
    first_bad_line: str | None = None
    restarts: int = 0

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
            return (f"HEALTHY: {span}, no non-finite gradient or loss, no replica mismatch, no divergence, "
                    f"large spike, vanishing, dead or never-updated parameter, stall or loss-scale collapse{tail}")
        p = self.problems[0]
        text = f"PROBLEM at step {p.step}: {p.detail}"
        if len(self.problems) > 1:
            others = ", ".join(f"{q.kind} at step {q.step}" for q in self.problems[1:])
            text += f". Later: {others}"
        return text + f". ({span})"
