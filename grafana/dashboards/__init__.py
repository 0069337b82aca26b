"""distgrad's Grafana dashboards: one module per dashboard (``build()`` returns the
grafana-foundation-sdk model, ``FILE`` names the committed JSON beside it), the shared house
style in :mod:`grafana.dashboards.common`."""

from __future__ import annotations

from grafana.dashboards import layers, overview

#: Every dashboard module, in the order build.py writes them.
MODULES = (overview, layers)
