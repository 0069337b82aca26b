"""The detection policy: which events of a run are incidents (they page or open a ticket) and
which are only dashboard annotations (a single spike training recovers from). One host-side,
deterministic state machine (:class:`IncidentPolicy`), fed each sampled step's reduced values:
every rank holds the same record, so every rank decides the same, without a collective. Its
state rides in the record (:class:`~distgrad.record.incidents.Incidents`): the exporter serves it
(``distgrad_incidents_total{incident}``, ``distgrad_incident_step`` / ``_value`` / ``_rank`` /
``_component``), the alert rules fire on it, and the offline verdict (``distgrad summary``) reads
the same record fields, so the page and the verdict cannot disagree.

Incidents (config section ``incidents``; severities in grafana/config.py):

``divergence`` (critical): training that does not recover.
    (a) *Excursion*: the loss goes above ``divergence_factor`` x its level (the median of the
    last ``level_window`` sampled losses before the excursion: the pre-spike level, frozen while
    the excursion lasts) and stays above it for ``divergence_steps`` consecutive sampled steps.
    The incident names the excursion's first step (the spike) and its loss. A spike whose loss
    comes back below the line within fewer steps opens nothing.
    (b) *Drift* (no single jump): the median of the last ``drift_window`` sampled losses rises
    above ``drift_factor`` x its lowest value so far and above that value plus the run's first
    such median (the offline verdict's divergence rule of earlier versions; e.g. 1.8 -> 28.6).
    One divergence at a time: a new one opens only after the loss came back.
``bad_batch`` (critical): one rank's batch is bad. The largest per-rank loss over the median
    loss of the other ranks (from the SUM collective's per-rank losses, :mod:`distgrad.loss.tracker`) is
    a robust jump (:class:`~distgrad.diagnostics.robust_spike.RobustJumpDetector` on that ratio:
    ``rank_k`` robust deviations and ``rank_ratio`` x above its trend) *and* the step's global
    gradient norm is at least ``rank_grad_ratio`` x the median of the last ``level_window``
    sampled norms. Names the rank and the step. Needs world size >= 2. Healthy per-rank noise
    moves the ratio a little (median ~1.15, at most 1.86 over 300 healthy steps on 3 ranks), and a
    healthy 2x grad-norm jump leaves the ratio alone: both together tell a corrupted shard from
    noise (a quarter of one rank's labels wrong, tests/test_causes.py: the ratio jumps to 4.3, the
    global loss 2.3x, the gradient norm only 1.3x).
``spike_burst`` (warning): ``burst_spikes`` sampled steps on which the robust jump detector
    (config ``spikes.robust_*``) flagged the loss or the gradient norm within ``burst_window``
    consecutive sampled steps: recurring instability worth a ticket although each spike recovered.

Every incident names the step of its event and the value there, not the last sampled step's.
With loss components (:mod:`distgrad.loss.components`) it also names the component whose
*weighted* contribution (weight x value) rose the most over its level when that rise explains at
least ``component_share`` of the loss's rise (a weight raised 1000x by a schedule bug: its
unweighted value does not move).

The divergence tests need a positive loss level and the bad-batch test positive per-rank
losses (a loss that can be negative, e.g. a DPO margin, opens neither). fp16 overflow steps and
non-finite values are not fed (non-finite training pages through the
non-finite alerts). The source of the thresholds' defaults: the healthy and faulty runs of
``tests/test_causes.py`` and ``tests/test_incidents.py``, and the healthy corpus (docs/runbook.md,
"Detection policy").
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Any

from distgrad.diagnostics.base import Diagnostic, DiagnosticContext, register
from distgrad.diagnostics.robust_spike import RobustJumpDetector
from distgrad.record import StepRecord
from distgrad.record.incidents import KINDS, Incident, Incidents

__all__ = ["IncidentPolicy", "IncidentDiagnostic"]

log = logging.getLogger("distgrad")

_NAN = float("nan")


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class IncidentPolicy:
    """The state machine of the module docstring. Pure Python, no torch: :meth:`update` takes one
    sampled step's reduced values and returns the :class:`Incidents` state after it.

    Args:
        cfg: the ``incidents`` config section (:class:`~distgrad.config.IncidentsConfig`).
        robust_window: samples of the rank-ratio jump detector's window (``spikes.robust_window``).
    """

    def __init__(self, cfg: Any, robust_window: int = 24) -> None:
        self.cfg = cfg
        self.robust_window = max(int(robust_window), int(cfg.level_min))
        self.reset()

    def reset(self) -> None:
        """Forget everything (a fresh run)."""
        c = self.cfg
        self.n = 0  # sampled steps fed
        self.total = {k: 0 for k in KINDS}
        self.last: dict[str, Incident] = {}
        self._loss: deque[tuple[int, float]] = deque(maxlen=c.level_window)
        self._gn: deque[float] = deque(maxlen=c.level_window)
        self._comp: dict[str, deque[float]] = {}
        self._exc: dict[str, Any] | None = None  # the loss excursion in progress
        self._drift: deque[float] = deque(maxlen=c.drift_window)
        self._first_med: float | None = None
        self._best: tuple[float, int] | None = None
        self._drift_open = False
        self._spikes: deque[tuple[int, int]] = deque()  # (sample index, step) of robust spikes
        self._rank_det = RobustJumpDetector(window=self.robust_window, k=c.rank_k, min_ratio=c.rank_ratio,
                                            min_samples=c.level_min)

    # ------------------------------------------------------------------------------------
    def update(self, step: int, loss: float | None, grad_norm: float | None, *, overflow: bool = False,
               rank_losses: list[float] | None = None, robust_spikes: tuple[str, ...] = (),
               components: dict[str, float] | None = None) -> Incidents:
        """Fold in one sampled step.

        Args:
            step: the optimizer step.
            loss: the step's global loss (None: not observed).
            grad_norm: the global gradient norm (gradient units).
            overflow: an fp16 overflow step (nothing is fed).
            rank_losses: each rank's own loss of the step (``RankStats.loss_mean``, length W).
            robust_spikes: the series (``"loss"``, ``"grad_norm"``) the robust jump detector
                flagged on this step (``rec.spikes.fired``).
            components: ``{component: weight x mean}`` of the step's loss components.

        Returns:
            :class:`Incidents`: totals, the incidents opened on this step, the last of each kind.
        """
        opened: list[Incident] = []
        self.n += 1
        if not overflow:
            lv, gv = _finite(loss), _finite(grad_norm)
            comps = {k: v for k, v in (components or {}).items() if _finite(v) is not None}
            self._bad_batch(step, lv, gv, rank_losses, comps, opened)
            if lv is not None:
                self._excursion(step, lv, gv, comps, opened)
                self._drift_rule(step, lv, gv, opened)
            if gv is not None:
                self._gn.append(gv)
            self._burst(step, loss, grad_norm, robust_spikes, opened)
        for inc in opened:
            self.total[inc.kind] += 1
            self.last[inc.kind] = inc
        active = ["divergence"] if (self._exc is not None and self._exc["opened"]) or self._drift_open else []
        return Incidents(total=dict(self.total), opened=opened,
                         last=[self.last[k] for k in KINDS if k in self.last], active=active)

    # ---- divergence ------------------------------------------------------------------------
    def _level(self) -> tuple[float, int] | None:
        if len(self._loss) < self.cfg.level_min:
            return None
        return statistics.median(v for _, v in self._loss), self._loss[-1][0]

    def _component(self, comps: dict[str, float], rise: float) -> str | None:
        """The component whose weighted contribution rose the most over its level, if that rise
        is at least ``component_share`` of ``rise`` (the loss's)."""
        best, name = 0.0, None
        for k, v in comps.items():
            hist = self._comp.get(k)
            ref = statistics.median(hist) if hist else 0.0
            if v - ref > best:
                best, name = v - ref, k
        return name if name is not None and rise > 0 and best >= self.cfg.component_share * rise else None

    def _keep(self, step: int, loss: float, comps: dict[str, float]) -> None:
        self._loss.append((step, loss))
        for k, v in comps.items():
            self._comp.setdefault(k, deque(maxlen=self.cfg.level_window)).append(v)

    def _excursion(self, step: int, loss: float, gn: float | None, comps: dict[str, float],
                   opened: list[Incident]) -> None:
        c = self.cfg
        exc = self._exc
        if exc is None:
            lvl = self._level()
            if lvl is None or lvl[0] <= 0 or loss <= c.divergence_factor * lvl[0]:
                self._keep(step, loss, comps)
                return
            exc = self._exc = {"step": step, "value": loss, "gn": gn, "level": lvl[0], "level_step": lvl[1],
                               "n_level": len(self._loss), "count": 0, "opened": False,
                               "component": self._component(comps, loss - lvl[0])}
        if loss <= c.divergence_factor * exc["level"]:  # back below the line: the excursion is over
            self._exc = None
            self._keep(step, loss, comps)
            return
        exc["count"] += 1
        if exc["count"] >= c.divergence_steps and not exc["opened"]:
            exc["opened"] = True
            if self._drift_open:
                return  # the same divergence, already opened by the drift rule
            comp = exc["component"]
            detail = (f"the loss diverged at step {exc['step']}: {exc['value']:.4g}, "
                      f"{exc['value'] / exc['level']:.3g}x its pre-spike level {exc['level']:.4g} (step "
                      f"{exc['level_step']}), the median of the {exc['n_level']} sampled losses up to it, and it "
                      f"stayed above {c.divergence_factor:g}x that level for {exc['count']} sampled steps (to step "
                      f"{step})" + (f"; the weighted contribution of loss component {comp!r} rose the most"
                                    if comp else ""))
            opened.append(Incident("divergence", exc["step"], exc["value"], "loss", step, level=exc["level"],
                                   level_step=exc["level_step"], component=comp,
                                   grad_norm=exc["gn"], detail=detail))

    def _drift_rule(self, step: int, loss: float, gn: float | None, opened: list[Incident]) -> None:
        c = self.cfg
        self._drift.append(loss)
        if len(self._drift) < self.cfg.drift_window:
            return
        med = statistics.median(self._drift)
        if self._first_med is None:
            self._first_med = med
        if self._best is None or med < self._best[0]:
            self._best = (med, step)
        best, bstep = self._best
        up = med > 0 and med - best > (c.drift_factor - 1) * max(abs(best), abs(self._first_med))
        if not up:
            self._drift_open = False
            return
        if self._drift_open or (self._exc is not None and self._exc["opened"]):
            return
        self._drift_open = True
        detail = (f"the loss diverged: the median of the last {len(self._drift)} sampled losses {med:.4g} at step "
                  f"{step}, up from its minimum {best:.4g} (step {bstep}), more than {c.drift_factor:g}x")
        opened.append(Incident("divergence", step, med, "loss", step, level=best, level_step=bstep,
                               grad_norm=gn, detail=detail))

    # ---- bad batch on one rank ---------------------------------------------------------------
    def _bad_batch(self, step: int, loss: float | None, gn: float | None, rank_losses: list[float] | None,
                   comps: dict[str, float], opened: list[Incident]) -> None:
        got = [_finite(v) for v in (rank_losses or [])]
        vals = [v for v in got if v is not None and v > 0]
        if len(vals) < 2 or len(vals) != len(got):  # a missing, non-finite or non-positive loss
            return
        top = max(range(len(vals)), key=lambda r: (vals[r], -r))
        others = statistics.median(v for r, v in enumerate(vals) if r != top)
        ratio = vals[top] / others
        jump = self._rank_det.update(ratio).is_spike
        if not jump or gn is None or len(self._gn) < self.cfg.level_min:
            return
        gref = statistics.median(self._gn)
        if not (gref > 0 and gn >= self.cfg.rank_grad_ratio * gref):
            return
        lvl = self._level()
        comp = self._component(comps, loss - lvl[0]) if comps and lvl is not None and loss is not None else None
        detail = (f"a bad batch on rank {top} at step {step}: its loss {vals[top]:.4g} is {ratio:.3g}x the median "
                  f"loss of the other ranks ({others:.4g}), and the step's gradient norm {gn:.4g} is "
                  f"{gn / gref:.3g}x its recent median ({gref:.4g})"
                  + (f"; the weighted contribution of loss component {comp!r} rose the most" if comp else ""))
        opened.append(Incident("bad_batch", step, vals[top], "rank_loss", step, level=others, rank=top,
                               component=comp, grad_norm=gn, detail=detail))

    # ---- recurring spikes --------------------------------------------------------------------
    def _burst(self, step: int, loss: Any, gn: Any, robust_spikes: tuple[str, ...], opened: list[Incident]) -> None:
        c = self.cfg
        while self._spikes and self._spikes[0][0] <= self.n - c.burst_window:
            self._spikes.popleft()
        if not robust_spikes:
            return
        self._spikes.append((self.n, step))
        if len(self._spikes) < c.burst_spikes:
            return
        series = "grad_norm" if "grad_norm" in robust_spikes else "loss"
        value = _finite(gn if series == "grad_norm" else loss)
        first = self._spikes[0][1]
        detail = (f"{len(self._spikes)} robust spikes within {self.n - self._spikes[0][0] + 1} sampled steps "
                  f"(steps {first} to {step}; at step {step} the {series.replace('_', ' ')} was "
                  f"{_NAN if value is None else value:.4g})")
        opened.append(Incident("spike_burst", step, _NAN if value is None else value, series, step,
                               first_step=first, grad_norm=_finite(gn), detail=detail))
        self._spikes.clear()

    # ---- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (the windows, the excursion, the counters)."""
        return {"n": self.n, "total": dict(self.total), "last": {k: v.to_dict() for k, v in self.last.items()},
                "loss": [list(x) for x in self._loss], "gn": list(self._gn),
                "comp": {k: list(v) for k, v in self._comp.items()}, "exc": self._exc,
                "drift": list(self._drift), "first_med": self._first_med,
                "best": None if self._best is None else list(self._best), "drift_open": self._drift_open,
                "spikes": [list(x) for x in self._spikes], "rank_det": self._rank_det.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (this instance's configuration is kept).

        Raises:
            KeyError / TypeError / ValueError: on a state this policy cannot read.
        """
        self.reset()
        self.n = int(sd["n"])
        self.total.update({k: int(v) for k, v in sd["total"].items() if k in self.total})
        self.last = {k: Incident.from_dict(v) for k, v in sd["last"].items()}
        self._loss.extend((int(s), float(v)) for s, v in sd["loss"])
        self._gn.extend(float(v) for v in sd["gn"])
        for k, v in sd["comp"].items():
            self._comp[k] = deque((float(x) for x in v), maxlen=self.cfg.level_window)
        self._exc = dict(sd["exc"]) if sd["exc"] is not None else None
        self._drift.extend(float(v) for v in sd["drift"])
        self._first_med = sd["first_med"]
        self._best = None if sd["best"] is None else (float(sd["best"][0]), int(sd["best"][1]))
        self._drift_open = bool(sd["drift_open"])
        self._spikes.extend((int(i), int(s)) for i, s in sd["spikes"])
        self._rank_det.load_state_dict(sd["rank_det"])


def record_inputs(rec: StepRecord) -> dict[str, Any]:
    """The keyword arguments of :meth:`IncidentPolicy.update` read from a record (the same
    function online and when the offline verdict replays a log written without the policy)."""
    fired = rec.spikes.fired if rec.spikes is not None else {}
    comps = None
    c = rec.loss_components
    if c is not None and c.names and not c.error:
        comps = {n: float(w) * float(m) for n, m, w in zip(c.names, c.mean, c.weight)}
    return {"step": int(rec.step), "loss": rec.loss, "grad_norm": rec.grad_norm, "overflow": bool(rec.overflow),
            "rank_losses": list(rec.ranks.loss_mean) if rec.ranks is not None else None,
            "robust_spikes": tuple(s for s in ("grad_norm", "loss") if "robust" in fired.get(s, ())),
            "components": comps}


@register
class IncidentDiagnostic(Diagnostic):
    """The detection policy (:class:`IncidentPolicy`, config section ``incidents``); runs after
    the spike detectors and writes ``rec.incidents``; global rank 0 logs each incident once."""

    name = "incidents"

    @classmethod
    def create(cls, ctx: DiagnosticContext) -> Diagnostic | None:
        return cls(ctx) if ctx.config.incidents.enabled else None

    def __init__(self, ctx: DiagnosticContext) -> None:
        super().__init__(ctx)
        self.policy = IncidentPolicy(ctx.config.incidents, ctx.config.spikes.robust_window)

    def on_record(self, rec: StepRecord) -> None:
        rec.incidents = self.policy.update(**record_inputs(rec))
        if self.ctx.global_rank == 0:
            for inc in rec.incidents.opened:
                log.warning("distgrad: incident %s at step %d (decided at step %d): %s", inc.kind, inc.step,
                            inc.decided, inc.detail)

    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.policy.load_state_dict(sd)
