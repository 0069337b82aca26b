"""The record's part for the opt-in action (:mod:`distgrad.diagnostics.action`)."""

from __future__ import annotations

from dataclasses import dataclass

from distgrad.record.base import _Part


@dataclass
class ActionPart(_Part):
    """What the opt-in action did on this sampled step (present when ``action.on_nonfinite`` or
    ``action.on_spike`` is set).

    Attributes:
        cause: ``"nonfinite"`` or ``"spike"`` when the action acted on this step, else None.
        mode: ``"skip"`` or ``"stop"`` when it acted, else None.
        skipped: the optimizer update of this step was skipped on every rank by distgrad.
        stop_requested: a stop was requested on this step or earlier
            (``Instrument.should_stop``; ``distgrad_action_stop_requested``).
        detail: what fired (e.g. ``"loss robust z=9.1"``), else None.
        samples_file: this rank's file holding the step's sample indices, when written (rank 0's
            path in rank 0's record).
    """

    cause: str | None = None
    mode: str | None = None
    skipped: bool = False
    stop_requested: bool = False
    detail: str | None = None
    samples_file: str | None = None

