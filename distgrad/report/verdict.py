"""Training-health findings of the offline verdict (``distgrad summary`` / ``report``) beyond
non-finite values: :class:`VerdictChecks`, fed every record by
:class:`~distgrad.report.analysis.RunAnalyzer`, bounded state (O(parameters + windows)).

Findings (each a :class:`~distgrad.report.analysis.Problem` whose detail names the step, what
to do and the runbook section, ``docs/runbook.md#verdict-<kind>``):

* ``divergence``: the median of the last ``window`` sampled losses rose above its lowest value
  so far by more than that lowest value and by more than the run's first such median (e.g.
  1.8 -> 28.6); named at the first step it holds.
* ``loss_spike`` / ``grad_norm_spike``: one sampled value at least ``loss_spike_factor`` (2) /
  ``grad_spike_factor`` (10) times the median of the previous ``window`` finite values (at
  least ``window // 2`` of them) and above that median by 6 robust standard deviations
  (1.4826 x MAD); fp16 overflow steps are left out.
* ``dead_adapter`` / ``never_updated``: a trainable parameter with no gradient (None: ``numel``
  0 in the record) or an exactly-zero gradient on every sampled step (at least ``min_records``),
  or whose update-to-weight ratio (``statistics.update_ratio``) was 0 on every applied step
  where it was recorded; ``dead_adapter`` when the name is an adapter's (LoRA, IA3, adapters).
* ``vanishing``: a parameter that had a gradient but whose gradient norm stayed below
  ``vanish_threshold`` (1e-10, as ``health.vanish_threshold``) or None on the last
  ``patience`` (3) or more sampled steps of the run; named at the step it started.
* ``stall``: no sampled step for ``stall_factor`` (20) times the median time between records
  and at least ``stall_seconds`` (300 s);
* ``no_progress`` (a loss plateau from the start): over at least 50 sampled losses, the median
  of the last tenth is not 1% below the median of the first tenth (not reported with a
  ``divergence``).
* ``loss_scale_collapse``: a record with ``scaler.loss_scale_collapsed`` (see
  :mod:`distgrad.diagnostics.loss_scale`).

One decision with the alerts: in a log whose records carry the detection policy's state
(``incidents``, :mod:`distgrad.diagnostics.incidents`, written by distgrad since the policy
exists, unless ``incidents.enabled`` is false), ``divergence``, ``bad_batch`` and ``spike_burst``
are the incidents the policy opened online, read from those record fields (:func:`incident_finding`),
the same state the alert rules fire on; the ``divergence`` / ``loss_spike`` / ``grad_norm_spike``
rules above then do not run (:attr:`VerdictChecks.use_incidents`). They judge only logs written
without the policy.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from distgrad.record import StepRecord

if TYPE_CHECKING:
    from distgrad.record.incidents import Incident

RUNBOOK = "docs/runbook.md"
_ADAPTER = re.compile(r"(^|[._])(lora_[A-Za-z0-9_]*|lora|adapter[s]?|ia3_[A-Za-z0-9_]*|prompt_encoder)([._]|$)")

_ADVICE = {
    "divergence": "lower the learning rate (or lengthen warm-up, clip gradients) and resume from a checkpoint "
                  "before step {best}",
    "loss_spike": "inspect the batch of that step (a garbage or mislabelled batch); if the loss does not come "
                  "back, resume from an earlier checkpoint with a lower learning rate",
    "grad_norm_spike": "enable or lower gradient clipping; check the batch of that step",
    "dead_adapter": "check that the adapter's output is added to the model's output (not detached) and that "
                    "its A and B are not both initialised to zero or frozen, and that the optimizer holds them",
    "never_updated": "check that the parameter is used in the forward pass and reaches the loss (not "
                     "detached), that it is in the optimizer with a non-zero learning rate, or freeze it",
    "vanishing": "check for a detached or dead (saturated activation) layer; lower depth/raise init scale, "
                 "use normalisation or residual connections",
    "stall": "check the training job (hung collective, data loader, preemption) and its logs around that step",
    "no_progress": "check the learning rate (0?), that the optimizer steps the model's parameters, and the "
                   "data (same batch every step?)",
    "bad_batch": "inspect the batch rank {rank} read at step {at} (its data shard, the sample indices the loop "
                 "passed to observe_loss); if the loss does not come back, resume from a checkpoint before that step",
    "spike_burst": "spikes keep coming: lower the learning rate or lengthen warm-up, enable or lower gradient "
                   "clipping, check the data around those steps",
    "loss_scale_collapse": "see the DistgradLossScaleCollapsed runbook: lower the learning rate, find the "
                           "overflowing layer, or switch to bf16",
}


def _finding(kind: str, step: int, what: str, **fmt: Any) -> tuple[str, int, str]:
    anchor = "verdict-" + kind.replace("_", "-")
    return kind, step, f"{what}; what to do: {_ADVICE[kind].format(**fmt)} ({RUNBOOK}#{anchor})"


def incident_finding(inc: Incident) -> tuple[str, int, str]:
    """``(kind, step, detail)`` of an :class:`~distgrad.record.incidents.Incident` the online policy
    opened, with what to do and the runbook section, as :meth:`VerdictChecks.findings` gives."""
    best = inc.level_step if inc.level_step is not None else inc.step
    return _finding(inc.kind, int(inc.step), inc.detail, best=best, rank=inc.rank, at=inc.step)


class _Rolling:
    """Median / MAD of the last ``n`` finite values, refreshed every 4 values."""

    def __init__(self, n: int) -> None:
        self.buf: deque[float] = deque(maxlen=n)
        self._age, self.med, self.mad = 4, math.nan, math.nan

    def stats(self) -> tuple[float, float]:
        if self._age >= 4 and self.buf:
            vals = list(self.buf)
            self.med = statistics.median(vals)
            self.mad = statistics.median(abs(v - self.med) for v in vals)
            self._age = 0
        return self.med, self.mad

    def add(self, x: float) -> None:
        self.buf.append(x)
        self._age += 1


class VerdictChecks:
    """The checks of the module docstring; :meth:`add` each record in order, then :meth:`findings`.

    Args:
        window: sampled steps of the rolling medians (loss divergence, spikes).
        loss_spike_factor, grad_spike_factor: spike ratios to the rolling median.
        min_records: sampled steps before a parameter may be called never updated.
        vanish_threshold: gradient norm (gradient units) below which a parameter has vanished.
        patience: trailing sampled steps for ``vanishing``.
        stall_factor, stall_seconds: a gap between records longer than both is a stall.
    """

    def __init__(self, window: int = 20, loss_spike_factor: float = 2.0, grad_spike_factor: float = 10.0,
                 min_records: int = 5, vanish_threshold: float = 1e-10, patience: int = 3,
                 stall_factor: float = 20.0, stall_seconds: float = 300.0) -> None:
        self.window, self.min_records, self.patience = window, min_records, patience
        self.spike = {"loss": loss_spike_factor, "grad_norm": grad_spike_factor}
        self.vanish_threshold, self.stall_factor, self.stall_seconds = vanish_threshold, stall_factor, stall_seconds
        self._roll = {"loss": _Rolling(window), "grad_norm": _Rolling(window)}
        self._div_len = max(3, window // 2)
        self._div_buf: deque[float] = deque(maxlen=self._div_len)
        self._first_med: float | None = None
        self._best: tuple[float, int] | None = None
        self._losses_head: list[float] = []
        self._losses_tail: deque[float] = deque()
        self._n_loss = 0
        self._out: dict[str, tuple[str, int, str]] = {}
        #: kind -> the ranks its finding names (an incident's culprit rank)
        self.ranks: dict[str, list[int]] = {}
        self._names: list[str] = []
        self._index: dict[str, int] = {}
        self._last_names: list[str] | None = None
        self._map = np.zeros(0, np.int64)
        self._seen = np.zeros(0, np.int64)           # records that listed the parameter
        self._had_grad = np.zeros(0, bool)           # a finite non-zero gradient at some step
        self._present = np.zeros(0, bool)            # a gradient (not None) at some step
        self._quiet_since = np.zeros(0, np.int64)    # step the current no/vanishing-gradient run began, -1 none
        self._quiet_n = np.zeros(0, np.int64)
        self._ur_seen = np.zeros(0, np.int64)
        self._ur_moved = np.zeros(0, bool)
        self._times: deque[float] = deque(maxlen=64)
        self._prev: tuple[float, int] | None = None
        self._last_step = 0

    # ------------------------------------------------------------------------------------
    def _put(self, kind: str, step: int, what: str, _inc: Incident | None = None, **fmt: Any) -> None:
        if kind not in self._out:
            self._out[kind] = incident_finding(_inc) if _inc is not None else _finding(kind, step, what, **fmt)
            if _inc is not None and _inc.rank is not None:
                self.ranks[kind] = [int(_inc.rank)]

    def _idx(self, names: list[str]) -> np.ndarray:
        if names is not self._last_names and names != self._last_names:
            for n in names:
                if n not in self._index:
                    self._index[n] = len(self._names)
                    self._names.append(n)
            grow = len(self._names) - self._seen.size
            if grow:
                self._seen = np.pad(self._seen, (0, grow))
                self._had_grad = np.pad(self._had_grad, (0, grow))
                self._present = np.pad(self._present, (0, grow))
                self._quiet_since = np.pad(self._quiet_since, (0, grow), constant_values=-1)
                self._quiet_n = np.pad(self._quiet_n, (0, grow))
                self._ur_seen = np.pad(self._ur_seen, (0, grow))
                self._ur_moved = np.pad(self._ur_moved, (0, grow))
            self._map = np.array([self._index[n] for n in names], np.int64)
        self._last_names = names
        return self._map

    #: the log carries the detection policy's state: divergence and spikes come from its incidents
    use_incidents = False

    def add(self, r: StepRecord) -> None:
        """Fold in one record (file order)."""
        step = int(r.step)
        if r.incidents is not None:
            self.use_incidents = True
            for inc in [*r.incidents.opened, *r.incidents.last]:  # `last` covers records lost from the log
                self._put(inc.kind, int(inc.step), "", _inc=inc)
        self._last_step = step
        self._gap(r, step)
        if r.scaler is not None and getattr(r.scaler, "loss_scale_collapsed", False):
            d = r.scaler.loss_scale_drop_factor
            self._put("loss_scale_collapse", step, f"fp16 loss scale collapsed to {r.loss_scale!r}"
                      + (f", {d:.4g}x below the scale training last worked at" if d is not None else ""))
        loss = float(r.loss) if r.loss is not None else math.nan
        if math.isfinite(loss):
            self._loss(loss, step)
        if not r.overflow:
            if not self.use_incidents:
                for series, v in (("loss", loss), ("grad_norm", float(r.grad_norm))):
                    self._spike(series, v, step)
            self._params(r, step)

    def _gap(self, r: StepRecord, step: int) -> None:
        t = float(r.timestamp)
        if self._prev is not None and math.isfinite(t):
            dt = t - self._prev[0]
            if len(self._times) >= 5:
                med = statistics.median(self._times)
                if dt > max(self.stall_factor * med, self.stall_seconds):
                    self._put("stall", self._prev[1], f"no sampled step for {dt:.0f} s after step {self._prev[1]} "
                              f"(next: step {step}; usually {med:.3g} s between records)")
            if dt >= 0:
                self._times.append(dt)
        if math.isfinite(t):
            self._prev = (t, step)

    def _loss(self, loss: float, step: int) -> None:
        self._n_loss += 1
        if len(self._losses_head) < 10_000:
            self._losses_head.append(loss)
        self._losses_tail.append(loss)
        while len(self._losses_tail) > max(10, self._n_loss // 10):
            self._losses_tail.popleft()
        self._div_buf.append(loss)
        if len(self._div_buf) < self._div_len:
            return
        med = statistics.median(self._div_buf)
        if self._first_med is None:
            self._first_med = med
        if self._best is None or med < self._best[0]:
            self._best = (med, step)
        best, bstep = self._best
        if med - best > max(abs(best), abs(self._first_med)) and med > 0 and not self.use_incidents:
            self._put("divergence", step, f"the loss diverged: median of the last {len(self._div_buf)} sampled "
                      f"losses {med:.4g} at step {step}, up from its minimum {best:.4g} (step {bstep})", best=bstep)

    def _spike(self, series: str, v: float, step: int) -> None:
        if not math.isfinite(v):
            return
        roll = self._roll[series]
        if len(roll.buf) >= self.window // 2:
            med, mad = roll.stats()
            if med > 0 and v >= self.spike[series] * med and v - med > 6 * 1.4826 * mad:
                self._put(f"{series}_spike", step, f"{series.replace('_', ' ')} spike: {v:.4g} at step {step}, "
                          f"{v / med:.3g}x the median of the previous {len(roll.buf)} sampled steps ({med:.4g})")
        roll.add(v)

    def _params(self, r: StepRecord, step: int) -> None:
        p = r.params
        if not len(p.names):
            return
        j = self._idx(p.names)
        numel = np.asarray(p.numel, np.float64)
        with np.errstate(invalid="ignore"):
            norm = np.sqrt(np.asarray(p.sumsq, np.float64))
        finite = np.isfinite(norm)
        has = (numel > 0) & finite & (norm > 0)
        quiet = (numel == 0) | (finite & (norm <= self.vanish_threshold))
        self._seen[j] += 1
        self._had_grad[j] |= has
        self._present[j] |= numel > 0
        qs = self._quiet_since[j]
        self._quiet_since[j] = np.where(quiet, np.where(qs < 0, step, qs), -1)
        self._quiet_n[j] = np.where(quiet, self._quiet_n[j] + 1, 0)
        if r.update_ratio and r.step_applied:
            for name, ratio in r.update_ratio.items():
                k = self._index.get(name)
                if k is not None and ratio is not None and math.isfinite(ratio):
                    self._ur_seen[k] += 1
                    self._ur_moved[k] |= ratio > 0

    # ------------------------------------------------------------------------------------
    def _param_findings(self) -> None:
        names = np.array(self._names, dtype=object)
        never = (self._seen >= self.min_records) & ~self._had_grad
        frozen = (self._ur_seen >= self.min_records) & ~self._ur_moved & self._had_grad
        dead = never | frozen
        adapter = np.array([bool(_ADAPTER.search(n)) for n in self._names], bool)

        def listing(sel: np.ndarray) -> str:
            def why(k: np.integer) -> str:
                return "no update" if frozen[k] else "zero gradient" if self._present[k] else "no gradient"

            picked = [f"{n} ({why(k)})" for k, n in zip(np.nonzero(sel)[0], names[sel])]
            more = f" and {len(picked) - 5} more" if len(picked) > 5 else ""
            return ", ".join(picked[:5]) + more

        first = self._first_step
        for kind, sel in (("dead_adapter", dead & adapter), ("never_updated", dead & ~adapter)):
            if sel.any():
                what = ("adapter parameter(s)" if kind == "dead_adapter" else "trainable parameter(s)")
                self._put(kind, first, f"{int(sel.sum())} {what} never updated (no gradient, an exactly-zero "
                          f"gradient or a zero update on every sampled step): {listing(sel)}")
        van = self._had_grad & (self._quiet_n >= self.patience) & ~dead
        if van.any():
            since = int(self._quiet_since[van].min())
            picked = list(names[van])
            more = f" and {len(picked) - 5} more" if len(picked) > 5 else ""
            self._put("vanishing", since, f"the gradient of {len(picked)} parameter(s) vanished (norm <= "
                      f"{self.vanish_threshold:g} or none) from step {since} to the end: {', '.join(picked[:5])}{more}")

    def findings(self, first_step: int) -> list[tuple[str, int, str]]:
        """``(kind, step, detail)`` of each finding, first occurrence per kind."""
        self._first_step = first_step
        self._param_findings()
        if self._n_loss >= 50 and "divergence" not in self._out:
            k = max(5, self._n_loss // 10)
            head, tail = statistics.median(self._losses_head[:k]), statistics.median(list(self._losses_tail)[-k:])
            if tail > head - 0.01 * abs(head):
                self._put("no_progress", self._last_step, f"no progress: the median of the last {k} sampled losses "
                          f"({tail:.4g}) is not 1% below that of the first {k} ({head:.4g}) at step "
                          f"{self._last_step}")
        return list(self._out.values())
