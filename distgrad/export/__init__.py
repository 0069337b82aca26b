"""Sinks: where each sampled step's :class:`~distgrad.record.StepRecord` goes (rank 0 only)."""
from distgrad.export.base import Sink, SinkError

__all__ = ["Sink", "SinkError"]
