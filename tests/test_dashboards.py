"""Grafana dashboards (grafana/dashboards/*.json): generated fresh by grafana-foundation-sdk,
their generator type-checked against the SDK's types (mypy), structurally sound, and their
PromQL listable by grafana/queries.py for end-to-end tests.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grafana import build, queries

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((REPO / "grafana" / "dashboards").glob("*.json"))
DS = {"type": "prometheus", "uid": "${datasource}"}


def _dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in DASHBOARDS}


def _panels(d: dict) -> list[dict]:
    return list(queries.iter_panels(d["panels"]))


def _exprs(d: dict) -> str:
    return "\n".join(t["expr"] for p in _panels(d) for t in p.get("targets", []))


def test_dashboards_are_freshly_generated():
    assert [p.name for p in DASHBOARDS] == sorted(build.DASHBOARDS)
    stale = [p.name for p in build.stale_outputs() if p.suffix == ".json"]
    assert stale == [], "stale dashboards: run python grafana/build.py"


@pytest.mark.parametrize("name", [p.name for p in DASHBOARDS])
def test_dashboard_structure(name):
    d = _dashboards()[name]
    assert 39 <= d["schemaVersion"] <= 41
    assert d["uid"].startswith("distgrad-") and 8 <= len(d["uid"]) <= 40
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert re.fullmatch(r"label_values\(distgrad_info(\{.*\})?, job\)", variables["job"]["query"])
    for optional in ("run", "instance"):  # label may be absent: "All" must match that too
        assert variables[optional]["includeAll"] and variables[optional]["allValue"] == ".*"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DS, v["name"]

    panels = _panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    boxes = []
    for p in panels:
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= set(g) and all(isinstance(g[k], int) for k in "hwxy"), p["title"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        boxes.append((g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"], p["title"]))
        if p["type"] == "row":
            continue
        assert p["datasource"] == DS, p["title"]
        unit = p["fieldConfig"]["defaults"].get("unit")
        assert isinstance(unit, str) and unit, f"panel {p['title']!r} has no unit"
        assert p.get("description"), p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS, p["title"]
            assert 'job=~"$job"' in t["expr"] or "ALERTS" in t["expr"], (p["title"], t["expr"])
    for i, a in enumerate(boxes):  # no two panels overlap
        for b in boxes[i + 1:]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a[4], b[4])

    alerts = [a for a in d["annotations"]["list"] if a.get("datasource") == DS]
    assert any('ALERTS{alertname=~"Distgrad.*"' in a["target"]["expr"] for a in alerts)


def test_overview_covers_the_training_signals():
    exprs = _exprs(_dashboards()["distgrad-overview.json"])
    for needle in ("distgrad_loss{", "distgrad_grad_norm{", "distgrad_loss_scale{", "distgrad_overflow_steps_total{",
                   "distgrad_nonfinite_steps_total{", "distgrad_skipped_steps_total{", "rate(distgrad_samples_total{",
                   "time() - distgrad_last_step_timestamp_seconds{", "distgrad_internal_errors_total{",
                   "distgrad_replica_mismatch_total{", "distgrad_refused_steps_total{",
                   "distgrad_grad_underflow_ratio{"):
        assert needle in exprs, needle


#: plug-in metrics not drawn, each for its reason: the optimizer step the held values of a signal
#: measured every few sampled steps come from (the panels' values are those of the last
#: measurement); the noise scale's micro-batch size, a setting constant over the run
NOT_DRAWN = {"distgrad_underflow_measured_step", "distgrad_applied_update_step", "distgrad_optimizer_signals_step",
             "distgrad_gradient_noise_micro_batch_size"}


def test_every_plug_in_metric_is_on_a_dashboard():
    """Every metric a signal or diagnostic plug-in declares (the opt-in families a user switches
    on) is read by some dashboard query, but the few of NOT_DRAWN; the rerun attribution's host
    to quarantine was not."""
    import distgrad.diagnostics  # noqa: F401 - registers the built-in plug-ins
    import distgrad.signals  # noqa: F401
    from distgrad.export import metrics

    declared = {n for _, _, names in metrics.PLUGIN_SAMPLES for n in names}
    assert {"distgrad_layer_attention_logit_max", "distgrad_rerun_quarantine_host_info",
            "distgrad_fp8_amax_min", "distgrad_router_load_imbalance"} <= declared  # the registry is read
    queried = {m for q in queries.dashboard_queries("distgrad") for m in q.metrics}
    fams = {m: metrics.by_name(m).family for m in declared}
    missing = sorted(m for m in declared - NOT_DRAWN if m not in queried and fams[m] not in queried)
    assert missing == [], missing
    assert NOT_DRAWN <= declared  # no stale entry


def test_layers_view_covers_layers_and_parameters():
    d = _dashboards()["distgrad-layers.json"]
    heatmaps = [p for p in _panels(d) if p["type"] == "heatmap"]
    assert any(t["expr"].startswith("distgrad_layer_grad_norm{") for p in heatmaps for t in p["targets"])
    exprs = _exprs(d)
    for needle in ("topk(10, distgrad_param_grad_norm{", "distgrad_layer_grad_nonfinite{",
                   "distgrad_layer_grad_zero_ratio{", "distgrad_layer_grad_headroom_ratio{",
                   "distgrad_layer_grad_underflow_ratio{"):
        assert needle in exprs, needle


def _metrics(panel: dict) -> list[str]:
    return sorted({m for t in panel["targets"] for m in re.findall(r"\b(distgrad_[a-z0-9_]+|ALERTS)\b", t["expr"])})


def _opt_in_only(panel: dict, opt_in: set[str]) -> set[str]:
    """The off-by-default conditions of ``panel`` when every metric it reads has one, else empty."""
    per_metric = [set(queries.conditions([m])) for m in _metrics(panel)]
    if per_metric and all(c and c <= opt_in for c in per_metric):
        return set().union(*per_metric)
    return set()


def test_off_by_default_features_sit_in_collapsed_rows_that_say_how_to_enable_them():
    """A default run fills every panel in sight: each panel whose metrics exist only with a
    feature a default run lacks (the conditions of ``common.OPT_IN``) is in a collapsed row whose
    title names how to turn that feature on; no panel of a default feature hides in such a row;
    the non-finite tables say "none" instead of "No data" before any event. Values spanning
    decades are drawn on log axes."""
    from grafana.dashboards import common
    opt_in = set(common.OPT_IN)
    hidden = 0
    for d in _dashboards().values():
        for top in d["panels"]:
            inner = top.get("panels", [])
            assert top["type"] == "row" or not inner, top["title"]
            if top["type"] != "row":
                continue
            assert top["collapsed"] == bool(inner), top["title"]  # collapsed rows hold their panels
            for p in inner:
                conds = _opt_in_only(p, opt_in)
                assert conds, (top["title"], p["title"])  # nothing a default run has
                for c in conds:
                    assert common.OPT_IN[c] in top["title"], (top["title"], c)
                hidden += 1
        for p in d["panels"]:
            if p["type"] == "row":
                continue
            assert not _opt_in_only(p, opt_in), p["title"]  # in sight: a default run fills it
            if p["type"] == "table" and set(queries.conditions(_metrics(p))) == {"nonfinite"}:
                assert p["fieldConfig"]["defaults"]["noValue"] == "none: no non-finite step yet", p["title"]
    assert hidden >= 11
    log_axes = {p["title"]: p["fieldConfig"]["defaults"]["custom"]["scaleDistribution"]
                for d in _dashboards().values() for p in _panels(d) if p["type"] == "timeseries"}
    for title in ("Update RMS", "Update RMS per layer", "Second-moment spike fraction", "Spike fraction per layer",
                  "Global gradient norm", "Layer gradient norm (lines)", "Abs-max headroom per layer"):
        assert log_axes[title] == {"type": "log", "log": 10}, title
    assert log_axes["fp16 loss scale"] == {"type": "log", "log": 2}


def test_dashboards_use_catalogue_metrics_only():
    catalogue = build.catalogue_metrics()
    queried = {m for q in queries.dashboard_queries("distgrad") for m in q.metrics} - {"ALERTS"}
    assert queried and queried <= catalogue, f"not in distgrad/export/metrics.py: {sorted(queried - catalogue)}"
    for p in DASHBOARDS:  # descriptions too
        unknown = build.referenced_metrics(p.read_text()) - catalogue
        assert unknown == set(), f"{p.name}: not in distgrad/export/metrics.py: {sorted(unknown)}"


def test_panel_descriptions_and_units_come_from_the_catalogue():
    from distgrad.export import metrics as catalogue

    from grafana.dashboards import common
    n = 0
    for d in _dashboards().values():
        for p in _panels(d):
            if p["type"] == "row":
                continue
            names = sorted({m for t in p["targets"] for m in re.findall(r"\bdistgrad_[a-z0-9_]+", t["expr"])})
            for name in names:
                m = catalogue.by_name(name)
                assert f"`{name}` ({m.unit}): {m.help}" in p["description"], (p["title"], name)
                n += 1
            units = {catalogue.by_name(x).unit for x in names}
            if units == {"ratio"} and "update ratio" not in p["title"]:  # ||dw|| / ||w||: unit="none"
                assert p["fieldConfig"]["defaults"]["unit"] == "percentunit", p["title"]
            if units == {"seconds"}:
                assert p["fieldConfig"]["defaults"]["unit"] == "s", p["title"]
    assert n >= 35  # (panel, metric) pairs checked
    with pytest.raises(KeyError, match="distgrad_not_declared"):
        common.describe("", ['rate(distgrad_not_declared{job="x"}[1m])'])
    with pytest.raises(ValueError, match="pass unit="):
        common.grafana_unit(["distgrad_clip_ratio", "distgrad_loss"])  # percentunit and none
    assert common.grafana_unit(["time() - distgrad_last_step_timestamp_seconds"]) == "s"


def test_queries_lists_every_target_with_variables_substituted():
    qs = queries.dashboard_queries("my-job-.*", rate_interval="30s")
    n_targets = sum(len(p.get("targets", [])) for d in _dashboards().values() for p in _panels(d))
    assert len([q for q in qs if q.kind == "panel"]) == n_targets
    assert {q.kind for q in qs} == {"panel", "variable", "annotation"}
    for q in qs:
        assert "$" not in q.expr and "[[" not in q.expr, q.expr
    panel_exprs = [q.expr for q in qs if q.kind == "panel"]
    assert 'distgrad_loss{job=~"my-job-.*", run=~".*", instance=~".*"}' in panel_exprs
    assert 'rate(distgrad_samples_total{job=~"my-job-.*", run=~".*", instance=~".*"}[30s])' in panel_exprs
    (loss_scale,) = [q for q in qs if q.expr.startswith("distgrad_loss_scale{")]
    assert loss_scale.conditional == ("loss_scaler",)  # distgrad/export/metrics.py: fp16 with a dynamic loss scaler only
    assert "fp16" in queries.condition_text("loss_scaler")
    with pytest.raises(ValueError, match="unknown_var"):
        queries.substitute("x{a=~\"$unknown_var\"}", {})


def test_provisioning_files():
    ds = yaml.safe_load((REPO / "grafana" / "provisioning" / "datasources" / "distgrad.yml").read_text())
    (src,) = ds["datasources"]
    assert ds["apiVersion"] == 1 and src["type"] == "prometheus" and src["url"].startswith("http://127.0.0.1:")
    prov = yaml.safe_load((REPO / "grafana" / "provisioning" / "dashboards" / "distgrad.yml").read_text())
    (p,) = prov["providers"]
    assert prov["apiVersion"] == 1 and p["type"] == "file" and p["options"]["path"]


# --- static type check of the generator against grafana-foundation-sdk's types --------------------
#
# The dashboards are built only through the SDK's builders, whose methods and enums are typed after
# Grafana's schema (the SDK ships py.typed): a misspelt option is a method that does not exist, a
# wrong value an argument of the wrong type. Python does not check that at run time, so mypy does.

MYPY_TARGETS = ("grafana/config.py", "grafana/dashboards")


def _mypy(root: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir", str(cache),
                           "--config-file", str(REPO / "pyproject.toml"), *MYPY_TARGETS],
                          cwd=root, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mypy-cache")


def test_dashboard_generator_type_checks_against_the_sdk(mypy_cache):
    r = _mypy(REPO, mypy_cache)
    assert r.returncode == 0, r.stdout + r.stderr


def test_type_check_rejects_broken_dashboard_code(tmp_path, mypy_cache):
    shutil.copytree(REPO / "grafana", tmp_path / "grafana", ignore=shutil.ignore_patterns("*.json", "__pycache__"))

    def edit(rel: str, old: str, new: str) -> None:
        path = tmp_path / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.write_text(text.replace(old, new, 1))

    edit("grafana/dashboards/common.py", ".placement(c.LegendPlacement.RIGHT)", ".placment(c.LegendPlacement.RIGHT)")
    edit("grafana/dashboards/common.py", ".draw_style(c.GraphDrawStyle.BARS if bars else c.GraphDrawStyle.LINE)",
         '.draw_style("dots")')  # not a draw style
    edit("grafana/dashboards/overview.py", '("red", stall))', '("red", "stall"))')  # a threshold that is no number
    r = _mypy(tmp_path, mypy_cache)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert '"VizLegendOptions" has no attribute "placment"' in out, out
    assert 'incompatible type "str"; expected "GraphDrawStyle"' in out, out
    assert "grafana/dashboards/overview.py" in out and 'Argument "th" to "stat" has incompatible type' in out, out


def test_spikes_and_incidents_are_annotations_on_every_dashboard():
    """A single spike is no alert (docs/runbook.md, "Detection policy"): every dashboard marks the
    robust/window detectors' spikes from their counters, and the policy's incidents."""
    for name, d in _dashboards().items():
        by_name = {a["name"]: a for a in d["annotations"]["list"]}
        spikes, incidents = by_name["distgrad spikes"], by_name["distgrad incidents"]
        for series in ("grad_norm", "loss"):
            assert f'increase(distgrad_{series}_spikes_total{{job=~"$job"' in spikes["target"]["expr"], name
        assert 'detector=~"robust|window"' in spikes["target"]["expr"] and spikes["tagKeys"] == "series,detector"
        assert incidents["target"]["expr"].startswith("increase(distgrad_incidents_total{") and \
            incidents["tagKeys"] == "incident", name
