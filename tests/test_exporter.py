"""The exporter (distgrad/export/exporter.py + its HTTP helper process, http_server.py) over real
loopback sockets: families collected once per change (not per scrape) and served from the
helper's copy with prometheus_client's exposition (responses equal its own WSGI app's), the name[] filter, OpenMetrics and gzip negotiation, keep-alive, and connections that
never finish a request dropped without a thread each."""

from __future__ import annotations

import gzip
import http.client
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest, make_wsgi_app
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from distgrad.record import ParamStats, StepRecord
from distgrad.export.prometheus import PrometheusSink

STATIC = {"engine": "ddp", "zero_stage": "", "dtype": "fp32", "version": "0"}


def _record(step: int) -> StepRecord:
    p = ParamStats(["a.w", "b.w"], numel=[2, 2], sum=[1.0, 2.0], sumsq=[1.0, 2.0 + step], nan=[0, 0],
                   inf=[0, 0], zeros=[0, 0], min=[0.0, 0.5], max=[1.0, 1.5])
    return StepRecord(step, step, 1e9 + step, 2, p, float(np.sqrt(p.sumsq.sum())), loss=1.0 / (1 + step),
                      counters={"sampled_steps": step + 1})


def _get(port: int, path: str = "/metrics", headers: dict | None = None, method: str = "GET"):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def _proc_status(pid: int) -> dict[str, str]:
    return {k: v.strip() for k, v in (line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())}


def _values(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def sink():
    s = PrometheusSink("127.0.0.1", 0, STATIC, 2, timeout_s=0.6, max_connections=48, refresh_s=0)
    yield s
    s.close()


def test_served_page_equals_the_library_rendering_and_follows_writes(sink):
    for step in range(3):
        sink.write(_record(step))
        status, hdr, body = _get(sink.port)
        assert status == 200 and hdr["Content-Type"].startswith("text/plain; version=0.0.4")
        assert body == generate_latest(sink.registry)  # the cached bytes = prometheus_client's own
        assert _values(body.decode())[("distgrad_optimizer_step", ())] == step


def test_rendered_once_per_change_not_per_scrape(sink):
    sink.write(_record(1))
    _get(sink.port)
    before = sink.cache.renders
    for _ in range(30):
        assert _get(sink.port)[0] == 200
    assert sink.cache.renders == before  # nothing changed: no rendering at all
    sink.write(_record(2))  # a new record and new counters: each part once
    for _ in range(10):
        _get(sink.port)
    assert sink.cache.renders == before + 2
    sink.collector.step_time = 5.0  # an unsampled step: only the small head part
    for _ in range(10):
        _get(sink.port)
    assert sink.cache.renders == before + 3


def test_a_flood_refreshes_at_most_once_per_refresh_s():
    s = PrometheusSink("127.0.0.1", 0, STATIC, 2, refresh_s=0.5)
    try:
        s.write(_record(1))
        assert _values(_get(s.port)[2].decode())[("distgrad_optimizer_step", ())] == 1
        renders = s.cache.renders
        s.write(_record(2))
        t0 = time.monotonic()
        seen = set()
        while time.monotonic() < t0 + 0.3:  # within refresh_s of the last rendering: the copy
            seen.add(_values(_get(s.port)[2].decode())[("distgrad_optimizer_step", ())])
        assert seen == {1} and s.cache.renders == renders
        time.sleep(0.3)
        assert _values(_get(s.port)[2].decode())[("distgrad_optimizer_step", ())] == 2
        assert s.cache.renders == renders + 2  # head and body, once
    finally:
        s.close()


def test_name_filter_selects_families_and_never_answers_empty(sink):
    sink.write(_record(4))
    full = _values(_get(sink.port)[2].decode())
    status, _, body = _get(sink.port, "/metrics?name[]=distgrad_grad_norm&name[]=distgrad_sampled_steps_total")
    got = _values(body.decode())
    assert status == 200
    assert set(got) == {("distgrad_grad_norm", ()), ("distgrad_sampled_steps_total", ())}
    assert all(got[k] == full[k] for k in got)
    per_param = _values(_get(sink.port, "/metrics?name[]=distgrad_param_grad_norm")[2].decode())
    assert set(per_param) == {("distgrad_param_grad_norm", (("param", "a.w"),)),
                              ("distgrad_param_grad_norm", (("param", "b.w"),))}
    # a name that is not served: the full page, not an empty 200
    status, _, body = _get(sink.port, "/metrics?name[]=distgrad_no_such_metric")
    assert status == 200 and _values(body.decode()) == full


def test_openmetrics_and_gzip_negotiation(sink):
    sink.write(_record(2))
    plain = _get(sink.port)[2]
    accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # what Prometheus sends
    status, hdr, body = _get(sink.port, headers={"Accept": accept, "Accept-Encoding": "gzip"})
    assert status == 200 and hdr["Content-Encoding"] == "gzip"
    assert hdr["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    text = gzip.decompress(body).decode()
    assert text.endswith("# EOF\n")
    om = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in om_families(text) for s in f.samples}
    assert om == _values(plain.decode())
    status, hdr, body = _get(sink.port, headers={"Accept-Encoding": "gzip, deflate"})
    assert hdr["Content-Encoding"] == "gzip" and gzip.decompress(body) == plain
    filtered = _get(sink.port, "/metrics?name[]=distgrad_loss", {"Accept": accept})[2].decode()
    assert filtered.endswith("# EOF\n") and "distgrad_loss " in filtered and "distgrad_grad_norm" not in filtered


def test_responses_equal_prometheus_clients_own_app(sink):
    """Each variant (format, gzip, name[]) equals what prometheus_client's make_wsgi_app answers
    for the training process's registry: same Content-Type and encoding, same page."""
    sink.write(_record(3))
    app = make_wsgi_app(sink.registry)
    om = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    cases = [("", "", ""), (om, "", ""), ("", "gzip", ""), (om, "gzip", "name[]=distgrad_loss"),
             ("", "", "name[]=distgrad_param_grad_norm&name[]=distgrad_sampled_steps_total"),
             ("text/plain;version=1.0.0", "", "")]
    for accept, enc, query in cases:
        status, hdr, body = _get(sink.port, "/metrics" + ("?" + query if query else ""),
                                 {"Accept": accept, "Accept-Encoding": enc})
        got: dict = {}
        want = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": query,
                             "HTTP_ACCEPT": accept, "HTTP_ACCEPT_ENCODING": enc},
                            lambda st, h: got.update(status=st, headers=dict(h))))
        assert status == 200 and got["status"] == "200 OK", (accept, enc, query)
        assert hdr["Content-Type"] == got["headers"]["Content-Type"], (accept, enc, query)
        assert hdr.get("Content-Encoding") == got["headers"].get("Content-Encoding"), (accept, enc, query)
        if enc:  # gzip streams differ in their header's timestamp: compare the pages
            body, want = gzip.decompress(body), gzip.decompress(want)
        assert body == want, (accept, enc, query)


def test_keep_alive_head_and_errors(sink):
    sink.write(_record(1))
    c = http.client.HTTPConnection("127.0.0.1", sink.port, timeout=5)
    try:
        for _ in range(3):  # one connection, several scrapes (as Prometheus does)
            c.request("GET", "/metrics")
            r = c.getresponse()
            assert r.status == 200 and b"distgrad_grad_norm" in r.read()
        c.request("HEAD", "/metrics")
        r = c.getresponse()
        assert r.status == 200 and int(r.getheader("Content-Length")) > 0 and r.read() == b""
    finally:
        c.close()
    assert _get(sink.port, method="POST")[0] == 405
    assert _get(sink.port, "/favicon.ico")[0] == 404
    with socket.create_connection(("127.0.0.1", sink.port), timeout=5) as s:
        s.sendall(b"NONSENSE\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")


def test_idle_and_half_sent_connections_are_dropped_without_threads(sink):
    sink.write(_record(1))
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", sink.port), timeout=5) for _ in range(150)]
    for s in idle[::2]:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x")  # half-sent headers
    time.sleep(0.2)
    assert threading.active_count() == threads  # no thread per connection
    assert _get(sink.port)[0] == 200  # scrapes still served: over the cap, the oldest idle go
    helper = _proc_status(sink.server.pid)
    assert helper["Threads"] == "1"  # the helper process: one thread for every connection
    assert len(list(Path(f"/proc/{sink.server.pid}/fd").iterdir())) <= 48 + 8  # over the cap: closed
    deadline = time.monotonic() + 5
    closed = 0
    for s in idle:  # every one is closed by the server: evicted at once, or after timeout_s
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            closed += s.recv(1) == b""
        except ConnectionResetError:  # closed with the half-sent request unread
            closed += 1
        except socket.timeout:
            pass
        s.close()
    assert closed == len(idle)


def test_close_releases_the_port():
    s = PrometheusSink("127.0.0.1", 0, STATIC, 1)
    port = s.port
    assert _get(port)[0] == 200
    s.close()
    s2 = PrometheusSink("127.0.0.1", port, STATIC, 1)  # the port is free again
    s2.close()
