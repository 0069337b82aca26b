"""The record part of the detection policy (:mod:`distgrad.diagnostics.incidents`): the
incidents a run has opened so far, written into every sampled step's record, so that the
exporter (``distgrad_incident*`` metrics, which the alert rules read) and the offline verdict
(``distgrad summary`` / ``report``) read the same decision."""

from __future__ import annotations

from dataclasses import dataclass, field

from distgrad.record.base import _Part

#: incident kinds (the bounded ``incident`` label), in the order they are documented
KINDS = ("divergence", "bad_batch", "spike_burst")

#: default severity of each kind (the alert rules' severity: grafana/config.py)
SEVERITY = {"divergence": "critical", "bad_batch": "critical", "spike_burst": "warning"}


@dataclass
class Incident(_Part):
    """One incident: the event that opened it and what the policy knew when it decided.

    Attributes:
        kind: one of :data:`KINDS`.
        step: optimizer step of the event that opened it (divergence: the first step of the
            loss excursion, the spike step; bad_batch: the step of the batch; spike_burst: the
            spike that completed the burst).
        value: the value at ``step`` (``series``' unit: the loss, a rank's loss, or the grad norm).
        series: what ``value`` is: ``"loss"``, ``"grad_norm"`` or ``"rank_loss"``.
        decided: optimizer step at which the policy opened the incident (>= ``step``; divergence:
            ``step`` plus the sampled steps it waited for the loss to come back).
        level: the reference ``value`` is compared with (divergence: the pre-spike loss level, the
            median of the losses before the excursion; bad_batch: the median loss of the other
            ranks; spike_burst: None).
        level_step: the last step of the reference (divergence), else None.
        rank: the rank whose loss was the outlier (bad_batch), else None.
        component: the loss component whose *weighted* contribution (weight x value) rose the
            most, when it explains at least ``incidents.component_share`` of the loss's rise;
            None without components or when none does.
        first_step: spike_burst: the step of the burst's first spike; else None.
        grad_norm: the global gradient norm at ``step`` (gradient units), None when not finite.
        detail: one sentence naming the event, as the verdict and the logs print it.
    """

    kind: str
    step: int
    value: float
    series: str
    decided: int
    level: float | None = None
    level_step: int | None = None
    rank: int | None = None
    component: str | None = None
    first_step: int | None = None
    grad_norm: float | None = None
    detail: str = ""


@dataclass
class Incidents(_Part):
    """The policy's state after one sampled step (every rank writes the same: it is decided from
    reduced values only).

    Attributes:
        total: ``{kind: incidents opened since the start}`` for every kind of :data:`KINDS`
            (``distgrad_incidents_total{incident}``, at 0 from the first sampled step).
        opened: incidents opened on this step (usually empty).
        last: the last incident of each kind opened so far, in :data:`KINDS` order
            (``distgrad_incident_step`` / ``_value`` / ``_rank`` / ``_component``).
        active: kinds whose condition still holds (a divergence whose loss has not come back).
    """

    total: dict[str, int] = field(default_factory=dict)
    opened: list[Incident] = field(default_factory=list)
    last: list[Incident] = field(default_factory=list)
    active: list[str] = field(default_factory=list)
