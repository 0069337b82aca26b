"""Run lifecycle, paged end to end (issue 23, "Done when" (c) and (d)): real Prometheus with the
repository's rules (scrape and evaluation every second), Alertmanager with the shipped routing
(configs/alertmanager.yml, real timings) and the echo receiver (launch/echo_receiver.py).

Three runs of a tiny steady job (tests/monitoring/lifecycle_run.py) register their own scrape
targets in a file_sd directory, with no Prometheus configuration naming them:

- ``clean`` (one process) and ``twonode`` (``torchrun --nnodes 2``, one process per simulated
  node on this host, rendezvous at 127.0.0.1) end cleanly;
- ``killed`` (one process) gets ``kill -9`` at the same moment.

Prometheus also scrapes a static target where nothing ever listens (a stack started before
any run). Asserts: every run is scraped under its own run label (two nodes' job with world size
2); within 3 minutes of the end, exactly one notification arrives -- the page
DistgradExporterDown for ``killed`` -- and nothing for the clean ends or the empty static
target for the whole 3 minutes; the clean runs served ``distgrad_run_state`` 2 and removed their
target files, the killed one's file stays. All runs share the one 3-minute wait: ~4 minutes.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import free_port

from .stack import REPO, EchoReceiver, MissingBinary, MonitoringStack, shipped_alertmanager_config, wait_until

pytestmark = [pytest.mark.monitoring, pytest.mark.multirank]

DRIVER = Path(__file__).with_name("lifecycle_run.py")
QUIET = 180.0  # seconds after the end in which only the kill -9 may notify


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def test_clean_ends_stay_silent_and_kill_9_pages(tmp_path):
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun not found")
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    targets = tmp_path / "targets"
    targets.mkdir()
    out = io.StringIO()
    procs: dict[str, list[subprocess.Popen]] = {}
    with EchoReceiver(out=out) as echo:
        cfg = shipped_alertmanager_config(echo.url + "pager", echo.url + "ticket")
        empty = f"127.0.0.1:{free_port()}"  # nothing listens there, ever
        stack = MonitoringStack(tmp_path / "stack", [empty], alertmanager_config=cfg, file_sd_dir=targets)
        try:
            stack.start()
        except MissingBinary as e:
            pytest.skip(f"monitoring binaries missing: {e}")
        with stack:
            try:
                logs = {}

                def start(name: str, argv: list[str]) -> subprocess.Popen:
                    log = open(tmp_path / f"{name}.log", "ab")
                    logs.setdefault(name.split(".")[0], []).append(tmp_path / f"{name}.log")
                    return subprocess.Popen(argv, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)

                for run in ("clean", "killed"):
                    procs[run] = [start(run, [sys.executable, str(DRIVER), run, str(targets), str(tmp_path / f"{run}.stop")])]
                rdzv = free_port()
                procs["twonode"] = [
                    start(f"twonode.{i}", [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(i),
                                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}",
                                           "--rdzv-id", "twonode", "--max-restarts", "0", str(DRIVER), "twonode",
                                           str(targets), str(tmp_path / "twonode.stop")])
                    for i in range(2)]

                def tail() -> str:
                    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                                     for ps in logs.values() for p in ps)

                # every run registered itself and is scraped, told apart by its run label
                def scraped() -> dict[str, float] | None:
                    for name, ps in procs.items():
                        if any(p.poll() is not None for p in ps):
                            raise AssertionError(f"{name} exited early:\n{tail()}")
                    got = {s["metric"].get("run"): float(s["value"][1])
                           for s in stack.query('distgrad_world_size{job="distgrad-file-sd"}')}
                    # each scraped a few times (a run is scraped many times before it ends)
                    often = stack.query('count_over_time(up{job="distgrad-file-sd"}[1m]) >= 5')
                    return got if set(got) == set(procs) and len(often) == len(procs) else None

                sizes = wait_until(scraped, 240, interval=0.5, what="all three runs scraped 5 times")
                assert sizes == {"clean": 1.0, "killed": 1.0, "twonode": 2.0}
                up = {s["metric"]["run"]: s["metric"]["instance"] for s in stack.query('up{job="distgrad-file-sd"} == 1')}
                assert set(up) == set(procs) and len(set(up.values())) == 3, up
                files = {json.loads(p.read_text())[0]["labels"]["run"]: p for p in targets.glob("*.json")}
                assert {r: json.loads(p.read_text())[0]["targets"] for r, p in files.items()} == {
                    r: [addr] for r, addr in up.items()}
                assert stack.query(f'up{{instance="{empty}"}} == 0')
                assert echo.notifications() == [], out.getvalue()  # nothing while healthy, nothing for the empty target

                # the end: two clean ends and one kill -9 of rank 0, at the same moment
                for run in ("clean", "twonode"):
                    (tmp_path / f"{run}.stop").touch()
                procs["killed"][0].send_signal(signal.SIGKILL)
                t_end = time.monotonic()
                for run in ("clean", "twonode"):
                    for p in procs[run]:
                        assert p.wait(120) == 0, tail()

                page = wait_until(lambda: echo.alerts("DistgradExporterDown", "firing", path="/pager"), QUIET,
                                  interval=1, what="DistgradExporterDown paged")
                delay = time.monotonic() - t_end
                assert delay < QUIET
                (alert,) = page
                assert alert["labels"] == {"alertname": "DistgradExporterDown", "severity": "critical",
                                           "job": "distgrad-file-sd", "instance": up["killed"], "run": "killed"}
                assert "last state it served was running" in alert["annotations"]["description"]
                # the rest of the 3 minutes: nothing else, for anyone
                time.sleep(max(0.0, t_end + QUIET - time.monotonic()))
                got = [(n["receiver"], a["labels"]["alertname"], a["labels"].get("run"), a["status"])
                       for n in echo.notifications() for a in n["alerts"]]
                assert got == [("distgrad-pager", "DistgradExporterDown", "killed", "firing")], out.getvalue()
                assert stack.alerts() == [] or {(a["labels"]["alertname"], a["labels"].get("run"))
                                                for a in stack.alerts()} == {("DistgradExporterDown", "killed")}
                # the clean ends said so before they went, and removed their targets; the killed one's stays
                last = {s["metric"]["run"]: float(s["value"][1])
                        for s in stack.query('last_over_time(distgrad_run_state{job="distgrad-file-sd"}[10m])')}
                assert last == {"clean": 2.0, "twonode": 2.0, "killed": 1.0}
                assert not files["clean"].exists() and not files["twonode"].exists()
                assert files["killed"].exists()
                for run in ("clean", "twonode"):  # the driver's own account of its end
                    assert any(f"lifecycle_run {run}: finished state scraped=True" in p.read_text()
                               for p in logs[run]), tail()
                print(f"kill -9 -> DistgradExporterDown at the pager after {delay:.1f} s")
                print(out.getvalue())
            finally:
                for ps in procs.values():
                    for p in ps:
                        if p.poll() is None:
                            p.kill()
                            p.wait(30)
