"""distgrad / Overview: training health from distgrad's rank-0 exporter (status, loss, gradient
norm, fp16 loss scaling, non-finite steps, throughput, stalls, spikes, errors)."""

from __future__ import annotations

from grafana_foundation_sdk.models.dashboard import Dashboard

from grafana import config
from grafana.dashboards.common import (FIRING_ALERTS, RATE, RED_IF_ANY, S, dashboard, opt_in_row, queries, row,
                                       stat, table, timeseries as ts)

FILE = "distgrad-overview.json"


def build() -> Dashboard:
    """The Overview dashboard (SDK model; :func:`grafana.dashboards.common.to_json` writes it).
    Panel descriptions: the note here, then the metrics' catalogue entries."""
    a = config.ALERTS
    stall = a["DistgradTrainingStalled"]["threshold_seconds"]
    stall_th = (("green", None), ("orange", stall / 2), ("red", stall))
    overflow_n = a["DistgradRepeatedOverflow"]["threshold"]
    overflow_th = (("green", None), ("red", overflow_n))
    adam = a["DistgradAdamUpdateExcursion"]
    adam_rms_th = (("green", None), ("red", adam["rms"]))
    adam_frac_th = (("green", None), ("red", adam["fraction"]))
    panels = [
        row("Status"),
        stat("Optimizer step", "", queries((f"distgrad_optimizer_step{{{S}}}", "{{instance}}")), 4, 4),
        stat("Time since last sample", f"Seconds since rank 0 last finished an optimizer step; DistgradTrainingStalled fires above {stall} s.",
             queries((f"time() - distgrad_last_step_timestamp_seconds{{{S}}}", "{{instance}}")), 4, 4, th=stall_th),
        stat("Samples/s", "Training samples consumed per second.",
             queries((f"rate(distgrad_samples_total{{{S}}}[{RATE}])", "{{instance}}")), 4, 4, unit="short", graph=True),
        stat("World size", "", queries((f"distgrad_world_size{{{S}}}", "{{instance}}")), 3, 4),
        stat("Non-finite steps", "Since start.",
             queries((f"distgrad_nonfinite_steps_total{{{S}}}", "{{instance}}")), 4, 4, th=RED_IF_ANY),
        stat("Firing distgrad alerts", "Distgrad* alerts firing now (ALERTS from Prometheus' rule evaluation).",
             queries((f"count({FIRING_ALERTS}) or vector(0)", "firing")), 5, 4, unit="none", th=RED_IF_ANY),
        table("Run info", "", f"distgrad_info{{{S}}}", 24, 4),
        row("Training"),
        ts("Loss", "", queries((f"distgrad_loss{{{S}}}", "{{instance}}")), 12, 8),
        ts("Global gradient norm", "Log scale; gaps are NaN/Inf steps.",
           queries((f"distgrad_grad_norm{{{S}}}", "{{instance}}")), 12, 8, log=10),
        ts("Overflow, non-finite and skipped steps", "Steps per interval: fp16 overflows, sampled steps with NaN/Inf gradients, optimizer steps not applied.",
           queries((f"increase(distgrad_overflow_steps_total{{{S}}}[{RATE}])", "overflow {{instance}}"),
                   (f"increase(distgrad_nonfinite_steps_total{{{S}}}[{RATE}])", "non-finite {{instance}}"),
                   (f"increase(distgrad_skipped_steps_total{{{S}}}[{RATE}])", "skipped {{instance}}")),
           8, 8, bars=True, min_=0),
        ts("Samples/s", "Training throughput.",
           queries((f"rate(distgrad_samples_total{{{S}}}[{RATE}])", "{{instance}}")), 8, 8, unit="short", min_=0),
        ts("Time since last sample", f"Seconds since the last optimizer step; the red band starts at the DistgradTrainingStalled threshold ({stall} s).",
           queries((f"time() - distgrad_last_step_timestamp_seconds{{{S}}}", "{{instance}}")), 8, 8, min_=0,
           th=stall_th, threshold_lines=True),
        row("Loss analysis"),
        ts("Loss trend (slope per 1000 steps)", "Least-squares slope of the loss over the last loss.trend_window steps, "
           "with a band of two standard errors; DistgradLossPlateau fires when the plateau flag stays 1 for "
           f"{a['DistgradLossPlateau']['for']}.",
           queries((f"distgrad_loss_trend_slope{{{S}}}", "slope {{instance}}"),
                   (f"distgrad_loss_trend_slope{{{S}}} + 2 * distgrad_loss_trend_stderr{{{S}}}", "+2 se {{instance}}"),
                   (f"distgrad_loss_trend_slope{{{S}}} - 2 * distgrad_loss_trend_stderr{{{S}}}", "-2 se {{instance}}"),
                   (f"distgrad_loss_plateau{{{S}}}", "plateau {{instance}}")), 8, 8),
        ts("Straggler ratio", "The step's wall time over what it would be at the median rank's data time; "
           f"DistgradStragglingRank fires above {a['DistgradStragglingRank']['threshold']}.",
           queries((f"distgrad_straggler_ratio{{{S}}}", "{{instance}}")), 8, 8),
        ts("Highest-loss and straggler rank", "The rank whose batch had the highest loss, and the rank the others "
           "waited for.",
           queries((f"distgrad_loss_max_rank{{{S}}}", "highest loss {{instance}}"),
                   (f"distgrad_straggler_rank{{{S}}}", "straggler {{instance}}")), 8, 8, min_=0),
        row("Spikes"),
        ts("Spike z-scores", "Per detector.",
           queries((f"distgrad_grad_norm_zscore{{{S}}}", "grad norm {{detector}} {{instance}}"),
                   (f"distgrad_loss_zscore{{{S}}}", "loss {{detector}} {{instance}}")), 12, 8),
        ts("Detected spikes", "Spikes detected per interval, per detector.",
           queries((f"increase(distgrad_grad_norm_spikes_total{{{S}}}[{RATE}])", "grad norm {{detector}} {{instance}}"),
                   (f"increase(distgrad_loss_spikes_total{{{S}}}[{RATE}])", "loss {{detector}} {{instance}}")),
           12, 8, bars=True, min_=0),
        row("Optimizer (Adam)"),
        ts("Update RMS", "sqrt(mean(g^2 / v_hat)) with Adam's second moment before the step: ~1 when v_hat tracks the "
           f"gradient; DistgradAdamUpdateExcursion fires above {adam['rms']} for {adam['for']} (from step "
           f"{adam['min_step']} on). Log scale: early steps and rare tokens reach 10-1000.",
           queries((f"distgrad_update_rms{{{S}}}", "{{instance}}")), 8, 8, log=10, th=adam_rms_th,
           threshold_lines=True),
        ts("Second-moment spike fraction", "Fraction of gradient elements with g^2 > theta * v_hat (~1e-4 when "
           f"healthy); DistgradAdamUpdateExcursion fires above {adam['fraction']:g} for {adam['for']}. Log scale; no "
           "sample on steps the gradient clip scales.",
           queries((f"distgrad_adam_spike_fraction{{{S}}}", "{{instance}}")), 8, 8, log=10, th=adam_frac_th,
           threshold_lines=True),
        ts("Diagonal Fisher trace", "sum(v_hat): the trace of the empirical diagonal Fisher estimate Adam keeps. Log scale.",
           queries((f"distgrad_fisher_trace{{{S}}}", "{{instance}}")), 8, 8, log=10),
        ts("Gradient-momentum cosine", "Cosine between the step's gradient and Adam's first moment; near or below 0: "
           "the gradient turned against the momentum.",
           queries((f"distgrad_grad_momentum_cosine{{{S}}}", "{{instance}}")), 12, 8, min_=-1, max_=1),
        ts("Adam moment norms", "L2 norms of exp_avg (gradient unit) and exp_avg_sq (its square). Log scale.",
           queries((f"distgrad_optimizer_moment_norm{{{S}}}", "{{moment}} {{instance}}")), 12, 8, log=10),
        row("Health"),
        ts("Internal and sink errors", "Failures per interval; training continued.",
           queries((f"increase(distgrad_internal_errors_total{{{S}}}[{RATE}])", "internal {{instance}}"),
                   (f"increase(distgrad_sink_errors_total{{{S}}}[{RATE}])", "sink {{sink}} {{instance}}")),
           8, 8, bars=True, min_=0),
        ts("Replica mismatch", "Mismatched sampled steps per interval, and the last disagreeing rank (-1: none yet).",
           queries((f"increase(distgrad_replica_mismatch_total{{{S}}}[{RATE}])", "mismatched steps {{instance}}"),
                   (f"distgrad_replica_mismatch_rank{{{S}}}", "last rank {{instance}}")), 8, 8),
        ts("Vanishing / exploding parameters", "",
           queries((f"distgrad_vanishing_params{{{S}}}", "vanishing {{instance}}"),
                   (f"distgrad_exploding_params{{{S}}}", "exploding {{instance}}")), 8, 8, min_=0),
        ts("Gradient clip ratio", "Below 1: the step was clipped.",
           queries((f"distgrad_clip_ratio{{{S}}}", "{{instance}}")), 12, 8, min_=0, max_=1),
        ts("Sampled and refused steps", "Sampled optimizer steps per interval, and those distgrad refused to export "
           "per reason (its gradients could not be the step's pre-clip gradient; DistgradRefusedSteps).",
           queries((f"increase(distgrad_sampled_steps_total{{{S}}}[{RATE}])", "sampled {{instance}}"),
                   (f"increase(distgrad_refused_steps_total{{{S}}}[{RATE}])", "refused {{reason}} {{instance}}")),
           12, 8, bars=True, min_=0),
        ts("Ranks training on the same data", "Data-parallel ranks whose per-rank losses were bit-identical to another "
           "replica's on duplicate_data.steps consecutive sampled steps (a loader that does not shard by rank; "
           "DistgradDuplicateData). 0 when healthy; the log and the JSONL record name the ranks.",
           queries((f"distgrad_duplicate_data_ranks{{{S}}}", "{{instance}}")), 24, 8, unit="short", min_=0),
        # features a default run does not have: collapsed, titled with how to turn them on
        opt_in_row("fp16 loss scaling", ["loss_scaler"], [
            ts("fp16 loss scale", "Log2 scale.",
               queries((f"distgrad_loss_scale{{{S}}}", "{{instance}}")), 12, 8, unit="short", log=2),
            ts("Consecutive overflow steps", f"The red line is DistgradRepeatedOverflow's threshold ({overflow_n}).",
               queries((f"distgrad_consecutive_overflow_steps{{{S}}}", "{{instance}}")), 12, 8, min_=0,
               th=overflow_th, threshold_lines=True),
        ]),
        opt_in_row("Loss components and per-token losses", ["components", "tokens"], [
            ts("Loss components: share of the total", "sum(weight x component) / sum(loss) per component.",
               queries((f"distgrad_loss_component_share{{{S}}}", "{{component}} {{instance}}")), 12, 8, min_=0),
            ts("Per-token loss", "Token-weighted mean per-token loss, overall and per data source (nats).",
               queries((f"distgrad_token_loss_mean{{{S}}}", "all {{instance}}"),
                       (f"distgrad_source_token_loss_mean{{{S}}}", "{{source}} {{instance}}")), 12, 8),
        ]),
        opt_in_row("Gradient noise scale", ["noise_scale"], [
            ts("Gradient noise scale vs batch size", "B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018), about the "
               "critical batch size: well above the step's batch, a larger batch would still train about as "
               "efficiently per sample; well below it, larger batches waste samples (noise_scale.enabled).",
               queries((f"distgrad_gradient_noise_scale{{{S}}}", "noise scale {{instance}}"),
                       (f"distgrad_gradient_noise_batch_size{{{S}}}", "step batch {{instance}}")), 12, 8,
               unit="short", log=10),
            ts("Noise-scale components", "The two moving averages whose ratio is the noise scale: tr(Sigma), the "
               "per-sample gradient variance, and |G|^2, the squared norm of the full-batch gradient.",
               queries((f"distgrad_gradient_noise_trace{{{S}}}", "tr(Sigma) {{instance}}"),
                       (f"distgrad_gradient_noise_true_grad_sq{{{S}}}", "|G|^2 {{instance}}")), 12, 8, log=10),
        ]),
        opt_in_row("Gradient histogram", ["histogram"], [
            ts("Gradient underflow and zero ratio", "Fraction of all gradient elements below the smallest normal value "
               "of the training dtype (as held, loss-scaled), and exactly 0. Needs histogram.enabled; per layer on the "
               "Layers dashboard.",
               queries((f"distgrad_grad_underflow_ratio{{{S}}}", "underflow {{instance}}"),
                       (f"distgrad_grad_zero_ratio{{{S}}}", "zero {{instance}}")), 24, 8, min_=0, max_=1),
        ]),
        opt_in_row("Replica weight hashes", ["replica_weights"], [
            ts("Replica weight hashes", "At each hash step (replica_weights.hash_interval), the parameters whose exact "
               "weight checksum differs across data-parallel replicas (DistgradReplicaWeightsDiverged: 0 when healthy), "
               "the rank outside its replica group's majority (-1: none) and the step of the last comparison.",
               queries((f"distgrad_replica_weights_mismatch_params{{{S}}}", "differing params {{instance}}"),
                       (f"distgrad_replica_weights_mismatch_rank{{{S}}}", "rank {{instance}}")), 16, 8, unit="short"),
            ts("Last weight-hash step", "Optimizer step of the last replica weight-hash comparison: it advances every "
               "replica_weights.hash_interval steps while the check runs.",
               queries((f"distgrad_replica_weights_hash_step{{{S}}}", "{{instance}}")), 8, 8, unit="short"),
        ]),
        opt_in_row("Rerun attribution", ["rerun"], [
            ts("Rerun verdicts", "Reruns of a non-finite or replica-mismatched step's forward and backward, per "
               "verdict: data (reproduces on another rank too), device (persistent fault on the culprit's device), "
               "transient (did not recur: node suspect), inconclusive; device and transient page "
               "(DistgradRerunFaultyNode). The rank to quarantine: -1 when none.",
               queries((f"distgrad_rerun_verdicts_total{{{S}}}", "{{verdict}} {{instance}}"),
                       (f"distgrad_rerun_quarantine_rank{{{S}}}", "quarantine rank {{instance}}")), 16, 8, unit="short"),
            ts("Last rerun step", "Optimizer step of the last rerun attribution. No data until the first rerun: "
               "a healthy run has none (every verdict count above stays 0).",
               queries((f"distgrad_rerun_step{{{S}}}", "{{instance}}")), 8, 8, unit="short"),
            table("Host to quarantine", "The host of the rank the last device or transient verdict names "
                  "(DistgradRerunFaultyNode's page names it too).",
                  f"distgrad_rerun_quarantine_host_info{{{S}}}", 24, 5, no_value="none: no device or transient verdict"),
        ]),
        opt_in_row("Opt-in action", ["action"], [
            ts("Updates skipped by distgrad", "Optimizer updates distgrad's opt-in action skipped on every rank, per "
               "cause (docs/action.md; DistgradUpdatesSkipped), and 1 once it requested a stop of the run "
               "(DistgradStopRequested). Empty when no action is configured.",
               queries((f"increase(distgrad_action_skipped_steps_total{{{S}}}[{RATE}])", "skipped {{cause}} {{instance}}"),
                       (f"distgrad_action_stop_requested{{{S}}}", "stop requested {{instance}}")),
               24, 8, bars=True, min_=0),
        ]),
        opt_in_row("Adaptive clipping", ["adaptive_clip"], [
            ts("Steps clipped by distgrad", "Optimizer steps on which distgrad's adaptive clipping (ZClip or AdaGC, "
               "docs/action.md) scaled gradients down. The exported gradient norm stays the pre-clip one.",
               queries((f"increase(distgrad_adaptive_clip_steps_total{{{S}}}[{RATE}])", "clipped {{instance}}")),
               12, 8, bars=True, min_=0),
            ts("Adaptive clip factor", "Smallest factor applied to a gradient on the last sampled step (1: nothing "
               "clipped) and the parameter tensors it scaled down.",
               queries((f"distgrad_adaptive_clip_factor{{{S}}}", "factor {{instance}}"),
                       (f"distgrad_adaptive_clip_tensors{{{S}}}", "tensors {{instance}}")), 12, 8, unit="short"),
        ]),
    ]
    return dashboard("overview", "distgrad / Overview",
                     "Training health from distgrad's rank-0 exporter: loss, gradient norm, fp16 loss scaling, non-finite steps, throughput, stalls, errors.",
                     panels)
