"""Grafana dashboards (grafana/dashboards/*.json): generated fresh, type-checked against
@grafana/schema with tsc (grafana/schema-check, needs node and npm), structurally sound, and
their PromQL listable by grafana/queries.py for end-to-end tests.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import load_grafana

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((REPO / "grafana" / "dashboards").glob("*.json"))
SCHEMA_CHECK = REPO / "grafana" / "schema-check"
DS = {"type": "prometheus", "uid": "${datasource}"}


def _dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in DASHBOARDS}


def _panels(d: dict) -> list[dict]:
    return list(load_grafana("queries").iter_panels(d["panels"]))


def _exprs(d: dict) -> str:
    return "\n".join(t["expr"] for p in _panels(d) for t in p.get("targets", []))


def test_dashboards_are_freshly_generated():
    build = load_grafana("build")
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
                   "distgrad_replica_mismatch_total{"):
        assert needle in exprs, needle


def test_layers_view_covers_layers_and_parameters():
    d = _dashboards()["distgrad-layers.json"]
    heatmaps = [p for p in _panels(d) if p["type"] == "heatmap"]
    assert any(t["expr"].startswith("distgrad_layer_grad_norm{") for p in heatmaps for t in p["targets"])
    exprs = _exprs(d)
    for needle in ("topk(10, distgrad_param_grad_norm{", "distgrad_layer_grad_nonfinite{",
                   "distgrad_layer_grad_zero_ratio{", "distgrad_layer_grad_headroom_ratio{"):
        assert needle in exprs, needle


def test_dashboards_use_catalogue_metrics_only():
    build = load_grafana("build")
    catalogue = build.catalogue_metrics()
    for p in DASHBOARDS:
        unknown = build.referenced_metrics(p.read_text()) - catalogue
        assert unknown == set(), f"{p.name}: not in docs/metrics.md: {sorted(unknown)}"


def test_queries_lists_every_target_with_variables_substituted():
    queries = load_grafana("queries")
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
    assert loss_scale.conditional == ("fp16 with a dynamic loss scaler",)
    with pytest.raises(ValueError, match="unknown_var"):
        queries.substitute("x{a=~\"$unknown_var\"}", {})


def test_provisioning_files():
    ds = yaml.safe_load((REPO / "grafana" / "provisioning" / "datasources" / "distgrad.yml").read_text())
    (src,) = ds["datasources"]
    assert ds["apiVersion"] == 1 and src["type"] == "prometheus" and src["url"].startswith("http://127.0.0.1:")
    prov = yaml.safe_load((REPO / "grafana" / "provisioning" / "dashboards" / "distgrad.yml").read_text())
    (p,) = prov["providers"]
    assert prov["apiVersion"] == 1 and p["type"] == "file" and p["options"]["path"]


# --- TypeScript check against @grafana/schema --------------------------------------------------

def _schema_check(*files: Path) -> subprocess.CompletedProcess:
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node and npm are needed for the @grafana/schema type check (CI has them)")
    if not (SCHEMA_CHECK / "node_modules" / "typescript").is_dir():
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=SCHEMA_CHECK, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"npm ci in grafana/schema-check failed:\n{r.stdout}{r.stderr}"
    return subprocess.run([node, "check.mjs", *map(str, files)], cwd=SCHEMA_CHECK, capture_output=True,
                          text=True, timeout=300)


def test_dashboards_type_check_against_grafana_schema():
    r = _schema_check()
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(DASHBOARDS)} dashboard(s) type-check" in r.stdout


def test_schema_check_rejects_broken_dashboards(tmp_path):
    d = _dashboards()["distgrad-overview.json"]
    ts = next(p for p in d["panels"] if p["type"] == "timeseries")
    ts["options"]["legend"]["placment"] = "bottom"  # misspelt option
    ts["fieldConfig"]["defaults"]["custom"]["drawStyle"] = "dots"  # not a draw style
    stat = next(p for p in d["panels"] if p["type"] == "stat")
    del stat["fieldConfig"]["defaults"]["unit"]
    (tmp_path / "broken.json").write_text(json.dumps(d, indent=2))
    r = _schema_check(tmp_path / "broken.json")
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "placment" in out and '"dots"' in out and "unit" in out, out
    assert "broken.json(" in out  # errors point into the JSON file
