"""Test helpers: a throw-away Prometheus + Alertmanager on free loopback ports, the webhook
receiver for Alertmanager's notifications (:class:`EchoReceiver`, launch/echo_receiver.py's, with
``out=None`` where nothing is printed), and polling helpers. Standard library only.

Usage (what ``test_stack_fake_exporter.py`` does)::

    with EchoReceiver(out=None) as hook, MonitoringStack(tmp_path, ["127.0.0.1:9400"],
                                                         webhook_url=hook.url) as stack:
        stack.wait_for_targets_up()
        wait_until(lambda: stack.firing("DistgradNonFiniteGradients"), timeout=20)
        wait_until(lambda: hook.alerts("DistgradNonFiniteGradients", status="firing"))

Everything listens on 127.0.0.1 and writes under the given work directory (TSDB, Alertmanager
state, the generated configs and both processes' logs, whose tail is attached to start-up
errors). Prometheus scrapes and evaluates every second, so an alert with ``for: 0s`` fires
about 1-2 s after its condition is scraped and reaches the webhook about 1 s later
(``group_wait: 0s``). Binaries: ``prometheus`` and ``prometheus-alertmanager`` (Debian) or
``alertmanager``, overridable with $PROMETHEUS / $ALERTMANAGER; :class:`MissingBinary` when
absent (tests turn it into a skip).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from launch.dist_env import free_port  # noqa: F401  (re-exported: below the ephemeral range)

REPO = Path(__file__).resolve().parents[2]
#: The repository's generated rule file.
RULES = REPO / "grafana" / "alerts" / "distgrad.rules.yml"
#: The shipped (generated) Alertmanager configuration: routing per severity, inhibitions.
ALERTMANAGER_YML = REPO / "configs" / "alertmanager.yml"


def _load_echo_receiver() -> Any:
    """launch/echo_receiver.py (launch/ is not a package), loaded once."""
    import importlib.util
    import sys

    name = "distgrad_launch_echo_receiver"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "launch" / "echo_receiver.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


#: The echo receiver monitoring_stack.sh runs (prints each notification; keeps them for tests).
EchoReceiver = _load_echo_receiver().EchoReceiver
format_notification = _load_echo_receiver().format_notification


def shipped_alertmanager_config(pager_url: str, ticket_url: str, fast: bool = False) -> dict[str, Any]:
    """configs/alertmanager.yml with its receivers' URLs replaced (as monitoring_stack.sh
    does): critical -> ``pager_url``, warning -> ``ticket_url``. ``fast``: every route's
    ``group_wait`` / ``group_interval`` 1 s (routing and inhibition unchanged)."""
    import yaml

    cfg = yaml.safe_load(ALERTMANAGER_YML.read_text())
    urls = {"http://127.0.0.1:9095/pager": pager_url, "http://127.0.0.1:9095/ticket": ticket_url}
    for rcv in cfg["receivers"]:
        for hook in rcv.get("webhook_configs", []):
            hook["url"] = urls[hook["url"]]
    if fast:
        for route in cfg["route"]["routes"]:
            route["group_wait"], route["group_interval"] = "1s", "1s"
    return cfg

T = TypeVar("T")


class MissingBinary(RuntimeError):
    """Prometheus or Alertmanager is not installed."""


def find_binary(env: str, *names: str) -> str:
    """``$env`` if set, else the first of ``names`` on PATH; :class:`MissingBinary` otherwise."""
    path = os.environ.get(env) or next((p for p in map(shutil.which, names) if p), None)
    if not path:
        raise MissingBinary(
            f"none of {', '.join(names)} on PATH (set ${env}, or apt-get install -y prometheus prometheus-alertmanager)"
        )
    return path




def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.2,
               what: str | None = None) -> T:
    """Call ``predicate`` every ``interval`` s until it returns something truthy; return that.

    ``OSError`` (connection refused while a server starts, HTTP errors) counts as "not yet".
    Raises ``TimeoutError`` naming ``what`` (default: the predicate) and the last result.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            last: Any = predicate()
        except OSError as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            name = what or getattr(predicate, "__name__", repr(predicate))
            raise TimeoutError(f"{name}: not true within {timeout:g} s; last result: {last!r}")
        time.sleep(interval)


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def parse_time(rfc3339: str) -> float:
    """Unix seconds from Prometheus' RFC 3339 timestamps (nanosecond fractions allowed)."""
    s = re.sub(r"(\.\d{6})\d+", r"\1", rfc3339).replace("Z", "+00:00")
    return datetime.fromisoformat(s).timestamp()


# --------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------

class MonitoringStack:
    """Prometheus (+ Alertmanager when ``webhook_url`` is given) as subprocesses.

    Args:
        work_dir: directory for data, configs and logs (e.g. pytest's ``tmp_path``).
        targets: ``host:port`` exporters scraped as job ``job`` every ``scrape_interval``.
        webhook_url: where Alertmanager posts notifications; None runs no Alertmanager
            (unless ``alertmanager_config`` is given).
        alertmanager_config: Alertmanager's configuration (default: one receiver posting
            every alert to ``webhook_url`` after 0 s; e.g. :func:`shipped_alertmanager_config`).
        file_sd_dir: also scrape the targets of ``<file_sd_dir>/*.json`` (Prometheus file_sd,
            as job ``job`` + "-file-sd"; re-read on change and every 2 s).
        rule_files: rule files to load (default: the repository's generated rules).
        job: the scrape job's name (the rules select ``job=~"distgrad.*"``).
        scrape_interval, evaluation_interval: Prometheus durations ("1s").
    """

    def __init__(self, work_dir: Path | str, targets: Sequence[str], *, webhook_url: str | None = None,
                 rule_files: Sequence[Path | str] = (RULES,), job: str = "distgrad",
                 scrape_interval: str = "1s", evaluation_interval: str = "1s",
                 alertmanager_config: dict[str, Any] | None = None,
                 file_sd_dir: Path | str | None = None) -> None:
        self.work_dir = Path(work_dir)
        self.targets = list(targets)
        self.webhook_url = webhook_url
        self.rule_files = [str(Path(f).resolve()) for f in rule_files]
        self.job = job
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.am_config = alertmanager_config
        self.file_sd_dir = None if file_sd_dir is None else Path(file_sd_dir).resolve()
        self.prometheus_url = ""
        self.alertmanager_url = ""
        self._procs: list[tuple[str, subprocess.Popen, Path]] = []

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "MonitoringStack":
        """Start Alertmanager (with a webhook) and Prometheus; a no-op when already started (so
        ``stack.start()`` followed by ``with stack:`` never runs a second Prometheus on the same
        TSDB directory, which crashes it: "expected newly cut file to have sequence...")."""
        if self._procs:
            return self
        prometheus = find_binary("PROMETHEUS", "prometheus")
        alertmanager = (find_binary("ALERTMANAGER", "prometheus-alertmanager", "alertmanager")
                        if self.webhook_url or self.am_config else None)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            if alertmanager:
                self.alertmanager_url = self._start_ready("alertmanager", lambda port: [
                    alertmanager,
                    f"--config.file={self._write('alertmanager.yml', self._alertmanager_config())}",
                    f"--storage.path={self.work_dir / 'alertmanager-data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    f"--web.external-url=http://127.0.0.1:{port}/",
                    "--cluster.listen-address=",  # no gossip port
                    "--log.level=warn",
                ], timeout)
            self.prometheus_url = self._start_ready("prometheus", lambda port: [
                prometheus,
                f"--config.file={self._write('prometheus.yml', self._prometheus_config())}",
                f"--storage.tsdb.path={self.work_dir / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--web.external-url=http://127.0.0.1:{port}/",
                "--log.level=warn",
            ], timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate every process started (SIGTERM, then SIGKILL after 10 s)."""
        for _, proc, _ in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc, _ in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._procs.clear()

    def __enter__(self) -> "MonitoringStack":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log(self, name: str) -> str:
        """The log of ``prometheus`` or ``alertmanager`` so far."""
        path = self.work_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # --- queries ----------------------------------------------------------------------------
    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; the vector's samples (``{"metric": {...}, "value": [t, "v"]}``)."""
        body = get_json(f"{self.prometheus_url}api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r}: {body}")
        return body["data"]["result"]

    def alerts(self, alertname: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        """Prometheus' active alerts (``state`` "pending" or "firing"), as /api/v1/alerts."""
        return [
            a for a in get_json(f"{self.prometheus_url}api/v1/alerts")["data"]["alerts"]
            if (alertname is None or a["labels"]["alertname"] == alertname) and (state is None or a["state"] == state)
        ]

    def firing(self, alertname: str | None = None) -> list[dict[str, Any]]:
        return self.alerts(alertname, "firing")

    def alertmanager_alerts(self) -> list[dict[str, Any]]:
        """The alerts Alertmanager holds (/api/v2/alerts)."""
        return get_json(f"{self.alertmanager_url}api/v2/alerts")

    def post_alerts(self, alerts: Sequence[dict[str, Any]]) -> None:
        """Send alerts (``{"labels": {...}, "annotations": {...}}``) to Alertmanager's API, as
        Prometheus does."""
        req = urllib.request.Request(f"{self.alertmanager_url}api/v2/alerts", data=json.dumps(list(alerts)).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            if r.status != 200:
                raise RuntimeError(f"Alertmanager answered {r.status} to posted alerts")

    def last_rule_evaluation(self) -> float:
        """Unix time of the oldest latest evaluation over all rule groups (0 before any)."""
        groups = get_json(f"{self.prometheus_url}api/v1/rules")["data"]["groups"]
        times = [parse_time(g["lastEvaluation"]) for g in groups]
        return min(times) if times and min(times) > 0 else 0.0

    def wait_for_targets_up(self, timeout: float = 30.0) -> None:
        """Until every target has been scraped successfully (the first scrape comes a few
        seconds after start)."""
        n = len(self.targets)
        wait_until(lambda: len(self.query(f'up{{job="{self.job}"}} == 1')) == n, timeout,
                   what=f"{n} target(s) of job {self.job} up")

    def wait_for_rule_evaluation(self, timeout: float = 15.0) -> None:
        """Until every rule group has been evaluated after this call (so alerts reflect the
        data scraped before it)."""
        t0 = time.time()
        wait_until(lambda: self.last_rule_evaluation() > t0, timeout, what="a rule evaluation after now")

    # --- internals --------------------------------------------------------------------------
    def _prometheus_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "global": {"scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval,
                       "evaluation_interval": self.evaluation_interval},
            "rule_files": self.rule_files,
            "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": self.targets}]}],
        }
        if self.file_sd_dir is not None:
            cfg["scrape_configs"].append({"job_name": f"{self.job}-file-sd", "file_sd_configs": [
                {"files": [f"{self.file_sd_dir}/*.json"], "refresh_interval": "2s"}]})
        if self.alertmanager_url:
            am = urllib.parse.urlsplit(self.alertmanager_url).netloc
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [am]}]}]}
        return cfg

    def _alertmanager_config(self) -> dict[str, Any]:
        if self.am_config is not None:
            return self.am_config
        return {
            "route": {"receiver": "test", "group_by": ["alertname", "job", "instance"],
                      "group_wait": "0s", "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "test", "webhook_configs": [{"url": self.webhook_url, "send_resolved": True}]}],
        }

    def _write(self, name: str, config: dict[str, Any]) -> Path:
        path = self.work_dir / name
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        return path

    def _start_ready(self, name: str, argv: Callable[[int], list[str]], timeout: float) -> str:
        """Start ``name`` on a free port and wait for ``/-/ready``; retried on a port race."""
        for attempt in range(3):
            port = free_port()
            log_path = self.work_dir / f"{name}.log"
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(argv(port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self._procs.append((name, proc, log_path))
            url = f"http://127.0.0.1:{port}/"

            def ready() -> bool:
                if proc.poll() is not None:
                    raise ChildProcessError(f"{name} exited with {proc.returncode}")
                with urllib.request.urlopen(url + "-/ready", timeout=2) as r:
                    return r.status == 200

            try:
                wait_until(ready, timeout, what=f"{name} ready on {url}")
                return url
            except ChildProcessError:
                if "address already in use" in self.log(name) and attempt < 2:
                    continue
                raise RuntimeError(f"{name} failed to start; log tail:\n{self.log(name)[-3000:]}") from None
            except TimeoutError as e:
                raise RuntimeError(f"{e}; log tail:\n{self.log(name)[-3000:]}") from None
        raise AssertionError("unreachable")
