"""Sinks: where each sampled step's :class:`~distgrad.record.StepRecord` goes (rank 0 only)."""
from distgrad.sinks.base import Sink

__all__ = ["Sink"]
