"""The Prometheus exposition of a record: names, labels and values, checked by parsing the text
that a scrape returns with prometheus_client's own parser, against values computed from the
record's raw sufficient statistics by hand (numpy)."""

from __future__ import annotations

import math
import socket
import urllib.request

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from distgrad.record import ParamStats, StepRecord
from distgrad.export.prometheus import PrometheusSink

STATIC = {"engine": "deepspeed", "zero_stage": "2", "dtype": "bf16", "version": "0.1.0"}


def _record(nan_in_b: bool = False) -> StepRecord:
    a = np.array([1.0, -2.0, 0.0, 4.0])
    b = np.array([0.5, 0.5, -1.5])
    if nan_in_b:
        b = np.array([0.5, np.nan, -1.5])

    def stats(*gs):
        return ParamStats(
            names=["layers.0.w", "layers.1.w"],
            numel=[g.size for g in gs], sum=[g.sum() for g in gs], sumsq=[(g * g).sum() for g in gs],
            nan=[np.isnan(g).sum() for g in gs], inf=[np.isinf(g).sum() for g in gs],
            zeros=[(g == 0).sum() for g in gs], min=[g.min() for g in gs], max=[g.max() for g in gs])
    p = stats(a, b)
    return StepRecord(step=7, micro_step=14, timestamp=1.7e9, world_size=2, params=p,
                      grad_norm=float(np.sqrt(p.sumsq.sum())), loss=2.5,
                      counters={"nonfinite_steps": int(nan_in_b), "sampled_steps": 8})


def _scrape(sink: PrometheusSink) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(sink.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_are_exported_at_zero_before_any_step():
    sink = PrometheusSink("127.0.0.1", 0, STATIC, 2, serve=False)
    m = _scrape(sink)
    for name in ("distgrad_nonfinite_steps_total", "distgrad_internal_errors_total",
                 "distgrad_replica_mismatch_total", "distgrad_overflow_steps_total",
                 "distgrad_skipped_steps_total", "distgrad_sampled_steps_total"):
        assert m[(name, ())] == 0.0, name
    assert m[("distgrad_info", tuple(sorted(STATIC.items())))] == 1.0
    assert m[("distgrad_world_size", ())] == 2.0
    assert ("distgrad_grad_norm", ()) not in m  # nothing sampled yet: no stale or fake value


def test_catalogue_values_match_hand_computed_statistics():
    sink = PrometheusSink("127.0.0.1", 0, STATIC, 2, serve=False)
    rec = _record()
    sink.write(rec)
    m = _scrape(sink)
    a = np.array([1.0, -2.0, 0.0, 4.0])
    P = (("param", "layers.0.w"),)
    assert m[("distgrad_param_grad_norm", P)] == pytest.approx(math.sqrt(1 + 4 + 16))
    assert m[("distgrad_param_grad_mean", P)] == pytest.approx(0.75)
    assert m[("distgrad_param_grad_std", P)] == pytest.approx(a.std())
    assert m[("distgrad_param_grad_min", P)] == -2.0
    assert m[("distgrad_param_grad_max", P)] == 4.0
    assert m[("distgrad_param_grad_abs_max", P)] == 4.0
    assert m[("distgrad_param_grad_zero_ratio", P)] == 0.25
    assert m[("distgrad_param_grad_nonfinite", (("kind", "nan"), ("param", "layers.0.w")))] == 0
    assert m[("distgrad_grad_norm", ())] == pytest.approx(math.sqrt(21 + 0.25 + 0.25 + 2.25))
    assert m[("distgrad_optimizer_step", ())] == 7
    assert m[("distgrad_loss", ())] == 2.5
    assert m[("distgrad_last_sample_timestamp_seconds", ())] == 1.7e9
    assert m[("distgrad_sampled_steps_total", ())] == 8


def test_nan_is_reported_not_masked():
    sink = PrometheusSink("127.0.0.1", 0, STATIC, 2, serve=False)
    sink.write(_record(nan_in_b=True))
    m = _scrape(sink)
    assert math.isnan(m[("distgrad_grad_norm", ())])
    assert math.isnan(m[("distgrad_param_grad_norm", (("param", "layers.1.w"),))])
    assert m[("distgrad_param_grad_nonfinite", (("kind", "nan"), ("param", "layers.1.w")))] == 1
    assert m[("distgrad_nonfinite_steps_total", ())] == 1


def test_serves_http_on_port_zero_and_refuses_a_taken_port():
    sink = PrometheusSink("127.0.0.1", 0, STATIC, 1)
    try:
        assert sink.port > 0
        sink.write(_record())
        body = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=5).read().decode()
        assert "distgrad_grad_norm" in body
        with pytest.raises(OSError, match=r"port=0|another"):
            PrometheusSink("127.0.0.1", sink.port, STATIC, 1)
    finally:
        sink.close()


def test_taken_port_message_names_address_and_fix():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError) as e:
            PrometheusSink("127.0.0.1", port, STATIC, 1)
    assert f"127.0.0.1:{port}" in str(e.value) and "port=0" in str(e.value)


def test_address_not_on_this_machine_gets_a_host_fix():
    with pytest.raises(OSError, match="not an address of this machine") as e:
        PrometheusSink("192.0.2.1", 0 + 9, STATIC, 1)  # TEST-NET-1: never a local address
    assert "port=0" not in str(e.value)
