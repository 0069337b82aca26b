"""The instrument: decides when to sample, runs the statistics core and the cross-rank
reduction on the optimizer-step boundary, builds the :class:`StepRecord`, and hands it to the
diagnostics and, on global rank 0, to the sinks.

Collective discipline: every rank makes the same collectives in the same order. Whether a step
is sampled is decided from the engine's optimizer-step counter (identical on all ranks); a rank
whose local computation fails still joins the collectives with identity values and an error
flag; the only data-dependent collective (per-rank provenance on a non-finite step) is decided
from the *reduced* non-finite count, which every rank holds identically.

Asynchronous records (config ``async_records``, on by default for CUDA gradients): at a sampled
step :meth:`Instrument.collect` enqueues the statistics, the two all-reduces and a non-blocking
copy to pinned host memory with a CUDA event, and :meth:`Instrument.finish` only does the
bookkeeping that needs no device value (overflow/skip counters) and enqueues the update-ratio
all-reduce; nothing on the training thread waits for the device. The step is *parked*, and
at the next boundary (``collect`` or ``skip`` of the next optimizer step, on every rank alike,
before that step's own collectives) or at ``close()`` / :meth:`Instrument.flush` its record is
built, the provenance all-gather made if its reduced statistics are non-finite, and the record
handed to the diagnostics, hooks and sinks: one optimizer step late, never more. Waiting for
the event there normally costs nothing (a whole step of device work was queued after it).
``last_record`` and the published metrics therefore lag one step behind in that mode.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from distgrad._version import __version__
from distgrad.config import DistgradConfig
from distgrad.core.dist import DTYPE_NAMES, dist_ready
from distgrad.core.step import StepOutcome, StepToken
from distgrad.core.step_collectives import provenance, update_ratio_sums, update_ratio_values, weight_pieces
from distgrad.core.watch import UnsampledWatch, step_ranges
from distgrad.diagnostics.action import Action, Decision
from distgrad.diagnostics.culprit import LocalGradCheck, culprit_flags, decode, pre_reduction_leaves
from distgrad.diagnostics.rerun import RerunAttribution
from distgrad.engines.base import GradSource
from distgrad.export import metrics
from distgrad.export.base import Sink, SinkError
from distgrad.loss.tracker import LossTracker, StepLoss
from distgrad.record import ScalerState, StepRecord, UnsampledNonfinite
from distgrad.signals.builtin import build as build_signals
from distgrad.stats import (
    RANK_COLS,
    SUM_COLS,
    HostCopy,
    Layout,
    error_blocks,
    global_norm,
    pack_local,
    reduce_blocks,
    reduce_blocks_async,
    replica_checksum,
    replica_outliers,
    unpack,
)
from distgrad.stats.layout import StepBlocks

if TYPE_CHECKING:
    from distgrad.diagnostics import Diagnostics
    from distgrad.engines.optimizer_boundary import OptimizerBoundary
    from distgrad.export.prometheus import PrometheusSink

log = logging.getLogger("distgrad")

#: value of a rank's error slot in the SUM block when it refuses a step (see Instrument.collect):
#: 2 + the index of the reason in the ``reason`` label's values, so that every rank learns why
_REFUSED = 2.0
REFUSAL_REASONS: tuple[str, ...] = metrics.LABELS["reason"].values or ()

class ReducedBlocks(NamedTuple):
    """A sampled step's reduced host array taken apart (:meth:`Instrument.split_reduced`), float64
    views: ``core`` ``[core SUM, core MAX]`` (for :func:`~distgrad.stats.unpack`), the loss
    block's and the packed signals' SUM and MAX parts, the unsampled steps' flags."""

    core: np.ndarray
    loss_sum: np.ndarray
    loss_max: np.ndarray
    signal_sum: np.ndarray
    signal_max: np.ndarray
    flags: np.ndarray


class _Refused(Exception):
    """Internal: this rank refuses the step (see :meth:`Instrument.collect`)."""


class Instrument:
    """Watches one training run. Built by :func:`distgrad.instrument`; not constructed directly.

    One class: its state, the optimizer-step boundary (sampling, statistics, collectives, the
    record), set-up (:meth:`start`, :meth:`agree`, the diagnostics), the calls users and
    integrations make (losses, samples, data time, checkpoint state, hooks, ``close``) and
    publishing to rank 0's sinks with distgrad's own failures counted
    (``distgrad_internal_errors_total``, ``distgrad_sink_errors_total``,
    ``distgrad_refused_steps_total``). Longer bodies live in functions of their own modules
    (:mod:`distgrad.core.startup`, :mod:`distgrad.core.checkpoint`, :mod:`distgrad.loss.tracker`),
    which these methods call.

    Engine boundaries and integrations (Hugging Face Trainer, Lightning callbacks) drive it only
    through its public boundary API: :meth:`start`, :meth:`begin_step` / :meth:`end_step`,
    :meth:`observe_loss`, :meth:`forward_started`, :meth:`after_micro_batch`, :meth:`on_close` and
    :meth:`count_error`
    (table and rules in ``docs/engines.md``, "Writing a boundary").

    Attributes:
        config: the validated :class:`DistgradConfig`.
        rank, world_size: this process's rank and the number of ranks combined.
        port: the Prometheus port actually bound on rank 0 (useful with ``port=0``), else None.
        last_record: the :class:`StepRecord` of the last sampled step (every rank has it).
        counters: totals since ``instrument()`` (see ``StepRecord.counters``).
    """

    def __init__(self, source: GradSource, config: DistgradConfig, group: Any = None) -> None:
        from distgrad.core.job import job_view

        self.source = source
        self.config = config
        #: the job-wide parameter list when this rank holds part of the model (pipeline stages,
        #: experts on other ranks; see distgrad.core.job), else None: statistics combine the whole job
        self.job = job_view(source)
        self.group = None if self.job is not None else group
        self.rank = dist.get_rank(self.group) if dist_ready() else 0
        self.world_size = dist.get_world_size(self.group) if dist_ready() else 1
        self.global_rank = dist.get_rank() if dist_ready() else 0
        #: the exported parameter names (the job's, or the source's own)
        self.names: list[str] = self.job.names if self.job is not None else list(source.names)
        self.layout = Layout(len(self.names), self.world_size)
        #: which share of each local piece this rank counts (exactly-once ownership, decided once)
        self.own = self.job.own if self.job is not None else source.ownership(self.rank, self.world_size)
        self.counters: dict[str, int] = {k: 0 for k in (
            "nonfinite_steps", "sampled_steps", "internal_errors", "replica_mismatch",
            "overflow_steps", "skipped_steps", "samples", "nonfinite_unsampled_steps", "nonfinite_loss_steps",
            "action_skipped_nonfinite", "action_skipped_spike")}
        self.last_record: StepRecord | None = None
        self.sinks: list[Sink] = []
        self.prometheus: PrometheusSink | None = None  # rank 0's exporter, set by start()
        self.port: int | None = None
        #: this rank's losses, sample indices and times of the current step (distgrad.loss.tracker)
        self.loss = LossTracker(self.world_size, config.loss.sources, config.loss.token_threshold)
        self._loss_step: StepLoss | None = None  # the sampled step's, from collect to its record
        #: how observed losses combine into ``distgrad_loss``: "mean" (each observation is one
        #: micro-batch's loss; averaged over micro-batches and ranks) or "sum" (each observation is
        #: the loss exactly as handed to backward by a framework that pre-scales it for gradient
        #: accumulation / number of items / world size; summed over the step's micro-batches, then
        #: averaged over ranks: the loss whose gradient the reduced gradient is). Set by the
        #: framework integrations (distgrad.integrations), never by users.
        self.loss_reduction = "mean"
        self._auto_loss = True  # automatic loss capture on, until the first explicit observe_loss
        self._auto_seen = False  # an automatically captured loss is in self.loss
        self._consecutive_overflow = 0
        self._replica_mismatch_rank = -1
        self._restore: list[Callable[[], None]] = []
        self._hooks: list[Callable[[StepRecord], None]] = []
        self._closed = False
        self._logged_errors: set[tuple[str, str]] = set()
        self._logged_bad_input: set[str] = set()
        #: records each sink failed to publish, by sink name (``distgrad_sink_errors_total{sink}``)
        self.sink_errors: dict[str, int] = {}
        #: sampled steps not exported because a rank could not vouch for its gradients, by the
        #: reason of the lowest such rank (``distgrad_refused_steps_total{reason}``; same on every rank)
        self.refused_steps: dict[str, int] = {}
        self._watcher = UnsampledWatch(config.sampling.interval)  # non-finite flags of unsampled steps
        self._unsampled: dict[str, list[int]] | None = None
        self._unsampled_logged = False
        self.diagnostics: Diagnostics | None = None
        mode = config.statistics.async_records
        #: the opt-in action and adaptive clipping (distgrad.diagnostics.action): need synchronous
        #: records, so "auto" is off with them
        self.action = Action(self)
        #: (the rerun attribution, distgrad.diagnostics.rerun, needs them too: it reruns before the update)
        self.async_records = mode == "on" or (mode == "auto" and self._device_type() == "cuda"
                                              and not (self.action.active or self.action.clipping)
                                              and not RerunAttribution.section_of(config).enabled)
        self._parked: dict[str, Any] | None = None  # the sampled step waiting for its host copy
        self.local_grad_check: LocalGradCheck | None = None  # culprit rank: local grads before reduction
        #: the packed signals (distgrad.signals) riding in the step's two collectives; decided
        #: here from the configuration (same on every rank); raises a configuration error
        self.signals = build_signals(self)
        self.sampled_step: int | None = None  # the optimizer step of the last collect()
        self.replay: Any = None  # culprit module: distgrad.diagnostics.replay.ForwardReplay, set by attach_replay
        #: PyTorch loops: the optimizer's step hooks, set by distgrad.instrument (None under DeepSpeed, when disabled)
        self.boundary: OptimizerBoundary | None = None

    def _device_type(self) -> str:
        try:
            return torch.device(self.source.device()).type
        except Exception:  # noqa: BLE001 - a source without a device yet: CPU behaviour
            return "cpu"

    # ----------------------------------------------------------------------------------
    # the boundary: every engine boundary and integration uses begin_step / end_step,
    # observe_loss, after_micro_batch, on_close and count_error, nothing else
    def is_sampled(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based, engine counter) is sampled."""
        return self.config.enabled and step % self.config.sampling.interval == 0

    def begin_step(self, step: int, refuse: str | None = None) -> StepToken:
        """Open optimizer step ``step`` at the boundary: after the gradient reduction (and
        accumulation) has completed, before the optimizer consumes the gradients.

        Decides sampling from ``step`` alone (so all ranks agree); on a sampled step reads this
        rank's gradient pieces, computes their statistics, makes the two collectives (SUM, MAX)
        and one host copy (:meth:`collect`; with asynchronous records a non-blocking copy, and
        first the previous sampled step's record is published). Must be called on every rank, for every optimizer
        step, skipped ones included, with the same ``step``. Never raises (failures are
        counted). Pair it with exactly one :meth:`end_step`.

        Args:
            step: the optimizer step, 0-based, counting every step the loop attempts.
            refuse: why this rank's gradients cannot be the step's reduced gradient, or None
                (see :meth:`collect`).

        Returns:
            The :class:`~distgrad.core.step.StepToken` to hand to :meth:`end_step`.
        """
        sampled = self.is_sampled(step)
        if not sampled:
            self.watch(step)  # device-side non-finite flag, folded into the next sampled step
        host = self.collect(step, refuse) if sampled else None
        if self.replay is not None:  # the culprit module of a non-finite step (distgrad.diagnostics.replay)
            self.replay.boundary(step, host, sampled)
        return StepToken(int(step), sampled, host)

    def decide_action(self, token: StepToken, grad_scale: float = 1.0) -> Decision | None:
        """Boundary API, right after :meth:`begin_step` on every rank, before the optimizer
        runs: the opt-in action's decision for this step (:mod:`distgrad.diagnostics.action`), None to apply
        the update. A decision means: skip this step's update on every rank (the boundary does
        it, and reports ``StepOutcome(step_applied=False)``). ``grad_scale``: the factor the
        gradients still carry (fp16). No collective, no host sync. Never raises."""
        return self.action.decide(token, grad_scale, bool(self.source.has_loss_scaler()))

    def end_step(self, token: StepToken, outcome: StepOutcome) -> StepRecord | None:
        """Close the step opened by :meth:`begin_step`, after the optimizer ran (or was
        skipped): account overflow / skipped steps / samples, and on a sampled step build the
        :class:`StepRecord`, run the diagnostics and hooks and publish it to the sinks
        (:meth:`finish`); the losses observed for the step are then dropped. Never raises.

        Returns:
            The record of a sampled step, else None (also when the step's statistics could not
            be computed on some rank: counted in ``internal_errors``; and with asynchronous
            records, where the record is built at the next boundary: see :meth:`flush`).
        """
        try:
            if token.sampled:
                return self.finish(token, outcome)
            self.skip(outcome)
            return None
        finally:
            self.loss.exit()
            if self.action.active:
                self.action.after_step(token.step)

    def collect(self, step: int, refuse: str | None = None) -> np.ndarray | HostCopy | None:
        """Local statistics + the two collectives + one host copy, for a sampled step.

        Must be called on every rank at the same boundary. Returns the reduced host array (or,
        with asynchronous records, the :class:`HostCopy` on its way there), or None when the
        reduction itself failed (counted). Asynchronous records: first publishes the parked
        previous sampled step.

        ``refuse``: a reason why this rank's gradients cannot be this step's reduced gradient
        (read before the step's backward, already clipped, no backward since the last step; see
        :mod:`distgrad.engines.guards`). The rank still joins both collectives, with a "refused"
        flag, so every rank drops the step: nothing is exported for it. The caller warns once.
        """
        self._drain(collectives=True)
        self.sampled_step = step  # the packed signals' view of the step (distgrad.signals.weight_hash)
        device = self.source.device()
        self._loss_step = step_loss = self.loss.arrive()
        grad_flag = None
        try:
            if self.local_grad_check is not None:  # taken (and reset) on every sampled step
                grad_flag = self.local_grad_check.take(device)
            if refuse is not None:
                raise _Refused(refuse)
            pieces = self.pieces(self.source.local_pieces())
            fingerprint = None
            if self.own.groups and self.config.statistics.replica_check and self.world_size > 1:
                fingerprint = replica_checksum([p for p, c in zip(pieces, self.own.check) if c], device)
            pieces = self.own.take(pieces)
            count = step_loss.count if self.loss_reduction == "mean" else min(step_loss.count, 1)
            parts = {"core": pack_local(pieces, self.layout, self.rank, device, fingerprint, step_loss.sum, count,
                                        culprit_flags(step_loss.sum, grad_flag, device)),
                     "loss": self.loss.block(step_loss, self.rank, device, self.loss_reduction),
                     "signals": self.signals.block(self, pieces, device)}
        except _Refused:  # join the collectives with the "refused" flag: every rank drops the step
            parts = self._error_blocks(device)
            code = REFUSAL_REASONS.index(refuse) if refuse in REFUSAL_REASONS else 0
            parts["core"][0][self.layout.rank_offset + self.rank * len(RANK_COLS) + 2] = _REFUSED + code
        except Exception:  # noqa: BLE001 - join the collectives anyway, with the error flag set
            self._internal_error("local statistics")
            parts = self._error_blocks(device)
        self._local_nonfinite = parts["core"][0][: self.layout.rank_offset].view(-1, len(SUM_COLS))[:, 3:5].clone()
        self._weights_before = None
        if self.config.statistics.update_ratio and refuse is None:
            try:
                self._weights_before = [w.clone() if w is not None else None for w in weight_pieces(self)]
            except Exception:  # noqa: BLE001
                self._internal_error("copying the weights for the update ratio")
        flags = self._watcher.take(device)  # the unsampled steps' flags ride in the MAX collective
        if flags is not None:
            parts[self._watcher.name] = (flags[:0], flags)
        sum_block, max_block = self.blocks.pack(parts)  # in the order of the declared blocks
        try:
            if self.async_records:
                return reduce_blocks_async(sum_block, max_block, self.group)
            return reduce_blocks(sum_block, max_block, self.group)
        except Exception:  # noqa: BLE001
            self._internal_error("cross-rank reduction")
            return None

    def _error_blocks(self, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """:func:`error_blocks` plus the identities of the per-rank loss block and the signals,
        by block name (the blocks of :attr:`blocks` but the unsampled-step flags)."""
        return {"core": error_blocks(self.layout, self.rank, device),
                "loss": self.loss.block(None, self.rank, device, self.loss_reduction),
                "signals": self.signals.block(self, None, device)}

    @property
    def blocks(self) -> StepBlocks:
        """The blocks of a sampled step's packed tensors (:class:`~distgrad.stats.layout.StepBlock`:
        a name and the SUM / MAX sizes, the same on every rank), in packing order: the core
        statistics (:class:`~distgrad.stats.layout.Layout`, ``"core"``), the loss block
        (:class:`~distgrad.loss.tracker.LossTracker`, ``"loss"``), the packed signals
        (:class:`~distgrad.signals.SignalPack`, ``"signals"``), the unsampled steps' flags
        (:class:`~distgrad.core.watch.UnsampledWatch`, ``"unsampled"``, MAX only). :meth:`collect`
        packs them (:meth:`~distgrad.stats.layout.StepBlocks.pack`), :meth:`split_reduced` takes
        them apart (:meth:`~distgrad.stats.layout.StepBlocks.split`)."""
        return StepBlocks([self.layout, self.loss, self.signals, self._watcher])

    def block_sizes(self) -> list[tuple[int, int]]:
        """``(SUM elements, MAX elements)`` of each of :attr:`blocks`, in packing order."""
        return self.blocks.sizes()

    def split_reduced(self, host: np.ndarray) -> ReducedBlocks:
        """The reduced host array of a sampled step taken apart by :attr:`blocks`
        (:meth:`~distgrad.stats.layout.StepBlocks.split`): used by :meth:`_complete` and by the opt-in
        action's decision (:mod:`distgrad.diagnostics.action`), which reads the same array before
        the optimizer step. No state changes.

        Raises:
            ValueError: the array does not have the blocks' length.
        """
        parts = self.blocks.split(host)
        (cs, cm), (ls, lm), (ss, sm) = parts["core"], parts["loss"], parts["signals"]
        return ReducedBlocks(np.concatenate([cs, cm]), ls, lm, ss, sm, parts[self._watcher.name][1])

    def pieces(self, local: Any) -> list[torch.Tensor | None]:
        """The source's per-parameter pieces at the positions of :attr:`names` (the job view
        places them in the job-wide list, None for parameters held elsewhere)."""
        return self.job.expand(local) if self.job is not None else list(local)

    def watch(self, step: int) -> None:
        """Non-finite check of an optimizer step that is not sampled (``interval`` > 1): see
        :mod:`distgrad.core.watch`. Called on every rank at the boundary of unsampled step ``step``,
        before the optimizer consumes the gradients; device work only (no collective, no host
        sync); the next sampled step's record counts the flagged steps
        (``nonfinite_unsampled_steps``, ``nonfinite_loss_steps``) and names them
        (``StepRecord.unsampled_nonfinite``). Never raises (a failure is counted)."""
        if self.local_grad_check is not None:
            self.local_grad_check.reset()  # the culprit flags are carried by sampled steps only
        if self.signals:
            self.signals.skip(self, step)
        if not self.config.enabled or self.config.sampling.interval < 2 or step % self.config.sampling.interval == 0:
            return
        try:
            pieces = self.own.take(self.pieces(self.source.local_pieces()))
            self._watcher.observe(step, pieces, self.loss.cur.sum, self.source.device())
        except Exception:  # noqa: BLE001
            self._internal_error("non-finite check of an unsampled step")

    def _fold_watch(self, step: int, flags: np.ndarray) -> None:
        """Count the unsampled steps the reduced flags mark (sets ``self._unsampled``)."""
        self._unsampled = self._watcher.flagged(step, flags)
        grad = self._unsampled["grad"] if self._unsampled else []
        self.counters["nonfinite_unsampled_steps"] += len(grad)
        self.counters["nonfinite_loss_steps"] += len(self._unsampled["loss"]) if self._unsampled else 0
        if grad and not self._unsampled_logged and self.global_rank == 0:
            log.warning("distgrad: non-finite gradients on unsampled optimizer step(s) %s (interval %d): "
                        "counted in distgrad_nonfinite_unsampled_steps_total; set sampling.interval: 1 for "
                        "per-parameter detail on every step", step_ranges(grad), self.config.sampling.interval)
        self._unsampled_logged = bool(grad)

    def finish(self, token: StepToken, outcome: StepOutcome) -> StepRecord | None:
        """Turn the sampled step's reduced array (``token.host``) into a record after the
        optimizer step, update counters and diagnostics, publish. Asynchronous records
        (``token.host`` a :class:`HostCopy`): only the counters and the update-ratio all-reduce
        now; the step is parked and its record built at the next boundary (returns None).
        Never raises."""
        step, host = token.step, token.host
        try:
            self.account(outcome)
            if self.signals:
                self.signals.after_step(self, outcome.step_applied)
            if host is None:
                self._publish_counters()
                return None
            if isinstance(host, HostCopy):
                ratio = None
                if self.config.statistics.update_ratio:
                    ratio = HostCopy(update_ratio_sums(self, self.layout.n_params))
                self._parked = {"step": step, "outcome": outcome, "host": host, "ratio": ratio,
                                "local_nonfinite": self._local_nonfinite, "loss": self._loss_step}
                self._publish_counters()
                return None
            return self._complete(host, step, outcome, self._local_nonfinite, ratio=None, collectives=True,
                                  step_loss=self._loss_step)
        except Exception:  # noqa: BLE001
            self._internal_error("finishing the step")
            return None
        finally:
            self._loss_step = None
            self.loss.drop()

    def _drain(self, collectives: bool) -> StepRecord | None:
        """Build and publish the parked sampled step (asynchronous records), if any. Waits for
        its host copy (normally complete by now). ``collectives``: allowed to make the provenance
        all-gather (every rank is at the same boundary). Never raises."""
        parked, self._parked = self._parked, None
        if parked is None:
            return None
        try:
            host = parked["host"].wait()
            return self._complete(host, parked["step"], parked["outcome"], parked["local_nonfinite"], parked["ratio"],
                                  collectives, parked["loss"])
        except Exception:  # noqa: BLE001
            self._internal_error("finishing the parked step")
            return None

    def _complete(self, host: np.ndarray, step: int, outcome: StepOutcome, local_nonfinite: torch.Tensor,
                  ratio: HostCopy | None, collectives: bool, step_loss: StepLoss | None = None) -> StepRecord | None:
        """The record of sampled step ``step`` from its reduced host array: diagnostics, hooks,
        sinks. ``ratio``: the update-ratio sums on their way to the host (asynchronous records),
        or None to make that all-reduce now (synchronous)."""
        grad_scale = outcome.grad_scale
        parts = self.split_reduced(host)
        self._fold_watch(step, parts.flags)  # sets self._unsampled for _build
        red = unpack(parts.core, self.layout, self.names, grad_scale)
        if red.rank_error.sum():
            # this rank counted its own failure already; learn of the others' from the flags.
            # A flag of _REFUSED is a rank that could not vouch for its gradients (not an error
            # of distgrad's; that rank warned): the step is dropped, nothing is exported.
            failed = (red.rank_error > 0) & (red.rank_error < _REFUSED)
            self.counters["internal_errors"] += int(failed.sum() - failed[self.rank])
            refused = np.flatnonzero(red.rank_error >= _REFUSED)
            if refused.size:
                code = int(round(float(red.rank_error[refused[0]]) - _REFUSED))
                self._count_refused(REFUSAL_REASONS[min(max(code, 0), len(REFUSAL_REASONS) - 1)])
            self._publish_counters()
            return None
        rec = self._build(step, outcome, red, local_nonfinite if collectives else None)
        if self.replay is not None:
            self.replay.attach(rec)
        rec.ranks, rec.loss_components, rec.token_loss = self.loss.unpack(parts.loss_sum, parts.loss_max)
        if self.signals:
            self.signals.finish(self, rec, parts.signal_sum, parts.signal_max, grad_scale)
        rec.action = self.action.part(step)
        if self.config.statistics.update_ratio:
            host_sums = (update_ratio_sums(self, len(rec.params.names)).cpu().numpy() if ratio is None
                         else ratio.wait())
            ratios = update_ratio_values(host_sums, rec.params.names, outcome.step_applied)
            if ratios is not None:
                rec.update_ratio = ratios
        self.last_record = rec
        if self.diagnostics is not None:  # each plug-in's failure is counted, the others run
            self.diagnostics.on_record(rec)
        try:
            path = self.loss.report_spike(rec, step_loss, self.rank, self.config.flight_recorder.dir)
            if path is not None:
                rec.loss_spike_report = str(path)
        except OSError as e:
            log.warning("distgrad: loss-spike report of step %d not written to flight_recorder.dir=%r: %s",
                        step, self.config.flight_recorder.dir, e)
            self._sink_error("flight_recorder")
        except Exception:  # noqa: BLE001
            self._internal_error("loss-spike report")
        for hook in self._hooks:
            try:
                hook(rec)
            except Exception:  # noqa: BLE001
                self._internal_error("hook")
        rec.counters = dict(self.counters)
        self._publish(rec)
        return rec

    def account(self, outcome: StepOutcome) -> None:
        """Per-boundary bookkeeping that needs no collective (every optimizer step, sampled or
        not): overflow and skipped-step counters, the overflow streak, the sample count."""
        overflow, samples = outcome.overflow, outcome.samples
        if overflow:
            self.counters["overflow_steps"] += 1
            self._consecutive_overflow += 1
        elif overflow is not None:
            self._consecutive_overflow = 0
        if not outcome.step_applied and self.action.pending is None:  # distgrad's own skips: action_skipped_*
            self.counters["skipped_steps"] += 1
        if samples is not None:
            self.counters["samples"] = samples
        if self.prometheus is not None:
            self.prometheus.collector.step_time = time.time()

    def after_micro_batch(self) -> None:
        """Called after each forward/backward: writes the tracer report once it has finished."""
        if self.diagnostics is not None:
            self.diagnostics.on_micro_batch()

    def skip(self, outcome: StepOutcome) -> None:
        """Boundary of a step that is not sampled: account it, drop the observed losses."""
        self._drain(collectives=True)
        try:
            self._watcher.overflow(outcome.overflow)  # fp16 overflow steps are expected: not "non-finite"
            self.account(outcome)
            self._publish_counters()
        except Exception:  # noqa: BLE001
            self._internal_error("accounting an unsampled step")
        finally:
            self.loss.drop()  # the step's losses, components, token losses and time are dropped

    def _build(self, step: int, outcome: StepOutcome, red: Any, local_nonfinite: torch.Tensor | None) -> StepRecord:
        """The record; on a non-finite step the provenance all-gather of ``local_nonfinite``
        (None: not allowed here, at ``close()``: the provenance stays empty, logged)."""
        grad_scale, loss_scale, overflow = outcome.grad_scale, outcome.loss_scale, outcome.overflow
        stats = red.params
        gnorm = global_norm(stats)
        self.counters["sampled_steps"] += 1
        dtype_max = float(torch.finfo(self.source.grad_dtype).max)
        with np.errstate(invalid="ignore"):
            headroom = (stats.abs_max * grad_scale / dtype_max).tolist()
        mismatch_rank: int | None = None
        mismatched: list[int] = []
        if self.own.groups and self.config.statistics.replica_check and self.world_size > 1:
            for members in self.own.groups:  # ranks that must hold identical replicated pieces
                sub = replica_outliers(red.fingerprints[members], 0.0)  # exact checksums: no tolerance
                mismatched += [members[j] for j in sub]
            mismatched.sort()
            if mismatched:
                self.counters["replica_mismatch"] += 1
                self._replica_mismatch_rank = mismatched[0]
                log.warning("distgrad: step %d: replicated gradients differ across ranks; %s disagree "
                            "(fingerprints %s)", step, ", ".join(self.own.name(r) for r in mismatched),
                            red.fingerprints.tolist())
            mismatch_rank = self._replica_mismatch_rank
        # a rank's shard held NaN/Inf, or (replicated) its full copy did: its fingerprint, which
        # stays 0 where none is computed, is then non-finite
        bad = (red.rank_nonfinite > 0) | ~np.isfinite(red.fingerprints)
        nonfinite_ranks = [int(r) for r in np.nonzero(bad)[0]]
        scaler = None
        culprits = decode(red.rank_culprit)
        if loss_scale is not None:
            mn = self.source.min_loss_scale()
            scaler = ScalerState(self._consecutive_overflow, bool(mn is not None and loss_scale <= mn))
        loss = red.loss_sum / red.loss_count if red.loss_count else None
        if loss is not None and not np.isfinite(loss):
            self.counters["nonfinite_loss_steps"] += 1
        if loss is None and self.counters["sampled_steps"] == 10 and self.global_rank == 0:
            log.warning("distgrad: no training loss observed in 10 sampled steps, so distgrad_loss, the "
                        "NaN-loss alert and loss-spike detection are off: call dg.observe_loss(loss) after "
                        "each forward (DeepSpeed's engine.backward(loss) and models returning the loss "
                        "are picked up automatically)")
        rec = StepRecord(
            step=int(step), micro_step=int(outcome.micro_step), timestamp=time.time(), world_size=self.world_size,
            params=stats, grad_norm=gnorm, loss=loss, loss_scale=loss_scale, overflow=overflow,
            step_applied=bool(outcome.step_applied), replica_mismatch_ranks=mismatched,
            nonfinite_ranks=nonfinite_ranks, culprits=culprits,
            grad_dtype=DTYPE_NAMES.get(self.source.grad_dtype, str(self.source.grad_dtype)),
            grad_scale=grad_scale, headroom=headroom, replica_mismatch_rank=mismatch_rank, scaler=scaler,
            unsampled_nonfinite=(None if self._unsampled is None else UnsampledNonfinite(
                list(self._unsampled["grad"]), list(self._unsampled["loss"]))))
        if rec.nonfinite and not overflow:  # an fp16 overflow the scaler skipped: overflow_steps
            self.counters["nonfinite_steps"] += 1
            if local_nonfinite is not None:
                rec.nonfinite_params = provenance(self, stats.names, local_nonfinite)
            else:
                rec.nonfinite_params = []
                log.warning("distgrad: step %d was non-finite; its per-rank provenance was not gathered "
                            "because the record was completed at close()", step)
        return rec

    # ----------------------------------------------------------------------------------
    # set-up, the user-facing calls, publishing
    def attach_diagnostics(self, model: Any = None, max_norm: float | None = None) -> None:
        """Create the :class:`~distgrad.diagnostics.Diagnostics` (spikes, health, provenance,
        flight recorder, tracer) for this run; ``max_norm`` is the engine's clip threshold."""
        from distgrad.diagnostics import Diagnostics

        info = {"engine": self.source.engine_name, "zero_stage": self.source.zero_stage,
                "world_size": self.world_size, "config": self.config.to_dict(), "version": __version__}
        self.diagnostics = Diagnostics(self.config, self.names, self.global_rank, max_norm, model, info,
                                       on_error=self.count_error, on_sink_error=self._sink_error)

    def attach_local_grad_check(self, module: Any, engine_name: str | None = None) -> None:
        """Install :class:`~distgrad.diagnostics.culprit.LocalGradCheck` on the leaves whose incoming
        gradient is this rank's own before the reduction
        (:func:`~distgrad.diagnostics.culprit.pre_reduction_leaves` of ``engine_name``, default the
        source's; ``module``: the model the forward runs, ``DeepSpeedEngine.module`` under
        DeepSpeed); removed at :meth:`close`. A NaN/Inf there marks this rank as a culprit of
        the step, under every engine. An engine without a known hook point gets no check (a
        warning; its culprit is then named by its loss only)."""
        try:
            leaves, lazy = pre_reduction_leaves(engine_name or self.source.engine_name, module)
        except ValueError as e:
            log.warning("distgrad: %s; a culprit rank is named by its loss only", e)
            return
        check = LocalGradCheck(leaves)
        self.local_grad_check = check
        self.on_close(check.remove)
        if lazy is not None:
            self.on_close(lazy(check))

    def attach_signals(self, module: Any) -> None:
        """:meth:`~distgrad.signals.SignalPack.attach` of the packed signals (gradient hooks
        etc. on ``module``, the model the user's forward runs; undone at :meth:`close`).

        Raises:
            ValueError / ConfigError: a signal that cannot serve this engine or module."""
        signals = getattr(self, "signals", None)
        if signals:
            signals.attach(self, module)

    def start(self) -> None:
        """Create rank 0's sinks (exporter, files), then agree across ranks that set-up succeeded
        and that every rank has the same parameters and collective-deciding settings (one small
        all-reduce), so that a port in use on rank 0 raises on every rank instead of leaving the
        others to hang in the first sampled step. Call once, on every rank, before the first
        boundary (``distgrad.instrument()`` does).

        Raises:
            OSError: rank 0 cannot bind the Prometheus port.
            ConfigError: a file sink's path cannot be used (the key is named).
            RuntimeError: set-up failed on another rank, or ranks disagree.

        The instrument is closed before any of these is raised."""
        from distgrad.core.startup import start

        start(self)

    def agree(self) -> None:
        """Only the set-up agreement of :meth:`start` (no sinks): what an instrument with
        ``enabled: false`` does on every rank, so that ranks disabled while others are not raise
        on every rank instead of leaving the others to hang.

        Raises:
            RuntimeError: ranks disagree (on ``enabled`` or another collective-deciding setting,
                or on the parameters)."""
        from distgrad.core.startup import agree

        agree(self)

    def observe_loss(self, loss: torch.Tensor | float, *, automatic: bool = False, samples: Any = None,
                     components: dict[str, Any] | None = None, weights: dict[str, float] | None = None,
                     token_losses: torch.Tensor | None = None, token_mask: torch.Tensor | None = None,
                     logits: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                     ignore_index: int = -100, sources: list[Any] | None = None) -> None:
        """Record one micro-batch's training loss on this rank (no host sync, no collective).

        The losses observed since the last optimizer-step boundary are summed on the device and
        averaged over micro-batches and ranks inside the sampled step's SUM collective; the
        result is ``StepRecord.loss`` / ``distgrad_loss``. DeepSpeed engines call this
        automatically from ``engine.backward(loss)`` (as ``automatic``: call it yourself, e.g. to
        pass components, and the engine's capture stops).

        Something that is not one loss value (a per-token loss tensor, a string) is ignored: the
        first time, one error naming the argument and the fix is logged; every time, it is counted
        in ``distgrad_internal_errors_total``. Never raises.

        Args:
            loss: 0-d tensor (any float dtype, any device) or a Python float.
            automatic: for boundaries that pick the loss out of the model's output (the PyTorch
                boundary's forward hook). The first call with ``automatic=False`` (the user's
                own) switches automatic capture off for the rest of the run and drops the
                automatic losses of the current step, so the two are never mixed.
            samples: optional indices (or ids) of the micro-batch's samples: a sequence or a 1-D
                integer tensor, kept by reference and read only when this rank's batch caused a
                loss spike (then written to ``flight_recorder.dir``, see
                :meth:`distgrad.loss.tracker.LossTracker.report_spike`).
            components: ``{name: value}`` (0-d tensors or floats), the loss's components; the
                set of names is declared by the first call (at most 8); see
                :mod:`distgrad.loss.components`. ``weights``: ``{name: coefficient}`` with which
                each enters the loss (default 1). Exported per component: mean, weight, share of
                the total (``distgrad_loss_component*``, ``StepRecord.loss_components``).
            token_losses: per-token losses in nats, ``[B, T]`` or ``[N]`` (e.g. cross-entropy
                with ``reduction="none"``); ``token_mask`` (same shape, True = counted) leaves
                out padding. Or ``logits`` ``[..., V]`` with ``labels`` ``[...]`` (aligned as
                your loss uses them; ``ignore_index`` left out): the per-token cross-entropy is
                computed in bounded chunks. ``sources``: one data-source label per sequence (B,
                needs ``[B, T]`` token losses; labels from config ``loss.sources``, others count
                as ``"other"``). Exported: a fixed-bin histogram, the fraction above
                ``loss.token_threshold``, perplexity, per source (:mod:`distgrad.loss.token`).

        Bad components or token inputs are ignored the same way (the loss itself still counts).

        Each rank's own mean and largest loss, and which rank had the largest, are in every
        sampled record (``StepRecord.ranks``, ``distgrad_loss_max_rank``).
        """
        from distgrad.loss.tracker import observe

        observe(self, loss, automatic, samples, components, weights, token_losses, token_mask, logits, labels,
                ignore_index, sources)

    def state_dict(self) -> dict[str, Any]:
        """distgrad's state for a checkpoint (counters, overflow streak, every diagnostic's
        state: detector windows / EMA / warm-up, health streaks, event), plain Python types;
        see :func:`distgrad.core.checkpoint.instrument_state`. No collective."""
        from distgrad.core.checkpoint import instrument_state

        return instrument_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output on every rank before the resumed run's first
        step (detectors continue without a new warm-up); raises ValueError on a state it cannot
        use. See :func:`distgrad.core.checkpoint.load_instrument_state`. No collective."""
        from distgrad.core.checkpoint import load_instrument_state

        load_instrument_state(self, state)

    def observe_data_time(self, seconds: float) -> None:
        """Report the seconds this rank's loop spent loading one micro-batch's data (summed over
        the optimizer step; host float, no sync). Without it distgrad measures the time from the
        previous optimizer step to the step's first forward. Names the straggler rank
        (``distgrad_straggler_rank``, ``StepRecord.ranks``). A value that is not a finite
        number >= 0 is ignored and counted in ``distgrad_internal_errors_total`` (logged once).
        Never raises."""
        from distgrad.loss.tracker import observe_data_time

        observe_data_time(self, seconds)

    def observe_samples(self, samples: Any) -> None:
        """The sample indices (or ids) of the micro-batch whose loss is observed next on this rank,
        for engines that pick the loss up themselves (DeepSpeed's ``engine.backward(loss)``); a
        sequence or a 1-D integer tensor, kept by reference and read only when this rank's batch
        caused a loss spike (see ``samples=`` of :meth:`observe_loss`). Never raises."""
        self.loss.pending_samples = samples

    def forward_started(self) -> None:
        """Boundary API: a forward pass of the model starts on this rank (host clock only)."""
        self.loss.forward_started()

    def read_gradients_now(self) -> None:
        """Read this optimizer step's reduced gradients now instead of in ``optimizer.step()``:
        call it on every rank after the step's last backward and before anything modifies the
        gradients (``clip_grad_norm_``). PyTorch models only (DeepSpeed reads inside
        ``engine.step()``, before its own clipping). Later reads in the same step do nothing.

        Raises:
            TypeError: the instrument watches a DeepSpeed engine (or is disabled).
        """
        boundary = getattr(self, "boundary", None)
        if boundary is None:
            raise TypeError("read_gradients_now() is for PyTorch models instrumented with optimizer=; "
                            "a DeepSpeed engine reads its gradients inside engine.step(), before clipping")
        boundary.read_now()

    @property
    def should_stop(self) -> bool:
        """True once the opt-in action (config ``action.on_nonfinite`` / ``action.on_spike``:
        ``stop``) requested a stop; the same on every rank, from the boundary of the stopping step
        on (whose update was skipped). A loop checks it after ``optimizer.step()`` /
        ``engine.step()`` and leaves its training loop on every rank; the Hugging Face and
        Lightning callbacks stop their trainer themselves. See docs/action.md."""
        return self.action.should_stop

    def on_stop(self, fn: Callable[[Any], None]) -> None:
        """Run ``fn(decision)`` once, on every rank, when the opt-in action decides to stop
        (``decision``: :class:`distgrad.diagnostics.action.Decision` with ``step``, ``cause``, ``detail``).
        It runs at the end of the stopping step's boundary, inside ``optimizer.step()`` /
        ``engine.step()``, after the (skipped) update: parameters and optimizer state are those
        before the offending step, every rank is at the same point, so it may save a checkpoint
        collectively. Its exceptions are counted in ``distgrad_internal_errors_total``."""
        self.action.on_stop(fn)

    def add_hook(self, fn: Callable[[StepRecord], None]) -> None:
        """Call ``fn(record)`` on every rank after each sampled step (exceptions are counted)."""
        self._hooks.append(fn)

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at :meth:`close` (callbacks run in reverse order of registration;
        their exceptions are ignored): how a boundary removes its hooks and restores the
        methods it wrapped."""
        self._restore.append(fn)

    def flush(self) -> StepRecord | None:
        """Asynchronous records: build and publish the parked sampled step now (waits for its
        host copy). Makes the provenance all-gather if that step was non-finite, so call it on
        every rank or on none. Returns the record, or None when nothing was parked."""
        return self._drain(collectives=True)

    def close(self) -> None:
        """Publish a parked sampled step (asynchronous records; without the provenance
        all-gather, which needs every rank), stop the exporter, close the sinks and run the
        :meth:`on_close` callbacks (which restore the engine's wrapped methods). Idempotent."""
        if self._closed:
            return
        self._drain(collectives=False)
        self._closed = True
        for restore in reversed(self._restore):
            try:
                restore()
            except Exception:  # noqa: BLE001
                pass
        if self.diagnostics is not None:
            self.diagnostics.close()
        for s in self.sinks:
            try:
                s.close()
            except Exception:  # noqa: BLE001
                log.exception("distgrad: closing sink %s failed", s.name)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if (exc_type is not None and not issubclass(exc_type, KeyboardInterrupt)
                and self.prometheus is not None):
            # the loop raised: not a clean end (the target file stays, the exporter-down alert pages)
            self.prometheus.close(clean=False)
        self.close()

    def _publish(self, rec: StepRecord) -> None:
        if self.global_rank != 0:
            return
        for s in self.sinks:
            try:
                s.write(rec)
            except SinkError:  # lost for a reason outside distgrad (disk full, ...), logged by the sink
                self._sink_error(s.name)
            except Exception:  # noqa: BLE001
                self._internal_error(f"sink {s.name}")
                self._sink_error(s.name)
        self._publish_counters()  # errors of sinks that ran before this one's snapshot

    def _publish_counters(self) -> None:
        if self.prometheus is not None:
            self.prometheus.set_counters(self.counters)

    def count_error(self, where: str) -> None:
        """Count and log a failure of distgrad's own work (``distgrad_internal_errors_total``)
        with the current traceback; call from an ``except`` block of a boundary or an
        integration, then carry on: training must not stop for distgrad. The traceback is logged
        the first time ``where`` fails with that exception type only (one log line per failure
        kind, not one per step)."""
        self.counters["internal_errors"] += 1
        kind = (where, type(sys.exc_info()[1]).__name__)
        if kind not in self._logged_errors:
            self._logged_errors.add(kind)
            log.error("distgrad: internal error in %s (training continues; counted in "
                      "distgrad_internal_errors_total, further %s errors here are not logged):\n%s",
                      where, kind[1], traceback.format_exc())
        self._publish_counters()

    def dump_flight_recorder(self, reason: str, step: int, what: str) -> str | None:
        """Write the flight recorder's buffer (``flightrec-step{step}-{reason}.json`` / ``.txt``,
        :meth:`distgrad.diagnostics.flight_recorder.FlightRecorder.dump`) for a plug-in's event.

        Args:
            reason: the file name's cause (``"rerun"``, ``"replica_weights"``).
            step: the event's optimizer step.
            what: the event in words, for the log line when the files cannot be written.

        Returns:
            the JSON file's path, or None when no recorder runs (no provenance diagnostic, or
            ``flight_recorder.dir`` unset) or the write failed (logged and counted as a
            ``flight_recorder`` sink error; never raised into the training loop).
        """
        prov = self.diagnostics.get("provenance") if self.diagnostics is not None else None
        recorder = getattr(prov, "recorder", None)
        if recorder is None or not self.config.flight_recorder.dir:
            return None
        try:
            return str(recorder.dump(reason, step=step))
        except OSError as e:
            log.warning("distgrad: flight-recorder report of %s at step %d not written to "
                        "flight_recorder.dir=%r: %s", what, step, self.config.flight_recorder.dir, e)
            self._sink_error("flight_recorder")
            return None

    def _sink_error(self, name: str) -> None:
        self.sink_errors[name] = self.sink_errors.get(name, 0) + 1
        if self.prometheus is not None:
            self.prometheus.collector.inc_labeled("distgrad_sink_errors", {"sink": name})

    def _count_refused(self, reason: str) -> None:
        self.refused_steps[reason] = self.refused_steps.get(reason, 0) + 1
        if self.prometheus is not None:
            self.prometheus.collector.inc_labeled("distgrad_refused_steps", {"reason": reason})

    _internal_error = count_error
