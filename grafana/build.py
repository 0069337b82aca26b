#!/usr/bin/env python3
"""Generate distgrad's Prometheus alert rules and Grafana dashboards from one config.

Laid out like a monitoring mixin (kubernetes-mixin): every selector, threshold, window and
``for:`` duration lives in :data:`CONFIG` below; this script writes

- ``grafana/alerts/distgrad.rules.yml`` (Prometheus rule file, ``promtool check rules``),
- ``grafana/dashboards/distgrad-overview.json`` and ``distgrad-layers.json`` (Grafana 11.6+
  dashboard JSON, schemaVersion 41, datasource as the ``${datasource}`` template variable).

The generated files are committed; ``tests/test_alert_rules.py`` and
``tests/test_dashboards.py`` fail when they differ from a fresh generation. After changing
CONFIG or this file run::

    python grafana/build.py          # rewrite the outputs
    python grafana/build.py --check  # exit 1 if the committed outputs are stale

The unit tests of the rules (``grafana/alerts/tests/*.yml``) are written by hand against the
default CONFIG: change a default threshold and they must change with it.

Metric names come from ``docs/metrics.md``. Standard library and PyYAML only.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent

#: The one place for selectors, thresholds, windows and durations.
CONFIG: dict[str, Any] = {
    # Selects distgrad's scrape jobs, in every alert and in the dashboards' job variable.
    "selector": 'job=~"distgrad.*"',
    "runbook_url": "https://github.com/distgrad/distgrad/blob/main/docs/runbook.md#{anchor}",
    "alerts": {
        # NaN/Inf gradient elements on a sampled step. With exclude_fp16_overflow, steps
        # counted by distgrad_overflow_steps_total (fp16 overflows the loss scaler handles by
        # skipping the step) are subtracted; persistent fp16 trouble is caught by
        # DistgradRepeatedOverflow and DistgradLossScaleCollapsed instead.
        "DistgradNonFiniteGradients": {
            "severity": "critical", "for": "0s", "window": "5m", "exclude_fp16_overflow": True,
        },
        "DistgradNaNLoss": {"severity": "critical", "for": "0s"},
        # detectors that page: OLMo's windowed 6-sigma score. ZClip's EMA z-score at its default
        # z = 2.5 flags ~1-2% of samples of a noisy but healthy series (tests/test_detectors.py),
        # fine for a dashboard, too often for an alert; use "ema|window" to page on both.
        "DistgradGradNormSpike": {"severity": "warning", "for": "0s", "window": "10m", "detectors": "window"},
        "DistgradLossSpike": {"severity": "warning", "for": "0s", "window": "10m", "detectors": "window"},
        "DistgradLossScaleCollapsed": {"severity": "critical", "for": "2m"},
        "DistgradRepeatedOverflow": {"severity": "warning", "for": "0s", "threshold": 5},
        # seconds since the last sampled step; must exceed sample_every x step time
        "DistgradTrainingStalled": {"severity": "critical", "for": "1m", "threshold_seconds": 600},
        "DistgradExporterDown": {"severity": "critical", "for": "2m"},
        "DistgradExporterAbsent": {"severity": "warning", "for": "5m"},
        "DistgradReplicaMismatch": {"severity": "critical", "for": "0s", "window": "10m"},
        "DistgradInternalErrors": {"severity": "warning", "for": "0s", "window": "10m"},
    },
    "dashboards": {
        "uid_prefix": "distgrad",
        "tags": ["distgrad"],
        "refresh": "10s",
        "time_from": "now-1h",
        "schema_version": 41,  # Grafana 11.6; later versions migrate it on import
        "topk": 10,
        # stat/threshold colours: headroom ratio (abs max / dtype max) that turns orange, red
        "headroom_warn": 0.5,
        "headroom_crit": 0.9,
    },
}

RULES_PATH = HERE / "alerts" / "distgrad.rules.yml"
DASHBOARDS_DIR = HERE / "dashboards"
CATALOGUE = HERE.parent / "docs" / "metrics.md"


def catalogue_metrics(path: Path = CATALOGUE) -> set[str]:
    """Metric names of the catalogue table in docs/metrics.md (first column; a cell like
    "`distgrad_param_grad_min` / `_max`" names both distgrad_param_grad_min and _max)."""
    names: set[str] = set()
    for line in path.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        prev = ""
        for tok in re.findall(r"`([^`]+)`", line.split("|")[1]):
            tok = prev.rsplit("_", 1)[0] + tok if tok.startswith("_") and prev else tok
            names.add(tok)
            prev = tok
    return names


def referenced_metrics(text: str) -> set[str]:
    """distgrad_* metric names used in a rule file or dashboard."""
    return set(re.findall(r"\bdistgrad_[a-z0-9_]+", text))


# --------------------------------------------------------------------------------------------
# Alert rules
# --------------------------------------------------------------------------------------------

def sel(extra: str = "") -> str:
    """``{<selector>[,extra]}`` for a metric in an alert expression."""
    inner = CONFIG["selector"] + (f",{extra}" if extra else "")
    return "{" + inner + "}"


#: Who the alert is about, for annotation text: job, optional run label, instance.
WHO = "{{ $labels.job }}{{ with $labels.run }} run {{ . }}{{ end }} ({{ $labels.instance }})"


def tquery(promql_fmt: str) -> str:
    """Go-template pipeline running ``promql_fmt`` (with ``%q`` placeholders for the job and
    instance label values of the alert) through Prometheus' ``query`` template function."""
    return f'printf "{promql_fmt}" $labels.job $labels.instance | query'


def tvalue(metric: str, fmt: str = "%.0f", missing: str = "unknown") -> str:
    """Template text: the value of ``metric`` of the alert's target, or ``missing``."""
    q = tquery(metric + "{job=%q,instance=%q}")
    return f'{{{{ with {q} }}}}{{{{ . | first | value | printf "{fmt}" }}}}{{{{ else }}}}{missing}{{{{ end }}}}'


def tlist(promql_fmt: str, item: str, sort_label: str, otherwise: str) -> str:
    """Template text: comma-separated ``item`` (a template over ``$s``) for every sample of
    the query, sorted by ``sort_label``; ``otherwise`` when the query returns nothing."""
    return (
        f"{{{{ with {tquery(promql_fmt)} }}}}"
        f'{{{{ range $i, $s := . | sortByLabel "{sort_label}" }}}}{{{{ if $i }}}}, {{{{ end }}}}{item}{{{{ end }}}}'
        f"{{{{ else }}}}{otherwise}{{{{ end }}}}"
    )


def _runbook(name: str) -> str:
    return CONFIG["runbook_url"].format(anchor=name.lower())


def _rule(name: str, expr: str, summary: str, description: str) -> dict[str, Any]:
    c = CONFIG["alerts"][name]
    return {
        "alert": name,
        "expr": expr,
        "for": c["for"],
        "labels": {"severity": c["severity"]},
        "annotations": {"summary": summary, "description": description, "runbook_url": _runbook(name)},
    }


def _nonfinite_rule() -> dict[str, Any]:
    c = CONFIG["alerts"]["DistgradNonFiniteGradients"]
    w = c["window"]
    nonfinite = f"increase(distgrad_nonfinite_steps_total{sel()}[{w}])"
    if c["exclude_fp16_overflow"]:
        # Both counters come from the same scrape (same sample times, both exported at 0), so
        # increase() extrapolates them alike and the difference counts non-overflow steps.
        # "or 0 * ..." stands in for runs without an fp16 scaler, which lack the overflow series.
        expr = (
            f"(\n  {nonfinite}\n  -\n"
            f"  (increase(distgrad_overflow_steps_total{sel()}[{w}]) or 0 * {nonfinite})\n) > 0\n"
        )
        note = " (fp16 overflow steps, which the loss scaler skips, are not counted)"
    else:
        expr = f"{nonfinite} > 0"
        note = ""
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
            ),
        ),
    )
    return _rule(
        "DistgradNonFiniteGradients",
        expr,
        "NaN/Inf gradients in {{ $labels.job }}.",
        f"{WHO} had sampled optimizer steps with NaN/Inf gradients in the last {w}{note}. "
        f"Last sampled step: {tvalue('distgrad_optimizer_step')}. "
        f"Non-finite parameters: {params}.",
    )


def _spike_rule(name: str, what: str, counter: str, gauge: str) -> dict[str, Any]:
    w = CONFIG["alerts"][name]["window"]
    det = CONFIG["alerts"][name]["detectors"]
    return _rule(
        name,
        f"max without (detector) (increase({counter}{sel(f'detector=~{chr(34)}{det}{chr(34)}')}[{w}])) > 0",
        f"{what.capitalize()} spike in {{{{ $labels.job }}}}.",
        f"The {what} spike detector of {WHO} flagged a spike in the last {w}. "
        f"{what.capitalize()} at the last sampled step {tvalue('distgrad_optimizer_step')}: "
        f"{tvalue(gauge, '%.4g')}.",
    )


def alert_rules() -> dict[str, Any]:
    """The rule file as a dict (``groups`` of ``rules``)."""
    a = CONFIG["alerts"]
    overflow_n = a["DistgradRepeatedOverflow"]["threshold"]
    stall_s = a["DistgradTrainingStalled"]["threshold_seconds"]
    gradients = [
        _nonfinite_rule(),
        _rule(
            "DistgradNaNLoss",
            f"distgrad_loss{sel()} != distgrad_loss{sel()}\n"
            f"or distgrad_loss{sel()} == Inf\nor distgrad_loss{sel()} == -Inf\n",
            "Non-finite training loss in {{ $labels.job }}.",
            f"{WHO} reports a training loss of {{{{ $value }}}} at sampled step "
            f"{tvalue('distgrad_optimizer_step')}.",
        ),
        _spike_rule("DistgradGradNormSpike", "gradient norm", "distgrad_grad_norm_spikes_total", "distgrad_grad_norm"),
        _spike_rule("DistgradLossSpike", "loss", "distgrad_loss_spikes_total", "distgrad_loss"),
        _rule(
            "DistgradReplicaMismatch",
            f"increase(distgrad_replica_mismatch_total{sel()}[{a['DistgradReplicaMismatch']['window']}]) > 0",
            "Replicated gradients differ across ranks in {{ $labels.job }}.",
            f"{WHO}: replicated gradients disagreed across ranks on sampled steps in the last "
            f"{a['DistgradReplicaMismatch']['window']}; the last disagreeing rank was "
            f"{tvalue('distgrad_replica_mismatch_rank')}.",
        ),
    ]
    fp16 = [
        _rule(
            "DistgradLossScaleCollapsed",
            f"distgrad_loss_scale_at_minimum{sel()} == 1",
            "fp16 loss scale stuck at its minimum in {{ $labels.job }}.",
            f"The dynamic loss scale of {WHO} has sat at its configured minimum for "
            f"{a['DistgradLossScaleCollapsed']['for']} (now {tvalue('distgrad_loss_scale', '%g')}); "
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
            f"and distgrad_last_step_timestamp_seconds{sel()} > 0\n",
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
    ]
    exporter = [
        _rule(
            "DistgradExporterDown",
            f"up{sel()} == 0",
            "distgrad exporter of {{ $labels.job }} is down.",
            f"Prometheus has failed to scrape {WHO} for {a['DistgradExporterDown']['for']}: rank 0 "
            "exited, hung or is unreachable.",
        ),
        _rule(
            "DistgradExporterAbsent",
            f"absent(up{sel()})",
            "No distgrad scrape target.",
            f"Prometheus has had no target matching {{{CONFIG['selector']}}} for "
            f"{a['DistgradExporterAbsent']['for']}: no distgrad training job is being monitored.",
        ),
    ]
    return {
        "groups": [
            {"name": "distgrad-gradients", "rules": gradients},
            {"name": "distgrad-fp16", "rules": fp16},
            {"name": "distgrad-training", "rules": training},
            {"name": "distgrad-exporter", "rules": exporter},
        ]
    }


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings, no line wrapping, keys in insertion order."""


def _str_representer(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_representer)


def render_rules() -> str:
    body = yaml.dump(alert_rules(), Dumper=_Dumper, sort_keys=False, width=1 << 30, allow_unicode=True)
    return "# Generated by grafana/build.py from its CONFIG: edit that, then run it. Do not edit by hand.\n" + body


# --------------------------------------------------------------------------------------------
# Dashboards
# --------------------------------------------------------------------------------------------

DS = {"type": "prometheus", "uid": "${datasource}"}
#: Series selector every dashboard query uses.
S = 'job=~"$job", run=~"$run", instance=~"$instance"'
RATE = "$__rate_interval"


def target(expr: str, legend: str = "__auto", ref: str = "A", instant: bool = False,
           fmt: str = "time_series") -> dict[str, Any]:
    return {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "format": fmt,
        "instant": instant,
        "legendFormat": legend,
        "range": not instant,
        "refId": ref,
    }


def targets(*specs: tuple) -> list[dict[str, Any]]:
    """``targets((expr, legend), ...)`` with refIds A, B, C..."""
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(specs)]


def thresholds(*steps: tuple[str, float | None]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


GREEN = thresholds(("green", None))
HIDE_FROM = {"legend": False, "tooltip": False, "viz": False}


def _defaults(unit: str, th: dict[str, Any] | None, color_mode: str, **extra: Any) -> dict[str, Any]:
    d = {"color": {"mode": color_mode}, "mappings": [], "thresholds": th or GREEN, "unit": unit}
    d.update(extra)
    return d


def timeseries(title: str, description: str, tgts: list[dict], unit: str, *, log: int = 0,
               th: dict | None = None, bars: bool = False, min_: float | None = None,
               max_: float | None = None, threshold_lines: bool = False) -> dict[str, Any]:
    custom = {
        "axisBorderShow": False,
        "axisCenteredZero": False,
        "axisColorMode": "text",
        "axisLabel": "",
        "axisPlacement": "auto",
        "barAlignment": 0,
        "barWidthFactor": 0.6,
        "drawStyle": "bars" if bars else "line",
        "fillOpacity": 60 if bars else 10,
        "gradientMode": "none",
        "hideFrom": HIDE_FROM,
        "insertNulls": False,
        "lineInterpolation": "linear",
        "lineWidth": 1,
        "pointSize": 4,
        "scaleDistribution": {"type": "log", "log": log} if log else {"type": "linear"},
        "showPoints": "auto",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "none"},
        "thresholdsStyle": {"mode": "line+area" if threshold_lines else "off"},
    }
    extra = {k: v for k, v in (("min", min_), ("max", max_)) if v is not None}
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {**_defaults(unit, th, "palette-classic", **extra), "custom": custom}, "overrides": []},
        "options": {
            "legend": {"calcs": ["lastNotNull", "max"], "displayMode": "table", "placement": "right", "showLegend": True},
            "tooltip": {"hideZeros": False, "mode": "multi", "sort": "desc"},
        },
        "targets": tgts,
    }


def stat(title: str, description: str, tgts: list[dict], unit: str, *, th: dict | None = None,
         graph: bool = False) -> dict[str, Any]:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": _defaults(unit, th, "thresholds"), "overrides": []},
        "options": {
            "colorMode": "value",
            "graphMode": "area" if graph else "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "percentChangeColorMode": "standard",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "showPercentChange": False,
            "textMode": "auto",
            "wideLayout": True,
        },
        "targets": tgts,
    }


def bargauge(title: str, description: str, expr: str, legend: str, unit: str, *,
             th: dict | None = None, max_: float | None = None) -> dict[str, Any]:
    extra = {"min": 0, **({"max": max_} if max_ is not None else {})}
    return {
        "type": "bargauge",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": _defaults(unit, th, "thresholds", **extra), "overrides": []},
        "options": {
            "displayMode": "gradient",
            "legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": False},
            "maxVizHeight": 300,
            "minVizHeight": 16,
            "minVizWidth": 8,
            "namePlacement": "left",
            "orientation": "horizontal",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "showUnfilled": True,
            "sizing": "auto",
            "valueMode": "color",
        },
        "targets": [target(expr, legend, instant=True)],
    }


def table(title: str, description: str, expr: str, unit: str) -> dict[str, Any]:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {
                **_defaults(unit, None, "thresholds"),
                "custom": {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False},
            },
            "overrides": [],
        },
        "options": {
            "cellHeight": "sm",
            "footer": {"countRows": False, "reducer": ["sum"], "show": False},
            "frameIndex": 0,
            "showHeader": True,
        },
        "targets": [target(expr, "", instant=True, fmt="table")],
        "transformations": [
            {"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True}, "indexByName": {}, "renameByName": {}}}
        ],
    }


def heatmap(title: str, description: str, expr: str, legend: str, unit: str) -> dict[str, Any]:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {"custom": {"hideFrom": HIDE_FROM, "scaleDistribution": {"type": "linear"}}, "unit": unit},
            "overrides": [],
        },
        "options": {
            # each series (one per layer) is one row of the heatmap, in legend order
            "calculate": False,
            "cellGap": 1,
            "cellValues": {"unit": unit},
            "color": {
                "exponent": 0.5, "fill": "dark-orange", "mode": "scheme", "reverse": False,
                "scale": "exponential", "scheme": "Spectral", "steps": 64,
            },
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto"},
            "selectionMode": "x",
            "showValue": "never",
            "tooltip": {"mode": "single", "showColorScale": True, "yHistogram": False},
            "yAxis": {"axisPlacement": "left", "reverse": False},
        },
        "targets": [target(expr, legend)],
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout(rows: list[list[tuple[dict[str, Any], int, int]]]) -> list[dict[str, Any]]:
    """Place panels left to right, wrapping at width 24; a row panel takes a full line.
    ``rows`` is a list of lines of ``(panel, width, height)``. Assigns ids 1, 2, ..."""
    out, y, pid = [], 0, 0
    for line in rows:
        x, line_h = 0, 0
        for panel, w, h in line:
            if x + w > 24:
                x, y, line_h = 0, y + line_h, 0
            pid += 1
            out.append({"id": pid, "gridPos": {"h": h, "w": w, "x": x, "y": y}, **copy.deepcopy(panel)})
            x, line_h = x + w, max(line_h, h)
        y += line_h
    return out


def variables(extra: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str, *, all_: bool) -> dict[str, Any]:
        v = {
            "datasource": DS,
            "hide": 0,
            "includeAll": all_,
            "label": label,
            "multi": all_,
            "name": name,
            "options": [],
            "query": query,
            "refresh": 2,
            "regex": "",
            "skipUrlSync": False,
            "sort": 1,
            "type": "query",
        }
        if all_:
            # ".*" also matches series without the label (run is optional)
            v["allValue"] = ".*"
            v["current"] = {"selected": True, "text": ["All"], "value": ["$__all"]}
        return v

    return [
        {
            "hide": 0, "includeAll": False, "label": "Data source", "multi": False, "name": "datasource",
            "options": [], "query": "prometheus", "refresh": 1, "regex": "", "skipUrlSync": False,
            "type": "datasource",
        },
        query_var("job", "Job", f"label_values(distgrad_info{{{CONFIG['selector']}}}, job)", all_=False),
        query_var("run", "Run", 'label_values(distgrad_info{job=~"$job"}, run)', all_=True),
        query_var("instance", "Instance", 'label_values(distgrad_info{job=~"$job", run=~"$run"}, instance)', all_=True),
        *(query_var(**e) for e in (extra or [])),
    ]


ALERT_ANNOTATIONS = [
    {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    },
    {
        "datasource": DS,
        "enable": True,
        "hide": False,
        "iconColor": "red",
        "name": "distgrad alerts",
        # job=~"$job|": also alerts without a job label (DistgradExporterAbsent)
        "target": {"expr": 'ALERTS{alertname=~"Distgrad.*", alertstate="firing", job=~"$job|"}', "interval": "", "refId": "Anno"},
        "tagKeys": "alertname,severity",
        "textFormat": "{{instance}}",
        "titleFormat": "{{alertname}}",
        "useValueForTime": False,
    },
]


def dashboard(uid: str, title: str, description: str, panels: list[dict[str, Any]],
              extra_vars: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    c = CONFIG["dashboards"]
    return {
        "annotations": {"list": ALERT_ANNOTATIONS},
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "links": [
            {
                "asDropdown": False, "icon": "external link", "includeVars": True, "keepTime": True,
                "tags": c["tags"], "targetBlank": False, "title": "distgrad", "tooltip": "",
                "type": "dashboards", "url": "",
            }
        ],
        "panels": panels,
        "refresh": c["refresh"],
        "schemaVersion": c["schema_version"],
        "tags": c["tags"],
        "templating": {"list": variables(extra_vars)},
        "time": {"from": c["time_from"], "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": title,
        "uid": f"{c['uid_prefix']}-{uid}",
        "version": 1,
        "weekStart": "",
    }


def overview() -> dict[str, Any]:
    stall = CONFIG["alerts"]["DistgradTrainingStalled"]["threshold_seconds"]
    stall_th = thresholds(("green", None), ("orange", stall / 2), ("red", stall))
    bad_if_any = thresholds(("green", None), ("red", 1))
    ts = timeseries
    panels = layout([
        [(row("Status"), 24, 1)],
        [
            (stat("Optimizer step", "Optimizer step of the last sampled step (distgrad_optimizer_step).",
                  targets((f"distgrad_optimizer_step{{{S}}}", "{{instance}}")), "none"), 4, 4),
            (stat("Time since last sample", "Seconds since rank 0 last sampled a step; DistgradTrainingStalled fires above the configured threshold.",
                  targets((f"time() - distgrad_last_step_timestamp_seconds{{{S}}}", "{{instance}}")), "s", th=stall_th), 4, 4),
            (stat("Samples/s", "Training samples consumed per second (rate of distgrad_samples_total).",
                  targets((f"rate(distgrad_samples_total{{{S}}}[{RATE}])", "{{instance}}")), "short", graph=True), 4, 4),
            (stat("World size", "Ranks in the job (distgrad_world_size).",
                  targets((f"distgrad_world_size{{{S}}}", "{{instance}}")), "none"), 3, 4),
            (stat("Non-finite steps", "Sampled steps with NaN/Inf gradients since start (distgrad_nonfinite_steps_total).",
                  targets((f"distgrad_nonfinite_steps_total{{{S}}}", "{{instance}}")), "none", th=bad_if_any), 4, 4),
            (stat("Firing distgrad alerts", "Distgrad* alerts firing now (ALERTS from Prometheus' rule evaluation).",
                  targets((f'count(ALERTS{{alertname=~"Distgrad.*", alertstate="firing", job=~"$job|"}}) or vector(0)', "firing")),
                  "none", th=bad_if_any), 5, 4),
        ],
        [(table("Run info", "Static run information (distgrad_info).", f"distgrad_info{{{S}}}", "none"), 24, 4)],
        [(row("Training"), 24, 1)],
        [
            (ts("Loss", "Training loss averaged over ranks and micro-batches of the sampled step (distgrad_loss).",
                targets((f"distgrad_loss{{{S}}}", "{{instance}}")), "none"), 12, 8),
            (ts("Global gradient norm", "L2 norm of the reduced gradient (distgrad_grad_norm), log scale; gaps are NaN/Inf steps.",
                targets((f"distgrad_grad_norm{{{S}}}", "{{instance}}")), "none", log=10), 12, 8),
            (ts("fp16 loss scale", "Dynamic loss scale (distgrad_loss_scale), log2 scale; only runs with a loss scaler export it.",
                targets((f"distgrad_loss_scale{{{S}}}", "{{instance}}")), "short", log=2), 8, 8),
            (ts("Overflow, non-finite and skipped steps", "Steps per interval: fp16 overflows, sampled steps with NaN/Inf gradients, optimizer steps not applied.",
                targets((f"increase(distgrad_overflow_steps_total{{{S}}}[{RATE}])", "overflow {{instance}}"),
                        (f"increase(distgrad_nonfinite_steps_total{{{S}}}[{RATE}])", "non-finite {{instance}}"),
                        (f"increase(distgrad_skipped_steps_total{{{S}}}[{RATE}])", "skipped {{instance}}")),
                "none", bars=True, min_=0), 8, 8),
            (ts("Consecutive overflow steps", "Length of the current fp16 overflow streak (distgrad_consecutive_overflow_steps).",
                targets((f"distgrad_consecutive_overflow_steps{{{S}}}", "{{instance}}")), "none", min_=0,
                th=thresholds(("green", None), ("red", CONFIG["alerts"]["DistgradRepeatedOverflow"]["threshold"])), threshold_lines=True), 8, 8),
            (ts("Samples/s", "Training throughput: rate of distgrad_samples_total.",
                targets((f"rate(distgrad_samples_total{{{S}}}[{RATE}])", "{{instance}}")), "short", min_=0), 12, 8),
            (ts("Time since last sample", "Seconds since the last sampled step; the red band starts at the DistgradTrainingStalled threshold.",
                targets((f"time() - distgrad_last_step_timestamp_seconds{{{S}}}", "{{instance}}")), "s", min_=0,
                th=stall_th, threshold_lines=True), 12, 8),
        ],
        [(row("Spikes"), 24, 1)],
        [
            (ts("Spike z-scores", "Spike score of the last sample per detector (distgrad_grad_norm_zscore, distgrad_loss_zscore).",
                targets((f"distgrad_grad_norm_zscore{{{S}}}", "grad norm {{detector}} {{instance}}"),
                        (f"distgrad_loss_zscore{{{S}}}", "loss {{detector}} {{instance}}")), "none"), 12, 8),
            (ts("Detected spikes", "Spikes detected per interval, per detector.",
                targets((f"increase(distgrad_grad_norm_spikes_total{{{S}}}[{RATE}])", "grad norm {{detector}} {{instance}}"),
                        (f"increase(distgrad_loss_spikes_total{{{S}}}[{RATE}])", "loss {{detector}} {{instance}}")),
                "none", bars=True, min_=0), 12, 8),
        ],
        [(row("Health"), 24, 1)],
        [
            (ts("Internal and sink errors", "Failures inside distgrad (training continued) and per sink, per interval.",
                targets((f"increase(distgrad_internal_errors_total{{{S}}}[{RATE}])", "internal {{instance}}"),
                        (f"increase(distgrad_sink_errors_total{{{S}}}[{RATE}])", "sink {{sink}} {{instance}}")),
                "none", bars=True, min_=0), 8, 8),
            (ts("Replica mismatch", "Sampled steps per interval where replicated gradients differed across ranks, and the last disagreeing rank (-1: none yet).",
                targets((f"increase(distgrad_replica_mismatch_total{{{S}}}[{RATE}])", "mismatched steps {{instance}}"),
                        (f"distgrad_replica_mismatch_rank{{{S}}}", "last rank {{instance}}")),
                "none"), 8, 8),
            (ts("Vanishing / exploding parameters", "Parameters currently flagged as vanishing or exploding.",
                targets((f"distgrad_vanishing_params{{{S}}}", "vanishing {{instance}}"),
                        (f"distgrad_exploding_params{{{S}}}", "exploding {{instance}}")),
                "none", min_=0), 8, 8),
            (ts("Gradient clip ratio", "min(1, max_norm / grad_norm): below 1 means the step was clipped (only with clipping configured).",
                targets((f"distgrad_clip_ratio{{{S}}}", "{{instance}}")), "percentunit", min_=0, max_=1), 12, 8),
            (ts("Sampled steps", "Sampled optimizer steps per interval (distgrad_sampled_steps_total).",
                targets((f"increase(distgrad_sampled_steps_total{{{S}}}[{RATE}])", "{{instance}}")), "none", bars=True, min_=0), 12, 8),
        ],
    ])
    return dashboard("overview", "distgrad / Overview",
                     "Training health from distgrad's rank-0 exporter: loss, gradient norm, fp16 loss scaling, non-finite steps, throughput, stalls, errors.",
                     panels)


def layers() -> dict[str, Any]:
    k = CONFIG["dashboards"]["topk"]
    c = CONFIG["dashboards"]
    head_th = thresholds(("green", None), ("orange", c["headroom_warn"]), ("red", c["headroom_crit"]))
    L = f'{S}, layer=~"$layer"'
    ts = timeseries
    panels = layout([
        [(row("Layers"), 24, 1)],
        [
            (heatmap("Layer gradient norm", "distgrad_layer_grad_norm per layer (rows) over time; colour is the norm.",
                     f"distgrad_layer_grad_norm{{{L}}}", "{{layer}}", "none"), 24, 10),
            (ts("Layer gradient norm (lines)", "distgrad_layer_grad_norm per layer, log scale.",
                targets((f"distgrad_layer_grad_norm{{{L}}}", "{{layer}}")), "none", log=10), 12, 8),
            (ts("Gradient norm by module kind", "Root-sum-square over all parameters of each kind (distgrad_module_kind_grad_norm).",
                targets((f"distgrad_module_kind_grad_norm{{{S}}}", "{{module_kind}}")), "none", log=10), 12, 8),
            (ts("Non-finite elements per layer", "NaN+Inf gradient elements per layer on the last sampled step (distgrad_layer_grad_nonfinite).",
                targets((f"distgrad_layer_grad_nonfinite{{{L}}}", "{{layer}}")), "none", bars=True, min_=0,
                th=thresholds(("green", None), ("red", 1))), 12, 8),
            (table("Non-finite parameters (last non-finite step)", "Elements per (parameter, rank shard) on the last step with NaN/Inf gradients (distgrad_nonfinite_params, at most 20 series).",
                   f"distgrad_nonfinite_params{{{S}}}", "none"), 12, 8),
            (ts("Zero-gradient ratio per layer", "Fraction of exactly-zero gradient elements per layer (distgrad_layer_grad_zero_ratio).",
                targets((f"distgrad_layer_grad_zero_ratio{{{L}}}", "{{layer}}")), "percentunit", min_=0, max_=1), 12, 8),
            (ts("Abs-max headroom per layer", "Largest |gradient| over the largest finite value of the training dtype (distgrad_layer_grad_headroom_ratio); 100% = overflow.",
                targets((f"distgrad_layer_grad_headroom_ratio{{{L}}}", "{{layer}}")), "percentunit", min_=0,
                th=head_th, threshold_lines=True), 12, 8),
        ],
        [(row("Parameters"), 24, 1)],
        [
            (bargauge(f"Top {k} parameters by gradient norm", "Largest per-parameter gradient L2 norms at the last sample (distgrad_param_grad_norm).",
                      f"topk({k}, distgrad_param_grad_norm{{{S}}})", "{{param}}", "none"), 12, 10),
            (bargauge(f"Top {k} parameters by abs-max headroom", "Parameters closest to overflowing the training dtype (distgrad_param_grad_headroom_ratio).",
                      f"topk({k}, distgrad_param_grad_headroom_ratio{{{S}}})", "{{param}}", "percentunit", th=head_th, max_=1), 12, 10),
            (bargauge(f"Top {k} parameters by zero-gradient ratio", "Parameters with the largest fraction of exactly-zero gradient elements (distgrad_param_grad_zero_ratio).",
                      f"topk({k}, distgrad_param_grad_zero_ratio{{{S}}})", "{{param}}", "percentunit", max_=1), 12, 10),
            (bargauge(f"Top {k} parameters by update ratio", "||dw|| / ||w|| of the last applied step (distgrad_param_update_ratio; only when enabled).",
                      f"topk({k}, distgrad_param_update_ratio{{{S}}})", "{{param}}", "none"), 12, 10),
            (ts(f"Top {k} parameter gradient norms over time", "The parameters with the largest gradient norm at each evaluation.",
                targets((f"topk({k}, distgrad_param_grad_norm{{{S}}})", "{{param}}")), "none", log=10), 24, 8),
        ],
    ])
    layer_var = {
        "name": "layer", "label": "Layer", "all_": True,
        "query": 'label_values(distgrad_layer_grad_norm{job=~"$job", run=~"$run", instance=~"$instance"}, layer)',
    }
    return dashboard("layers", "distgrad / Layers and parameters",
                     "Per-layer and per-parameter gradient statistics from distgrad: norms, non-finite elements, zero ratio, dtype headroom.",
                     panels, extra_vars=[layer_var])


DASHBOARDS = {"distgrad-overview.json": overview, "distgrad-layers.json": layers}


def render_dashboard(build) -> str:
    return json.dumps(build(), indent=2) + "\n"


# --------------------------------------------------------------------------------------------

def outputs() -> dict[Path, str]:
    """Every generated file and its content."""
    out = {RULES_PATH: render_rules()}
    out.update({DASHBOARDS_DIR / name: render_dashboard(b) for name, b in DASHBOARDS.items()})
    return out


def stale_outputs() -> list[Path]:
    """Generated files whose committed content differs from a fresh generation."""
    return [p for p, text in outputs().items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale instead of writing")
    args = ap.parse_args(argv)
    if args.check:
        stale = stale_outputs()
        for p in stale:
            print(f"stale: {p.relative_to(HERE.parent)} (run python grafana/build.py)", file=sys.stderr)
        return 1 if stale else 0
    for p, text in outputs().items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
