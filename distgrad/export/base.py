"""The one interface every output of distgrad implements."""

from __future__ import annotations

import abc

from distgrad.record import StepRecord


class Sink(abc.ABC):
    """Receives every sampled step's record on global rank 0.

    ``write`` is called from the training thread right after the step's statistics are ready;
    it must be cheap (no network round trips) and may raise: the caller
    counts it in ``distgrad_sink_errors_total{sink}`` (and, unless it is a :class:`SinkError`, in
    ``distgrad_internal_errors_total``, logging its traceback once per sink and exception type), and
    carries on with the other sinks. ``close`` is called once at shutdown.
    """

    #: short, bounded identifier used as the ``sink`` label value (e.g. "prometheus", "jsonl")
    name: str = "sink"

    @abc.abstractmethod
    def write(self, record: StepRecord) -> None:
        """Publish one sampled step."""

    def close(self) -> None:  # noqa: B027  (optional: a sink with nothing to release keeps it)
        """Flush and release resources; idempotent."""


class SinkError(OSError):
    """A sink could not publish a record for a reason outside distgrad (disk full, directory
    removed, ...) and has already logged that once. The caller counts it in
    ``distgrad_sink_errors_total{sink}`` only (not as an internal error) and logs nothing more."""
