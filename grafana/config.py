"""The one place for everything an operator may want to change in distgrad's monitoring mixin.

Laid out like kubernetes-mixin's ``config.libsonnet``: the selector of distgrad's scrape jobs,
the runbook base URL, each alert's thresholds, windows, ``for:`` durations and severities, and
the dashboards' settings. :mod:`grafana.alerts` and :mod:`grafana.dashboards` read only this;
``python grafana/build.py`` regenerates the committed rule file and dashboard JSON from it.

The unit tests of the rules (``grafana/alerts/tests/*.yml``) are written by hand against these
defaults: change a default threshold and they must change with it.
"""

from __future__ import annotations

from typing import Any

#: Selects distgrad's scrape jobs, in every alert and in the dashboards' job variable.
SELECTOR = 'job=~"distgrad.*"'

#: Every alert gets ``runbook_url`` = this + ``#`` + the alert name in lower case, which is the
#: anchor of that alert's ``## <AlertName>`` section in docs/runbook.md. The default is the
#: runbook inside this repository, as a path relative to its root. Deployments point it at
#: their own copy without editing this file: ``python grafana/build.py --runbook-url URL
#: --rules-out FILE`` writes a rule file with that base, and ``launch/monitoring_stack.sh
#: --runbook-url URL`` renders its copy with it (its default: ``file://<the clone>/docs/runbook.md``).
RUNBOOK_URL = "docs/runbook.md"

#: Per alert: ``severity`` (critical pages, warning tickets), ``for`` (how long the condition
#: must hold), the alert's own windows and thresholds, and optionally ``incident``
#: (``"divergence"``: a NaN alert of the same run silences it in Alertmanager, see INHIBITIONS).
ALERTS: dict[str, dict[str, Any]] = {
    # NaN/Inf gradient elements on a sampled step (distgrad_nonfinite_steps_total leaves out the
    # fp16 overflows the loss scaler skips; persistent fp16 trouble is caught by
    # DistgradRepeatedOverflow and DistgradLossScaleCollapsed instead).
    "DistgradNonFiniteGradients": {"severity": "critical", "for": "0s", "window": "5m"},
    "DistgradNaNLoss": {"severity": "critical", "for": "0s"},
    # Severity policy (docs/runbook.md, "Detection policy"): critical = a person must act now
    # (non-finite training, divergence that does not recover, a bad batch on one rank, loss-scale
    # collapse, a stop requested, a run that died or hung while running); warning = a ticket for
    # working hours; anything else = a dashboard annotation, no alert.
    # Spikes and divergence are decided by one state machine in distgrad
    # (distgrad.diagnostics.incidents, config section `incidents`: every threshold and duration in
    # sampled steps is a key there) whose state the offline verdict reads too; these rules only
    # fire on its counters (for: 0s: the policy already waited the steps it needed), and
    # `window` is how long an alert stays firing after its incident opened.
    # the loss stayed above incidents.divergence_factor x its pre-spike level for
    # incidents.divergence_steps sampled steps (or its rolling median drifted up drift_factor x)
    "DistgradLossDivergence": {"severity": "critical", "for": "0s", "window": "1h", "incident": "divergence"},
    # one rank's loss a robust outlier against the other ranks while the gradient norm jumped
    "DistgradBadBatch": {"severity": "critical", "for": "0s", "window": "1h", "incident": "divergence"},
    # incidents.burst_spikes robust spikes within incidents.burst_window sampled steps
    "DistgradRecurringSpikes": {"severity": "warning", "for": "0s", "window": "1h", "incident": "divergence"},
    # A single spike (robust jump test, distgrad.diagnostics.robust_spike, or OLMo's windowed 6-sigma score)
    # that training recovers from is no alert: the dashboards mark it (annotations from
    # distgrad_{loss,grad_norm}_spikes_total); a healthy 200-step run of the example has 2-3 of them
    # (2-2.5x grad-norm jumps at small batch). The consequences alert (above).
    "DistgradLossScaleCollapsed": {"severity": "critical", "for": "2m"},
    "DistgradRepeatedOverflow": {"severity": "warning", "for": "0s", "threshold": 5},
    # seconds since the last sampled step; must exceed sample_every x step time; only while the
    # run is running (distgrad_run_state 1), not while a finished run lingers for its last scrape
    "DistgradTrainingStalled": {"severity": "critical", "for": "1m", "threshold_seconds": 600},
    # lifecycle (distgrad_run_state: 1 running, 2 finished, served until scraped at a clean end):
    # a target that fails its scrapes for `for` pages only if the last state it served within
    # `window` was "running" -- not before the first run, not after a clean end, and it resolves
    # `window` after the last successful scrape of a crashed run. kill -9 of rank 0 pages after
    # one failed scrape + `for` + the pager's group_wait (~1.5 min with the shipped settings).
    "DistgradExporterDown": {"severity": "critical", "for": "1m", "window": "1h"},
    # a running run's scrape target vanished (its file_sd file deleted, the service discovery lost
    # it) without a clean end: its last state within `window` is "running" and it has no `up`
    "DistgradExporterAbsent": {"severity": "warning", "for": "2m", "window": "1h"},
    "DistgradReplicaMismatch": {"severity": "critical", "for": "0s", "window": "10m"},
    # weights differ across data-parallel replicas at a replica weight-hash step
    # (replica_weights.hash_interval, distgrad.signals.weight_hash): a silent data corruption the
    # replicas will train on for the rest of the run; pages at once
    "DistgradReplicaWeightsDiverged": {"severity": "critical", "for": "0s"},
    # data-parallel ranks whose losses were bit-identical on duplicate_data.steps sampled steps
    # (distgrad.signals.duplicate_data): a loader that does not shard by rank; the run wastes its
    # compute but is not broken: a ticket
    "DistgradDuplicateData": {"severity": "warning", "for": "0s"},
    # the opt-in rerun attribution (rerun.enabled, distgrad.diagnostics.rerun) re-executed a
    # non-finite or mismatched step and blamed one rank's hardware: `device` (reproduces on that
    # rank, not on another with the same micro-batches and weights) or `transient` (does not
    # reproduce: the node is suspect); a person drains the node now. `data` verdicts do not page
    # here (the non-finite alerts already did; the fault is in the data or the model)
    "DistgradRerunFaultyNode": {"severity": "critical", "for": "0s", "window": "1h"},
    "DistgradInternalErrors": {"severity": "warning", "for": "0s", "window": "10m"},
    # sampled steps distgrad refused to export (gradients read in the wrong order, clipped
    # before distgrad read them, or no backward since the last step): the loop needs a fix
    "DistgradRefusedSteps": {"severity": "warning", "for": "0s", "window": "10m"},
    # a rank the others keep waiting for: the step's wall time over what it would be at the
    # median rank's data time (distgrad_straggler_ratio) above the threshold for 10 minutes
    "DistgradStragglingRank": {"severity": "warning", "for": "10m", "threshold": 1.2},
    # the loss slope over loss.trend_window steps is within loss.plateau_z standard errors of 0
    "DistgradLossPlateau": {"severity": "warning", "for": "30m"},
    # distgrad's opt-in action (docs/action.md) skipped an optimizer update: skipping hides the
    # cause, so any skip alerts (per cause); a stop it requested is critical (the run ends)
    "DistgradUpdatesSkipped": {"severity": "warning", "for": "0s", "window": "30m"},
    "DistgradStopRequested": {"severity": "critical", "for": "0s"},
    # Adam's second moment no longer tracks the gradient (distgrad.signals.adam): the median
    # over the last `window` of the global update RMS sqrt(mean(g^2 / v_hat)) above rms, or of
    # the fraction of elements with g^2 > spike_threshold * v_hat above fraction, for `for`, once
    # the optimizer has taken min_step steps (before, v_hat rests on a handful of samples and the
    # ratio is routinely far above 1). The median ignores the isolated outliers healthy language
    # models show (a rare token's embedding row after a long absence: one sample at 10-1000);
    # healthy runs sit at a median of ~1 and ~1e-4 (docs/signals.md, "Alert").
    "DistgradAdamUpdateExcursion": {"severity": "warning", "for": "5m", "window": "10m", "rms": 2.0,
                                    "fraction": 0.01, "min_step": 100, "incident": "divergence"},
    # the maximum pre-softmax attention logit of some layer (logits.attention: true, opt-in;
    # distgrad.signals.logits) above `threshold` on `for` of sampled steps: the logit growth that
    # precedes attention-entropy collapse and loss spikes. 100 is Kimi K2's QK-Clip bound
    # (arXiv 2507.20534); healthy small models stay near 10 (docs/signals.md, "Logit precursors").
    # A ticket: a precursor, seen before the loss moves (the loss alerts page if it diverges).
    "DistgradAttentionLogitHigh": {"severity": "warning", "for": "1m", "threshold": 100},
    # the update the optimizer applies moves the weights by more than `threshold` of their norm per
    # step (update_geometry.enabled, opt-in; distgrad.signals.update): the median over `window` of
    # the overall ||dW|| / ||W|| above `threshold` for `for`, once the optimizer has taken min_step
    # steps. A normalised-update optimizer (AdamW, Muon, Lion) with decoupled weight decay settles
    # at ||dW|| / ||W|| ~ sqrt(2 lr wd) (Kosson et al. 2023, "Rotational equilibrium", arXiv
    # 2305.17212): 0.014 at lr 1e-3, wd 0.1; 0.063 at Muon's lr 0.02 (measured 0.06 on a small
    # Muon model, docs/signals.md). 0.2 (the weights replaced within ~25 steps) is far above both.
    # A ticket: a learning rate or schedule that is too large, seen before the loss moves.
    "DistgradUpdateRatioHigh": {"severity": "warning", "for": "5m", "window": "10m", "threshold": 0.2,
                                "min_step": 100},
    # the fraction of all gradient elements lost to underflow (non-zero in a float32 recomputation
    # of a sampled micro-batch, exactly zero in the training precision; underflow.enabled, opt-in,
    # distgrad.signals.underflow) above `threshold` for `for`. Measured: fp16 autocast without loss
    # scaling on the test decoder 0.67-0.69 (its decoder layers 0.84-0.85); ZeRO-2 fp16 with its loss scale
    # 2e-5..5e-5; bf16 autocast on the same decoder 0 (docs/signals.md, "Lost to underflow"). Held between
    # recomputations: `for` spans more than one scrape of the same measurement.
    # A ticket: the run trains on a gradient with holes, it does not diverge at once.
    "DistgradGradientsLostToUnderflow": {"severity": "warning", "for": "10m", "threshold": 0.05},
    # FP8 scaling health (fp8.enabled: true, opt-in; distgrad.signals.fp8), per layer and tensor
    # (input, weight, grad_output) of torchao float8 linears, one alert each (labels layer, tensor).
    # An amax of 0: the scale is fp8_max/eps (torchao) or infinite (TransformerEngine) and the
    # layer's matmul turns into NaN or garbage (pytorch/ao #3356): page on the sampled step.
    "DistgradFp8AmaxZero": {"severity": "critical", "for": "0s"},
    # a NaN scale (a NaN amax), an infinite one (TransformerEngine PR #786) or 0 (an infinite
    # amax): the cast produces NaN / zeros from now on: page on the sampled step.
    "DistgradFp8ScaleInvalid": {"severity": "critical", "for": "0s"},
    # a scale fallen below `ratio` of its own maximum over `window`: the tensor's amax jumped
    # (100x at the default), its small elements now underflow; a ticket (healthy training moves
    # amax by a few x over hours, docs/runbook.md).
    "DistgradFp8ScaleCollapse": {"severity": "warning", "for": "0s", "ratio": 1e-2, "window": "30m"},
    # more than `threshold` of a tensor's elements clipped by the float8 cast beyond its rounding
    # error (0 under dynamic scaling of a finite tensor; delayed or static scales): activations
    # or gradients are being cut: page when it holds for `for`.
    "DistgradFp8Saturation": {"severity": "critical", "for": "1m", "threshold": 1e-3},
    # MoE router health (router.enabled: true, opt-in; distgrad.signals.router). Collapse: in some
    # MoE layer the busiest expert got more than `threshold` times the mean tokens per expert
    # (E/k when every token goes to the same k experts) on every sampled step for `for`: the layer
    # trains as a dense one and does not recover by itself (critical: act now). Healthy routers
    # stay below 2 (docs/signals.md, "MoE router health"); a layer with E/k <= threshold can only
    # show collapse as dead experts.
    "DistgradRouterCollapse": {"severity": "critical", "for": "5m", "threshold": 3.0},
    # experts that got no token on each of the last router.dead_after sampled steps (the step
    # count is the "for"), per MoE layer (distgrad_router_layer_dead_experts): capacity the model
    # pays for and does not use (a ticket naming the layers and how many experts each lost)
    "DistgradRouterDeadExperts": {"severity": "warning", "for": "0s"},
}

#: Alertmanager routing and inhibition; ``python grafana/build.py`` renders configs/alertmanager.yml
#: from it (:mod:`grafana.routing`). Notifications are grouped per run (``group_by``: one
#: notification per incident of a run, however many of its alerts fire). Each severity goes to
#: its receiver (a webhook; ``launch/monitoring_stack.sh --pager-url/--ticket-url`` replaces the
#: URLs, its echo receiver serves the defaults); an alert of any other severity reaches no one
#: (``distgrad-annotations``: it is a dashboard annotation, not a notification).
ROUTING: dict[str, Any] = {
    "group_by": ["job", "instance", "run"],
    "routes": {
        # a person must act now
        "distgrad-pager": {"severity": "critical", "url": "http://127.0.0.1:9095/pager",
                           "group_wait": "10s", "group_interval": "1m", "repeat_interval": "1h"},
        # a ticket for working hours
        "distgrad-ticket": {"severity": "warning", "url": "http://127.0.0.1:9095/ticket",
                            "group_wait": "1m", "group_interval": "5m", "repeat_interval": "12h"},
    },
    "default_receiver": "distgrad-annotations",
}

#: Alertmanager inhibitions between the alerts of one incident, each for alerts with the same
#: ``equal`` labels (one run): while an alert matching ``source`` fires, the alerts matching
#: ``target`` are not sent. ``source`` / ``target``: ``{"alertname": [names]}`` or
#: ``{"severity": value}`` or ``{"incident": value}``, where ``{"incident": "divergence"}``
#: means every alert of :data:`ALERTS` whose entry has ``"incident": "divergence"`` (spike and
#: divergence alerts: a NaN explains them). Alert names must be in :data:`ALERTS`.
INHIBITIONS: list[dict[str, Any]] = [
    # a NaN/Inf in the gradients or the loss silences the spike/divergence alerts of that run
    {"source": {"alertname": ["DistgradNonFiniteGradients", "DistgradNaNLoss"]},
     "target": {"incident": "divergence"}, "equal": ["job", "instance", "run"]},
    # a dead exporter silences "stalled" of that run
    {"source": {"alertname": ["DistgradExporterDown"]},
     "target": {"alertname": ["DistgradTrainingStalled"]}, "equal": ["job", "instance", "run"]},
    # a page silences the tickets of the same run
    {"source": {"severity": "critical"}, "target": {"severity": "warning"}, "equal": ["job", "instance", "run"]},
]

#: Dashboard settings shared by every dashboard.
DASHBOARDS: dict[str, Any] = {
    "uid_prefix": "distgrad",
    "tags": ["distgrad"],
    "refresh": "10s",
    "time_from": "now-1h",
    "topk": 10,
    # stat/threshold colours: headroom ratio (abs max / dtype max) that turns orange, red
    "headroom_warn": 0.5,
    "headroom_crit": 0.9,
}

#: Grafana version the dashboards target; it is also the version of grafana-foundation-sdk
#: that builds them (pyproject.toml pins ``grafana-foundation-sdk==<build>!11.6.0``), whose
#: dashboard model writes schemaVersion 41. Later Grafana versions migrate it on import.
GRAFANA_VERSION = "11.6"
