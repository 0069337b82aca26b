"""Offline evaluation of a Prometheus rule file over distgrad's recorded series: every sampled
step of a run's JSONL log, not only the ones a live Prometheus happened to scrape.

Each record is rendered by distgrad's own exporter code (:class:`DistgradCollector`, the
families rank 0 serves) into the samples a scrape right after that step would have returned;
the samples of the metrics the rules read are written as OpenMetrics with one synthetic
timestamp per step (``dt`` seconds apart: one step per scrape and rule evaluation), backfilled
into a fresh TSDB with ``promtool tsdb create-blocks-from openmetrics``, and a real Prometheus
evaluates every alerting rule's expression over the whole run with ``query_range`` at ``dt``
resolution. ``for:`` is applied as Prometheus does (firing once the condition has held at every
evaluation for that long), in the synthetic time axis: ``for: 2m`` at ``dt = 1`` means 120
consecutive sampled steps.

Rules about the target rather than the records (``up``, ``absent(up)``) are not evaluated: a
replay has no scrape target (:data:`LIVENESS_RULES`); the live test covers them.

:func:`render_alerts` gives the labels and rendered annotations (summary, description: the text a
page carries) of an alert firing at one step, via ``promtool test rules`` over the same series.

Used by tests/monitoring/test_paging_corpus.py, tests/monitoring/test_precursor_paging.py and
launch/paging_eval.py. Needs ``promtool``
and ``prometheus`` ($PROMTOOL / $PROMETHEUS override); :class:`tests.monitoring.stack.MissingBinary`
-like ``FileNotFoundError`` when absent.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

#: rules whose expression reads only the scrape target's health: not evaluable from records
LIVENESS_RULES = ("DistgradExporterDown", "DistgradExporterAbsent")
JOB = "distgrad"


@dataclass
class AlertEval:
    """One alerting rule evaluated over one run. Steps are the runs' record steps.

    ``condition_steps``: steps at which the expression returned a sample (the condition held);
    ``fire_steps``: the first step of each firing episode (after ``for:``), i.e. each page or
    ticket the rule would have sent for this run."""

    alert: str
    severity: str
    for_s: float
    condition_steps: list[int] = field(default_factory=list)
    fire_steps: list[int] = field(default_factory=list)


@dataclass
class RunEval:
    run: str
    steps: int
    first_step: int
    alerts: dict[str, AlertEval] = field(default_factory=dict)

    def pages(self, severity: str | None = None) -> list[tuple[str, int]]:
        """``(alert, step)`` of every firing episode, optionally of one severity."""
        return sorted(((a.alert, s) for a in self.alerts.values() if severity in (None, a.severity)
                       for s in a.fire_steps), key=lambda x: (x[1], x[0]))


def parse_duration(s: str | None) -> float:
    """Seconds of a Prometheus duration ("0s", "2m", "1h30m", "500ms")."""
    if not s:
        return 0.0
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    total, pos = 0.0, 0
    for m in re.finditer(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)", s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * units[m.group(2)]
        pos = m.end()
    if pos != len(s):
        raise ValueError(f"not a Prometheus duration: {s!r}")
    return total


def alerting_rules(rule_file: str | os.PathLike) -> list[dict[str, Any]]:
    """The alerting rules (``alert``, ``expr``, ``for``, ``labels``...) of a rule file."""
    doc = yaml.safe_load(Path(rule_file).read_text())
    return [r for g in doc.get("groups", []) for r in g.get("rules", []) if "alert" in r]


def metric_names(rules: Iterable[dict[str, Any]]) -> set[str]:
    """Every ``distgrad_*`` series name the rules' expressions read (exposition sample names)."""
    names: set[str] = set()
    for r in rules:
        names |= set(re.findall(r"\b(distgrad_[a-zA-Z0-9_]+)", r["expr"]))
    return names


# ------------------------------------------------------------------------------ records -> series
def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def read_records(path: str | os.PathLike) -> list[Any]:
    """The StepRecords of a JSONL run log (rotated backups first), in file order."""
    from distgrad.export.jsonl import read_jsonl

    return list(read_jsonl(path))


def run_series(records: Sequence[Any], run: str, names: set[str], t0: float, dt: float = 1.0) -> dict[str, list[str]]:
    """OpenMetrics sample lines per sample name: each record rendered by distgrad's exporter
    collector as a scrape right after it would return, at ``t0 + i * dt`` (i = the record's
    position), labelled ``job="distgrad"``, ``instance="replay/<run>"``, ``run="<run>"``.
    ``distgrad_last_step_timestamp_seconds`` is the synthetic time of the step (the replay's
    clock), so rules comparing it with ``time()`` read the replay's time axis."""
    from distgrad.export import metrics
    from distgrad.export.prometheus import DistgradCollector

    world = records[0].world_size if records else 1
    col = DistgradCollector({"engine": "replay", "zero_stage": "", "dtype": "", "version": ""}, world,
                            has_loss_scaler=any(r.loss_scale is not None for r in records), has_samples=True)
    for reason in metrics.LABELS["reason"].values or ():  # as distgrad.core.startup does at instrument()
        col.inc_labeled("distgrad_refused_steps", {"reason": reason}, 0)
    extra = f'job="{JOB}",instance="replay/{_escape(run)}",run="{_escape(run)}"'
    out: dict[str, list[str]] = {}
    for i, rec in enumerate(records):
        t = t0 + i * dt
        col.step_time = t
        col.update(rec, rec.counters)
        for fam in col.collect():
            for s in fam.samples:
                if s.name not in names:
                    continue
                labels = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(s.labels.items()))
                lab = "{" + (labels + "," if labels else "") + extra + "}"
                out.setdefault(s.name, []).append(f"{s.name}{lab} {_fmt(float(s.value))} {t:.3f}")
    return out


# ------------------------------------------------------------------------------ Prometheus
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(env: str, name: str) -> str:
    path = os.environ.get(env) or shutil.which(name)
    if not path:
        raise FileNotFoundError(f"{name} not on PATH (set ${env}, or apt-get install -y prometheus)")
    return path


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def evaluate(runs: dict[str, Sequence[Any]], rule_file: str | os.PathLike, dt: float = 1.0,
             work_dir: str | os.PathLike | None = None) -> dict[str, RunEval]:
    """Evaluate every alerting rule of ``rule_file`` (except :data:`LIVENESS_RULES`) over the
    records of each run (``{run name: [StepRecord, ...]}``, consecutive sampled steps).

    Returns ``{run: RunEval}``. Raises FileNotFoundError (binaries), RuntimeError (promtool or a
    query failed: the message says which)."""
    rules = [r for r in alerting_rules(rule_file) if r["alert"] not in LIVENESS_RULES]
    names = metric_names(rules)
    # whole minutes, 3 h in the past: inside the default retention, outside the live head block
    t0 = math.floor(time.time() / 60) * 60 - 3 * 3600
    own = work_dir is None
    tmp = Path(tempfile.mkdtemp(prefix="rule-replay-")) if own else Path(work_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        by_name: dict[str, list[str]] = {}
        span = 0
        for run, recs in runs.items():
            span = max(span, len(recs))
            for name, lines in run_series(recs, run, names, t0, dt).items():
                by_name.setdefault(name, []).extend(lines)
        om = tmp / "series.om"
        with open(om, "w") as f:
            for name in sorted(by_name):
                f.write(f"# TYPE {name} unknown\n")
                f.write("\n".join(by_name[name]) + "\n")
            f.write("# EOF\n")
        data = tmp / "tsdb"
        p = subprocess.run([_binary("PROMTOOL", "promtool"), "tsdb", "create-blocks-from", "openmetrics", str(om), str(data)],
                           check=False, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"promtool backfill failed: {p.stdout[-2000:]} {p.stderr[-2000:]}")
        cfg = tmp / "prometheus.yml"
        cfg.write_text(json.dumps({"global": {"scrape_interval": "1m", "evaluation_interval": "1m"}}))
        port = _free_port()
        url = f"http://127.0.0.1:{port}/"
        with open(tmp / "prometheus.log", "wb") as log:
            proc = subprocess.Popen([_binary("PROMETHEUS", "prometheus"), f"--config.file={cfg}",
                                     f"--storage.tsdb.path={data}", f"--web.listen-address=127.0.0.1:{port}",
                                     "--storage.tsdb.retention.time=30d", "--log.level=warn"],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(url + "-/ready", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"replay Prometheus did not start: {(tmp / 'prometheus.log').read_text()[-2000:]}")
                time.sleep(0.2)
            end = t0 + (span - 1) * dt
            results = {run: RunEval(run, len(recs), recs[0].step if recs else 0) for run, recs in runs.items()}
            step_of = {run: [r.step for r in recs] for run, recs in runs.items()}
            for rule in rules:
                q = urllib.parse.urlencode({"query": rule["expr"], "start": f"{t0:.3f}", "end": f"{end:.3f}",
                                            "step": f"{dt:g}"})
                body = _get(f"{url}api/v1/query_range?{q}")
                if body.get("status") != "success":
                    raise RuntimeError(f"{rule['alert']}: {body}")
                for_s = parse_duration(rule.get("for"))
                sev = rule.get("labels", {}).get("severity", "")
                per_run: dict[str, set[int]] = {}
                for series in body["data"]["result"]:
                    run = series["metric"].get("run")
                    if run not in results:
                        continue
                    idx = {round((float(t) - t0) / dt) for t, _ in series["values"]}
                    per_run.setdefault(run, set()).update(i for i in idx if i < len(step_of[run]))
                for run, res in results.items():
                    ae = res.alerts[rule["alert"]] = AlertEval(rule["alert"], sev, for_s)
                    held = sorted(per_run.get(run, ()))
                    ae.condition_steps = [step_of[run][i] for i in held]
                    need = math.ceil(for_s / dt - 1e-9)
                    start = None
                    prev = None
                    firing = False
                    for i in held:
                        if prev is None or i != prev + 1:
                            start, firing = i, False
                        if not firing and i - start >= need:
                            ae.fire_steps.append(step_of[run][i])
                            firing = True
                        prev = i
            return results
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    finally:
        if own:
            shutil.rmtree(tmp, ignore_errors=True)


def evaluate_jsonl(paths: dict[str, str | os.PathLike], rule_file: str | os.PathLike, dt: float = 1.0,
                   work_dir: str | os.PathLike | None = None) -> dict[str, RunEval]:
    """:func:`evaluate` over JSONL run logs (``{run name: path}``)."""
    return evaluate({run: read_records(p) for run, p in paths.items()}, rule_file, dt, work_dir)


# ------------------------------------------------------------------------------ rendered alerts
def _promtool_value(v: str) -> str:
    """A sample value of :func:`run_series` in promtool's input-series notation."""
    return {"+Inf": "Inf", "NaN": "NaN", "-Inf": "-Inf"}.get(v, v)


def _parse_go_labels(text: str) -> dict[str, str]:
    """``{a="x", b="y \\"z\\""}`` as Go's ``labels.Labels.String`` prints it (values quoted by
    ``strconv.Quote``) -> ``{"a": "x", "b": 'y "z"'}``."""
    import ast

    return {m.group(1): ast.literal_eval(m.group(2)) for m in re.finditer(r'(\w+)=("(?:[^"\\]|\\.)*")', text)}


def render_alerts(records: Sequence[Any], run: str, rule_file: str | os.PathLike, alert: str, step: int,
                  dt: float = 1.0, work_dir: str | os.PathLike | None = None
                  ) -> list[tuple[dict[str, str], dict[str, str]]]:
    """The alerts ``alert`` of ``rule_file`` firing at the run's record step ``step``, each as
    ``(labels, annotations)`` with the annotation templates rendered by Prometheus' own template
    engine (``$labels``, ``$value`` and the ``query`` function, which sees the run's series),
    i.e. the text a notification about that alert would carry.

    The records up to ``step`` are rendered as in :func:`evaluate` (one record every ``dt``
    seconds, ``job``/``instance``/``run`` labels) into the input series of a ``promtool test
    rules`` unit test of the unchanged rule file (``for:`` applied by promtool at ``dt``
    evaluations); the test expects no alert, and promtool's failure report lists the alerts that
    did fire, with their labels and annotations. ``dt`` must be a whole number of milliseconds.

    Returns ``[]`` when the alert is not firing at that step. Raises ValueError (``step`` not a
    record step), FileNotFoundError (no promtool), RuntimeError (promtool failed otherwise)."""
    steps = [r.step for r in records]
    if step not in steps:
        raise ValueError(f"step {step} is not a record step of run {run!r}")
    n = steps.index(step) + 1
    ms = round(dt * 1000)
    if ms <= 0 or abs(ms - dt * 1000) > 1e-6:
        raise ValueError(f"dt={dt!r} is not a positive whole number of milliseconds")
    rules = alerting_rules(rule_file)
    names = metric_names(rules)
    for r in rules:  # the series the annotation templates query, too
        for text in r.get("annotations", {}).values():
            names |= set(re.findall(r"\b(distgrad_[a-zA-Z0-9_]+)", text))
    series: dict[str, list[str]] = {}
    for lines in run_series(records[:n], run, names, 0.0, dt).values():
        for line in lines:
            key, value, t = line.rsplit(" ", 2)
            i = round(float(t) / dt)
            series.setdefault(key, ["_"] * n)[i] = _promtool_value(value)
    own = work_dir is None
    tmp = Path(tempfile.mkdtemp(prefix="rule-render-")) if own else Path(work_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        test = {"rule_files": [str(Path(rule_file).resolve())], "evaluation_interval": f"{ms}ms",
                "tests": [{"interval": f"{ms}ms",
                           "input_series": [{"series": k, "values": " ".join(v)}
                                            for k, v in sorted(series.items())],
                           "alert_rule_test": [{"eval_time": f"{(n - 1) * ms}ms", "alertname": alert,
                                                "exp_alerts": []}]}]}
        path = tmp / "render_test.yml"
        path.write_text(yaml.safe_dump(test, sort_keys=False, width=1 << 20))
        p = subprocess.run([_binary("PROMTOOL", "promtool"), "test", "rules", str(path)], check=False,
                           capture_output=True, text=True)
        out = p.stdout + p.stderr
        if p.returncode == 0:
            return []
        if "got:[" not in out:
            raise RuntimeError(f"promtool test rules failed: {out[-3000:]}")
        got = out.split("got:[", 1)[1]
        found = re.findall(r"Labels:(\{.*?\})\s*\n\s*Annotations:(\{.*\})\s*\n", got)
        if not found:
            raise RuntimeError(f"cannot read promtool's report: {out[-3000:]}")
        return [(_parse_go_labels(lab), _parse_go_labels(ann)) for lab, ann in found]
    finally:
        if own:
            shutil.rmtree(tmp, ignore_errors=True)
