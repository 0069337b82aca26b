"""The built-in diagnostic plug-ins, registered in the order they run (see
:mod:`distgrad.diagnostics`)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from distgrad.diagnostics.base import Diagnostic, DiagnosticContext, register
from distgrad.diagnostics.detectors import EmaZScoreDetector, WindowSpikeDetector
from distgrad.diagnostics.flight_recorder import FlightRecorder, provenance_from
from distgrad.diagnostics.health import LayerHealth, clip_ratio, post_clip_norm
from distgrad.diagnostics.robust_spike import RobustJumpDetector
from distgrad.diagnostics.spike_monitor import SpikeMonitor
from distgrad.export.base import SinkError
from distgrad.naming.classify import classify, forward_order_key
from distgrad.naming.grouping import aggregate, check_budget, group_keys, opt_in_series, select_series, series_count
from distgrad.record import Aggregates, Clip, Health, NonfiniteEvent, Provenance, Spikes, StepRecord

log = logging.getLogger("distgrad")

#: how many parameter names the health lists carry in a record (counts are exact)
_LIST_CAP = 20




def _highest_loss_rank(rec: StepRecord) -> str:
    """``"; rank R had the highest own loss (V)"`` from the step's per-rank losses
    (``rec.ranks``, the step's SUM collective: no extra communication), or ``""`` when unknown."""
    rs = rec.ranks
    r = rs.loss_max_rank if rs is not None else None
    if rs is None or r is None or not 0 <= r < len(rs.loss_max):
        return ""
    finite = [float(v) for v in rs.loss_max if math.isfinite(v)]
    median = f", median over ranks {float(np.median(finite)):.4g}" if finite else ""
    return f"; rank {r} had the highest own loss ({float(rs.loss_max[r]):.4g}{median})"


@register
class SpikeDiagnostic(Diagnostic):
    """Spike detectors (:class:`SpikeMonitor`: ZClip's EMA z-score, OLMo's window test and the
    robust jump test of :mod:`distgrad.diagnostics.robust_spike`, the one that pages) on
    the global grad norm and the loss; writes ``rec.spikes``. A skipped (fp16 overflow) step
    carries no usable value: it is never fed, so never re-reported."""

    name = "spikes"
    SERIES = ("grad_norm", "loss")

    def __init__(self, ctx: DiagnosticContext) -> None:
        super().__init__(ctx)
        c = ctx.config
        sp = c.spikes
        ratio = {"grad_norm": sp.robust_grad_norm_ratio, "loss": sp.robust_loss_ratio}
        self.monitors = {s: SpikeMonitor(s, EmaZScoreDetector(sp.ema_alpha, sp.ema_z, sp.ema_warmup),
                                         WindowSpikeDetector(sp.window, sp.window_sigma),
                                         RobustJumpDetector(sp.robust_window, sp.robust_k, ratio[s], sp.robust_warmup))
                         for s in self.SERIES}

    def on_record(self, rec: StepRecord) -> None:
        out = Spikes()
        for series, value in (("grad_norm", rec.grad_norm), ("loss", rec.loss)):
            mon = self.monitors[series]
            res = mon.update(None if rec.overflow else value, step=rec.step)
            out.zscore[series] = {k: r.score for k, r in res.items()}
            out.total[series] = dict(mon.spikes)
            fired = [k for k, r in res.items() if r.is_spike]
            if fired:
                out.flagged.append(series)
                out.fired[series] = fired
                if self.ctx.global_rank == 0:  # one line per spike for the job, not one per rank
                    log.warning("distgrad: step %d: %s spike (%s = %.4g; detector(s) %s; z %s)%s", rec.step, series,
                                series, value, ", ".join(fired), {k: round(r.score, 2) for k, r in res.items()},
                                _highest_loss_rank(rec))
        rec.spikes = out

    def state_dict(self) -> dict[str, Any]:
        return {s: m.state_dict() for s, m in self.monitors.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for s, m in self.monitors.items():
            if s in sd:
                m.load_state_dict(sd[s])


@register
class HealthDiagnostic(Diagnostic):
    """Vanishing / exploding parameters (:class:`LayerHealth`); writes ``rec.health`` and logs
    newly flagged parameters once (rank 0)."""

    name = "health"

    def __init__(self, ctx: DiagnosticContext) -> None:
        super().__init__(ctx)
        c = ctx.config
        self.health = LayerHealth.from_config(c.health)
        self._flagged: set[str] = set()

    def on_record(self, rec: StepRecord) -> None:
        # no gradient is a finding: a trainable parameter without a gradient element on any rank
        # (.grad None everywhere: a detached branch, an unused module) counts as a zero gradient,
        # as the exact zeros DeepSpeed writes for the same bug do
        none = rec.params.numel == 0
        norms = np.where(none, 0.0, rec.params.norm)
        rep = self.health.update(list(rec.params.names), norms)
        no_grad = [n for n, z in zip(rec.params.names, none) if z]
        rec.health = Health(rep.n_vanishing, rep.n_exploding, list(rep.vanishing[:_LIST_CAP]),
                            list(rep.exploding[:_LIST_CAP]), len(no_grad), no_grad[:_LIST_CAP])
        flagged = set(rep.vanishing) | set(rep.exploding)
        new = flagged - self._flagged
        if new and self.ctx.global_rank == 0:
            log.warning("distgrad: step %d: vanishing %s (of which without any gradient: %s), exploding %s", rec.step,
                        sorted(new & set(rep.vanishing))[:_LIST_CAP], sorted(new & set(no_grad))[:_LIST_CAP],
                        sorted(new & set(rep.exploding))[:_LIST_CAP])
        self._flagged = flagged

    def state_dict(self) -> dict[str, Any]:
        return {"health": self.health.state_dict(), "flagged": sorted(self._flagged)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.health.load_state_dict(sd["health"])
        self._flagged = set(sd.get("flagged", []))


@register
class ClipDiagnostic(Diagnostic):
    """Clip ratio and post-clip norm for a known clipping threshold; writes ``rec.clip``."""

    name = "clip"

    @classmethod
    def create(cls, ctx: DiagnosticContext) -> Diagnostic | None:
        return cls(ctx) if ctx.max_norm is not None else None

    def on_record(self, rec: StepRecord) -> None:
        m = float(self.ctx.max_norm)  # type: ignore[arg-type]
        rec.clip = Clip(m, clip_ratio(rec.grad_norm, m, eps=1e-6), post_clip_norm(rec.grad_norm, m, eps=1e-6))


@register
class AggregatesDiagnostic(Diagnostic):
    """Per-layer and per-module-kind aggregates, and the per-parameter series budget
    (:func:`distgrad.naming.grouping.select_series`); writes ``rec.aggregates``. Stateless."""

    name = "aggregates"

    def __init__(self, ctx: DiagnosticContext) -> None:
        super().__init__(ctx)
        c, names = ctx.config, ctx.names
        groups = [classify(n, ctx.rules) for n in names]
        self.layer_keys = group_keys(names, "layer", ctx.rules)
        self.kind_keys = [g.module_kind if g.lora is None else f"{g.module_kind}/lora_{g.lora}" for g in groups]
        self.n_layers, self.n_kinds = len(set(self.layer_keys)), len(set(self.kind_keys))
        st = c.statistics
        try:  # the series of the families this configuration enables must fit the budget
            check_budget(c, names, ctx.rules)
        except ValueError as e:
            from distgrad.config.errors import ConfigError

            raise ConfigError(str(e)) from None
        extra = opt_in_series(c, self.n_layers, self.n_kinds)
        if extra and ctx.global_rank == 0:
            log.info("distgrad: opt-in metric families switched on serve %s Prometheus series (%s) of the budget "
                     "statistics.max_param_series = %d", sum(extra.values()),
                     ", ".join(f"{k}: {v}" for k, v in extra.items()), st.max_param_series)
        self.all_params_fit = st.per_param and series_count(
            len(names), self.n_layers, self.n_kinds, len(names), update_ratio=st.update_ratio,
            config=c) <= st.max_param_series

    def on_record(self, rec: StepRecord) -> None:
        p, c = rec.params, self.ctx.config
        headroom = np.asarray(rec.headroom if rec.headroom is not None else np.full(len(p.names), np.nan),
                              dtype=np.float64)
        layers = aggregate(p, self.layer_keys)
        hr: dict[str, float] = {}
        for key, h in zip(self.layer_keys, headroom.tolist()):
            hr[key] = h if key not in hr or (math.isnan(h) or h > hr[key]) else hr[key]
        kinds = aggregate(p, self.kind_keys)
        if not c.statistics.per_param:
            exported: list[int] | None = []
        elif self.all_params_fit:
            exported = None
        else:
            top_k = max(1, min(len(p.names), c.statistics.max_param_series))
            exported = select_series(p, budget=c.statistics.max_param_series, top_k=top_k,
                                     update_ratio=c.statistics.update_ratio, rules=self.ctx.rules, config=c)
        rec.aggregates = Aggregates(
            layer_norm=dict(zip(layers.names, layers.norm.tolist())),
            layer_nonfinite=dict(zip(layers.names, layers.nonfinite.tolist())),
            layer_zero_ratio=dict(zip(layers.names, layers.zero_ratio.tolist())),
            layer_headroom=hr, module_kind_norm=dict(zip(kinds.names, kinds.norm.tolist())),
            exported_params=exported)


@register
class ProvenanceDiagnostic(Diagnostic):
    """Non-finite provenance (which parameter, which rank; ``rec.provenance``), the current
    non-finite event (``rec.nonfinite_event``, logged once per streak on rank 0), and the
    flight recorder, which rank 0 dumps on the first non-finite step that is not an fp16
    overflow (``rec.flight_recorder_report``).

    Checkpointed: the event, the loss-scale history and whether the one automatic dump was
    written. The recorder's buffer of full records is not (it starts empty after a restore)."""

    name = "provenance"

    def __init__(self, ctx: DiagnosticContext) -> None:
        super().__init__(ctx)
        c, names = ctx.config, ctx.names
        self._idx = {n: i for i, n in enumerate(names)}
        # forward order: the naming table's where every parameter is recognised, else the
        # registration order (which is the definition order, forward order for most models)
        if all(classify(n, ctx.rules).layer != "other" for n in names):
            self._order_key: dict[str, Any] = {n: forward_order_key(n, ctx.rules) for n in names}
        else:
            self._order_key = {n: i for i, n in enumerate(names)}
        self.recorder = FlightRecorder(max(1, c.flight_recorder.steps), c.flight_recorder.dir or ".",
                                       ctx.run_info or c.to_dict(),
                                       dump_on_overflow=False) if c.flight_recorder.steps else None
        self._loss_scale_history: list[tuple[int, float]] = []
        self._dump_failed = False
        self._event: NonfiniteEvent | None = None

    def on_record(self, rec: StepRecord) -> None:
        if rec.loss_scale is not None:
            self._loss_scale_history.append((rec.step, rec.loss_scale))
            del self._loss_scale_history[:-1024]
        if rec.nonfinite:
            self._nonfinite(rec)
        else:
            self._event = None
            self._dump_failed = False  # a failed report is retried at the next non-finite event
        c = self.ctx.config
        if self.recorder is not None:
            self.recorder.record(rec)
            if rec.nonfinite and c.flight_recorder.dir and self.ctx.global_rank == 0 \
                    and not self.recorder.dumped_nonfinite and not rec.overflow and not self._dump_failed:
                self._dump_failed = True  # until it succeeds: a failing dump is reported once, not per step
                try:
                    path = self.recorder.maybe_dump_on_nonfinite(
                        rec, provenance=rec.provenance.to_dict() if rec.provenance else None,
                        loss_scale_history=self._loss_scale_history)
                except OSError as e:  # a full or unwritable directory: a sink failure, not distgrad's
                    log.warning("distgrad: flight-recorder report for step %d not written to "
                                "flight_recorder.dir=%r: %s (counted in distgrad_sink_errors_total"
                                "{sink=\"flight_recorder\"})", rec.step, c.flight_recorder.dir, e)
                    raise SinkError(f"flight recorder: {e}") from e
                self._dump_failed = False
                if path is not None:
                    self.ctx.reports.append(Path(path))
                    rec.flight_recorder_report = str(path)
                    log.warning("distgrad: flight-recorder report written to %s", path)

    def _nonfinite(self, rec: StepRecord) -> None:
        rows = rec.nonfinite_params or []
        names = self.ctx.names
        W = max(rec.world_size, 1)
        nan = np.zeros((W, len(names)))
        inf = np.zeros((W, len(names)))
        for r in rows:
            if r.param in self._idx and r.rank < W:
                nan[r.rank, self._idx[r.param]] += r.nan
                inf[r.rank, self._idx[r.param]] += r.inf
        prov = Provenance.from_dict({**provenance_from(names, nan, inf, order_key=self._order_key), "step": rec.step})
        if prov.first_param is not None:
            prov.first_layer = classify(prov.first_param, self.ctx.rules).layer
        rec.provenance = prov
        if self._event is None:  # first step of a streak: this is the event (logged once)
            self._event = NonfiniteEvent(rec.step, list(rows[:_LIST_CAP]), prov, list(rec.culprits[:_LIST_CAP]),
                                         rec.culprit_module)
            if self.ctx.global_rank == 0 and not rec.overflow:  # fp16 overflows are routine: counted, not logged
                log.warning("%s", _event_line(rec, prov))
        rec.nonfinite_event = self._event

    def state_dict(self) -> dict[str, Any]:
        dumped = self.recorder.dumped_nonfinite if self.recorder is not None else None
        return {"event": self._event.to_dict() if self._event else None,
                "loss_scale_history": [list(x) for x in self._loss_scale_history],
                "dumped": None if dumped is None else str(dumped)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        ev = sd.get("event")
        self._event = NonfiniteEvent.from_dict(ev) if ev else None
        self._loss_scale_history = [(int(s), float(v)) for s, v in sd.get("loss_scale_history", [])]
        if self.recorder is not None and sd.get("dumped"):
            self.recorder.dumped_nonfinite = Path(sd["dumped"])


def _event_line(rec: StepRecord, prov: Provenance) -> str:
    """The one log line of a non-finite event (rank 0): its step, where the NaN/Inf started
    (culprit rank(s), the forward replay's culprit module or why none), then the shard view."""
    n = len(prov.params)
    who = ", ".join(f"{c.rank} ({'+'.join(k for k in ('loss', 'grad') if getattr(c, k))})"
                    for c in rec.culprits[:_LIST_CAP]) or "none seen"
    cm = rec.culprit_module
    module = cm.describe() if cm is not None else "culprit module unknown: not replayed"
    last = (f"; last in forward order (where the backward pass met it first): {prov.first_param} "
            f"(layer {prov.first_layer})" if prov.first_param is not None else "")
    shards = "; ".join(f"{r.name}: {r.nan} NaN, {r.inf} Inf, ranks {r.ranks}" for r in prov.params[:5])
    return (f"distgrad: step {rec.step}: non-finite gradients; culprit rank(s), whose "
            f"own loss / gradient was non-finite before the reduction: {who}; {module}; {n} non-finite "
            f"parameter(s){last}; by rank shard of the reduced gradient: {shards}"
            f"{f'; and {n - 5} more' if n > 5 else ''}")


@register
class TracerDiagnostic(Diagnostic):
    """Forward overflow tracer (:class:`distgrad.diagnostics.tracer.OverflowTracer`): armed on the first
    non-finite step for ``trace_micro_batches`` micro-batches; each rank that saw the event
    writes ``tracer-rank{r}.txt`` to ``flight_recorder_dir`` once it has disarmed.
    Checkpointed: whether the one trace already ran."""

    name = "tracer"

    @classmethod
    def create(cls, ctx: DiagnosticContext) -> Diagnostic | None:
        return cls(ctx) if ctx.model is not None and ctx.config.tracer.micro_batches > 0 else None

    def __init__(self, ctx: DiagnosticContext) -> None:
        super().__init__(ctx)
        from distgrad.diagnostics.tracer import OverflowTracer

        self.tracer = OverflowTracer(ctx.model, max_micro_batches=ctx.config.tracer.micro_batches)
        self.traced = False

    def on_record(self, rec: StepRecord) -> None:
        if rec.nonfinite and not self.traced:
            self.traced = True
            self.tracer.arm()
            log.warning("distgrad: rank %d: forward overflow tracer armed for %d micro-batch(es)",
                        self.ctx.global_rank, self.ctx.config.tracer.micro_batches)

    def report(self) -> dict[str, Any] | None:
        """The tracer's report once it has run (None before)."""
        if not self.traced or self.tracer.armed:
            return None
        return self.tracer.report()

    def write_report(self) -> Path | None:
        """Write the text report to ``flight_recorder_dir`` once the tracer has disarmed."""
        rep = self.report()
        if rep is None or not self.ctx.config.flight_recorder.dir:
            return None
        path = Path(self.ctx.config.flight_recorder.dir) / f"tracer-rank{self.ctx.global_rank}.txt"
        if path.exists():
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.tracer.render())
        self.ctx.reports.append(path)
        return path

    def on_micro_batch(self) -> None:
        self.write_report()

    def state_dict(self) -> dict[str, Any]:
        # a trace still armed at the checkpoint did not finish: the resumed run may arm again
        return {"traced": self.traced and not self.tracer.armed}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.traced = bool(sd.get("traced", False))

    def close(self) -> None:
        self.tracer.disarm()


