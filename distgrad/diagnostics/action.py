"""The opt-in action (config section ``action``, docs/action.md): on a non-finite step or a paging
spike, skip the optimizer update on every rank, or skip it and stop the run after the user's
``on_stop`` callbacks.

Where the decision comes from: the sampled step's reduced statistics, which with synchronous
records are on the host at the boundary, after the reduction and before the optimizer runs
(:meth:`distgrad.Instrument.begin_step`). Every rank holds the same reduced array and feeds the
same detectors, so every rank decides the same with no extra collective and no extra host sync.
That is why the action needs ``sampling.interval: 1`` (an unsampled step has no host values:
its non-finite flag stays on the device) and synchronous records (``statistics.async_records``
``off``; ``auto`` resolves to off when an action is configured): :func:`check_config` refuses
the other combinations at ``instrument()``.

- ``nonfinite``: a NaN/Inf element in the reduced gradient or a NaN/Inf observed loss on some
  rank. Not under fp16 with a dynamic loss scaler (DeepSpeed fp16, ``scaler=`` GradScaler):
  there such a step is an overflow the scaler skips itself.
- ``spike``: the paging detector (:class:`~distgrad.diagnostics.robust_spike.RobustJumpDetector`) fires on
  the step's loss or global gradient norm; :meth:`RobustJumpDetector.test` asks it without
  changing its state, and the record's spike diagnostic then feeds the same value.

How an update is skipped is the engine boundary's business (see
:meth:`distgrad.engines.optimizer_boundary.OptimizerBoundary` and
:func:`distgrad.engines.deepspeed.attach_deepspeed`); this module decides, counts
(``distgrad_action_skipped_steps_total{cause}``, ``distgrad_action_stop_requested``), logs one
warning per episode of consecutive skipped steps, writes the step's sample indices and runs the
stop callbacks.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distgrad.diagnostics import adaptive_clip
from distgrad.record.action import ActionPart

log = logging.getLogger("distgrad")

#: values of the ``cause`` label of ``distgrad_action_skipped_steps_total``
CAUSES: tuple[str, ...] = ("nonfinite", "spike")


def active(config: Any) -> bool:
    """Whether ``config`` (a DistgradConfig) asks for an action."""
    a = config.action
    return config.enabled and (a.on_nonfinite != "none" or a.on_spike != "none")


def check_config(config: Any) -> None:
    """Refuse settings under which the action could not act on every step it is asked to.

    Raises:
        ConfigError: ``sampling.interval`` > 1 or ``statistics.async_records: on`` with an action
            configured (the message names the keys and the fix).
    """
    from distgrad.config import ConfigError
    from distgrad.diagnostics.adaptive_clip import check_config as check_adaptive_clip

    check_adaptive_clip(config)
    if not active(config):
        return
    a = config.action
    keys = ", ".join(f"action.{k}: {v}" for k, v in (("on_nonfinite", a.on_nonfinite), ("on_spike", a.on_spike))
                     if v != "none")
    if config.sampling.interval != 1:
        raise ConfigError(
            f"distgrad config: {keys} needs 'sampling.interval' 1 (got {config.sampling.interval}): the decision "
            "is made from the step's reduced statistics on the host before the optimizer runs, which only sampled "
            "steps have; set sampling.interval: 1, or set the action to none")
    if config.statistics.async_records == "on":
        raise ConfigError(
            f"distgrad config: {keys} needs synchronous records: with 'statistics.async_records' on the reduced "
            "statistics reach the host one step late, after the optimizer ran; set statistics.async_records: off "
            "(or auto), or set the action to none")


@dataclass
class Decision:
    """What the action decided at the boundary of one optimizer step.

    Attributes:
        step: the optimizer step.
        cause: ``"nonfinite"`` or ``"spike"``.
        mode: ``"skip"`` or ``"stop"`` (a stop skips the update too).
        detail: what fired, for logs and the record.
        loss: the step's reduced loss (None when none was observed).
        grad_norm: the global norm of the reduced gradient.
    """

    step: int
    cause: str
    mode: str
    detail: str
    loss: float | None
    grad_norm: float


class Action:
    """The action of one :class:`~distgrad.Instrument` (``inst.action``); inert when no action
    is configured. Boundary side: :meth:`decide` (after ``begin_step``, before the optimizer),
    :meth:`after_step` (in ``end_step``). User side: :attr:`should_stop`, :meth:`on_stop`.

    Attributes:
        active: an action is configured.
        skipped: updates skipped so far, by cause (same on every rank; kept in
            ``Instrument.counters`` as ``action_skipped_<cause>``, so checkpointed with them).
        should_stop: a stop was requested (same on every rank, from the stopping step on).
        stop_decision: the :class:`Decision` that requested the stop, else None.
        pending: the decision of the step between :meth:`decide` and :meth:`after_step`.
    """

    def __init__(self, inst: Any) -> None:
        cfg = inst.config.action
        self.inst = inst
        self.active = active(inst.config)
        self.modes = {"nonfinite": cfg.on_nonfinite, "spike": cfg.on_spike}
        self.dir = cfg.samples_dir or inst.config.flight_recorder.dir
        self.should_stop = False
        self.stop_decision: Decision | None = None
        self.pending: Decision | None = None
        self._callbacks: list[Callable[[Decision], None]] = []
        self._episode: list[Any] | None = None  # [first step, last step, count, causes]
        self._samples_file: str | None = None
        self._no_dir_logged = False
        #: adaptive clipping (distgrad.diagnostics.adaptive_clip) is configured: decided here too
        self.clipping = adaptive_clip.enabled(inst.config)
        adaptive_clip.check_engine(inst.config, inst.source.engine_name, inst.job is not None)
        #: the per-parameter factors adaptive clipping decided for the step being opened
        #: (:meth:`take_clip`), None when nothing is to be clipped
        self.clip_factors: Any = None

    @property
    def skipped(self) -> dict[str, int]:
        return {c: self.inst.counters[f"action_skipped_{c}"] for c in CAUSES}

    # -- user side ----------------------------------------------------------------------------
    def on_stop(self, fn: Callable[[Decision], None]) -> None:
        """Register ``fn(decision)``, run once on every rank when a stop is decided."""
        self._callbacks.append(fn)

    # -- boundary side ------------------------------------------------------------------------
    def decide(self, token: Any, grad_scale: float = 1.0, loss_scaler: bool = False) -> Decision | None:
        """The decision for the step of ``token`` (from :meth:`Instrument.begin_step`), made from
        its reduced host array; None: apply the update. ``loss_scaler``: fp16 with a dynamic
        loss scaler (non-finite steps are its overflows: no action). Never raises (a failure is
        counted and the update applied)."""
        self.clip_factors = None
        if not (self.active or self.clipping) or not token.sampled or not isinstance(token.host, np.ndarray):
            return None
        d = None
        try:
            from distgrad.stats import unpack

            inst = self.inst
            parts = inst.split_reduced(token.host)  # no state change; the blocks Instrument._complete reads
            red = unpack(parts.core, inst.layout, inst.names, grad_scale)
            if self.active:
                d = self._decide(token, red, loss_scaler)
        except Exception:  # noqa: BLE001 - the action must never break training
            self.inst.count_error("deciding the action")
            return None
        if d is not None:
            self.pending = d
            self._take(d)
        elif self.clipping:
            self._decide_clip(token, red, loss_scaler)
        return d

    def _decide_clip(self, token: Any, red: Any, loss_scaler: bool) -> None:
        """Adaptive clipping's factors for the step (:attr:`clip_factors`), on an update that is
        applied. Never raises (a failure is counted and nothing is clipped)."""
        clip = self.inst.diagnostics.get("adaptive_clip") if self.inst.diagnostics is not None else None
        if clip is None:
            return
        try:
            if red.rank_error.sum():
                clip.not_acted(token.step, "refused: a rank could not vouch for its gradients at distgrad's read "
                                           "(distgrad_refused_steps_total; e.g. clipped before the read)")
            elif loss_scaler and not bool(np.all(np.isfinite(red.params.sumsq))):
                clip.not_acted(token.step, "fp16 overflow (the loss scaler skips the step)")
            else:
                self.clip_factors = clip.decide(token.step, red.params.sumsq, red.params.numel)
        except Exception:  # noqa: BLE001 - adaptive clipping must never break training
            self.clip_factors = None
            self.inst.count_error("deciding adaptive clipping")

    def take_clip(self) -> Any:
        """The per-parameter factors decided for the step being opened (float64 (P,), aligned
        with the instrument's parameter names), or None; cleared by the call."""
        f, self.clip_factors = self.clip_factors, None
        return f

    def _decide(self, token: Any, red: Any, loss_scaler: bool) -> Decision | None:
        from distgrad.stats import global_norm

        inst = self.inst
        if red.rank_error.sum():
            return None  # a rank could not vouch for its gradients: the step is not exported either
        gnorm = global_norm(red.params)
        loss = red.loss_sum / red.loss_count if red.loss_count else None
        bad_loss = loss is not None and not math.isfinite(loss)
        nonfinite = bool(red.params.nonfinite.sum() > 0) or not math.isfinite(gnorm) or bad_loss
        if nonfinite and loss_scaler:
            return None  # an fp16 overflow: the loss scaler skips it (the spike detectors are not fed it either)
        if nonfinite and self.modes["nonfinite"] != "none":
            grads = bool(red.params.nonfinite.sum() > 0) or not math.isfinite(gnorm)
            what = "loss and gradient" if bad_loss and grads else ("loss" if bad_loss else "gradient")
            return Decision(token.step, "nonfinite", self.modes["nonfinite"], f"non-finite {what}", loss, gnorm)
        if self.modes["spike"] == "none" or inst.diagnostics is None:
            return None
        spikes = inst.diagnostics.get("spikes")
        if spikes is None:
            return None
        for series, value in (("grad_norm", gnorm), ("loss", loss)):
            det = spikes.monitors[series].detectors.get("robust")
            if det is None or value is None:
                continue
            r = det.test(value)
            if r.is_spike:
                return Decision(token.step, "spike", self.modes["spike"],
                                f"{series} {value:.4g} robust z={r.score:.1f} (threshold {r.threshold:.4g})",
                                loss, gnorm)
        return None

    def _take(self, d: Decision) -> None:
        """Count, log, write the sample indices; a stop is flagged (callbacks in after_step)."""
        self.inst.counters[f"action_skipped_{d.cause}"] += 1
        if self.inst.prometheus is not None:
            self.inst.prometheus.collector.inc_labeled("distgrad_action_skipped_steps", {"cause": d.cause})
        if self._episode is None:
            self._episode = [d.step, d.step, 0, set()]
            if self.inst.global_rank == 0:
                log.warning("distgrad: step %d: %s (loss %s, grad norm %.4g): the optimizer update is SKIPPED on every "
                            "rank (action.on_%s: %s); counted in distgrad_action_skipped_steps_total{cause=%r}. "
                            "Skipping hides the cause: look at it (docs/runbook.md, DistgradUpdatesSkipped)",
                            d.step, d.detail, d.loss, d.grad_norm, d.cause, d.mode, d.cause)
        self._episode[1] = d.step
        self._episode[2] += 1
        self._episode[3].add(d.cause)
        self._samples_file = self._write_samples(d)
        if d.mode == "stop" and not self.should_stop:
            self.should_stop, self.stop_decision = True, d
            if self.inst.global_rank == 0:
                log.warning("distgrad: step %d: stopping the run (action.on_%s: stop): the update was skipped; "
                            "on_stop callbacks run on every rank now and Instrument.should_stop is True",
                            d.step, d.cause)

    def _write_samples(self, d: Decision) -> str | None:
        """Append this rank's sample indices of the step to ``<dir>/action-rank<rank>.jsonl``."""
        from distgrad.loss.tracker import _indices

        if not self.dir:
            if not self._no_dir_logged and self.inst.global_rank == 0:
                self._no_dir_logged = True
                log.warning("distgrad: the sample indices of acted-on steps are not written: set action.samples_dir "
                            "(or flight_recorder.dir)")
            return None
        s = getattr(self.inst, "_loss_step", None)
        samples = {} if s is None else {str(k): _indices(v) for k, v in sorted(s.samples.items())}
        doc = {"step": d.step, "rank": self.inst.global_rank, "cause": d.cause, "mode": d.mode, "detail": d.detail,
               "loss": d.loss, "grad_norm": d.grad_norm, "samples_by_micro_batch": samples}
        path = Path(self.dir) / f"action-rank{self.inst.global_rank}.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(doc) + "\n")
        except OSError as e:
            log.warning("distgrad: step %d: sample indices not written to %s: %s", d.step, path, e)
            self.inst._sink_error("flight_recorder")
            return None
        return str(path)

    def part(self, step: int) -> ActionPart | None:
        """The record's :class:`ActionPart` for sampled step ``step`` (None when inactive)."""
        if not self.active:
            return None
        d = self.pending if self.pending is not None and self.pending.step == step else None
        return ActionPart(cause=d.cause if d else None, mode=d.mode if d else None, skipped=d is not None,
                          stop_requested=self.should_stop, detail=d.detail if d else None,
                          samples_file=self._samples_file if d else None)

    def after_step(self, step: int) -> None:
        """End of the boundary of ``step`` (every rank): run the stop callbacks of a stop
        decided on this step; log the end of an episode of skipped steps. Never raises."""
        d, self.pending = self.pending, None
        if d is None and self._episode is not None:
            first, last, n, causes = self._episode
            self._episode = None
            if self.inst.global_rank == 0:
                log.warning("distgrad: step %d: optimizer updates applied again after %d skipped step(s) %d-%d (%s)",
                            step, n, first, last, ", ".join(sorted(causes)))
        if d is not None and d is self.stop_decision:
            for fn in self._callbacks:
                try:
                    fn(d)
                except Exception:  # noqa: BLE001 - counted, the others run
                    self.inst.count_error("on_stop callback")


__all__ = ["Action", "Decision", "CAUSES", "active", "check_config"]
