"""The one interface every output of distgrad implements."""

from __future__ import annotations

import abc

from distgrad.record import StepRecord


class Sink(abc.ABC):
    """Receives every sampled step's record on global rank 0.

    ``write`` is called from the training thread right after the step's statistics are ready;
    it must be cheap (no network round trips) and may raise: the caller logs the exception,
    counts it in ``distgrad_internal_errors_total`` and ``distgrad_sink_errors_total{sink}``, and
    carries on with the other sinks. ``close`` is called once at shutdown.
    """

    #: short, bounded identifier used as the ``sink`` label value (e.g. "prometheus", "jsonl")
    name: str = "sink"

    @abc.abstractmethod
    def write(self, record: StepRecord) -> None:
        """Publish one sampled step."""

    def close(self) -> None:
        """Flush and release resources; idempotent."""
