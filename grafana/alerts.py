"""distgrad's Prometheus alert rules, built from :mod:`grafana.config`.

:func:`alert_rules` assembles the rule groups; one transform, :func:`with_runbook_links`, then
gives every rule its ``runbook_url`` annotation (``config.RUNBOOK_URL#<alertname in lower
case>``, a section of docs/runbook.md), so no rule can lack one. :func:`render_rules` is the
YAML that ``python grafana/build.py`` writes to ``grafana/alerts/distgrad.rules.yml`` (checked
by ``promtool check rules``; unit-tested by ``grafana/alerts/tests/*.yml``).

Annotation texts name the alert's target and pull context (the step where a non-finite streak
started, its culprit rank and module, the last sampled step, ...) with Prometheus' ``query``
template function.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml

from grafana import config


def sel(extra: str = "") -> str:
    """``{<selector>[,extra]}`` for a metric in an alert expression."""
    inner = config.SELECTOR + (f",{extra}" if extra else "")
    return "{" + inner + "}"


#: Who the alert is about, for annotation text: job, optional run label, instance.
WHO = "{{ $labels.job }}{{ with $labels.run }} run {{ . }}{{ end }} ({{ $labels.instance }})"


def tquery(promql_fmt: str) -> str:
    """Go-template pipeline running ``promql_fmt`` (with ``%q`` placeholders for the job and
    instance label values of the alert) through Prometheus' ``query`` template function."""
    return f'printf "{promql_fmt}" $labels.job $labels.instance | query'


def _held(promql_fmt: str, held: str) -> str:
    """``promql_fmt`` with every ``distgrad_*{job=%q,instance=%q...}`` selector replaced by
    ``last_over_time(<selector>[held])``: the last value the target served within ``held``."""
    return re.sub(r"(distgrad_[a-z_]+\{job=%q,instance=%q[^}]*\})", rf"last_over_time(\1[{held}])", promql_fmt)


def tvalue(metric: str, fmt: str = "%.0f", missing: str = "unknown", held: str | None = None,
           extra: str = "") -> str:
    """Template text: the value of ``metric`` of the alert's target, or ``missing``. With
    ``held`` (a range such as ``5m``), a target that stopped serving ``metric`` (rank 0 killed
    while the alert still fires) is described by the last value it served within ``held``.
    ``extra``: more matchers of the selector (``,name=\\"value\\"``, escaped for ``printf``)."""
    def one(q: str, otherwise: str) -> str:
        return (f'{{{{ with {tquery(q)} }}}}{{{{ . | first | value | printf "{fmt}" }}}}'
                f"{{{{ else }}}}{otherwise}{{{{ end }}}}")
    q = metric + "{job=%q,instance=%q" + extra + "}"
    return one(q, one(_held(q, held), missing) if held else missing)


def tlist(promql_fmt: str, item: str, sort_label: str, otherwise: str, held: str | None = None) -> str:
    """Template text: comma-separated ``item`` (a template over ``$s``) for every sample of
    the query, sorted by ``sort_label``; ``otherwise`` when the query returns nothing. With
    ``held``, an empty query is retried over the last ``held`` of the target's series
    (:func:`_held`) before ``otherwise``, so a notification re-sent after the target died still
    names what it named while the target was up."""
    def one(q: str, otherwise: str) -> str:
        return (
            f"{{{{ with {tquery(q)} }}}}"
            f'{{{{ range $i, $s := . | sortByLabel "{sort_label}" }}}}{{{{ if $i }}}}, {{{{ end }}}}{item}{{{{ end }}}}'
            f"{{{{ else }}}}{otherwise}{{{{ end }}}}"
        )
    return one(promql_fmt, one(_held(promql_fmt, held), otherwise) if held else otherwise)


#: The run an alert is about, for the one-line summary a pager shows: the job, and the run label
#: where the target has one (every self-registered run shares the job ``distgrad-file-sd``).
JOB_RUN = "{{ $labels.job }}{{ with $labels.run }} run {{ . }}{{ end }}"


def rose(metric: str, window: str) -> str:
    """PromQL: the counter ``metric`` (a selector) rose within ``window``, or its series is younger
    than ``window`` and already above 0. ``increase()`` alone misses an event made before the
    series' first scrape (a run that goes NaN or diverges in its first seconds, before Prometheus
    has read its self-registered target): its first sample is already 1, so nothing increases."""
    return f"(increase({metric}[{window}]) > 0 or ({metric} > 0 unless {metric} offset {window}))"


def _rule(name: str, expr: str, summary: str, description: str) -> dict[str, Any]:
    """One alerting rule from :data:`grafana.config.ALERTS` ``[name]``; the summary's
    ``{{ $labels.job }}`` becomes :data:`JOB_RUN`, so the pager's one line names the run."""
    c = config.ALERTS[name]
    summary = summary.replace("{{ $labels.job }}", JOB_RUN)
    return {
        "alert": name,
        "expr": expr,
        "for": c["for"],
        "labels": {"severity": c["severity"]},
        "annotations": {"summary": summary, "description": description},
    }


def _rerun_rule() -> dict[str, Any]:
    """DistgradRerunFaultyNode: the opt-in rerun attribution (distgrad.diagnostics.rerun) blamed
    the hardware of one rank: a ``device`` verdict (persistent) or a ``transient`` one."""
    w = config.ALERTS["DistgradRerunFaultyNode"]["window"]
    host = tlist("distgrad_rerun_quarantine_host_info{job=%q,instance=%q}", "{{ $s.Labels.host }}", "host",
                 "unknown", held=w)
    what = ('{{ if eq $labels.verdict "device" }}reproduced on the culprit rank but not on another rank given '
            "the same micro-batches and weights: a persistent fault of that rank's device"
            "{{ else }}did not reproduce on a rerun from the same weights and inputs: a transient fault (a bit "
            "flip, a bad kernel launch); the node is suspect{{ end }}")
    return _rule(
        "DistgradRerunFaultyNode",
        rose("distgrad_rerun_verdicts_total" + sel('verdict=~"device|transient"'), w),
        "A rerun blames one rank's hardware in {{ $labels.job }} ({{ $labels.verdict }} fault).",
        f"{WHO}: distgrad re-executed the forward and backward of the non-finite or replica-mismatched step "
        f"{tvalue('distgrad_rerun_step', held=w)} for the culprit rank's micro-batches; the fault {what}. "
        f"Quarantine global rank {tvalue('distgrad_rerun_quarantine_rank', held=w)} on host {host}: resume "
        "from the last good checkpoint without that node. The record's rerun part (and the flight-recorder "
        "report) holds both ranks' rerun fingerprints.",
    )


def _nonfinite_rule() -> dict[str, Any]:
    c = config.ALERTS["DistgradNonFiniteGradients"]
    w = c["window"]
    # fp16 overflow steps the loss scaler skips are not in distgrad_nonfinite_steps_total (they
    # count in distgrad_overflow_steps_total; persistent fp16 trouble pages through
    # DistgradRepeatedOverflow and DistgradLossScaleCollapsed), so nothing is subtracted here.
    expr = rose(f"distgrad_nonfinite_steps_total{sel()}", w)
    note = "; fp16 overflow steps, which the loss scaler skips, do not count"
    params = tlist(
        "topk(5, distgrad_nonfinite_params{job=%q,instance=%q} > 0)",
        '{{ $s.Labels.param }} (rank {{ $s.Labels.rank }}: {{ $s.Value | printf "%.0f" }} elements)',
        "param",
        tlist(
            "topk(5, distgrad_param_grad_nonfinite{job=%q,instance=%q} > 0)",
            '{{ $s.Labels.param }} ({{ $s.Labels.kind }}: {{ $s.Value | printf "%.0f" }} elements)',
            "param",
            tlist(
                "topk(5, distgrad_layer_grad_nonfinite{job=%q,instance=%q} > 0)",
                'layer {{ $s.Labels.layer }} ({{ $s.Value | printf "%.0f" }} elements)',
                "layer",
                "not exported",
                held=w,
            ),
            held=w,
        ),
        held=w,
    )
    culprits, module = _culprit_texts(held=w)
    origin = tvalue("distgrad_nonfinite_origin_step", held=w)
    return _rule(
        "DistgradNonFiniteGradients",
        expr,
        f"NaN/Inf gradients in {{{{ $labels.job }}}} from step {origin}.",
        f"{WHO} has NaN/Inf gradients since sampled optimizer step {origin}, where the streak started "
        f"(last sampled step: {tvalue('distgrad_optimizer_step', held=w)}; alerting on the last {w}{note}). "
        f"{_where_it_started(culprits, module)} "
        f"Non-finite parameters (by rank shard of the reduced gradient: where the NaN landed): {params}.",
    )


def _culprit_texts(held: str | None = None) -> tuple[str, str]:
    """Template texts of the culprit rank(s) and the culprit module of the last non-finite
    event (its first step), each with what to say when there is none; ``held``: as in
    :func:`tlist` (the alert's window, for an alert that outlives its target)."""
    culprits = tlist(
        "sum by (rank) (distgrad_nonfinite_culprit{job=%q,instance=%q})",
        "{{ $s.Labels.rank }}",
        "rank",
        "none seen (no rank had a non-finite loss or gradient of its own before the reduction)",
        held=held,
    )
    # the forward replay of the event's first step (distgrad.diagnostics.replay): the module, else why none
    module = tlist(
        "distgrad_nonfinite_culprit_module{job=%q,instance=%q}",
        "{{ $s.Labels.module }} (rank {{ $s.Labels.rank }})",
        "module",
        tlist(
            "distgrad_nonfinite_replay_outcome{job=%q,instance=%q}",
            "unknown ({{ $s.Labels.outcome }})",
            "outcome",
            "unknown (not replayed)",
            held=held,
        ),
        held=held,
    )
    return culprits, module


def _if_gradients_nonfinite(then: str, finite: str, unknown: str) -> str:
    """Template text: ``then`` when the grad norm of the alert's target at its last sampled step
    is NaN/Inf (so the non-finite event views, which describe the *last* event, are about this
    one), ``finite`` when it is finite, ``unknown`` when no grad norm is served."""
    nonfinite = ('printf "(distgrad_grad_norm{job=%[1]q,instance=%[2]q} != distgrad_grad_norm{job=%[1]q,instance=%[2]q})'
                 ' or abs(distgrad_grad_norm{job=%[1]q,instance=%[2]q}) == Inf" $labels.job $labels.instance | query')
    served = tquery("distgrad_grad_norm{job=%q,instance=%q}")
    return (f"{{{{ if {nonfinite} }}}}{then}{{{{ else if {served} }}}}{finite}{{{{ else }}}}{unknown}"
            "{{ end }}")


def _where_it_started(culprits: str, module: str) -> str:
    """The page's one answer to "where did the NaN start" (besides the origin step): the culprit
    rank(s) and the forward replay's culprit module; never the parameter last in forward order."""
    return (f"Culprit rank(s), whose own loss or gradient was non-finite before the reduction: {culprits}. "
            f"Culprit module, whose forward output first went NaN/Inf when that step was replayed: {module}.")


def tincident(metric: str, incident: str, fmt: str = "%.0f", missing: str = "unknown",
              held: str | None = None) -> str:
    """Template text: the value of ``metric{incident="<incident>"}`` of the alert's target (the
    detection policy's last incident of that kind), or ``missing``; ``held`` as in :func:`tvalue`."""
    return tvalue(metric, fmt, missing, held, extra=',incident=\\"' + incident + '\\"')


def _component(incident: str, held: str | None = None) -> str:
    """Template text naming the loss component of the last incident of ``incident``, if any;
    ``held`` as in :func:`tlist`."""
    return tlist("distgrad_incident_component{job=%q,instance=%q,incident=" + f'\\"{incident}\\"' + "}",
                 " Loss component whose weighted contribution (weight x value) rose the most: "
                 "{{ $s.Labels.component }}.", "component", "", held=held)


def _incident_rule(name: str, incident: str, summary: str, what: str) -> dict[str, Any]:
    """A thin rule on the detection policy's counter ``distgrad_incidents_total{incident}``
    (:mod:`distgrad.diagnostics.incidents` decides; ``for: 0s``): fires from the scrape that
    saw the incident open until ``window`` after."""
    w = config.ALERTS[name]["window"]
    return _rule(
        name,
        rose(f"distgrad_incidents_total{sel(f'incident={chr(34)}{incident}{chr(34)}')}", w),
        summary,
        f"{WHO}: {what}{_component(incident, w)} Last sampled step: {tvalue('distgrad_optimizer_step', held=w)}; "
        f"{tincident('distgrad_incidents_total', incident, held=w)} such incident(s) since the start.",
    )


def runbook_url(alert: str, base: str | None = None) -> str:
    """The runbook section of ``alert``: docs/runbook.md's ``## <alert>`` heading, under
    ``base`` (default ``config.RUNBOOK_URL``; a trailing ``#`` or ``/`` is not doubled)."""
    base = (config.RUNBOOK_URL if base is None else base).rstrip("#")
    return f"{base}#{alert.lower()}"


def with_runbook_links(rules: dict[str, Any], base: str | None = None) -> dict[str, Any]:
    """A copy of the rule file ``rules`` in which every alerting rule has a ``runbook_url``
    annotation (:func:`runbook_url` of its name under ``base``, default ``config.RUNBOOK_URL``).
    Raises ``ValueError`` if a rule already sets one: links come from this transform only."""
    out = copy.deepcopy(rules)
    for group in out["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            ann = rule.setdefault("annotations", {})
            if "runbook_url" in ann:
                raise ValueError(f"{rule['alert']}: runbook_url is added by with_runbook_links, not by the rule")
            ann["runbook_url"] = runbook_url(rule["alert"], base)
    return out


def alert_rules(runbook_base: str | None = None) -> dict[str, Any]:
    """The rule file as a dict (``groups`` of ``rules``), runbook links (under
    ``runbook_base``, default ``config.RUNBOOK_URL``) included."""
    return with_runbook_links(_groups(), runbook_base)


def _groups() -> dict[str, Any]:
    """The rule groups as written, before :func:`with_runbook_links`."""
    a = config.ALERTS
    # the incident alerts fire for their window: their texts keep the incident's values that long
    held_div, held_bad, held_burst = (a[n]["window"] for n in ("DistgradLossDivergence", "DistgradBadBatch",
                                                                "DistgradRecurringSpikes"))
    overflow_n = a["DistgradRepeatedOverflow"]["threshold"]
    stall_s = a["DistgradTrainingStalled"]["threshold_seconds"]
    refused_w = a["DistgradRefusedSteps"]["window"]
    # the running total of the alert's own reason (tvalue() selects by job and instance only)
    refused_n = ('{{ with printf "distgrad_refused_steps_total{job=%q,instance=%q,reason=%q}" $labels.job '
                 '$labels.instance $labels.reason | query }}{{ . | first | value | printf "%.0f" }}'
                 "{{ else }}unknown{{ end }}")
    # the NaN loss's event (origin step, culprit rank and module) when that step's gradients are
    # non-finite too; the event views describe the last event, which may be an older one otherwise
    nan_loss_event = _if_gradients_nonfinite(
        f"Its non-finite gradients started at step {tvalue('distgrad_nonfinite_origin_step')}. "
        + _where_it_started(*_culprit_texts()),
        "The gradients of that step are finite: no non-finite gradient event to name (a loss observed but "
        "not backpropagated, or a NaN in the loss value only).",
        "Whether its gradients are non-finite is unknown (no grad norm served).")
    gradients = [
        _nonfinite_rule(),
        _rule(
            "DistgradNaNLoss",
            f"distgrad_loss{sel()} != distgrad_loss{sel()}\n"
            f"or distgrad_loss{sel()} == Inf\nor distgrad_loss{sel()} == -Inf\n",
            "Non-finite training loss in {{ $labels.job }}.",
            f"{WHO} reports a training loss of {{{{ $value }}}} at sampled step "
            f"{tvalue('distgrad_optimizer_step')}. {nan_loss_event}",
        ),
        _incident_rule(
            "DistgradLossDivergence", "divergence", "The training loss of {{ $labels.job }} diverged.",
            f"the loss rose at step {tincident('distgrad_incident_step', 'divergence', held=held_div)} to "
            f"{tincident('distgrad_incident_value', 'divergence', '%.4g', held=held_div)} "
            "and did not come back: it stayed well above its level before that step for several sampled "
            "steps, or its running median kept climbing (thresholds: the incidents config section).",
        ),
        _incident_rule(
            "DistgradBadBatch", "bad_batch", "A bad batch on one rank of {{ $labels.job }}.",
            f"the batch of rank {tincident('distgrad_incident_rank', 'bad_batch', held=held_bad)} at step "
            f"{tincident('distgrad_incident_step', 'bad_batch', held=held_bad)} made its loss "
            f"{tincident('distgrad_incident_value', 'bad_batch', '%.4g', held=held_bad)}, "
            "a robust outlier against the other "
            "ranks' losses, and moved the step's gradient norm: inspect that rank's data at that step.",
        ),
        _incident_rule(
            "DistgradRecurringSpikes", "spike_burst", "Loss or gradient-norm spikes keep recurring in {{ $labels.job }}.",
            f"the loss or gradient norm spiked again and again within a short window of sampled steps "
            f"(thresholds: the incidents config section), the last spike at step "
            f"{tincident('distgrad_incident_step', 'spike_burst', held=held_burst)} (value "
            f"{tincident('distgrad_incident_value', 'spike_burst', '%.4g', held=held_burst)}); "
            "each recovered, but the run is "
            "unstable (learning rate, warm-up, clipping, data).",
        ),
        _rule(
            "DistgradReplicaMismatch",
            rose(f"distgrad_replica_mismatch_total{sel()}", a["DistgradReplicaMismatch"]["window"]),
            "Replicated gradients differ across ranks in {{ $labels.job }}.",
            f"{WHO}: replicated gradients disagreed across ranks on sampled steps in the last "
            f"{a['DistgradReplicaMismatch']['window']}; the last disagreeing rank was "
            f"{tvalue('distgrad_replica_mismatch_rank')}.",
        ),
        _rule(
            "DistgradReplicaWeightsDiverged",
            f"distgrad_replica_weights_mismatch_params{sel()} > 0",
            "Weights differ across data-parallel replicas in {{ $labels.job }}.",
            f"{WHO}: the replica weight hash at optimizer step {tvalue('distgrad_replica_weights_hash_step')} "
            "found {{ $value }} parameter(s) whose weights differ across data-parallel replicas (a silent data "
            "corruption: the replicas now train different models); the rank outside its replica group's "
            f"majority: {tvalue('distgrad_replica_weights_mismatch_rank')} (with two replicas there is no majority: "
            "the higher rank is named). The "
            "parameters are named in the JSONL record's replica_weights and the flight-recorder report.",
        ),
        _rule(
            "DistgradDuplicateData",
            f"distgrad_duplicate_data_ranks{sel()} > 0",
            "Data-parallel ranks train on the same data in {{ $labels.job }}.",
            f"{WHO}: {{{{ $value }}}} data-parallel ranks had bit-identical losses on consecutive sampled steps "
            f"(last sampled step {tvalue('distgrad_optimizer_step')}): their data loader does not shard by rank "
            "(or a sampler misses set_epoch). The ranks are named in the log and the JSONL record's duplicate_data.",
        ),
        _rerun_rule(),
    ]
    fp16 = [
        _rule(
            "DistgradLossScaleCollapsed",
            # at_minimum needs a configured floor (DeepSpeed); collapsed needs none (torch GradScaler)
            f"distgrad_loss_scale_at_minimum{sel()} == 1\nor distgrad_loss_scale_collapsed{sel()} == 1\n",
            "fp16 loss scale collapsed in {{ $labels.job }}.",
            f"The dynamic loss scale of {WHO} has collapsed for {a['DistgradLossScaleCollapsed']['for']} "
            f"(now {tvalue('distgrad_loss_scale', '%g')}, {tvalue('distgrad_loss_scale_drop_factor', '%.0f')} "
            "times below the scale training last worked at, or at the scaler's configured minimum); "
            "overflowing steps can no longer be rescued by lowering it.",
        ),
        _rule(
            "DistgradRepeatedOverflow",
            f"distgrad_consecutive_overflow_steps{sel()} >= {overflow_n}",
            "Repeated fp16 overflows in {{ $labels.job }}.",
            f"{WHO} has overflowed on {{{{ $value }}}} consecutive fp16 steps (threshold {overflow_n}); "
            f"loss scale now {tvalue('distgrad_loss_scale', '%g')}.",
        ),
    ]
    training = [
        _rule(
            "DistgradTrainingStalled",
            f"(time() - distgrad_last_step_timestamp_seconds{sel()} > {stall_s})\n"
            f"and distgrad_last_step_timestamp_seconds{sel()} > 0\n"
            f"and on (job, instance, run) distgrad_run_state{sel()} == 1\n",
            "Training stalled in {{ $labels.job }}.",
            f"{WHO} has not sampled an optimizer step for {{{{ $value | humanizeDuration }}}} "
            f"(threshold {stall_s}s); the last sampled step was {tvalue('distgrad_optimizer_step')}.",
        ),
        _rule(
            "DistgradInternalErrors",
            f"increase(distgrad_internal_errors_total{sel()}[{a['DistgradInternalErrors']['window']}]) > 0",
            "distgrad internal errors in {{ $labels.job }}.",
            f"distgrad itself failed in {WHO} in the last {a['DistgradInternalErrors']['window']} "
            f"({tvalue('distgrad_internal_errors_total')} failures since start); training "
            "continued, but some metrics may be missing or stale.",
        ),
        _rule(
            "DistgradRefusedSteps",
            f"increase(distgrad_refused_steps_total{sel()}[{refused_w}]) > 0",
            "distgrad refuses to export steps of {{ $labels.job }}.",
            f"{WHO} did not export sampled optimizer steps in the last {refused_w}: the gradients "
            "distgrad read could not be the step's reduced, pre-clip gradient (reason "
            f"{{{{ $labels.reason }}}}; {refused_n} such steps since start). The refusing rank's log "
            "names the fix once; the runbook lists it per reason.",
        ),
    ]
    strag = a["DistgradStragglingRank"]["threshold"]
    training += [
        _rule(
            "DistgradStragglingRank",
            f"distgrad_straggler_ratio{sel()} > {strag}",
            "A rank is holding back {{ $labels.job }}.",
            f"In {WHO} every rank has been waiting for one: the sampled steps take {{{{ $value | printf \"%.2f\" }}}} "
            f"times what they would at the median rank's data time (threshold {strag}, for "
            f"{a['DistgradStragglingRank']['for']}). Straggler at the last sampled step: rank "
            f"{tvalue('distgrad_straggler_rank')}; step time {tvalue('distgrad_step_time_seconds', '%.3g')} s.",
        ),
        _rule(
            "DistgradLossPlateau",
            f"distgrad_loss_plateau{sel()} == 1",
            "The training loss of {{ $labels.job }} has plateaued.",
            f"The loss of {WHO} has not moved distinguishably from flat for {a['DistgradLossPlateau']['for']}: "
            f"slope {tvalue('distgrad_loss_trend_slope', '%.3g')} +- {tvalue('distgrad_loss_trend_stderr', '%.2g')} "
            f"per 1000 steps over the trend window; loss {tvalue('distgrad_loss', '%.4g')} at step "
            f"{tvalue('distgrad_optimizer_step')}.",
        ),
    ]
    skip_w = a["DistgradUpdatesSkipped"]["window"]
    skip_n = ('{{ with printf "distgrad_action_skipped_steps_total{job=%q,instance=%q,cause=%q}" $labels.job '
              '$labels.instance $labels.cause | query }}{{ . | first | value | printf "%.0f" }}'
              "{{ else }}unknown{{ end }}")
    action = [
        _rule(
            "DistgradUpdatesSkipped",
            f"increase(distgrad_action_skipped_steps_total{sel()}[{skip_w}]) > 0",
            "distgrad skipped optimizer updates of {{ $labels.job }} ({{ $labels.cause }}).",
            f"distgrad's opt-in action skipped the optimizer update of {WHO} on every rank in the last {skip_w} "
            f"(cause {{{{ $labels.cause }}}}; {skip_n} such steps since start; last sampled step "
            f"{tvalue('distgrad_optimizer_step')}). Skipping hides the cause: find it (the non-finite and spike "
            "alerts, the rank logs, the skipped steps' sample indices in action.samples_dir).",
        ),
        _rule(
            "DistgradStopRequested",
            f"distgrad_action_stop_requested{sel()} == 1",
            "distgrad stopped the training of {{ $labels.job }}.",
            f"distgrad's opt-in action requested a stop of {WHO} (action: stop) after skipping the offending "
            f"update; last sampled step {tvalue('distgrad_optimizer_step')}. The on_stop callbacks ran on every "
            "rank; the run ends or has ended.",
        ),
    ]
    adam = a["DistgradAdamUpdateExcursion"]
    training += [
        _rule(
            "DistgradAdamUpdateExcursion",
            f"(\n  quantile_over_time(0.5, distgrad_update_rms{sel()}[{adam['window']}]) > {adam['rms']}\n"
            f"  or quantile_over_time(0.5, distgrad_adam_spike_fraction{sel()}[{adam['window']}]) > "
            f"{adam['fraction']}\n)\nand on (job, instance) distgrad_optimizer_step{sel()} >= {adam['min_step']}\n",
            "Adam's second moment no longer tracks the gradient in {{ $labels.job }}.",
            f"For {adam['for']}, the gradients of {WHO} have outgrown what Adam's second moment expects "
            f"(median over {adam['window']} of the update RMS above {adam['rms']}, ~1 when healthy, or of the "
            f"fraction of elements with g^2 > theta * v_hat above {adam['fraction']}, counted on steps the clip "
            f"does not scale). Now: update RMS "
            f"{tvalue('distgrad_update_rms', '%.3g')}, spike fraction {tvalue('distgrad_adam_spike_fraction', '%.3g')} "
            f"at sampled step {tvalue('distgrad_optimizer_step')}. Loss spikes tend to follow within a few steps.",
        ),
    ]
    att = a["DistgradAttentionLogitHigh"]
    training += [
        _rule(
            "DistgradAttentionLogitHigh",
            f"max by (job, instance, run) (distgrad_layer_attention_logit_max{sel()}) > {att['threshold']}\n",
            "Attention logits of {{ $labels.job }} grow past " + f"{att['threshold']}.",
            f"For {att['for']}, the maximum pre-softmax attention logit q.k/sqrt(d) of {WHO} has been above "
            f"{att['threshold']} (Kimi K2's QK-Clip bound): now {{{{ $value | printf \"%.1f\" }}}} at sampled step "
            f"{tvalue('distgrad_optimizer_step')}, in layer(s) "
            + tlist(f"topk(3, distgrad_layer_attention_logit_max{{job=%q,instance=%q}} > {att['threshold']})",
                    '{{ $s.Labels.layer }} ({{ $s.Value | printf "%.1f" }})', "layer", "unknown")
            + ". Growing attention logits precede attention-entropy collapse and loss spikes: lower the "
            "learning rate of the attention projections, add QK-norm or QK-clip (docs/runbook.md).",
        ),
    ]
    upd = a["DistgradUpdateRatioHigh"]
    training += [
        _rule(
            "DistgradUpdateRatioHigh",
            f"quantile_over_time(0.5, distgrad_applied_update_ratio{sel()}[{upd['window']}]) > {upd['threshold']}\n"
            f"and on (job, instance, run) distgrad_optimizer_step{sel()} >= {upd['min_step']}\n",
            "The optimizer's updates of {{ $labels.job }} are large against the weights.",
            f"For {upd['for']}, the median over {upd['window']} of the update/weight ratio ||dW|| / ||W|| of {WHO} "
            f"(the update the optimizer applied, any optimizer) has been above {upd['threshold']} (healthy: 1e-3 "
            f"to a few 1e-2): now {{{{ $value | printf \"%.3g\" }}}}, update RMS "
            f"{tvalue('distgrad_applied_update_rms', '%.3g')} at sampled step {tvalue('distgrad_optimizer_step')}; "
            "largest layers "
            + tlist("topk(3, distgrad_layer_applied_update_ratio{job=%q,instance=%q})",
                    '{{ $s.Labels.layer }} ({{ $s.Value | printf "%.3g" }})', "layer", "unknown")
            + ". A learning rate (or its schedule) too large for the weights' scale: lower it or check the "
            "warm-up (docs/runbook.md).",
        ),
    ]
    uf = a["DistgradGradientsLostToUnderflow"]
    training += [
        _rule(
            "DistgradGradientsLostToUnderflow",
            f"max by (job, instance, run) (distgrad_grad_lost_to_underflow_ratio{sel()}) > {uf['threshold']}\n",
            "Gradients of {{ $labels.job }} are lost to underflow.",
            f"For {uf['for']}, more than {uf['threshold']:.0%} of the gradient elements of {WHO} were lost to "
            "underflow (non-zero in a float32 recomputation of a sampled micro-batch, exactly zero in the training "
            "precision): now {{ $value | humanizePercentage }} at the recomputation of sampled step "
            + tvalue("distgrad_underflow_measured_step") + ", most in layer(s) "
            + tlist(f"topk(3, distgrad_layer_grad_lost_to_underflow_ratio{{job=%q,instance=%q}} > 0)",
                    '{{ $s.Labels.layer }} ({{ $s.Value | humanizePercentage }})', "layer", "unknown")
            + ". Those layers train on a gradient with holes: use dynamic loss scaling or raise the loss scale, or "
            "train in bf16 (docs/runbook.md).",
        ),
    ]
    # per (layer, tensor) where a layer-labelled series exists (the amax, the saturation per layer),
    # per tensor over all float8 layers otherwise (the series budget); the record names the module
    f8, f8t = "by (job, instance, run, layer, tensor) ", "by (job, instance, run, tensor) "
    col, sat = a["DistgradFp8ScaleCollapse"], a["DistgradFp8Saturation"]
    step = tvalue("distgrad_optimizer_step")
    training += [
        _rule(
            "DistgradFp8AmaxZero",
            f"min {f8}(distgrad_fp8_amax_min{sel()}) == 0\n",
            "FP8 amax of 0 in layer {{ $labels.layer }} ({{ $labels.tensor }}) of {{ $labels.job }}.",
            f"At sampled step {step} of {WHO}, the float8 {{{{ $labels.tensor }}}} of layer {{{{ $labels.layer }}}} "
            "was all zeros on some micro-batch (amax 0): its float8 scale is fp8_max/eps or infinite and the "
            "layer's output turns into NaN or garbage (pytorch/ao #3356). Find why the tensor is zero (a dead "
            "layer, an empty or masked batch) before NaNs spread; the record's fp8 part names the module "
            "(docs/runbook.md).",
        ),
        _rule(
            "DistgradFp8ScaleInvalid",
            f"(min {f8t}(distgrad_fp8_scale_min{sel()}) == 0)\n"
            f"or (max {f8t}(distgrad_fp8_scale_max{sel()}) == +Inf)\n"
            f"or (count {f8t}(distgrad_fp8_scale_min{sel()} != distgrad_fp8_scale_min{sel()}))\n",
            "FP8 scale NaN, infinite or 0 for the {{ $labels.tensor }} of a float8 layer of {{ $labels.job }}.",
            f"At sampled step {step} of {WHO}, the float8 scale of the {{{{ $labels.tensor }}}} of some float8 "
            "layer was NaN (a NaN in the tensor), infinite (a tiny amax, TransformerEngine PR #786) or 0 (an "
            "infinite amax): the cast yields NaN or zeros. The record's fp8 part names the module; look for the "
            "first non-finite value (DistgradNonFiniteGradients, the flight recorder) and restart from the last "
            "good checkpoint (docs/runbook.md).",
        ),
        _rule(
            "DistgradFp8ScaleCollapse",
            f"min {f8t}(distgrad_fp8_scale_min{sel()})\n"
            f"  < {col['ratio']:g} * max {f8t}(max_over_time(distgrad_fp8_scale_min{sel()}[{col['window']}]))\n",
            "FP8 scale of the {{ $labels.tensor }} of {{ $labels.job }} collapsed.",
            f"At sampled step {step} of {WHO}, the smallest float8 scale of the {{{{ $labels.tensor }}}} over "
            f"the float8 layers fell below {col['ratio']:g} of its maximum over the last {col['window']}: now "
            "{{ $value | printf \"%.3g\" }}. Some layer's amax jumped (an outlier activation or gradient) and "
            "its small elements now underflow to zero; distgrad_fp8_amax_min and the record's fp8 part name "
            "the layer (docs/runbook.md).",
        ),
        _rule(
            "DistgradFp8Saturation",
            f"max by (job, instance, run, layer) (distgrad_fp8_layer_saturation_ratio{sel()}) > {sat['threshold']:g}\n",
            "FP8 saturation in layer {{ $labels.layer }} of {{ $labels.job }}.",
            f"For {sat['for']}, more than {sat['threshold']:g} of the elements of a float8 tensor of layer "
            f"{{{{ $labels.layer }}}} of {WHO} were clipped by the float8 cast (now "
            f"{{{{ $value | printf \"%.3g\" }}}} at sampled step {step}): its scale is stale for the "
            "tensor's range (a precomputed weight scale not refreshed: torchao's "
            "precompute_float8_dynamic_scale_for_fsdp belongs after every optimizer step; delayed or static "
            "scaling). The record's fp8 part names the module and tensor; fix the scale's source, restart "
            "from a checkpoint before the episode if the loss moved (docs/runbook.md).",
        ),
    ]
    col = a["DistgradRouterCollapse"]
    training += [
        _rule(
            "DistgradRouterCollapse",
            f"max by (job, instance, run) (distgrad_router_load_imbalance{sel()}) > {col['threshold']}\n",
            "The MoE router of {{ $labels.job }} collapsed onto few experts.",
            f"For {col['for']}, the busiest expert of some MoE layer of {WHO} has had more than {col['threshold']} "
            "times the mean tokens per expert (now {{ $value | printf \"%.2f\" }} at sampled step "
            f"{tvalue('distgrad_optimizer_step')}), in layer(s) "
            + tlist(f"topk(3, distgrad_router_load_imbalance{{job=%q,instance=%q}} > {col['threshold']})",
                    '{{ $s.Labels.moe_layer }} ({{ $s.Value | printf "%.2f" }})', "moe_layer", "unknown")
            + ". The layer trains as a dense one and does not recover by itself: check the load-balancing loss "
            "or bias update, the router's learning rate, and the tokens per expert in the JSONL record "
            "(router.tokens); restart from a checkpoint before the collapse (docs/runbook.md).",
        ),
        _rule(
            "DistgradRouterDeadExperts",
            f"sum by (job, instance, run) (distgrad_router_layer_dead_experts{sel()}) > 0\n",
            "Experts of {{ $labels.job }} receive no tokens.",
            f"{{{{ $value | printf \"%.0f\" }}}} expert(s) of {WHO} got no token on each of the last router.dead_after "
            f"sampled steps (sampled step {tvalue('distgrad_optimizer_step')}), in MoE layer(s) "
            + tlist("distgrad_router_layer_dead_experts{job=%q,instance=%q} > 0",
                    '{{ $s.Labels.layer }} ({{ $s.Value | printf "%.0f" }} dead)', "layer", "unknown")
            + ". Their parameters are trained by nothing; the expert indices are in the JSONL record "
            "(router.dead). Check the load balancing of the layer(s) named (docs/runbook.md).",
        ),
    ]
    down, gone = a["DistgradExporterDown"], a["DistgradExporterAbsent"]
    # the last state the target served within the window (stale markers are not samples)
    last_state = f"last_over_time(distgrad_run_state{sel()}[" + "{w}])"
    step_of = ('{{ with printf "last_over_time(distgrad_optimizer_step{job=%q,instance=%q}[' + "{w}" +
               '])" $labels.job $labels.instance | query }}{{ . | first | value | printf "%.0f" }}'
               "{{ else }}unknown{{ end }}")
    exporter = [
        _rule(
            "DistgradExporterDown",
            f"up{sel()} == 0\nand on (job, instance, run) {last_state.replace('{w}', down['window'])} == 1\n",
            "distgrad exporter of {{ $labels.job }} is down while the run was running.",
            f"Prometheus has failed to scrape {WHO} for {down['for']}, and the last state it served was "
            "running (distgrad_run_state 1), not finished: rank 0 was killed, crashed or is unreachable "
            f"(a clean end serves 2 first). Last sampled step seen: {step_of.replace('{w}', down['window'])}.",
        ),
        _rule(
            "DistgradExporterAbsent",
            f"{last_state.replace('{w}', gone['window'])} == 1\nunless on (job, instance, run) up{sel()}\n",
            "The scrape target of {{ $labels.job }} vanished while the run was running.",
            f"Prometheus no longer has a scrape target for {WHO}, whose last state (within {gone['window']}) "
            "was running, not finished: its file_sd target file was deleted or its service discovery lost "
            f"it without a clean end. Last sampled step seen: {step_of.replace('{w}', gone['window'])}.",
        ),
    ]
    return {
        "groups": [
            {"name": "distgrad-gradients", "rules": gradients},
            {"name": "distgrad-fp16", "rules": fp16},
            {"name": "distgrad-training", "rules": training},
            {"name": "distgrad-action", "rules": action},
            {"name": "distgrad-exporter", "rules": exporter},
        ]
    }


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings, no line wrapping, keys in insertion order."""


def _str_representer(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_representer)


def render_rules(runbook_base: str | None = None) -> str:
    """The rule file's text (YAML), runbook links under ``runbook_base`` (default
    ``config.RUNBOOK_URL``, the runbook inside this repository)."""
    body = yaml.dump(alert_rules(runbook_base), Dumper=_Dumper, sort_keys=False, width=1 << 30, allow_unicode=True)
    return ("# Generated by grafana/build.py from grafana/config.py and grafana/alerts.py: edit those, "
            "then run it. Do not edit by hand.\n" + body)
