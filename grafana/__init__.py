"""distgrad's monitoring mixin: Prometheus alert rules and Grafana dashboards, generated.

Laid out like kubernetes-mixin: :mod:`grafana.config` (selectors, thresholds, runbook URL),
:mod:`grafana.alerts` (the rule file), :mod:`grafana.dashboards` (one module per dashboard, on
Grafana's grafana-foundation-sdk), ``grafana/build.py`` (writes and checks the committed
outputs), :mod:`grafana.queries` (every dashboard query, for live tests). Not part of the
installed ``distgrad`` package: run it from the repository root.
"""
