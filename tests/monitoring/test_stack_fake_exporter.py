"""The monitoring fixtures against live processes: two fake distgrad exporters (a bf16 run
that hits a NaN gradient, and a healthy fp16 run) scraped by Prometheus with the repository's
rules, Alertmanager posting to a local webhook.

One Prometheus run (module-scoped fixture) serves both tests; about 15 s in all.
"""

from __future__ import annotations

import time

import pytest


from .fake_exporter import FakeDistgradRun
from .stack import REPO, MissingBinary, MonitoringStack, EchoReceiver, wait_until

pytestmark = pytest.mark.monitoring

NAN_PARAM = "layers.1.mlp.weight"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    sick, healthy = FakeDistgradRun(fp16=False), FakeDistgradRun(fp16=True)
    with sick, healthy, EchoReceiver(out=None) as hook:
        stack = MonitoringStack(tmp_path_factory.mktemp("stack"), [sick.address, healthy.address],
                                webhook_url=hook.url)
        try:
            stack.start()
        except MissingBinary as e:
            pytest.skip(f"monitoring binaries missing: {e}")
        with stack:
            stack.wait_for_targets_up()
            yield stack, hook, sick, healthy


def _about(alerts, address):
    return [a for a in alerts if a["labels"].get("instance") == address]


def test_nan_gradient_alert_reaches_webhook_and_healthy_run_stays_silent(env):
    stack, hook, sick, healthy = env
    # both runs healthy, counters scraped at 0 (so increase() will see 0 -> 1), rules evaluated
    for run in (sick, healthy):
        wait_until(lambda: stack.query(f'distgrad_nonfinite_steps_total{{instance="{run.address}"}} == 0'),
                   10, what=f"{run.address} scraped with the counter at 0")
    wait_until(lambda: stack.query(f'count_over_time(distgrad_optimizer_step{{instance="{sick.address}"}}[1m]) >= 2'),
               10, what="two scrapes of the sick run")
    stack.wait_for_rule_evaluation()
    assert stack.alerts() == [], "healthy runs raised alerts"

    sick.nan_step(NAN_PARAM, layer="1", rank=1, elements=12)
    t_nan = time.monotonic()

    firing = wait_until(lambda: stack.firing("DistgradNonFiniteGradients"), 20, what="DistgradNonFiniteGradients firing")
    (alert,) = firing
    assert alert["labels"] == {"alertname": "DistgradNonFiniteGradients", "severity": "critical",
                               "job": "distgrad", "instance": sick.address}
    assert f"{NAN_PARAM} (rank 1: 12 elements)" in alert["annotations"]["description"]
    # the step (since f1d6ff3 the text names the streak's origin step and the last sampled step)
    assert f"since sampled optimizer step {sick.last_step}, where the streak started" in alert["annotations"]["description"]
    assert f"(last sampled step: {sick.last_step};" in alert["annotations"]["description"]

    delivered = wait_until(lambda: hook.alerts("DistgradNonFiniteGradients", status="firing"), 20,
                           what="webhook notification")
    latency = time.monotonic() - t_nan
    a = delivered[0]
    assert a["labels"]["alertname"] == "DistgradNonFiniteGradients"
    assert a["labels"]["instance"] == sick.address and a["labels"]["severity"] == "critical"
    assert NAN_PARAM in a["annotations"]["description"]
    assert a["annotations"]["runbook_url"].endswith("docs/runbook.md#distgradnonfinitegradients")
    assert latency < 20, latency

    # the healthy run was scraped and evaluated all along: no alert, not even pending
    stack.wait_for_rule_evaluation()
    assert _about(stack.alerts(), healthy.address) == []
    assert _about(hook.alerts(), healthy.address) == []
    assert {x["labels"]["alertname"] for x in stack.alerts()} == {"DistgradNonFiniteGradients"}
    assert {x["labels"]["alertname"] for x in stack.alertmanager_alerts()} == {"DistgradNonFiniteGradients"}


def test_every_dashboard_query_parses_and_has_data_from_the_fakes(env):
    """Runs every dashboard query (variables substituted) against the live Prometheus: each
    must be valid PromQL, and each over metrics the fakes export must return data."""
    stack, _, sick, healthy = env
    from grafana import queries
    exported = sick.metric_names() | healthy.metric_names()
    qs = queries.dashboard_queries("distgrad", rate_interval="1m")
    assert len(qs) > 40
    wait_until(lambda: stack.query(f'count_over_time(distgrad_samples_total{{instance="{healthy.address}"}}[1m]) >= 2'),
               10, what="two scrapes of the healthy run")
    counts = queries.run_queries(stack.prometheus_url, qs)  # raises on a PromQL error
    empty = [(q.dashboard, q.title, q.expr) for q, n in counts.items()
             if n == 0 and q.kind != "annotation" and set(q.metrics) - {"ALERTS"} <= exported]
    assert empty == []
