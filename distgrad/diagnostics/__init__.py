"""Everything distgrad derives from a step's statistics beyond the statistics themselves, as
plug-ins: spike detection, layer health, clip ratio, layer / module-kind aggregation and the
series budget, non-finite provenance with the flight recorder, and the forward overflow tracer.

Each diagnostic is one :class:`Diagnostic` subclass registered with :func:`register`; the
:class:`Diagnostics` container creates the registered ones for a run and feeds them every
sampled :class:`StepRecord`, in registration order. They run on every rank after the step's
reduction (host-side numpy only, no collective: every rank holds the same reduced record) and
write their typed part of the record (``rec.spikes``, ``rec.health``, ...), from which the
sinks export. A plug-in that raises is reported through ``on_error`` (the instrument counts it
in ``distgrad_internal_errors_total``) and never stops the others. Files (flight-recorder
reports) are written by global rank 0; the tracer report by every rank that saw the event.

Checkpointing: :meth:`Diagnostics.state_dict` collects every plug-in's
:meth:`Diagnostic.state_dict` (plain Python types, JSON-serialisable) under its :attr:`name`;
:meth:`Diagnostics.load_state_dict` hands each one its part back, so that a resumed run keeps
its detectors' windows, EMA statistics and warm-up, the health streaks and the event state.

Adding a diagnostic: a new subclass (``name``, ``on_record``, and ``state_dict`` /
``load_state_dict`` when it keeps state across steps) decorated with :func:`register`, plus the
typed part it writes in :mod:`distgrad.record`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distgrad.diagnostics.adaptive_clip import AdaptiveClip  # noqa: F401  (registers it)
from distgrad.diagnostics.base import REGISTRY, Diagnostic, DiagnosticContext, register
from distgrad.diagnostics.builtin import (
    AggregatesDiagnostic,
    ClipDiagnostic,
    HealthDiagnostic,
    ProvenanceDiagnostic,
    SpikeDiagnostic,
    TracerDiagnostic,
)
from distgrad.diagnostics.incidents import IncidentDiagnostic  # noqa: F401  (registers it: runs last)
from distgrad.diagnostics.loss import ComponentSpikeDiagnostic, LossTrendDiagnostic  # noqa: F401  (registers them)
from distgrad.diagnostics.loss_scale import LossScaleDiagnostic
from distgrad.diagnostics.rerun import RerunAttribution  # noqa: F401  (registers it: after the incidents)
from distgrad.diagnostics.spike_monitor import SpikeMonitor
from distgrad.export.base import SinkError
from distgrad.record import StepRecord

if TYPE_CHECKING:  # distgrad.config imports the diagnostics (their declared sections)
    from distgrad.config import DistgradConfig

__all__ = ["Diagnostics", "Diagnostic", "DiagnosticContext", "REGISTRY", "register", "STATE_VERSION",
           "SpikeDiagnostic", "HealthDiagnostic", "ClipDiagnostic", "AggregatesDiagnostic",
           "ProvenanceDiagnostic", "TracerDiagnostic", "LossScaleDiagnostic"]

log = logging.getLogger("distgrad")

#: version of :meth:`Diagnostics.state_dict`'s layout
STATE_VERSION = 1




class Diagnostics:
    """The diagnostics of one run, fed one :class:`StepRecord` per sampled step.

    Args:
        config: thresholds and options (one place: :class:`DistgradConfig`).
        names: P parameter names in registration (forward) order.
        global_rank: this process's global rank (rank 0 writes files).
        max_norm: gradient-clipping threshold the engine applies (DeepSpeed
            ``gradient_clipping``), or None; ``config.clip.max_grad_norm`` wins when set.
        model: the module, for the forward overflow tracer (None disables tracing).
        run_info: JSON-serialisable description of the run for flight-recorder reports.
        plugins: the plug-in classes to run, in order (default :data:`REGISTRY`).
        on_error: ``fn(where)`` called inside the ``except`` block when a plug-in raises (the
            instrument counts it as an internal error); default: logged. Either way the other
            plug-ins run.
        on_sink_error: ``fn(sink)`` called when a plug-in raises
            :class:`~distgrad.export.base.SinkError` (a file it writes could not be written: disk
            full, unwritable directory); the instrument counts it in
            ``distgrad_sink_errors_total{sink}``. Default: handled like any other failure.

    Attributes:
        plugins: the plug-ins of this run (those whose :meth:`Diagnostic.create` applied).
        reports: files the plug-ins wrote (flight-recorder dumps, tracer reports).
    """

    def __init__(self, config: DistgradConfig, names: Sequence[str], global_rank: int = 0,
                 max_norm: float | None = None, model: Any = None, run_info: dict[str, Any] | None = None,
                 plugins: Sequence[type[Diagnostic]] | None = None,
                 on_error: Callable[[str], None] | None = None,
                 on_sink_error: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.names = list(names)
        self.global_rank = global_rank
        self.max_norm = config.clip.max_grad_norm if config.clip.max_grad_norm is not None else (
            max_norm if max_norm and max_norm > 0 else None)
        self.ctx = DiagnosticContext(config, self.names, global_rank, self.max_norm, model, dict(run_info or {}))
        self.reports: list[Path] = self.ctx.reports
        self.on_error = on_error
        self.on_sink_error = on_sink_error
        made = (cls.create(self.ctx) for cls in (REGISTRY if plugins is None else plugins))
        self.plugins: list[Diagnostic] = [p for p in made if p is not None]

    def get(self, name: str) -> Diagnostic | None:
        """The plug-in called ``name``, or None when this run does not have it."""
        return next((p for p in self.plugins if p.name == name), None)

    def _each(self, what: str, fn: Callable[[Diagnostic], None]) -> None:
        for p in self.plugins:
            try:
                fn(p)
            except SinkError:  # a report file not written (logged by the plug-in), not distgrad's fault
                if self.on_sink_error is not None:
                    self.on_sink_error(p.sink_name)
                elif self.on_error is not None:
                    self.on_error(f"diagnostic {p.name} ({what})")
            except Exception:  # noqa: BLE001 - one failing plug-in never stops the others
                if self.on_error is not None:
                    self.on_error(f"diagnostic {p.name} ({what})")
                else:
                    log.exception("distgrad: diagnostic %s failed in %s", p.name, what)

    def on_record(self, rec: StepRecord) -> None:
        """Run every plug-in on ``rec`` (each writes its typed part of the record)."""
        self._each("on_record", lambda p: p.on_record(rec))

    def on_micro_batch(self) -> None:
        """After each forward/backward on this rank (writes the tracer report once ready)."""
        self._each("on_micro_batch", lambda p: p.on_micro_batch())

    def close(self) -> None:
        """Close every plug-in (removes the tracer's hooks)."""
        self._each("close", lambda p: p.close())

    def state_dict(self) -> dict[str, Any]:
        """``{"version": STATE_VERSION, "plugins": {name: plug-in state}}``, JSON-serialisable."""
        return {"version": STATE_VERSION, "plugins": {p.name: p.state_dict() for p in self.plugins}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Give each plug-in its part of :meth:`state_dict`'s output. A plug-in absent from
        ``sd`` (new, or disabled in the saved run) keeps its fresh state; states of plug-ins this
        run does not have are ignored.

        Raises:
            ValueError: on a state of another layout version, or one a plug-in cannot read
                (the plug-in's name is given).
        """
        if not isinstance(sd, dict) or sd.get("version") != STATE_VERSION:
            version = sd.get("version") if isinstance(sd, dict) else sd
            raise ValueError(f"distgrad diagnostics state: version {version!r}"
                             f" is not {STATE_VERSION} (the state must come from Instrument.state_dict())")
        states = sd.get("plugins", {})
        for p in self.plugins:
            if p.name in states:
                try:
                    p.load_state_dict(states[p.name])
                except (KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"distgrad diagnostics state: plug-in {p.name!r} cannot load it: {e}") from e

    # -- shortcuts kept for callers of the previous single-class version --------------------
    @property
    def monitors(self) -> dict[str, SpikeMonitor]:
        """The spike monitors by series (``{}`` without the spikes plug-in)."""
        p = self.get("spikes")
        return p.monitors if isinstance(p, SpikeDiagnostic) else {}

    @property
    def tracer(self) -> Any:
        """The :class:`~distgrad.diagnostics.tracer.OverflowTracer`, or None when tracing is off."""
        p = self.get("tracer")
        return p.tracer if isinstance(p, TracerDiagnostic) else None

    def tracer_report(self) -> dict[str, Any] | None:
        """The overflow tracer's report once it has run (None before / without tracer)."""
        p = self.get("tracer")
        return p.report() if isinstance(p, TracerDiagnostic) else None

    def write_tracer_report(self, rank: int | None = None) -> Path | None:
        """Write the tracer's text report once it has disarmed (``rank`` is ignored: the
        plug-in writes its own global rank's file)."""
        p = self.get("tracer")
        return p.write_report() if isinstance(p, TracerDiagnostic) else None
