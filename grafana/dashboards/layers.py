"""distgrad / Layers and parameters: per-layer and per-parameter gradient statistics (norms,
non-finite elements, zero ratio, dtype headroom), with a ``$layer`` filter."""

from __future__ import annotations

from grafana_foundation_sdk.models.dashboard import Dashboard

from grafana import config
from grafana.dashboards.common import (RED_IF_ANY, S, bargauge, dashboard, heatmap, opt_in_row, queries, row,
                                       table, timeseries as ts)

FILE = "distgrad-layers.json"


def build() -> Dashboard:
    """The Layers dashboard (SDK model; :func:`grafana.dashboards.common.to_json` writes it).
    Panel descriptions: the note here, then the metrics' catalogue entries."""
    c = config.DASHBOARDS
    k = c["topk"]
    head_th = (("green", None), ("orange", c["headroom_warn"]), ("red", c["headroom_crit"]))
    L = f'{S}, layer=~"$layer"'
    panels = [
        row("Layers"),
        heatmap("Layer gradient norm", "One row per layer over time; colour is the norm.",
                f"distgrad_layer_grad_norm{{{L}}}", "{{layer}}", 24, 10),
        ts("Layer gradient norm (lines)", "Per layer, log scale.",
           queries((f"distgrad_layer_grad_norm{{{L}}}", "{{layer}}")), 12, 8, log=10),
        ts("Gradient norm by module kind", "Log scale.",
           queries((f"distgrad_module_kind_grad_norm{{{S}}}", "{{module_kind}}")), 12, 8, log=10),
        ts("Non-finite elements per layer", "On the last sampled step.",
           queries((f"distgrad_layer_grad_nonfinite{{{L}}}", "{{layer}}")), 12, 8, bars=True, min_=0, th=RED_IF_ANY),
        table("Non-finite parameters (last non-finite step)", "Elements per (parameter, rank shard).",
              f"distgrad_nonfinite_params{{{S}}}", 12, 8, no_value="none: no non-finite step yet"),
        table("Culprit ranks (last non-finite step)", "Ranks whose own loss or gradient was NaN/Inf before the "
              "reduction (source loss / grad): where the NaN came from; the shard table shows where it landed.",
              f"distgrad_nonfinite_culprit{{{S}}}", 12, 8, no_value="none: no non-finite step yet"),
        table("Culprit module (last non-finite step)", "The first module whose forward output went NaN/Inf when the "
              "step's micro-batches were replayed on the culprit rank (module, rank), or why none is named (outcome: "
              "finite = the NaN came from the backward pass; see the runbook).",
              f"distgrad_nonfinite_culprit_module{{{S}}} or distgrad_nonfinite_replay_outcome{{{S}}}", 12, 8,
              no_value="none: no non-finite step yet"),
        ts("Zero-gradient ratio per layer", "",
           queries((f"distgrad_layer_grad_zero_ratio{{{L}}}", "{{layer}}")), 12, 8, min_=0, max_=1),
        ts("Abs-max headroom per layer", "Largest |gradient| over the largest finite value of the training dtype; "
           "100% = overflow. Log scale: fp16 runs sit at 1e-4..1e-1, fp32/bf16 far below.",
           queries((f"distgrad_layer_grad_headroom_ratio{{{L}}}", "{{layer}}")), 12, 8, log=10,
           th=head_th, threshold_lines=True),
        ts("Update RMS per layer", "sqrt(mean(g^2 / v_hat)) over the layer, Adam's second moment before the step "
           "(~1 when it tracks the gradient). Log scale.",
           queries((f"distgrad_layer_update_rms{{{L}}}", "{{layer}}")), 12, 8, log=10),
        ts("Spike fraction per layer", "Fraction of the layer's elements with g^2 > theta * v_hat. Log scale.",
           queries((f"distgrad_layer_adam_spike_fraction{{{L}}}", "{{layer}}")), 12, 8, log=10),
        row("Parameters"),
        bargauge(f"Top {k} parameters by gradient norm", "Largest at the last sample.",
                 f"topk({k}, distgrad_param_grad_norm{{{S}}})", "{{param}}", 8, 10),
        bargauge(f"Top {k} parameters by abs-max headroom", "The parameters closest to overflowing the training dtype.",
                 f"topk({k}, distgrad_param_grad_headroom_ratio{{{S}}})", "{{param}}", 8, 10, th=head_th, max_=1),
        bargauge(f"Top {k} parameters by zero-gradient ratio", "The parameters with the largest fraction of exactly-zero gradient elements.",
                 f"topk({k}, distgrad_param_grad_zero_ratio{{{S}}})", "{{param}}", 8, 10, max_=1),
        ts(f"Top {k} parameter gradient norms over time", "The parameters with the largest gradient norm at each evaluation.",
           queries((f"topk({k}, distgrad_param_grad_norm{{{S}}})", "{{param}}")), 24, 8, log=10),
        # features a default run does not have: collapsed, titled with how to turn them on
        opt_in_row("Update-to-weight ratio", ["update_ratio"], [
            # typically ~1e-3 and unbounded above: a plain number, not a percentage
            bargauge(f"Top {k} parameters by update ratio", "Largest at the last applied step.",
                     f"topk({k}, distgrad_param_update_ratio{{{S}}})", "{{param}}", 24, 10, unit="none"),
        ]),
        opt_in_row("Gradient histogram", ["histogram"], [
            ts("Underflow ratio per layer", "Fraction of the layer's gradient elements that are non-zero but below the "
               "smallest normal value of the training dtype (as held, loss-scaled): precision lost to subnormals, or lost "
               "to 0 in fp16. Needs histogram.enabled; full log2|g| histograms are in TensorBoard and distgrad report.",
               queries((f"distgrad_layer_grad_underflow_ratio{{{L}}}", "{{layer}}")), 24, 8, min_=0, max_=1),
        ]),
        opt_in_row("Lost to underflow", ["underflow"], [
            ts("Gradient elements lost to underflow per layer", "Fraction of the layer's gradient elements that are "
               "non-zero in a float32 recomputation of a sampled micro-batch but exactly zero in the training precision "
               "(underflow.enabled; every underflow.interval-th sampled step, held until the next): lost, not "
               "genuinely zero. DistgradGradientsLostToUnderflow fires when the model's fraction stays above "
               f"{config.ALERTS['DistgradGradientsLostToUnderflow']['threshold']:.0%}.",
               queries((f"distgrad_layer_grad_lost_to_underflow_ratio{{{L}}}", "{{layer}}"),
                       (f"distgrad_grad_lost_to_underflow_ratio{{{S}}}", "model {{instance}}"),
                       (f"distgrad_grad_genuine_zero_ratio{{{S}}}", "genuinely zero {{instance}}")),
               24, 8, min_=0, max_=1),
        ]),
        opt_in_row("Curvature", ["curvature"], [
            ts("Curvature along the last update per layer", "(g_t - g_{t-1}) . dtheta / |dtheta|^2 over the layer's "
               "parameters, and over the model (curvature.enabled): how sharply the loss bends along the step just "
               "taken; below 0 it curves down (a saddle direction or an overshooting step).",
               queries((f"distgrad_layer_curvature{{{L}}}", "{{layer}}"),
                       (f"distgrad_curvature{{{S}}}", "model {{instance}}")), 24, 8),
        ]),
        opt_in_row("Applied update geometry", ["update_geometry", "update_geometry_spectral", "update_geometry_muon",
                                               "update_geometry_adafactor"], [
            ts("Update/weight ratio per layer", "||dW|| / ||W|| of the update the optimizer applied at the previous "
               "sampled step, per layer and over the model (update_geometry.enabled; any optimizer). Typically 1e-3 to "
               f"a few 1e-2; DistgradUpdateRatioHigh fires on a median above "
               f"{config.ALERTS['DistgradUpdateRatioHigh']['threshold']}. Log scale.",
               queries((f"distgrad_layer_applied_update_ratio{{{L}}}", "{{layer}}"),
                       (f"distgrad_applied_update_ratio{{{S}}}", "model {{instance}}")), 12, 8, log=10),
            ts("Applied update RMS per layer", "sqrt(mean(dW^2)) per layer and over the model, in parameter units; "
               "with the spectral norm of each layer's largest matrix update where update_geometry.spectral is on. "
               "Log scale.",
               queries((f"distgrad_layer_applied_update_rms{{{L}}}", "{{layer}}"),
                       (f"distgrad_applied_update_rms{{{S}}}", "model {{instance}}"),
                       (f"distgrad_layer_applied_update_spectral_norm{{{L}}}", "spectral {{layer}}")), 12, 8, log=10),
            ts("Optimizer extras: Muon step RMS per lr, Adafactor second moment", "Muon: RMS of the orthogonalised "
               "step over the learning rate (0.2 targeted by adjust_lr_fn=match_rms_adamw, ~0.18 healthy with "
               "torch's Newton-Schulz). Adafactor: trace of its factored second-moment estimate.",
               queries((f"distgrad_muon_update_rms_per_lr{{{S}}}", "Muon RMS / lr {{instance}}"),
                       (f"distgrad_adafactor_second_moment_trace{{{S}}}", "Adafactor trace {{instance}}")), 24, 8),
        ]),
        opt_in_row("Logit precursors", ["logits"], [
            ts("Max attention logit per layer", "Maximum pre-softmax attention logit q.k/sqrt(d) of each layer over its "
               "heads and the sampled step's micro-batches (logits.attention: Hugging Face attention modules are "
               "found; other attention code calls distgrad.signals.logits.observe_attention and is selected by "
               "logits.attention_modules, docs/signals.md). Kimi K2 clips it at 100 "
               f"(QK-Clip); DistgradAttentionLogitHigh fires above {config.ALERTS['DistgradAttentionLogitHigh']['threshold']}.",
               queries((f"distgrad_layer_attention_logit_max{{{L}}}", "{{layer}}")), 12, 8),
            ts("Output logits: log-sum-exp z and max |logit|", "z = logsumexp of the output logits per position "
               "(logits.output): mean, sqrt of the mean of z^2 (PaLM's z-loss quantity) and max; and the max |logit|. "
               "A climbing z is the output-logit divergence z-loss prevents.",
               queries((f"distgrad_output_logsumexp_mean{{{S}}}", "mean z {{instance}}"),
                       (f"sqrt(distgrad_output_logsumexp_sq_mean{{{S}}})", "rms z {{instance}}"),
                       (f"distgrad_output_logsumexp_max{{{S}}}", "max z {{instance}}"),
                       (f"distgrad_output_logit_abs_max{{{S}}}", "max |logit| {{instance}}")), 12, 8),
        ]),
        opt_in_row("FP8 scaling health", ["fp8"], [
            ts("FP8 smallest amax per layer and tensor", "Smallest max|x| of each tensor (input, weight, grad_output) "
               "a torchao float8 linear of the layer cast on the sampled step (fp8.enabled), for the 8 (layer, tensor) "
               "pairs of smallest amax; DistgradFp8AmaxZero pages at 0.",
               queries((f"distgrad_fp8_amax_min{{{L}}}", "{{layer}} {{tensor}}")), 12, 8, log=10),
            ts("FP8 scale per tensor", "Smallest and largest float8 scale fp8_max/amax of each tensor over the float8 "
               "linears; DistgradFp8ScaleCollapse tickets when the smallest falls 100x below its 30-minute maximum.",
               queries((f"distgrad_fp8_scale_min{{{S}}}", "min {{tensor}}"),
                       (f"distgrad_fp8_scale_max{{{S}}}", "max {{tensor}}")), 12, 8, log=10),
            ts("FP8 underflow and saturation", "Fraction of each tensor's elements the float8 cast flushes to zero "
               "(underflow) or clips (saturation, also per layer); DistgradFp8Saturation pages above "
               f"{config.ALERTS['DistgradFp8Saturation']['threshold']:g} for 1m.",
               queries((f"distgrad_fp8_underflow_ratio{{{S}}}", "underflow {{tensor}}"),
                       (f"distgrad_fp8_saturation_ratio{{{S}}}", "saturation {{tensor}}"),
                       (f"distgrad_fp8_layer_saturation_ratio{{{L}}}", "saturation layer {{layer}}")), 12, 8,
               min_=0, max_=1),
            ts("FP8 amax disagreement across tensor-parallel shards", "max/min of each tensor's amax over the shards "
               "of a TP group (fp8.tp_size > 1); 1 when every shard scaled alike (torchtitan #3109).",
               queries((f"distgrad_fp8_amax_disagreement{{{S}}}", "{{tensor}}"),
                       (f"distgrad_fp8_amax_max{{{S}}}", "largest amax {{tensor}}")), 12, 8),
        ]),
        opt_in_row("MoE router health", ["router"], [
            ts("Expert load imbalance per MoE layer", "Max over experts / mean over experts of the tokens each expert "
               "got in the sampled step, all ranks (router.enabled): 1 is balanced, E/k means every token goes to the same "
               "k experts. DistgradRouterCollapse pages above "
               f"{config.ALERTS['DistgradRouterCollapse']['threshold']}; "
               "per-layer CV, entropy and dead experts are in the JSONL record (router.*).",
               queries((f"distgrad_router_load_imbalance{{{S}}}", "max/mean {{moe_layer}}")), 12, 8, min_=0),
            ts("Dead experts per MoE layer", "Experts of each MoE layer that got no token on each of the last "
               "router.dead_after sampled steps, all ranks (router.enabled); DistgradRouterDeadExperts fires when any "
               "layer has one and names the layers; the expert indices are in the JSONL record (router.dead).",
               queries((f"distgrad_router_layer_dead_experts{{{S}}}", "dead experts layer {{layer}}")), 12, 8,
               min_=0),
            ts("Dead experts, lowest router entropy, auxiliary loss", "Experts that got no token on each of the last "
               "router.dead_after sampled steps, all MoE layers (DistgradRouterDeadExperts); the lowest over layers "
               "of the mean router softmax entropy (nats; log E uniform, toward 0 as a router turns one-hot); the "
               "auxiliary load-balancing loss (DeepSpeed l_aux summed over layers, Hugging Face aux_loss).",
               queries((f"distgrad_router_dead_experts{{{S}}}", "dead experts {{instance}}"),
                       (f"distgrad_router_entropy_min_nats{{{S}}}", "min entropy {{instance}}"),
                       (f"distgrad_router_aux_loss{{{S}}}", "aux loss {{instance}}")), 12, 8, min_=0),
        ]),
    ]
    layer_var = ("layer", "Layer", 'label_values(distgrad_layer_grad_norm{job=~"$job", run=~"$run", instance=~"$instance"}, layer)')
    return dashboard("layers", "distgrad / Layers and parameters",
                     "Per-layer and per-parameter gradient statistics from distgrad: norms, non-finite elements, zero ratio, dtype headroom.",
                     panels, extra_vars=[layer_var])
