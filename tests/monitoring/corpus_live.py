"""The healthy-run corpus and the fault runs (tests/dist/corpus_cases.py) served live to a real
Prometheus + Alertmanager + echo receiver, and the same records replayed offline through the
rule file (grafana/rule_replay.py). Used by tests/monitoring/test_paging_corpus.py and
``launch/paging_eval.py --live``.

Prometheus: 1 s scrape and rule evaluation, the SHIPPED rule file (or ``rules``), each run's
exporter discovered through file_sd (the run registers ``<sd>/<run>.json`` and removes it when
it closes). Alertmanager: the shipped routing and inhibitions (configs/alertmanager.yml), route
timings shortened to 1 s, posting to the echo receiver (launch/echo_receiver.py): critical ->
``/pager``, warning -> ``/ticket``. The 1-process and the 2-rank launches run concurrently;
each run waits until Prometheus has scraped it before its first step and its last step's state
before it closes.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

from grafana import rule_replay
from tests.dist.corpus_cases import RUNS
from tests.helpers import launch

from .stack import (
    RULES,
    EchoReceiver,
    MonitoringStack,
    get_json,
    shipped_alertmanager_config,
)

#: seconds a fault run keeps serving after its last step (so that a rule with a short ``for:``
#: can still fire while its series exist); healthy runs close right after their final scrape
FAULT_HOLD_S = 8.0


def run_corpus_live(tmp: Path, rules: Path = RULES, sets: str = "all") -> dict[str, Any]:
    """Run the corpus (``sets``: "tune,heldout,faults" or a part) live and offline.

    Returns ``{"runs": {run: the driver's facts (losses, t_fault, scraped...)}, "seen": {run:
    what Prometheus holds: max up, number of samples, last step, alerts ever firing, first
    firing time per alert}, "notifications": [(unix time received, path, payload)] (also written
    to ``tmp/notifications.json``), "offline":
    {run: rule_replay.RunEval}, "tmp": tmp}``.

    Raises:
        MissingBinary: Prometheus / Alertmanager absent; AssertionError: a launch failed.
    """
    got: list[tuple[float, str, dict]] = []
    with EchoReceiver(out=io.StringIO()) as echo:
        received = echo._received

        def timed(path: str, payload: dict) -> None:  # the receive time of each notification
            got.append((time.time(), path, payload))
            received(path, payload)
        echo._received = timed
        cfg = shipped_alertmanager_config(echo.url + "pager", echo.url + "ticket", fast=True)
        with MonitoringStack(tmp / "stack", [], alertmanager_config=cfg, file_sd_dir=tmp / "sd",
                             rule_files=[rules]) as stack:
            t_start = time.time()
            common = ["--jsonl-dir", str(tmp / "jsonl"), "--sd-dir", str(tmp / "sd"), "--prom-url", stack.prometheus_url,
                      "--fault-hold", str(FAULT_HOLD_S)]
            single = ",".join(s for s in sets.split(",") if s != "faults") if sets != "all" else "tune,heldout"
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                one = pool.submit(launch, "corpus_cases.py", tmp / "one.json", "--set", single, *common, nproc=1) \
                    if single else None
                two = pool.submit(launch, "corpus_cases.py", tmp / "two.json", "--set", sets, *common, nproc=2)
                runs = {**(one.result()["runs"] if one else {}), **two.result()["runs"]}
            time.sleep(6)  # the last notifications (group_wait 1 s, group_interval 1 s)
            t_end = time.time()
            span = f"{int(t_end - t_start) + 60}s"
            seen = {}
            for name in runs:
                q = {k: stack.query(e.format(run=name, span=span)) for k, e in {
                    "up": 'max_over_time(up{{run="{run}"}}[{span}])',
                    "samples": 'count_over_time(distgrad_optimizer_step{{run="{run}"}}[{span}])',
                    "last_step": 'max_over_time(distgrad_optimizer_step{{run="{run}"}}[{span}])',
                    "firing": 'max by (alertname, severity) (max_over_time(ALERTS{{run="{run}",alertstate="firing"}}[{span}]))',
                }.items()}
                first: dict[str, float] = {}
                body = get_json(f"{stack.prometheus_url}api/v1/query_range?" + urllib.parse.urlencode({
                    "query": f'ALERTS{{run="{name}",alertstate="firing"}}', "start": f"{t_start:.3f}",
                    "end": f"{t_end:.3f}", "step": "1"}))
                for series in body["data"]["result"]:
                    a = series["metric"]["alertname"]
                    first[a] = min([first.get(a, float("inf"))] + [float(t) for t, _ in series["values"]])
                seen[name] = {"up": [float(x["value"][1]) for x in q["up"]],
                              "samples": [float(x["value"][1]) for x in q["samples"]],
                              "last_step": [float(x["value"][1]) for x in q["last_step"]],
                              "firing": sorted((x["metric"]["alertname"], x["metric"].get("severity", ""))
                                               for x in q["firing"]),
                              "first_firing": first}
    (tmp / "notifications.json").write_text(json.dumps([{"received": t, "path": p, "payload": n} for t, p, n in got],
                                                       indent=1))
    offline = rule_replay.evaluate_jsonl({name: tmp / "jsonl" / f"{name}.jsonl" for name in runs}, rules,
                                         work_dir=tmp / "replay")
    return {"runs": runs, "seen": seen, "notifications": got, "offline": offline, "tmp": tmp}


def alerts_of(notification: dict, run: str) -> list[dict]:
    """The alerts of one notification that are about ``run``."""
    return [a for a in notification.get("alerts", []) if a["labels"].get("run") == run]


def pages_of(notifications: list[tuple[float, str, dict]], run: str, path: str = "/pager") -> list[tuple[float, dict]]:
    """The pages about ``run``: ``(time received, notification)`` of the notifications to
    ``path`` that bring a firing alert (alert name and start time) that no earlier one brought.
    Alertmanager's later notifications of the same group (one of its alerts resolved,
    ``send_resolved``) are not new pages."""
    known: set = set()
    pages = []
    for t, p, n in notifications:
        if p != path:
            continue
        new = {(a["labels"]["alertname"], a["startsAt"]) for a in alerts_of(n, run) if a["status"] == "firing"} - known
        known |= new
        if new:
            pages.append((t, n))
    return pages


__all__ = ["FAULT_HOLD_S", "RUNS", "alerts_of", "pages_of", "run_corpus_live"]
