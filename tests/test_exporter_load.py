"""Load test of rank 0's exporter (issue 14): a 2-rank DDP run (tests/dist/load_job.py) keeps
its step rate while 32 scrapers flood /metrics and 1,000 idle or half-sent connections are held
open; rank 0's thread count and RSS stay bounded; no scrape fails.

Method: the scrapers' own CPU use on this small machine slows training whatever they scrape,
so the unloaded reference is the same flood against a *decoy*: the same exporter (helper
process and page cache) run from this test process, serving the page rank 0 serves. Phases
alternate decoy / rank 0 (PAIRS = 4 of each, 2.5 s, the first 0.5 s of each left out); the
step rate under load over the step rate under the decoy flood must stay >= RATIO_MIN (0.75:
single phases on the shared 2-core test machine vary by +-30%). Measured there: this exporter
0.89-0.96 (threads 5 -> 5, RSS +1 MiB); the pre-#14 one (prometheus_client's thread per
connection and render per scrape; this test run against main's distgrad before the change)
0.43 with no idle connections and 0.30 with 200, its threads 5 -> 211, and its name[]
scrapes came back empty.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import DIST, ROOT, free_port
from distgrad.export.exporter import ExporterProcess, PageCache

SCRAPERS = 32
IDLE = 1000
PHASE_S, SETTLE_S, PAIRS = 2.5, 0.5, 4
RATIO_MIN = 0.75
ACCEPTS = [{}, {"Accept-Encoding": "gzip"},
           {"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"}]


def _proc_status(pid: int) -> tuple[int, int]:
    """(threads, VmRSS in bytes) of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) * 1024


def _helper_of(pid: int) -> int:
    """The exporter's HTTP helper process among the children of ``pid``."""
    kids = [int(k) for t in Path(f"/proc/{pid}/task").iterdir() for k in (t / "children").read_text().split()]
    (helper,) = [k for k in kids if b"http_server.py" in Path(f"/proc/{k}/cmdline").read_bytes()]
    return helper


class Flood:
    """SCRAPERS threads scraping ``self.port`` (switchable) in a loop, each request checked."""

    def __init__(self) -> None:
        self.port = 0
        self.stop = False
        self.ok = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(SCRAPERS)]

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop:
            n += 1
            port, hdrs = self.port, ACCEPTS[(i + n) % len(ACCEPTS)]
            path = "/metrics?name[]=distgrad_grad_norm" if (i + n) % 5 == 0 else "/metrics"
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                c.request("GET", path, headers=hdrs)
                r = c.getresponse()
                body = r.read()
                if r.getheader("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if r.status != 200 or b"distgrad_grad_norm" not in body:
                    self.errors.append(f"{port}: {r.status} {body[:80]!r}")
                else:
                    self.ok += 1
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"{port}: {type(e).__name__}: {e}")
            finally:
                c.close()
            time.sleep(0.005)


def _decoy(port: int) -> ExporterProcess:
    """The same exporter (helper process + page cache) serving the families rank 0 serves now,
    from this process instead of the training process."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    fams = list(text_string_to_metric_families(c.getresponse().read().decode()))
    c.close()
    return ExporterProcess("127.0.0.1", 0, PageCache({"all": (lambda: 0, lambda: (0, fams))}))


@pytest.mark.multirank
def test_scrape_flood_and_idle_connections_leave_training_speed_threads_and_memory(tmp_path):
    port, ready, stop, out = free_port(), tmp_path / "ready", tmp_path / "stop", tmp_path / "out.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    bindir = Path(sys.executable).parent
    log = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen([str(bindir / "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                             "--master_port", str(free_port()), str(DIST / "load_job.py"), "--out", str(out),
                             "--port", str(port), "--ready", str(ready), "--stop", str(stop)],
                            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    flood, idle, decoy = Flood(), [], None
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.2)
        pid = json.loads(ready.read_text())["pid"]
        decoy = _decoy(port)
        decoy_port = decoy.port
        time.sleep(1.0)
        threads0, rss0 = _proc_status(pid)
        samples = [(threads0, rss0)]
        helper = _helper_of(pid)
        helper_samples = []
        for i in range(IDLE):  # idle connections; every other one with half-sent headers
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1")
            idle.append(s)
        flood.port = decoy_port
        for t in flood.threads:
            t.start()
        phases, scrapes = [], []
        for k in range(2 * PAIRS):
            target = "decoy" if k % 2 == 0 else "rank0"
            flood.port = decoy_port if target == "decoy" else port
            t0, ok0 = time.time(), flood.ok
            while time.time() < t0 + PHASE_S:
                time.sleep(0.25)
                samples.append(_proc_status(pid))
                helper_samples.append(_proc_status(helper))
            phases.append((target, t0 + SETTLE_S, time.time()))
            scrapes.append(flood.ok - ok0)
        flood.stop = True
        for t in flood.threads:
            t.join(15)
        stop.write_text("")
        proc.wait(60)
        assert proc.returncode == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        flood.stop = True
        for s in idle:
            s.close()
        if decoy is not None:
            decoy.close()
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
        log.close()
    times = json.loads(out.read_text())["times"]
    rate = {}
    for target in ("decoy", "rank0"):
        steps = sum(sum(1 for t in times if a <= t < b) for tg, a, b in phases if tg == target)
        rate[target] = steps / sum(b - a for tg, a, b in phases if tg == target)
    ratio = rate["rank0"] / rate["decoy"]
    threads_max = max(t for t, _ in samples)
    rss_growth = max(r for _, r in samples) - rss0
    per_phase = [round(sum(1 for t in times if a <= t < b) / (b - a), 1) for _, a, b in phases]
    print(f"per phase (decoy, rank0, ...): steps/s {per_phase}, scrapes {scrapes}")
    print(f"steps/s {rate}, ratio {ratio:.3f}, scrapes {flood.ok}, threads {threads0}->{threads_max}, "
          f"RSS +{rss_growth / 2**20:.1f} MiB, helper RSS {max(r for _, r in helper_samples) / 2**20:.1f} MiB")
    assert flood.errors == [], flood.errors[:5]
    assert flood.ok > 20 * SCRAPERS  # the flood did run
    assert ratio >= RATIO_MIN, (rate, ratio)
    assert threads_max <= threads0 + 1, (threads0, threads_max)  # no thread per connection
    assert rss_growth < 40 * 2**20, rss_growth
    # the helper holds the connections: one thread, small (its cap of 256 connections)
    assert {t for t, _ in helper_samples} == {1} and max(r for _, r in helper_samples) < 80 * 2**20
