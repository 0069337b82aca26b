#!/usr/bin/env python3
"""Every PromQL expression of the distgrad dashboards, with template variables substituted,
so that a test can run each one against a live Prometheus and require data.

Reads the committed ``grafana/dashboards/*.json`` (what users import), not the generator::

    from grafana.queries import dashboard_queries, run_queries   # or load this file by path
    qs = dashboard_queries(job_regex="distgrad")
    counts = run_queries("http://127.0.0.1:9090", qs)            # {PanelQuery: series count}
    empty = [q for q, n in counts.items() if n == 0 and not q.conditional]

Substitution: ``$job`` (and ``${job}``, ``${job:regex}``, ``[[job]]``) becomes ``job_regex``;
every other query variable becomes its "All" value (``.*``, which also matches series
without the label); ``$__rate_interval`` / ``$__interval`` become ``rate_interval``;
``$__range`` becomes ``range_``. An unknown variable raises ``ValueError``.

Queries whose metrics only exist under some condition (an fp16 loss scaler, clipping, a
non-finite step, a firing alert, ...) carry those conditions in ``PanelQuery.conditional``:
the metric's ``when`` in distgrad's metric catalogue (:mod:`distgrad.export.metrics`), unless it is
one of :data:`UNCONDITIONAL`, and :data:`ALERT` for Prometheus' own ``ALERTS`` series;
:func:`condition_text` says what each means.

Command line: ``python grafana/queries.py --job distgrad [--prometheus URL]`` lists the
queries, and with ``--prometheus`` runs them and marks those without data.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

if __name__ == "__main__":  # run as a script: the repository root holds distgrad and grafana
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distgrad.export import metrics as catalogue  # noqa: E402

DASHBOARDS_DIR = Path(__file__).resolve().parent / "dashboards"

#: Catalogue conditions (``Metric.when``) under which every instrumented run has the metric.
UNCONDITIONAL = frozenset({"always", "step", "sample"})
#: The condition of Prometheus' ``ALERTS`` series (not a distgrad metric).
ALERT = "alert"


def condition_text(when: str) -> str:
    """What the condition ``when`` (a catalogue ``Metric.when`` or :data:`ALERT`) means."""
    return "a Distgrad* alert firing (and the rule file loaded)" if when == ALERT else catalogue.CONDITIONS[when]


def conditions(metrics: Iterable[str]) -> tuple[str, ...]:
    """The conditions under which the series ``metrics`` exist, sorted; () when every run has
    them. Raises ``KeyError`` for a distgrad metric the catalogue does not declare."""
    out = {ALERT if m == "ALERTS" else catalogue.by_name(m).when for m in metrics}
    return tuple(sorted(out - UNCONDITIONAL))


_METRIC_RE = re.compile(r"\b(distgrad_[a-z0-9_]+|ALERTS)\b")
_VAR_RE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")
_LABEL_VALUES_RE = re.compile(r"^\s*label_values\((.*),\s*(\w+)\s*\)\s*$", re.S)


@dataclass(frozen=True)
class PanelQuery:
    """One PromQL expression of a dashboard.

    kind: ``panel`` (a panel target), ``variable`` (a template variable's query, rewritten
    from ``label_values(sel, label)`` to ``count by (label) (sel)``) or ``annotation``.
    metrics: the distgrad metrics (and ``ALERTS``) it reads; conditional: :func:`conditions`
    of those.
    """

    dashboard: str
    kind: str
    panel_id: int | None
    title: str
    ref_id: str
    expr: str
    instant: bool
    metrics: tuple[str, ...]
    conditional: tuple[str, ...]


def iter_panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Panels in dashboard order, descending into (collapsed) row panels."""
    for p in panels:
        yield p
        yield from iter_panels(p.get("panels", []))


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace ``$var``, ``${var}``, ``${var:fmt}`` and ``[[var]]`` by ``variables[var]``."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in variables:
            raise ValueError(f"no value for template variable {name!r} in {expr!r}")
        return variables[name]

    return _VAR_RE.sub(repl, expr)


def _variables(dashboard: dict[str, Any], job_regex: str, rate_interval: str, range_: str) -> dict[str, str]:
    values = {"__rate_interval": rate_interval, "__interval": rate_interval, "__range": range_}
    for v in dashboard.get("templating", {}).get("list", []):
        if v["type"] == "datasource":
            continue
        values[v["name"]] = v.get("allValue") or ".*"
    values["job"] = job_regex
    return values


def _query(dashboard: str, kind: str, panel_id: int | None, title: str, ref_id: str, expr: str,
           instant: bool) -> PanelQuery:
    metrics = tuple(sorted(set(_METRIC_RE.findall(expr))))
    return PanelQuery(dashboard, kind, panel_id, title, ref_id, expr, instant, metrics, conditions(metrics))


def dashboard_queries(job_regex: str, *, dashboards_dir: Path = DASHBOARDS_DIR, rate_interval: str = "1m",
                      range_: str = "1h", include_variables: bool = True,
                      include_annotations: bool = True) -> list[PanelQuery]:
    """Every PromQL expression of every ``*.json`` dashboard in ``dashboards_dir``, in order."""
    out: list[PanelQuery] = []
    for path in sorted(Path(dashboards_dir).glob("*.json")):
        d = json.loads(path.read_text())
        values = _variables(d, job_regex, rate_interval, range_)
        name = path.name
        if include_variables:
            for v in d.get("templating", {}).get("list", []):
                if v["type"] != "query":
                    continue
                q = v["query"] if isinstance(v["query"], str) else v["query"]["query"]
                m = _LABEL_VALUES_RE.match(q)
                expr = f"count by ({m.group(2)}) ({m.group(1)})" if m else q
                out.append(_query(name, "variable", None, f"${v['name']}", v["name"], substitute(expr, values), True))
        if include_annotations:
            for a in d.get("annotations", {}).get("list", []):
                expr = a.get("target", {}).get("expr") or a.get("expr")
                if expr and a.get("datasource", {}).get("type") == "prometheus":
                    out.append(_query(name, "annotation", None, a["name"], "Anno", substitute(expr, values), False))
        for p in iter_panels(d.get("panels", [])):
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append(_query(name, "panel", p["id"], p.get("title", ""), t["refId"],
                                      substitute(t["expr"], values), bool(t.get("instant"))))
    return out


def instant_query(base_url: str, expr: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Run ``expr`` through Prometheus' ``/api/v1/query``; the result list (vector samples)."""
    url = base_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"query {expr!r} failed: {body}")
    data = body["data"]
    return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]


def run_queries(base_url: str, queries: Iterable[PanelQuery]) -> dict[PanelQuery, int]:
    """Number of series each query returns now (instant query; raises on a PromQL error)."""
    return {q: len(instant_query(base_url, q.expr)) for q in queries}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="List (and optionally run) the distgrad dashboards' PromQL queries.")
    ap.add_argument("--job", default="distgrad.*", help="regex substituted for $job (default: %(default)s)")
    ap.add_argument("--rate-interval", default="1m")
    ap.add_argument("--prometheus", help="base URL, e.g. http://127.0.0.1:9090: run every query and report empty ones")
    args = ap.parse_args(argv)
    qs = dashboard_queries(args.job, rate_interval=args.rate_interval)
    counts = run_queries(args.prometheus, qs) if args.prometheus else {}
    missing = 0
    for q in qs:
        where = f"{q.dashboard} {q.kind} {q.panel_id or ''} {q.title!r} {q.ref_id}"
        if args.prometheus:
            n = counts[q]
            flag = "ok   " if n else ("cond " if q.conditional else "EMPTY")
            if not n and q.conditional:
                where += " (exists: " + "; ".join(map(condition_text, q.conditional)) + ")"
            missing += not n and not q.conditional
            print(f"{flag} {n:4d}  {where}\n             {q.expr}")
        else:
            print(f"{where}\n    {q.expr}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
