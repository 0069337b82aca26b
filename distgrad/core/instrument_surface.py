"""The surface of :class:`~distgrad.core.instrument.Instrument`: set-up (:meth:`start`,
:meth:`agree`, diagnostics), the calls users and integrations make (losses, samples, data time,
checkpoint state, hooks, ``close``), and publishing to rank 0's sinks with distgrad's own
failures counted (``distgrad_internal_errors_total``, ``distgrad_sink_errors_total``,
``distgrad_refused_steps_total``).

A mixin: the state these methods use (``config``, ``sinks``, ``counters``, ...) is created by
``Instrument.__init__``; the optimizer-step boundary (sampling, statistics, collectives, the
record) stays in :mod:`distgrad.instrument`.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable

from distgrad._version import __version__
from distgrad.diagnostics.culprit import LocalGradCheck, pre_reduction_leaves
from distgrad.record import StepRecord
from distgrad.export.base import SinkError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("distgrad")


class InstrumentSurface:
    """Set-up, user-facing calls and publishing of :class:`~distgrad.core.instrument.Instrument`
    (see there for the attributes)."""

    # attributes created by Instrument.__init__ (declared for readers and type checkers)
    config: Any
    source: Any
    names: list[str]
    rank: int
    world_size: int
    global_rank: int
    counters: dict[str, int]
    sinks: list[Any]
    prometheus: Any
    diagnostics: Any
    local_grad_check: LocalGradCheck | None
    action: Any
    sink_errors: dict[str, int]
    refused_steps: dict[str, int]
    loss: Any
    _hooks: list[Callable[[StepRecord], None]]
    _restore: list[Callable[[], None]]
    _closed: bool
    _logged_errors: set[tuple[str, str]]

    def _drain(self, collectives: bool) -> StepRecord | None:  # implemented by Instrument
        raise NotImplementedError

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

    def observe_loss(self, loss: "torch.Tensor | float", *, automatic: bool = False, samples: Any = None,
                     components: "dict[str, Any] | None" = None, weights: "dict[str, float] | None" = None,
                     token_losses: "torch.Tensor | None" = None, token_mask: "torch.Tensor | None" = None,
                     logits: "torch.Tensor | None" = None, labels: "torch.Tensor | None" = None,
                     ignore_index: int = -100, sources: "list[Any] | None" = None) -> None:
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

    def _sink_error(self, name: str) -> None:
        self.sink_errors[name] = self.sink_errors.get(name, 0) + 1
        if self.prometheus is not None:
            self.prometheus.collector.inc_labeled("distgrad_sink_errors", {"sink": name})

    def _count_refused(self, reason: str) -> None:
        self.refused_steps[reason] = self.refused_steps.get(reason, 0) + 1
        if self.prometheus is not None:
            self.prometheus.collector.inc_labeled("distgrad_refused_steps", {"reason": reason})

    _internal_error = count_error
