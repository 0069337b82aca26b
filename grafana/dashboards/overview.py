"""distgrad / Overview: training health from distgrad's rank-0 exporter (status, loss, gradient
norm, fp16 loss scaling, non-finite steps, throughput, stalls, spikes, errors)."""

from __future__ import annotations

from grafana_foundation_sdk.models.dashboard import Dashboard

from grafana import config
from grafana.dashboards.common import (FIRING_ALERTS, RATE, RED_IF_ANY, S, dashboard, queries, row, stat, table,
                                       timeseries as ts)

FILE = "distgrad-overview.json"


def build() -> Dashboard:
    """The Overview dashboard (SDK model; :func:`grafana.dashboards.common.to_json` writes it)."""
    a = config.ALERTS
    stall = a["DistgradTrainingStalled"]["threshold_seconds"]
    stall_th = (("green", None), ("orange", stall / 2), ("red", stall))
    overflow_th = (("green", None), ("red", a["DistgradRepeatedOverflow"]["threshold"]))
    panels = [
        row("Status"),
        stat("Optimizer step", "Optimizer step of the last sampled step (distgrad_optimizer_step).",
             queries((f"distgrad_optimizer_step{{{S}}}", "{{instance}}")), "none", 4, 4),
        stat("Time since last sample", "Seconds since rank 0 last sampled a step; DistgradTrainingStalled fires above the configured threshold.",
             queries((f"time() - distgrad_last_step_timestamp_seconds{{{S}}}", "{{instance}}")), "s", 4, 4, th=stall_th),
        stat("Samples/s", "Training samples consumed per second (rate of distgrad_samples_total).",
             queries((f"rate(distgrad_samples_total{{{S}}}[{RATE}])", "{{instance}}")), "short", 4, 4, graph=True),
        stat("World size", "Ranks in the job (distgrad_world_size).",
             queries((f"distgrad_world_size{{{S}}}", "{{instance}}")), "none", 3, 4),
        stat("Non-finite steps", "Sampled steps with NaN/Inf gradients since start (distgrad_nonfinite_steps_total).",
             queries((f"distgrad_nonfinite_steps_total{{{S}}}", "{{instance}}")), "none", 4, 4, th=RED_IF_ANY),
        stat("Firing distgrad alerts", "Distgrad* alerts firing now (ALERTS from Prometheus' rule evaluation).",
             queries((f"count({FIRING_ALERTS}) or vector(0)", "firing")), "none", 5, 4, th=RED_IF_ANY),
        table("Run info", "Static run information (distgrad_info).", f"distgrad_info{{{S}}}", "none", 24, 4),
        row("Training"),
        ts("Loss", "Training loss averaged over ranks and micro-batches of the sampled step (distgrad_loss).",
           queries((f"distgrad_loss{{{S}}}", "{{instance}}")), "none", 12, 8),
        ts("Global gradient norm", "L2 norm of the reduced gradient (distgrad_grad_norm), log scale; gaps are NaN/Inf steps.",
           queries((f"distgrad_grad_norm{{{S}}}", "{{instance}}")), "none", 12, 8, log=10),
        ts("fp16 loss scale", "Dynamic loss scale (distgrad_loss_scale), log2 scale; only runs with a loss scaler export it.",
           queries((f"distgrad_loss_scale{{{S}}}", "{{instance}}")), "short", 8, 8, log=2),
        ts("Overflow, non-finite and skipped steps", "Steps per interval: fp16 overflows, sampled steps with NaN/Inf gradients, optimizer steps not applied.",
           queries((f"increase(distgrad_overflow_steps_total{{{S}}}[{RATE}])", "overflow {{instance}}"),
                   (f"increase(distgrad_nonfinite_steps_total{{{S}}}[{RATE}])", "non-finite {{instance}}"),
                   (f"increase(distgrad_skipped_steps_total{{{S}}}[{RATE}])", "skipped {{instance}}")),
           "none", 8, 8, bars=True, min_=0),
        ts("Consecutive overflow steps", "Length of the current fp16 overflow streak (distgrad_consecutive_overflow_steps).",
           queries((f"distgrad_consecutive_overflow_steps{{{S}}}", "{{instance}}")), "none", 8, 8, min_=0,
           th=overflow_th, threshold_lines=True),
        ts("Samples/s", "Training throughput: rate of distgrad_samples_total.",
           queries((f"rate(distgrad_samples_total{{{S}}}[{RATE}])", "{{instance}}")), "short", 12, 8, min_=0),
        ts("Time since last sample", "Seconds since the last sampled step; the red band starts at the DistgradTrainingStalled threshold.",
           queries((f"time() - distgrad_last_step_timestamp_seconds{{{S}}}", "{{instance}}")), "s", 12, 8, min_=0,
           th=stall_th, threshold_lines=True),
        row("Spikes"),
        ts("Spike z-scores", "Spike score of the last sample per detector (distgrad_grad_norm_zscore, distgrad_loss_zscore).",
           queries((f"distgrad_grad_norm_zscore{{{S}}}", "grad norm {{detector}} {{instance}}"),
                   (f"distgrad_loss_zscore{{{S}}}", "loss {{detector}} {{instance}}")), "none", 12, 8),
        ts("Detected spikes", "Spikes detected per interval, per detector.",
           queries((f"increase(distgrad_grad_norm_spikes_total{{{S}}}[{RATE}])", "grad norm {{detector}} {{instance}}"),
                   (f"increase(distgrad_loss_spikes_total{{{S}}}[{RATE}])", "loss {{detector}} {{instance}}")),
           "none", 12, 8, bars=True, min_=0),
        row("Health"),
        ts("Internal and sink errors", "Failures inside distgrad (training continued) and per sink, per interval.",
           queries((f"increase(distgrad_internal_errors_total{{{S}}}[{RATE}])", "internal {{instance}}"),
                   (f"increase(distgrad_sink_errors_total{{{S}}}[{RATE}])", "sink {{sink}} {{instance}}")),
           "none", 8, 8, bars=True, min_=0),
        ts("Replica mismatch", "Sampled steps per interval where replicated gradients differed across ranks, and the last disagreeing rank (-1: none yet).",
           queries((f"increase(distgrad_replica_mismatch_total{{{S}}}[{RATE}])", "mismatched steps {{instance}}"),
                   (f"distgrad_replica_mismatch_rank{{{S}}}", "last rank {{instance}}")), "none", 8, 8),
        ts("Vanishing / exploding parameters", "Parameters currently flagged as vanishing or exploding.",
           queries((f"distgrad_vanishing_params{{{S}}}", "vanishing {{instance}}"),
                   (f"distgrad_exploding_params{{{S}}}", "exploding {{instance}}")), "none", 8, 8, min_=0),
        ts("Gradient clip ratio", "min(1, max_norm / grad_norm): below 1 means the step was clipped (only with clipping configured).",
           queries((f"distgrad_clip_ratio{{{S}}}", "{{instance}}")), "percentunit", 12, 8, min_=0, max_=1),
        ts("Sampled steps", "Sampled optimizer steps per interval (distgrad_sampled_steps_total).",
           queries((f"increase(distgrad_sampled_steps_total{{{S}}}[{RATE}])", "{{instance}}")), "none", 12, 8,
           bars=True, min_=0),
    ]
    return dashboard("overview", "distgrad / Overview",
                     "Training health from distgrad's rank-0 exporter: loss, gradient norm, fp16 loss scaling, non-finite steps, throughput, stalls, errors.",
                     panels)
