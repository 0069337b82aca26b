"""The record parts of the loss analysis (each rank's loss and time, loss components, per-token
loss distribution, loss trend): typed parts of :class:`distgrad.record.StepRecord` (see
:mod:`distgrad.loss.tracker`, :mod:`distgrad.loss.components`, :mod:`distgrad.loss.token`,
:mod:`distgrad.loss.trend`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distgrad.record.base import _Part


@dataclass
class RankStats(_Part):
    """Each rank's own loss and step time on one sampled step (carried in the step's SUM
    collective; see :mod:`distgrad.loss.tracker`). Lists have one entry per rank (length W).

    Attributes:
        loss_mean: the rank's loss over its micro-batches of the step (``"sum"`` loss reduction:
            its step loss), in the loss's unit; NaN where the rank observed no loss.
        loss_max: the rank's largest micro-batch loss (``"sum"``: its step loss); NaN where none.
        loss_max_micro: 0-based index of that micro-batch within the rank's step (``"sum"``: of
            the micro-batch with the largest loss handed to backward, NaN/Inf first); NaN where none.
        step_time: seconds from the end of the rank's previous optimizer-step boundary to its
            arrival at this one (host wall clock); NaN on the first step.
        data_time: seconds of data loading the loop reported for the step
            (``observe_data_time``), else the time from the previous boundary to the step's
            first forward, else NaN (not known).
        data_reported: whether ``data_time`` was reported by the loop (else measured).
        loss_max_rank: the first rank whose loss is NaN/Inf if any, else the rank with the
            highest ``loss_max`` (ties: lowest); None when no rank observed a loss.
        straggler_rank: the rank with the longest ``data_time`` (the one the others waited
            for); None when no rank's data time is known.
        straggler_ratio: ``max(step_time) / (max(step_time) - (max(data_time) -
            median(data_time)))``: the step's wall time over what it would have been had the
            straggler's data time been the median's (dimensionless, >= 1); None when the step
            time is not known (first step) or shorter than the excess.
    """

    loss_mean: list[float] = field(default_factory=list)
    loss_max: list[float] = field(default_factory=list)
    loss_max_micro: list[float] = field(default_factory=list)
    step_time: list[float] = field(default_factory=list)
    data_time: list[float] = field(default_factory=list)
    data_reported: list[bool] = field(default_factory=list)
    loss_max_rank: int | None = None
    straggler_rank: int | None = None
    straggler_ratio: float | None = None


@dataclass
class LossComponents(_Part):
    """Loss components of one sampled step (see :mod:`distgrad.loss.components`), each exact
    over all micro-batches and ranks that passed them; lists in the order of ``names``.

    Attributes:
        names: the component names declared at first use (sorted, at most 8).
        mean: per component, its mean value (the loss's unit).
        weight: per component, its mean weight (dimensionless; 1 when none was given).
        share: per component, ``sum(weight * value) / sum(loss)``: its fraction of the total loss.
        count: per component, the micro-batches (over all ranks) that passed it.
        error: set (and the rest empty) when ranks declared different component sets.
        zscore: ``{component: {detector: z}}`` of the loss's spike detectors run on the
            component's weighted contribution (weight x mean); spikes_total:
            ``{component: {detector: count}}`` since the start;
            flagged: components judged a spike on this step.
    """

    names: list[str] = field(default_factory=list)
    mean: list[float] = field(default_factory=list)
    weight: list[float] = field(default_factory=list)
    share: list[float] = field(default_factory=list)
    count: list[float] = field(default_factory=list)
    error: str | None = None
    zscore: dict[str, dict[str, float]] = field(default_factory=dict)
    spikes_total: dict[str, dict[str, int]] = field(default_factory=dict)
    flagged: list[str] = field(default_factory=list)


@dataclass
class TokenLossStats(_Part):
    """Per-token loss distribution of one sampled step over all ranks and micro-batches (see
    :mod:`distgrad.loss.token`).

    Attributes:
        tokens: tokens counted (exact count as float).
        mean: token-weighted mean token loss (nats); perplexity: ``exp(mean)``.
        above_fraction: fraction of tokens whose loss exceeds ``threshold`` (nats), in [0, 1].
        nan_tokens: tokens whose loss was NaN (they make ``mean`` NaN).
        edges: the fixed bin upper edges (nats); hist: counts per bin (``len(edges) + 1``).
        max: the largest token loss (nats).
        sources: per data source with tokens this step (configured ``loss.sources`` and
            ``"other"``): ``{"tokens", "mean", "perplexity", "above_fraction", "nan_tokens",
            "hist"}``.
    """

    tokens: float = 0.0
    mean: float = float("nan")
    perplexity: float = float("nan")
    above_fraction: float = float("nan")
    nan_tokens: float = 0.0
    threshold: float = float("nan")
    edges: list[float] = field(default_factory=list)
    hist: list[float] = field(default_factory=list)
    max: float = float("nan")
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class LossTrend(_Part):
    """Trend of the loss over the last ``window`` optimizer steps (see :mod:`distgrad.loss.trend`).

    Attributes:
        window: the span in optimizer steps (config ``trend_window``).
        points: sampled steps with a finite loss in the window.
        slope_per_1k: ordinary least-squares slope of loss against step, per 1000 steps (the
            loss's unit); NaN with fewer than 3 points.
        stderr_per_1k: its standard error (same unit).
        plateau: the window is covered (its points span at least ``plateau_fraction`` of it) and
            ``|slope| <= plateau_z * stderr``: no trend distinguishable from 0.
    """

    window: int = 0
    points: int = 0
    slope_per_1k: float = float("nan")
    stderr_per_1k: float = float("nan")
    plateau: bool = False
