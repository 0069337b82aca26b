"""Alert rules (grafana/alerts/distgrad.rules.yml), their promtool unit tests, the
Prometheus/Alertmanager configs and the runbook links.

promtool and amtool come with the Debian packages prometheus and prometheus-alertmanager
(CI installs them); tests needing one skip with a message saying so when it is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from grafana import alerts, build, config

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "grafana" / "alerts" / "distgrad.rules.yml"
RULE_TESTS = sorted((REPO / "grafana" / "alerts" / "tests").glob("*.yml"))
RUNBOOK = REPO / "docs" / "runbook.md"

#: Alerts issue #4 asks for; issue #23 replaced its DistgradGradNormSpike / DistgradLossSpike (a
#: single spike training recovers from is a dashboard annotation) by the detection policy's
#: alerts on the consequences (distgrad.diagnostics.incidents).
REQUIRED_ALERTS = {
    "DistgradNonFiniteGradients", "DistgradNaNLoss", "DistgradLossDivergence", "DistgradBadBatch",
    "DistgradRecurringSpikes",
    "DistgradLossScaleCollapsed", "DistgradRepeatedOverflow", "DistgradTrainingStalled",
    "DistgradExporterDown", "DistgradExporterAbsent", "DistgradReplicaMismatch", "DistgradInternalErrors",
}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (apt-get install -y prometheus prometheus-alertmanager); CI installs it")
    return path


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_rule_file_is_freshly_generated():
    assert RULES not in build.stale_outputs(), "grafana/alerts/distgrad.rules.yml is stale: run python grafana/build.py"


def test_promtool_check_rules():
    r = _run(_tool("promtool"), "check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in r.stdout


def test_promtool_unit_tests():
    assert RULE_TESTS, "no rule unit tests"
    r = _run(_tool("promtool"), "test", "rules", *map(str, RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(RULE_TESTS), r.stdout


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    fires, silent = set(), set()
    for path in RULE_TESTS:
        for group in yaml.safe_load(path.read_text())["tests"]:
            for t in group.get("alert_rule_test", []):
                if t.get("exp_alerts"):
                    fires.add(t["alertname"])
                    for a in t["exp_alerts"]:  # exact labels and annotations, not a subset
                        assert {"summary", "description", "runbook_url"} <= set(a["exp_annotations"]), (path, t)
                        assert "severity" in a["exp_labels"], (path, t)
                else:
                    silent.add(t["alertname"])
    names = {r["alert"] for r in _rules()}
    assert names - fires == set(), "alerts without a firing test"
    assert names - silent == set(), "alerts without a must-not-fire test"


def test_rule_conventions():
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert REQUIRED_ALERTS <= set(names)
    assert len(names) == len(set(names))
    anchors = {re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
               for h in re.findall(r"^## (.+)$", RUNBOOK.read_text(), re.M)}
    for r in rules:
        assert re.fullmatch(r"Distgrad(?:[A-Z][a-zA-Z0-9]*)+", r["alert"]), r["alert"]
        assert re.fullmatch(r"\d+[smh]", r["for"]), r
        assert r["labels"]["severity"] in {"critical", "warning"}, r
        ann = r["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url"}, r
        if not r["expr"].startswith("absent("):  # absent() has no labels to name
            assert "$labels" in ann["description"], r
        anchor = ann["runbook_url"].split("#", 1)[1]
        assert ann["runbook_url"] == f"docs/runbook.md#{anchor}"  # config.RUNBOOK_URL: inside this repository
        assert anchor == r["alert"].lower() and anchor in anchors, f"docs/runbook.md lacks a section for {r['alert']}"
        assert 'job=~"distgrad.*"' in r["expr"], r  # config.SELECTOR of grafana/config.py


def test_runbook_links_come_from_one_transform():
    written = alerts._groups()
    assert all("runbook_url" not in r["annotations"] for g in written["groups"] for r in g["rules"])
    linked = alerts.with_runbook_links(written)
    rules = [r for g in linked["groups"] for r in g["rules"]]
    assert len(rules) == len(config.ALERTS)
    for r in rules:
        assert r["annotations"]["runbook_url"] == f"{config.RUNBOOK_URL}#{r['alert'].lower()}"
    assert all("runbook_url" not in r["annotations"] for g in written["groups"] for r in g["rules"])  # a copy
    written["groups"][0]["rules"][0]["annotations"]["runbook_url"] = "https://example.invalid/"
    with pytest.raises(ValueError, match="runbook_url is added by with_runbook_links"):
        alerts.with_runbook_links(written)


def test_build_writes_rules_with_another_runbook_base(tmp_path):
    """``grafana/build.py --runbook-url URL --rules-out FILE``: the committed rules with every
    runbook link under URL instead of config.RUNBOOK_URL (docs/runbook.md of this repository)."""
    out = tmp_path / "rules.yml"
    assert build.main(["--runbook-url", "https://wiki.example/rb", "--rules-out", str(out)]) == 0
    text = out.read_text()
    assert text == RULES.read_text().replace("runbook_url: docs/runbook.md#", "runbook_url: https://wiki.example/rb#")
    assert text.count("runbook_url: https://wiki.example/rb#") == len(_rules())
    with pytest.raises(SystemExit):  # the committed file keeps the default base
        build.main(["--runbook-url", "https://wiki.example/rb"])


def test_rules_use_catalogue_metrics_only():
    unknown = build.referenced_metrics(RULES.read_text()) - build.catalogue_metrics()
    assert unknown == set(), f"not in distgrad/export/metrics.py: {sorted(unknown)}"


def test_nonfinite_alert_fires_on_first_step_and_critical():
    (r,) = [r for r in _rules() if r["alert"] == "DistgradNonFiniteGradients"]
    assert r["for"] == "0s" and r["labels"]["severity"] == "critical"
    assert "increase(distgrad_nonfinite_steps_total{" in r["expr"]


def test_prometheus_config_is_valid():
    r = _run(_tool("promtool"), "check", "config", "configs/prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout  # rule_files resolves to the repo's rules
    cfg = yaml.safe_load((REPO / "configs" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["distgrad"]["static_configs"][0]["targets"] == ["127.0.0.1:9400"]
    assert jobs["distgrad-file-sd"]["file_sd_configs"][0]["files"] == ["targets/*.json"]
    assert cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]


def test_alertmanager_config_is_valid():
    r = _run(_tool("amtool"), "check-config", "configs/alertmanager.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 inhibit rules" in r.stdout and "3 receivers" in r.stdout
    cfg = yaml.safe_load((REPO / "configs" / "alertmanager.yml").read_text())
    urls = {rc["name"]: rc["webhook_configs"][0]["url"] for rc in cfg["receivers"] if "webhook_configs" in rc}
    assert urls == {"distgrad-pager": "http://127.0.0.1:9095/pager", "distgrad-ticket": "http://127.0.0.1:9095/ticket"}
    assert cfg["route"]["group_by"] == ["job", "instance", "run"]


def test_alertmanager_config_is_freshly_generated():
    assert build.ALERTMANAGER_PATH not in build.stale_outputs(), \
        "configs/alertmanager.yml is stale: run python grafana/build.py"


def test_amtool_routes_each_alert_by_its_severity():
    """``amtool config routes test`` on the shipped config: every rule of the rule file reaches
    the receiver of the severity it carries there (critical pages, warning tickets); another
    severity (a dashboard annotation) reaches the receiver without notifications."""
    amtool = _tool("amtool")
    by_severity = {"critical": "distgrad-pager", "warning": "distgrad-ticket", "info": "distgrad-annotations"}
    cases = [(r["alert"], r["labels"]["severity"]) for r in _rules()] + [("DistgradSomeAnnotation", "info")]
    assert {sev for _, sev in cases} == set(by_severity)
    for alert, sev in cases:
        r = _run(amtool, "config", "routes", "test", "--config.file=configs/alertmanager.yml",
                 f"alertname={alert}", f"severity={sev}", "job=distgrad", "instance=127.0.0.1:9400", "run=r")
        assert r.returncode == 0 and r.stdout.strip() == by_severity[sev], (alert, sev, r.stdout, r.stderr)


def test_inhibitions_name_known_alerts():
    """The NaN alerts silence the divergence alerts of grafana/config.py (those with
    ``incident: divergence``), a dead exporter silences "stalled", critical silences warning,
    each within one run; every name used is an alert of the rule file."""
    cfg = yaml.safe_load((REPO / "configs" / "alertmanager.yml").read_text())
    names = {r["alert"] for r in _rules()}
    divergence = {n for n, c in config.ALERTS.items() if c.get("incident") == "divergence"}
    assert {"DistgradLossDivergence", "DistgradBadBatch", "DistgradRecurringSpikes"} <= divergence <= names
    assert not {"DistgradGradNormSpike", "DistgradLossSpike"} & names  # single spikes: annotations (issue #23)
    rules = [(i["source_matchers"], i["target_matchers"], i["equal"]) for i in cfg["inhibit_rules"]]
    assert rules == [
        (['alertname=~"DistgradNonFiniteGradients|DistgradNaNLoss"'],
         [f'alertname=~"{"|".join(n for n in config.ALERTS if n in divergence)}"'], ["job", "instance", "run"]),
        (['alertname=~"DistgradExporterDown"'], ['alertname=~"DistgradTrainingStalled"'], ["job", "instance", "run"]),
        (['severity="critical"'], ['severity="warning"'], ["job", "instance", "run"]),
    ]
    for m in [m for i in cfg["inhibit_rules"] for m in i["source_matchers"] + i["target_matchers"]]:
        if m.startswith("alertname=~"):
            assert set(m.split('"')[1].split("|")) <= names, m


def test_monitoring_stack_renders_valid_configs(tmp_path):
    _tool("promtool")
    r = _run("bash", "launch/monitoring_stack.sh", "--check", "--data-dir", str(tmp_path / "d"),
             "--targets-dir", str(tmp_path / "targets"), "--target", "node17:9401",
             "--alertmanager-port", "19093", "--pager-url", "http://127.0.0.1:8080/hook",
             "--ticket-url", "http://127.0.0.1:8080/ticket",
             "--runbook-url", "https://wiki.example/distgrad#")
    assert r.returncode == 0, r.stdout + r.stderr
    prom = yaml.safe_load((tmp_path / "d" / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["node17:9401"]
    assert prom["scrape_configs"][1]["file_sd_configs"][0]["files"] == [f"{tmp_path / 'targets'}/*.json"]
    # the rendered copy of the rules: the same rules, runbook links under the given base
    assert prom["rule_files"] == [str(tmp_path / "d" / "distgrad.rules.yml")]
    rendered = yaml.safe_load((tmp_path / "d" / "distgrad.rules.yml").read_text())
    links = [r["annotations"].pop("runbook_url") for g in rendered["groups"] for r in g["rules"]]
    assert links == [f"https://wiki.example/distgrad#{r['alert'].lower()}" for g in rendered["groups"] for r in g["rules"]]
    committed = yaml.safe_load(RULES.read_text())
    for g in committed["groups"]:
        for r in g["rules"]:
            r["annotations"].pop("runbook_url")
    assert rendered == committed
    # and by default the runbook of this clone
    r = _run("bash", "launch/monitoring_stack.sh", "--check", "--keep", "--data-dir", str(tmp_path / "d2"),
             "--targets-dir", str(tmp_path / "targets"))
    assert r.returncode == 0, r.stdout + r.stderr
    am = yaml.safe_load((tmp_path / "d2" / "alertmanager.yml").read_text())  # the echo receiver's
    assert [rc["webhook_configs"][0]["url"] for rc in am["receivers"][:2]] == [
        "http://127.0.0.1:9095/pager", "http://127.0.0.1:9095/ticket"]
    rendered = yaml.safe_load((tmp_path / "d2" / "distgrad.rules.yml").read_text())
    assert {r["annotations"]["runbook_url"].split("#")[0] for g in rendered["groups"] for r in g["rules"]} == {
        f"file://{REPO}/docs/runbook.md"}
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:19093"]
    am = yaml.safe_load((tmp_path / "d" / "alertmanager.yml").read_text())
    assert am["receivers"][0]["webhook_configs"][0]["url"] == "http://127.0.0.1:8080/hook"
    assert am["receivers"][1]["webhook_configs"][0]["url"] == "http://127.0.0.1:8080/ticket"
    shipped = yaml.safe_load((REPO / "configs" / "alertmanager.yml").read_text())
    assert am["route"] == shipped["route"] and am["inhibit_rules"] == shipped["inhibit_rules"]
