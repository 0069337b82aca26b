"""Loss diagnostics (plug-ins, see :mod:`distgrad.diagnostics`): the trend of the training loss
(:mod:`distgrad.loss.trend`) and the loss's spike detectors on each loss component
(:mod:`distgrad.loss.components`)."""

from __future__ import annotations

from typing import Any

from distgrad.diagnostics.base import Diagnostic, DiagnosticContext, register
from distgrad.diagnostics.detectors import EmaZScoreDetector, WindowSpikeDetector
from distgrad.diagnostics.spike_monitor import SpikeMonitor
from distgrad.loss.trend import TrendTracker
from distgrad.record import StepRecord


@register
class LossTrendDiagnostic(Diagnostic):
    """The loss trend (:class:`TrendTracker`, config section ``loss``); writes ``rec.loss_trend``.
    A skipped (fp16 overflow) step's loss is not fed."""

    name = "loss_trend"

    def __init__(self, ctx: DiagnosticContext) -> None:
        super().__init__(ctx)
        lc = ctx.config.loss
        self.trend = TrendTracker(lc.trend_window, lc.plateau_z)

    def on_record(self, rec: StepRecord) -> None:
        rec.loss_trend = self.trend.update(rec.step, None if rec.overflow else rec.loss)

    def state_dict(self) -> dict[str, Any]:
        return self.trend.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.trend.load_state_dict(sd)


@register
class ComponentSpikeDiagnostic(Diagnostic):
    """The spike detectors of the loss (config section ``spikes``) on each loss component's
    weighted contribution, mean weight x mean value (:class:`~distgrad.record.LossComponents`:
    a weight raised by a schedule bug is seen though the value does not move); writes its ``zscore``, ``spikes_total``
    and ``flagged``. Monitors are created at a component's first record."""

    name = "loss_component_spikes"

    def __init__(self, ctx: DiagnosticContext) -> None:
        super().__init__(ctx)
        self.monitors: dict[str, SpikeMonitor] = {}
        self._saved: dict[str, Any] = {}

    def _monitor(self, name: str) -> SpikeMonitor:
        m = self.monitors.get(name)
        if m is None:
            sp = self.ctx.config.spikes
            m = self.monitors[name] = SpikeMonitor(name, EmaZScoreDetector(sp.ema_alpha, sp.ema_z, sp.ema_warmup),
                                                   WindowSpikeDetector(sp.window, sp.window_sigma), robust=False)
            if name in self._saved:
                m.load_state_dict(self._saved.pop(name))
        return m

    def on_record(self, rec: StepRecord) -> None:
        c = rec.loss_components
        if c is None or not c.names:
            return
        for name, value, weight in zip(c.names, c.mean, c.weight):
            # the weighted contribution: a weight a schedule bug raised 1000x moves it, not the value
            res = self._monitor(name).update(None if rec.overflow else float(weight) * float(value), step=rec.step)
            c.zscore[name] = {k: r.score for k, r in res.items()}
            c.spikes_total[name] = dict(self.monitors[name].spikes)
            if any(r.is_spike for r in res.values()):
                c.flagged.append(name)

    def state_dict(self) -> dict[str, Any]:
        return {**self._saved, **{n: m.state_dict() for n, m in self.monitors.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._saved = dict(sd)
        for n in list(self.monitors):
            if n in self._saved:
                self.monitors[n].load_state_dict(self._saved.pop(n))
