"""distgrad / Layers and parameters: per-layer and per-parameter gradient statistics (norms,
non-finite elements, zero ratio, dtype headroom), with a ``$layer`` filter."""

from __future__ import annotations

from grafana_foundation_sdk.models.dashboard import Dashboard

from grafana import config
from grafana.dashboards.common import (RED_IF_ANY, S, bargauge, dashboard, heatmap, queries, row, table,
                                       timeseries as ts)

FILE = "distgrad-layers.json"


def build() -> Dashboard:
    """The Layers dashboard (SDK model; :func:`grafana.dashboards.common.to_json` writes it)."""
    c = config.DASHBOARDS
    k = c["topk"]
    head_th = (("green", None), ("orange", c["headroom_warn"]), ("red", c["headroom_crit"]))
    L = f'{S}, layer=~"$layer"'
    panels = [
        row("Layers"),
        heatmap("Layer gradient norm", "distgrad_layer_grad_norm per layer (rows) over time; colour is the norm.",
                f"distgrad_layer_grad_norm{{{L}}}", "{{layer}}", "none", 24, 10),
        ts("Layer gradient norm (lines)", "distgrad_layer_grad_norm per layer, log scale.",
           queries((f"distgrad_layer_grad_norm{{{L}}}", "{{layer}}")), "none", 12, 8, log=10),
        ts("Gradient norm by module kind", "Root-sum-square over all parameters of each kind (distgrad_module_kind_grad_norm).",
           queries((f"distgrad_module_kind_grad_norm{{{S}}}", "{{module_kind}}")), "none", 12, 8, log=10),
        ts("Non-finite elements per layer", "NaN+Inf gradient elements per layer on the last sampled step (distgrad_layer_grad_nonfinite).",
           queries((f"distgrad_layer_grad_nonfinite{{{L}}}", "{{layer}}")), "none", 12, 8, bars=True, min_=0,
           th=RED_IF_ANY),
        table("Non-finite parameters (last non-finite step)", "Elements per (parameter, rank shard) on the last step with NaN/Inf gradients (distgrad_nonfinite_params, at most 20 series).",
              f"distgrad_nonfinite_params{{{S}}}", "none", 12, 8),
        ts("Zero-gradient ratio per layer", "Fraction of exactly-zero gradient elements per layer (distgrad_layer_grad_zero_ratio).",
           queries((f"distgrad_layer_grad_zero_ratio{{{L}}}", "{{layer}}")), "percentunit", 12, 8, min_=0, max_=1),
        ts("Abs-max headroom per layer", "Largest |gradient| over the largest finite value of the training dtype (distgrad_layer_grad_headroom_ratio); 100% = overflow.",
           queries((f"distgrad_layer_grad_headroom_ratio{{{L}}}", "{{layer}}")), "percentunit", 12, 8, min_=0,
           th=head_th, threshold_lines=True),
        row("Parameters"),
        bargauge(f"Top {k} parameters by gradient norm", "Largest per-parameter gradient L2 norms at the last sample (distgrad_param_grad_norm).",
                 f"topk({k}, distgrad_param_grad_norm{{{S}}})", "{{param}}", "none", 12, 10),
        bargauge(f"Top {k} parameters by abs-max headroom", "Parameters closest to overflowing the training dtype (distgrad_param_grad_headroom_ratio).",
                 f"topk({k}, distgrad_param_grad_headroom_ratio{{{S}}})", "{{param}}", "percentunit", 12, 10,
                 th=head_th, max_=1),
        bargauge(f"Top {k} parameters by zero-gradient ratio", "Parameters with the largest fraction of exactly-zero gradient elements (distgrad_param_grad_zero_ratio).",
                 f"topk({k}, distgrad_param_grad_zero_ratio{{{S}}})", "{{param}}", "percentunit", 12, 10, max_=1),
        bargauge(f"Top {k} parameters by update ratio", "||dw|| / ||w|| of the last applied step (distgrad_param_update_ratio; only when enabled).",
                 f"topk({k}, distgrad_param_update_ratio{{{S}}})", "{{param}}", "none", 12, 10),
        ts(f"Top {k} parameter gradient norms over time", "The parameters with the largest gradient norm at each evaluation.",
           queries((f"topk({k}, distgrad_param_grad_norm{{{S}}})", "{{param}}")), "none", 24, 8, log=10),
    ]
    layer_var = ("layer", "Layer", 'label_values(distgrad_layer_grad_norm{job=~"$job", run=~"$run", instance=~"$instance"}, layer)')
    return dashboard("layers", "distgrad / Layers and parameters",
                     "Per-layer and per-parameter gradient statistics from distgrad: norms, non-finite elements, zero ratio, dtype headroom.",
                     panels, extra_vars=[layer_var])
