"""The shipped Alertmanager routing (configs/alertmanager.yml, generated from grafana/config.py
ROUTING and INHIBITIONS) in a live Alertmanager posting to the echo receiver
(launch/echo_receiver.py): critical alerts reach the pager, warnings the ticket receiver, any
other severity no one; one notification per run; a NaN alert silences the divergence alerts of
its run, a dead exporter its "stalled", a page its tickets -- and only of that run.

Alerts are posted to Alertmanager's API as Prometheus would (the routing does not depend on
where they come from); the route timings are shortened to 1 s, the routes and inhibitions are
the shipped ones. About 10 s.
"""

from __future__ import annotations

import io
import time

import pytest

from grafana import config

from .stack import MissingBinary, MonitoringStack, EchoReceiver, shipped_alertmanager_config, wait_until

#: the alerts a NaN alert silences (grafana/config.py: "incident": "divergence")
DIVERGENCE = [n for n, c in config.ALERTS.items() if c.get("incident") == "divergence"]

pytestmark = pytest.mark.monitoring


def _alert(run: str, name: str, severity: str, **ann: str) -> dict:
    return {"labels": {"alertname": name, "severity": severity, "job": "distgrad", "instance": f"{run}:9400",
                       "run": run},
            "annotations": {"summary": f"{name} of {run}", "description": f"{name} of {run}, in detail",
                            "runbook_url": f"docs/runbook.md#{name.lower()}", **ann}}


def test_shipped_routing_and_inhibition(tmp_path):
    assert DIVERGENCE, "no alert of grafana/config.py has incident divergence"
    div, div2 = DIVERGENCE[0], DIVERGENCE[-1]
    out = io.StringIO()
    with EchoReceiver(out=out) as echo:
        cfg = shipped_alertmanager_config(echo.url + "pager", echo.url + "ticket", fast=True)
        stack = MonitoringStack(tmp_path, [], alertmanager_config=cfg)
        try:
            stack.start()
        except MissingBinary as e:
            pytest.skip(f"monitoring binaries missing: {e}")
        with stack:
            stack.post_alerts([
                # run a: a NaN silences the divergence alerts (here a critical one, so that the
                # critical-over-warning rule cannot be what silences it) and the tickets
                _alert("a", "DistgradNaNLoss", "critical"),
                _alert("a", div, "critical"),
                _alert("a", div2, "warning"),
                # run b: a dead exporter silences "stalled"
                _alert("b", "DistgradExporterDown", "critical"),
                _alert("b", "DistgradTrainingStalled", "critical"),
                # run c: without a NaN the divergence alert pages; its warning is silenced by it
                _alert("c", div, "critical"),
                _alert("c", "DistgradStragglingRank", "warning"),
                # run d: a warning alone opens a ticket; another severity reaches no one
                _alert("d", "DistgradStragglingRank", "warning"),
                _alert("d", "DistgradSomeAnnotation", "info"),
            ])
            expected = {"/pager": {("a", "DistgradNaNLoss"), ("b", "DistgradExporterDown"), ("c", div)},
                        "/ticket": {("d", "DistgradStragglingRank")}}

            def got(path):
                return {(a["labels"]["run"], a["labels"]["alertname"]) for a in echo.alerts(path=path)}

            wait_until(lambda: all(got(p) >= e for p, e in expected.items()), 30, what="the expected notifications")
            # the silenced ones would have come with their group (group_wait 1 s): give them 3 s more
            time.sleep(3)
            assert {p: got(p) for p in expected} == expected
            assert {p for p, _ in echo._got} == {"/pager", "/ticket"}
            # one notification per run (group_by job, instance, run), from the named receiver
            for path, receiver in (("/pager", "distgrad-pager"), ("/ticket", "distgrad-ticket")):
                for n in echo.notifications(path):
                    assert n["receiver"] == receiver
                    assert len({a["labels"]["run"] for a in n["alerts"]}) == 1, n
                    assert n["groupLabels"] == {"job": "distgrad", "instance": f"{n['alerts'][0]['labels']['run']}:9400",
                                                "run": n["alerts"][0]["labels"]["run"]}
            # Alertmanager holds the silenced alerts as inhibited, by the rule's source
            held = {(a["labels"]["run"], a["labels"]["alertname"]): a["status"] for a in stack.alertmanager_alerts()}
            for key in [("a", div), ("a", div2), ("b", "DistgradTrainingStalled"), ("c", "DistgradStragglingRank")]:
                assert held[key]["state"] == "suppressed" and held[key]["inhibitedBy"], (key, held[key])
            assert held[("d", "DistgradSomeAnnotation")]["state"] == "active"
    # what a person reads: the echo receiver's text names the page, the alert, the run, the runbook
    text = out.getvalue()
    assert "PAGE (receiver distgrad-pager, 1 firing)" in text and "TICKET (receiver distgrad-ticket, 1 firing)" in text
    assert "FIRING critical DistgradNaNLoss  run a  job distgrad  instance a:9400" in text
    assert "    DistgradNaNLoss of a, in detail" in text
    assert "    runbook: docs/runbook.md#distgradnanloss" in text
    assert "DistgradTrainingStalled" not in text
