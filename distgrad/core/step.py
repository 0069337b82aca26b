"""The two values that pass between an optimizer-step boundary and the :class:`~distgrad.Instrument`
(see :meth:`~distgrad.Instrument.begin_step` / :meth:`~distgrad.Instrument.end_step`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from distgrad.stats.host_copy import HostCopy


@dataclasses.dataclass
class StepToken:
    """What :meth:`Instrument.begin_step` decided and read for one optimizer step; hand it back
    to :meth:`Instrument.end_step` unchanged.

    Attributes:
        step: the optimizer step (0-based, the engine's counter, identical on every rank).
        sampled: whether the step is sampled (``step % interval == 0`` and enabled).
        host: on a sampled step, the reduced statistics (float64 ``[sum_size + max_size]``
            host array, :func:`distgrad.stats.reduce_blocks`; with asynchronous records the
            :class:`~distgrad.stats.HostCopy` on its way there), or None when the reduction
            failed (counted in ``internal_errors``); None on unsampled steps.
    """

    step: int
    sampled: bool
    host: np.ndarray | HostCopy | None = None


@dataclasses.dataclass
class StepOutcome:
    """How the optimizer step went, as the boundary saw it after the optimizer ran.

    Attributes:
        overflow: True when a dynamic loss scaler found Inf/NaN and skipped the step, False when
            it checked and found none, None without a loss scaler.
        step_applied: whether the optimizer changed the weights.
        loss_scale: the loss scale the step's backward used (dimensionless, a power of 2), or
            None without a scaler; read on sampled steps only (it may sync with the device).
        grad_scale: the factor the gradients carried when :meth:`Instrument.begin_step` read
            them (1.0 when they were already unscaled); the statistics are divided by it.
        samples: training samples consumed so far when the engine counts them, else None.
        micro_step: micro-batches (forward/backward passes) since the start, this step's
            included (:attr:`StepRecord.micro_step`).
    """

    overflow: bool | None = None
    step_applied: bool = True
    loss_scale: float | None = None
    grad_scale: float = 1.0
    samples: int | None = None
    micro_step: int = 0
