#!/usr/bin/env python3
"""Write (or check) the generated files of distgrad's monitoring mixin.

- ``grafana/alerts/distgrad.rules.yml`` from :mod:`grafana.alerts` (Prometheus rule file),
- ``configs/alertmanager.yml`` from :mod:`grafana.routing` (routing per severity, inhibitions),
- ``grafana/dashboards/<FILE>`` for each module of :mod:`grafana.dashboards` (Grafana 11.6
  dashboard JSON built with grafana-foundation-sdk, datasource as the ``${datasource}``
  template variable),

all from the settings in :mod:`grafana.config`. The generated files are committed;
``tests/test_alert_rules.py`` and ``tests/test_dashboards.py`` fail when they differ from a
fresh generation. After changing grafana/::

    python grafana/build.py          # rewrite the outputs
    python grafana/build.py --check  # exit 1 if the committed outputs are stale

For a deployment whose runbook lives elsewhere (a wiki, a web copy of docs/runbook.md), write
a rule file with that base instead of the committed one (the committed file keeps the default,
``grafana.config.RUNBOOK_URL``, the runbook inside this repository)::

    python grafana/build.py --runbook-url https://wiki.example/distgrad-runbook --rules-out /etc/prometheus/distgrad.rules.yml

Metric facts (names, units, help, when a metric exists) come from distgrad's metric catalogue,
``distgrad/export/metrics.py``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __name__ == "__main__" and str(HERE.parent) not in sys.path:  # run as a script: grafana/ is a package
    sys.path.insert(0, str(HERE.parent))

from distgrad.export import metrics as catalogue  # noqa: E402
from grafana import alerts, dashboards, routing  # noqa: E402
from grafana.dashboards.common import to_json  # noqa: E402

RULES_PATH = HERE / "alerts" / "distgrad.rules.yml"
ALERTMANAGER_PATH = HERE.parent / "configs" / "alertmanager.yml"
DASHBOARDS_DIR = HERE / "dashboards"
#: Generated dashboard file name -> module that builds it.
DASHBOARDS = {m.FILE: m for m in dashboards.MODULES}


def catalogue_metrics() -> set[str]:
    """Names of the metrics declared in distgrad's metric catalogue (:mod:`distgrad.export.metrics`)."""
    return set(catalogue.names())


def referenced_metrics(text: str) -> set[str]:
    """distgrad_* metric names used in a rule file or dashboard."""
    return set(re.findall(r"\bdistgrad_[a-z0-9_]+", text))


def outputs() -> dict[Path, str]:
    """Every generated file and its content."""
    out = {RULES_PATH: alerts.render_rules(), ALERTMANAGER_PATH: routing.render_alertmanager()}
    out.update({DASHBOARDS_DIR / name: to_json(m.build()) for name, m in DASHBOARDS.items()})
    return out


def stale_outputs() -> list[Path]:
    """Generated files whose committed content differs from a fresh generation."""
    return [p for p, text in outputs().items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale instead of writing")
    ap.add_argument("--runbook-url", metavar="URL", help="runbook base of the alerts' runbook_url (URL#<alert>); "
                    "needs --rules-out (the committed rule file keeps grafana.config.RUNBOOK_URL)")
    ap.add_argument("--rules-out", metavar="FILE", help="write only the rule file, to FILE ('-': stdout)")
    args = ap.parse_args(argv)
    if args.runbook_url is not None and args.rules_out is None:
        ap.error("--runbook-url needs --rules-out FILE: the committed rule file keeps the default base")
    if args.rules_out is not None:
        text = alerts.render_rules(args.runbook_url)
        if args.rules_out == "-":
            sys.stdout.write(text)
        else:
            Path(args.rules_out).write_text(text)
            print(f"wrote {args.rules_out}", file=sys.stderr)
        return 0
    if args.check:
        stale = stale_outputs()
        for p in stale:
            print(f"stale: {p.relative_to(HERE.parent)} (run python grafana/build.py)", file=sys.stderr)
        return 1 if stale else 0
    for p, text in outputs().items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
