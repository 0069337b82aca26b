"""Run lifecycle of rank 0's exporter (issue 23 item 4): ``distgrad_run_state`` 1 while running,
2 after a clean end, served until a scraper has read it (bounded by ``exporter.linger_seconds``
and by the scraper's own rhythm), the file_sd target (a file or one file per run in a
directory) removed at a clean end and kept after a crash.

The values are read back the way Prometheus reads them: HTTP GETs of the served page, parsed
by prometheus_client's text parser. The process-level cases (interpreter exit without
``close()``, an uncaught exception, an exception out of ``with instrument``) run as concurrent
subprocesses; about 15 s in all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from distgrad.export.prometheus import PrometheusSink

REPO = Path(__file__).resolve().parents[1]


def _state(page: str) -> float | None:
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            if s.name == "distgrad_run_state":
                return s.value
    return None


class Scraper:
    """GETs ``url`` every ``every`` seconds in a thread; keeps (time, run_state) of each page."""

    def __init__(self, url: str, every: float) -> None:
        self.url, self.every = url, every
        self.seen: list[tuple[float, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(_scrape(self.url), timeout=2) as r:
                    self.seen.append((time.monotonic(), _state(r.read().decode())))
            except OSError:
                pass
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _scrape(url: str) -> urllib.request.Request:
    """A GET as Prometheus sends it (with its scrape-timeout header, which marks a scrape)."""
    return urllib.request.Request(url, headers={"X-Prometheus-Scrape-Timeout-Seconds": "2"})


def _sink(**kw) -> PrometheusSink:
    return PrometheusSink("127.0.0.1", 0, {"engine": "test"}, 1, refresh_s=0, **kw)


def test_clean_close_serves_finished_until_scraped_and_removes_the_target_file(tmp_path):
    sink = _sink(linger_s=10)
    sink.file_sd_path = str(tmp_path / "t.json")
    Path(sink.file_sd_path).write_text("[]")
    scraper = Scraper(f"http://127.0.0.1:{sink.port}/metrics", 0.2)
    try:
        deadline = time.monotonic() + 10
        while len(scraper.seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [s for _, s in scraper.seen] == [1.0] * len(scraper.seen) and len(scraper.seen) >= 3
        t0 = time.monotonic()
        sink.close()
        took = time.monotonic() - t0
    finally:
        scraper.stop()
    states = [s for _, s in scraper.seen]
    # the scraper read "finished" before the exporter stopped, and the wait was one scrape's
    assert states[-1] == 2.0 and set(states) == {1.0, 2.0} and states.index(2.0) == len(states) - 1
    assert took < 2 * 0.2 + 1.0, took
    assert not os.path.exists(tmp_path / "t.json")


def test_no_scraper_or_a_gone_one_never_holds_the_exit():
    sink = _sink(linger_s=30)  # nobody scrapes
    t0 = time.monotonic()
    sink.close()
    assert time.monotonic() - t0 < 0.5
    sink = _sink(linger_s=30)
    url = f"http://127.0.0.1:{sink.port}/metrics"
    for _ in range(5):  # GETs without Prometheus' header (a person, a test): not scrapes
        urllib.request.urlopen(url, timeout=2).read()
    assert sink.server.served()[1] == 0
    for _ in range(3):  # a scraper every 0.1 s, gone for 1.5 s (> 2 x 0.1 + 1 s)
        urllib.request.urlopen(_scrape(url), timeout=2).read()
        time.sleep(0.1)
    version, n, last, gap = sink.server.served()
    assert n == 3 and 0.05 < gap < 1.0 and version == sink.collector.head_version
    time.sleep(1.5)
    t0 = time.monotonic()
    assert sink.finish() is False
    sink.close()
    assert time.monotonic() - t0 < 0.5


def test_after_a_single_scrape_waits_for_the_next_up_to_linger_seconds():
    sink = _sink(linger_s=10)
    url = f"http://127.0.0.1:{sink.port}/metrics"
    urllib.request.urlopen(_scrape(url), timeout=2).read()
    got = []

    def scrape_later():
        time.sleep(1.0)
        with urllib.request.urlopen(_scrape(url), timeout=2) as r:
            got.append(_state(r.read().decode()))

    t = threading.Thread(target=scrape_later)
    t.start()
    t0 = time.monotonic()
    assert sink.finish() is True  # its interval unknown: waited for the second scrape
    took = time.monotonic() - t0
    t.join()
    sink.close()
    assert got == [2.0] and 0.8 < took < 5.0, (got, took)


def test_linger_is_capped_by_linger_seconds():
    sink = _sink(linger_s=0.3)
    scraper = Scraper(f"http://127.0.0.1:{sink.port}/metrics", 1.0)  # due again ~1 s after each visit
    try:
        deadline = time.monotonic() + 10
        while len(scraper.seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        assert sink.finish() is False  # the next visit is ~1 s away: the 0.3 s cap ends the wait first
        took = time.monotonic() - t0
    finally:
        sink.close()
        scraper.stop()
    assert 0.28 < took < 0.9, took


SCRIPT = textwrap.dedent("""
    import sys, time, torch
    import distgrad as dg
    mode, sd_dir, port_file = sys.argv[1], sys.argv[2], sys.argv[3]
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inst = dg.instrument(model, optimizer=opt, exporter={"port": 0, "file_sd_path": sd_dir + "/",
                         "run_name": mode, "linger_seconds": 10})
    def step():
        opt.zero_grad(); model(torch.randn(3, 4)).sum().backward(); opt.step()
    step()
    open(port_file, "w").write(str(inst.port))
    time.sleep(1.5)  # scraped meanwhile
    step()
    if mode == "exit":
        sys.exit(0)  # no close(): the interpreter exit ends the run cleanly
    if mode == "crash":
        raise RuntimeError("the loop crashed")
    if mode == "sigterm":  # a launcher or scheduler stopping the run on purpose
        import os, signal
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    if mode == "with_crash":
        with inst:
            raise RuntimeError("the loop crashed inside `with instrument`")
""")


def test_process_end_clean_exit_sigterm_crash_and_with_crash(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    modes = ["exit", "sigterm", "crash", "with_crash"]
    sd = tmp_path / "targets"
    sd.mkdir()
    procs = {m: subprocess.Popen([sys.executable, str(script), m, str(sd), str(tmp_path / f"{m}.port")], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for m in modes}
    scrapers = {}
    try:
        deadline = time.monotonic() + 120
        while len(scrapers) < len(modes) and time.monotonic() < deadline:
            for m in modes:
                f = tmp_path / f"{m}.port"
                if m not in scrapers and f.exists() and f.read_text():
                    port = int(f.read_text())
                    # the target file names the run and the exporter
                    (target,) = [p for p in sd.iterdir() if p.name == f"distgrad-{m}-127.0.0.1-{port}.json"]
                    assert json.loads(target.read_text()) == [{"targets": [f"127.0.0.1:{port}"], "labels": {"run": m}}]
                    scrapers[m] = (Scraper(f"http://127.0.0.1:{port}/metrics", 0.2), target)
            if any(p.poll() is not None for m, p in procs.items() if m not in scrapers):
                break
            time.sleep(0.05)
        outs = {m: p.communicate(timeout=120)[0] for m, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for s, _ in scrapers.values():
            s.stop()
    assert set(scrapers) == set(modes), outs
    assert procs["exit"].returncode == 0, outs["exit"]
    assert procs["crash"].returncode != 0 and "the loop crashed" in outs["crash"]
    assert procs["with_crash"].returncode != 0 and "inside `with instrument`" in outs["with_crash"]
    states = {m: [st for _, st in s.seen] for m, (s, _) in scrapers.items()}
    # clean end: the last page said finished, and the target file is gone
    assert states["exit"][-1] == 2.0 and states["exit"][0] == 1.0, states
    assert not scrapers["exit"][1].exists()
    # SIGTERM (deepspeed's launcher on Ctrl-C, a scheduler's preemption): ends like a clean exit,
    # then the process still dies of SIGTERM
    assert procs["sigterm"].returncode == -signal.SIGTERM, outs["sigterm"]
    assert states["sigterm"][-1] == 2.0 and states["sigterm"][0] == 1.0, states
    assert not scrapers["sigterm"][1].exists()
    # crashes: never said finished, the target file stays (the dead target pages)
    for m in ("crash", "with_crash"):
        assert states[m] and set(states[m]) == {1.0}, (m, states[m])
        assert scrapers[m][1].exists(), m


def test_reachable_host_of_an_exporter_bound_to_all_interfaces(monkeypatch):
    """The file_sd target's host when the exporter binds 0.0.0.0: the FQDN if it resolves to a
    non-loopback address, else the address routing to the rendezvous host (MASTER_ADDR)."""
    import socket

    from distgrad.core import startup

    monkeypatch.setattr(socket, "getfqdn", lambda *a: "node17.cluster")
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3" if host == "node17.cluster" else "127.0.0.1", 0))])
    assert startup.reachable_host() == "node17.cluster"
    monkeypatch.undo()
    # a FQDN of "localhost" (containers, VMs): the interface towards MASTER_ADDR, here loopback
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "localhost")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert startup.reachable_host() == "127.0.0.1"
