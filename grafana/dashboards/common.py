"""The house style of distgrad's dashboards, on Grafana's own grafana-foundation-sdk.

Every panel, query, variable and annotation is an SDK builder (typed after Grafana's schema for
the pinned version, :data:`grafana.config.GRAFANA_VERSION`); this module only fixes the options
all distgrad panels share, so that ``overview.py`` and ``layers.py`` read as lists of panels.
:func:`to_json` serialises a built dashboard with the SDK's JSON encoder.

All queries select ``job=~"$job", run=~"$run", instance=~"$instance"`` (:data:`S`) on the
``${datasource}`` Prometheus data source (:data:`DS`).

Metric facts come from distgrad's metric catalogue (:mod:`distgrad.export.metrics`): every
``distgrad_*`` metric a panel queries must be declared there (else building fails with
``KeyError``), each panel's description lists its metrics with their catalogue unit, help text
and existence condition, and its Grafana unit follows from their catalogue unit
(:func:`grafana_unit`) unless the panel says otherwise.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Sequence, TypeVar, cast

from grafana_foundation_sdk.builders import bargauge as bargauge_b
from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import heatmap as heatmap_b
from grafana_foundation_sdk.builders import prometheus as prometheus_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import table as table_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as c
from grafana_foundation_sdk.models import dashboard as d
from grafana_foundation_sdk.models import heatmap as heatmap_m
from grafana_foundation_sdk.models import prometheus as prometheus_m

from distgrad.export import metrics as catalogue
from grafana import config
from grafana.queries import UNCONDITIONAL

DS = d.DataSourceRef(type_val="prometheus", uid="${datasource}")
#: Series selector every dashboard query uses.
S = 'job=~"$job", run=~"$run", instance=~"$instance"'
RATE = "$__rate_interval"
#: The firing distgrad alerts; ``job=~"$job|"`` also matches alerts without a job label
#: (DistgradExporterAbsent).
FIRING_ALERTS = 'ALERTS{alertname=~"Distgrad.*", alertstate="firing", job=~"$job|"}'

Threshold = tuple[str, "float | None"]
#: A panel target, as the SDK's panel builders take it.
Target = cogbuilder.Builder[cogvariants.Dataquery]


# --- metrics (from the catalogue) ----------------------------------------------------------------

_METRIC_RE = re.compile(r"\bdistgrad_[a-z0-9_]+")
#: Grafana unit of a catalogue unit; every other catalogue unit is shown as a plain number.
GRAFANA_UNITS = {"seconds": "s", "ratio": "percentunit"}


def metrics_in(*exprs: str) -> list[Any]:
    """The catalogue entries (:class:`distgrad.export.metrics.Metric`) of the distgrad metrics in
    ``exprs``, in order of first use. Raises ``KeyError`` naming a metric that is not declared."""
    names = dict.fromkeys(n for e in exprs for n in _METRIC_RE.findall(e))
    return [catalogue.by_name(n) for n in names]


def grafana_unit(exprs: Sequence[str]) -> str:
    """The Grafana unit of a panel over ``exprs``: :data:`GRAFANA_UNITS` of their metrics'
    catalogue unit ("none" for the others). Raises ``ValueError`` when the metrics' units map
    to different Grafana units, or there is no distgrad metric: such a panel names its unit."""
    units = {GRAFANA_UNITS.get(m.unit, "none") for m in metrics_in(*exprs)}
    if len(units) != 1:
        raise ValueError(f"no single unit for {list(exprs)} ({sorted(units)}): pass unit=")
    return units.pop()


def describe(note: str, exprs: Sequence[str]) -> str:
    """A panel description (Markdown): ``note``, then each metric of ``exprs`` with its
    catalogue unit, help and, unless every run has it, when it exists."""
    lines = []
    for m in metrics_in(*exprs):
        line = f"`{m.name}` ({m.unit}): {m.help}"
        if m.max_series and m.max_series > 1:
            line += f" At most {m.max_series} series."
        if m.when not in UNCONDITIONAL:
            line += f" Exists: {catalogue.CONDITIONS[m.when]}."
        lines.append(line)
    body = "\n".join(f"- {x}" for x in lines) if len(lines) > 1 else "".join(lines)
    return "\n\n".join(x for x in (note, body) if x)


# --- queries ----------------------------------------------------------------------------------

def query(expr: str, legend: str = "__auto", ref: str = "A", *, instant: bool = False,
          fmt: prometheus_m.PromQueryFormat = prometheus_m.PromQueryFormat.TIME_SERIES) -> prometheus_b.Dataquery:
    """A PromQL target on :data:`DS` (range query unless ``instant``)."""
    q = (prometheus_b.Dataquery().datasource(DS).editor_mode(prometheus_m.QueryEditorMode.CODE).expr(expr)
         .format(fmt).legend_format(legend).ref_id(ref))
    return q.instant() if instant else q.range()


def queries(*specs: tuple[str, str]) -> list[Target]:
    """``queries((expr, legend), ...)`` with refIds A, B, C..."""
    return [query(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(specs)]


def _exprs(targets: Sequence[Target]) -> list[str]:
    return [cast(prometheus_m.Dataquery, t.build()).expr for t in targets]


def thresholds(*steps: Threshold) -> dashboard_b.ThresholdsConfig:
    """Absolute thresholds; the first step's value is None (the base colour)."""
    return (dashboard_b.ThresholdsConfig().mode(d.ThresholdsMode.ABSOLUTE)
            .steps([d.Threshold(color=col, value=v) for col, v in steps]))


GREEN: tuple[Threshold, ...] = (("green", None),)
RED_IF_ANY: tuple[Threshold, ...] = (("green", None), ("red", 1))


def _hide_from() -> common_b.HideSeriesConfig:
    return common_b.HideSeriesConfig().legend(False).tooltip(False).viz(False)


P = TypeVar("P")


def _common(panel: P, title: str, note: str, exprs: Sequence[str], unit: str | None, w: int, h: int,
            th: Sequence[Threshold] | None, color: d.FieldColorModeId) -> P:
    """Sets what every panel type has (title, description, size, unit, thresholds, colour mode)
    on ``panel``; the SDK's panel builders share these methods but no base class."""
    b: Any = panel
    (b.title(title).description(describe(note, exprs)).datasource(DS).span(w).height(h)
     .unit(unit or grafana_unit(exprs)).mappings([]).thresholds(thresholds(*(th or GREEN)))
     .color_scheme(dashboard_b.FieldColor().mode(color)))
    return panel


# --- panels -----------------------------------------------------------------------------------

def timeseries(title: str, note: str, targets: list[Target], w: int, h: int, *, unit: str | None = None,
               log: int = 0, th: Sequence[Threshold] | None = None, bars: bool = False,
               min_: float | None = None, max_: float | None = None,
               threshold_lines: bool = False) -> timeseries_b.Panel:
    """Lines (or ``bars``) per series, legend table on the right with last and max values,
    shared tooltip sorted by value; ``log`` (2 or 10) makes the y axis logarithmic;
    ``threshold_lines`` draws the thresholds as lines and bands."""
    p = _common(timeseries_b.Panel(), title, note, _exprs(targets), unit, w, h, th, d.FieldColorModeId.PALETTE_CLASSIC)
    if min_ is not None:
        p.min(min_)
    if max_ is not None:
        p.max(max_)
    scale = common_b.ScaleDistributionConfig()
    scale = scale.type(c.ScaleDistribution.LOG).log(log) if log else scale.type(c.ScaleDistribution.LINEAR)
    p = (p.axis_border_show(False).axis_centered_zero(False).axis_color_mode(c.AxisColorMode.TEXT)
         .axis_label("").axis_placement(c.AxisPlacement.AUTO).bar_alignment(c.BarAlignment.CENTER)
         .bar_width_factor(0.6)
         .draw_style(c.GraphDrawStyle.BARS if bars else c.GraphDrawStyle.LINE)
         .fill_opacity(60 if bars else 10).gradient_mode(c.GraphGradientMode.NONE).hide_from(_hide_from())
         .insert_nulls(False).line_interpolation(c.LineInterpolation.LINEAR).line_width(1).point_size(4)
         .scale_distribution(scale).show_points(c.VisibilityMode.AUTO).span_nulls(False)
         .stacking(common_b.StackingConfig().group("A").mode(c.StackingMode.NONE))
         .thresholds_style(common_b.GraphThresholdsStyleConfig().mode(
             c.GraphThresholdsStyleMode.LINE_AND_AREA if threshold_lines else c.GraphThresholdsStyleMode.OFF)))
    p = (p.legend(common_b.VizLegendOptions().calcs(["lastNotNull", "max"]).display_mode(c.LegendDisplayMode.TABLE)
                  .placement(c.LegendPlacement.RIGHT).show_legend(True))
         .tooltip(common_b.VizTooltipOptions().hide_zeros(False).mode(c.TooltipDisplayMode.MULTI)
                  .sort(c.SortOrder.DESCENDING)))
    return p.targets(targets)


def _reduce_last() -> common_b.ReduceDataOptions:
    return common_b.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)


def stat(title: str, note: str, targets: list[Target], w: int, h: int, *, unit: str | None = None,
         th: Sequence[Threshold] | None = None, graph: bool = False) -> stat_b.Panel:
    """The last value, coloured by the thresholds; ``graph`` adds a sparkline."""
    p = _common(stat_b.Panel(), title, note, _exprs(targets), unit, w, h, th, d.FieldColorModeId.THRESHOLDS)
    return (p.color_mode(c.BigValueColorMode.VALUE)
            .graph_mode(c.BigValueGraphMode.AREA if graph else c.BigValueGraphMode.NONE)
            .justify_mode(c.BigValueJustifyMode.AUTO).orientation(c.VizOrientation.AUTO)
            .percent_change_color_mode(c.PercentChangeColorMode.STANDARD).reduce_options(_reduce_last())
            .show_percent_change(False).text_mode(c.BigValueTextMode.AUTO).wide_layout(True)
            .targets(targets))


def bargauge(title: str, note: str, expr: str, legend: str, w: int, h: int, *, unit: str | None = None,
             th: Sequence[Threshold] | None = None, max_: float | None = None) -> bargauge_b.Panel:
    """Horizontal gradient bars of an instant query (one bar per series), from 0 to ``max_``."""
    p = _common(bargauge_b.Panel(), title, note, [expr], unit, w, h, th, d.FieldColorModeId.THRESHOLDS).min(0)
    if max_ is not None:
        p.max(max_)
    return (p.display_mode(c.BarGaugeDisplayMode.GRADIENT)
            .legend(common_b.VizLegendOptions().calcs([]).display_mode(c.LegendDisplayMode.LIST)
                    .placement(c.LegendPlacement.BOTTOM).show_legend(False))
            .max_viz_height(300).min_viz_height(16).min_viz_width(8)
            .name_placement(c.BarGaugeNamePlacement.LEFT).orientation(c.VizOrientation.HORIZONTAL)
            .reduce_options(_reduce_last()).show_unfilled(True).sizing(c.BarGaugeSizing.AUTO)
            .value_mode(c.BarGaugeValueMode.COLOR)
            .targets([query(expr, legend, instant=True)]))


def table(title: str, note: str, expr: str, w: int, h: int, *, unit: str | None = None,
          no_value: str | None = None) -> table_b.Panel:
    """One row per series of an instant query, its labels as columns (Time and __name__ hidden);
    ``no_value``: the text shown instead of "No data" when the query returns nothing."""
    p = _common(table_b.Panel(), title, note, [expr], unit, w, h, None, d.FieldColorModeId.THRESHOLDS)
    if no_value:
        p = p.no_value(no_value)
    return (p.align(c.FieldTextAlignment.AUTO).cell_options(c.TableAutoCellOptions()).inspect(False)
            .cell_height(c.TableCellHeight.SM)
            .footer(common_b.TableFooterOptions().count_rows(False).reducer(["sum"]).show(False))
            .frame_index(0).show_header(True)
            .targets([query(expr, "", instant=True, fmt=prometheus_m.PromQueryFormat.TABLE)])
            .transformations([d.DataTransformerConfig(id_val="organize", options={
                "excludeByName": {"Time": True, "__name__": True}, "indexByName": {}, "renameByName": {}})]))


def heatmap(title: str, note: str, expr: str, legend: str, w: int, h: int, *,
            unit: str | None = None) -> heatmap_b.Panel:
    """Each series (one per label value) is one row of the heatmap, in legend order; colour is
    the value (no bucketing: ``calculate`` off)."""
    unit = unit or grafana_unit([expr])
    p = (heatmap_b.Panel().title(title).description(describe(note, [expr])).datasource(DS).span(w).height(h).unit(unit)
         .hide_from(_hide_from()).scale_distribution(common_b.ScaleDistributionConfig().type(c.ScaleDistribution.LINEAR)))
    return (p.calculate(False).cell_gap(1).cell_values(heatmap_b.CellValues().unit(unit))
            .color(heatmap_b.HeatmapColorOptions().exponent(0.5).fill("dark-orange")
                   .mode(heatmap_m.HeatmapColorMode.SCHEME).reverse(False)
                   .scale(heatmap_m.HeatmapColorScale.EXPONENTIAL).scheme("Spectral").steps(64))
            .exemplars_color("rgba(255,0,255,0.7)")
            .filter_values(heatmap_b.FilterValueRange().le(1e-9))
            .show_legend()
            .rows_frame(heatmap_b.RowsHeatmapOptions().layout(c.HeatmapCellLayout.AUTO))
            .selection_mode(heatmap_m.HeatmapSelectionMode.X)
            .show_value(c.VisibilityMode.NEVER)
            .mode(c.TooltipDisplayMode.SINGLE).show_color_scale(True).hide_y_histogram()
            .y_axis(heatmap_b.YAxisConfig().axis_placement(c.AxisPlacement.LEFT).reverse(False))
            .targets([query(expr, legend)]))


def row(title: str) -> dashboard_b.Row:
    """An expanded row header; the panels after it (until the next row) belong to it."""
    return dashboard_b.Row(title).collapsed(False)


#: The catalogue conditions (:data:`distgrad.export.metrics.CONDITIONS`) of features a default run does
#: not have, and how to turn each on: the panels that read only such metrics go in a collapsed
#: row (:func:`opt_in_row`) whose title says it, never among the panels a default run fills.
OPT_IN: dict[str, str] = {
    "loss_scaler": "fp16 runs with a dynamic loss scaler only",
    "update_ratio": "statistics.update_ratio: true",
    "replicated": "replicated gradients (DDP, ZeRO-0, HSDP) with statistics.replica_check: true",
    "components": "observe_loss(loss, components=...)",
    "tokens": "observe_loss(loss, token_losses=... or logits=, labels=)",
    "histogram": "histogram.enabled: true",
    "noise_scale": "noise_scale.enabled: true",
    "curvature": "curvature.enabled: true",
    "logits": "logits.attention / logits.output: true",
    "underflow": "underflow.enabled: true",
    "router": "router.enabled: true (MoE models)",
    "action": "action.on_nonfinite / action.on_spike",
    "adaptive_clip": "adaptive_clip.mode: zclip / adagc",
    "replica_weights": "replica_weights.hash_interval > 0 (DDP, ZeRO-0, HSDP)",
    "update_geometry": "update_geometry.enabled: true",
    "update_geometry_spectral": "update_geometry.spectral: true for the spectral norm",
    "update_geometry_muon": "Muon's extra with torch.optim.Muon",
    "update_geometry_adafactor": "Adafactor's with torch.optim.Adafactor",
    "rerun": "rerun.enabled: true",
    "fp8": "fp8.enabled: true with torchao float8 layers",
}


def opt_in_row(what: str, conditions: Sequence[str], panels: Sequence[Any]) -> dashboard_b.Row:
    """A collapsed row of ``panels``, which read metrics that exist only with ``conditions``
    (keys of :data:`OPT_IN`), titled ``"<what> (off by default: <how to turn it on>)"``: the
    panels a default run cannot fill stay out of sight instead of saying "No data".

    Raises:
        KeyError: a condition that is not in :data:`OPT_IN`.
    """
    how = "; ".join(OPT_IN[k] for k in conditions)
    b = dashboard_b.Row(f"{what} (off by default: {how})").collapsed(True)
    for panel in panels:
        b = b.with_panel(panel)
    return b


# --- dashboard --------------------------------------------------------------------------------

def _query_variable(name: str, label: str, expr: str, *, all_: bool) -> dashboard_b.QueryVariable:
    v = (dashboard_b.QueryVariable(name).datasource(DS).hide(d.VariableHide.DONT_HIDE).include_all(all_)
         .label(label).multi(all_).options([]).query(expr).refresh(d.VariableRefresh.ON_TIME_RANGE_CHANGED)
         .regex("").sort(d.VariableSort.ALPHABETICAL_ASC))
    v.build().skip_url_sync = False
    if all_:
        # ".*" also matches series without the label (run is optional)
        v.all_value(".*").current(d.VariableOption(selected=True, text=["All"], value=["$__all"]))
    return v


def variables(extra: Iterable[tuple[str, str, str]] = ()) -> list[Any]:
    """Data source, job (one), run and instance (any, "All" by default), then ``extra``
    ``(name, label, label_values query)`` variables with "All"."""
    ds = (dashboard_b.DatasourceVariable("datasource").hide(d.VariableHide.DONT_HIDE).include_all(False)
          .label("Data source").multi(False).type("prometheus").regex(""))
    m = ds.build()
    m.options, m.refresh, m.skip_url_sync = [], d.VariableRefresh.ON_DASHBOARD_LOAD, False
    return [
        ds,
        _query_variable("job", "Job", f"label_values(distgrad_info{{{config.SELECTOR}}}, job)", all_=False),
        _query_variable("run", "Run", 'label_values(distgrad_info{job=~"$job"}, run)', all_=True),
        _query_variable("instance", "Instance", 'label_values(distgrad_info{job=~"$job", run=~"$run"}, instance)',
                        all_=True),
        *(_query_variable(name, label, expr, all_=True) for name, label, expr in extra),
    ]


class PromAnnotation(d.AnnotationQuery):
    """An annotation from a Prometheus query: the SDK's AnnotationQuery plus the fields Grafana's
    Prometheus data source reads (series labels as tags, title and text templates); the SDK's
    model types ``target`` after the built-in Grafana annotations only."""

    def __init__(self, name: str, target: prometheus_m.Dataquery, *, icon_color: str, tag_keys: str,
                 title_format: str, text_format: str) -> None:
        super().__init__(name=name, datasource=DS, enable=True, hide=False, icon_color=icon_color)
        self.target = target  # type: ignore[assignment]  # a Prometheus query, see above
        self.tag_keys, self.title_format, self.text_format = tag_keys, title_format, text_format

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "tagKeys": self.tag_keys, "textFormat": self.text_format,
                "titleFormat": self.title_format, "useValueForTime": False}


def alert_annotations() -> list[Any]:
    """Grafana's built-in annotations and alerts, and the firing Distgrad* alerts (from
    Prometheus' ALERTS series) as red marks tagged with alert name and severity."""
    builtin = (dashboard_b.AnnotationQuery().built_in(1)
               .datasource(d.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
               .enable(True).hide(True).icon_color("rgba(0, 211, 255, 1)").name("Annotations & Alerts")
               .type("dashboard"))
    target = prometheus_b.Dataquery().expr(FIRING_ALERTS).interval("").ref_id("Anno").build()
    alerts = PromAnnotation("distgrad alerts", target, icon_color="red", tag_keys="alertname,severity",
                            title_format="{{alertname}}", text_format="{{instance}}")
    return [builtin.build(), alerts, *spike_annotations()]


#: A single spike training recovers from is no alert (docs/runbook.md, "Detection policy"): it is
#: marked here, from the spike counters of the robust and window detectors (each increase in the
#: scrape interval is a mark, tagged with the series and the detector) ...
SPIKES = ('max by (job, instance, series, detector) (label_replace(increase(distgrad_grad_norm_spikes_total'
          '{job=~"$job", run=~"$run", instance=~"$instance", detector=~"robust|window"}[$__interval]), "series", '
          '"grad_norm", "", "") > 0 or label_replace(increase(distgrad_loss_spikes_total{job=~"$job", '
          'run=~"$run", instance=~"$instance", detector=~"robust|window"}[$__interval]), "series", "loss", "", "") > 0)')
#: ... and the detection policy's incidents (which the alerts fire on) as marks of their own
INCIDENTS = 'increase(distgrad_incidents_total{job=~"$job", run=~"$run", instance=~"$instance"}[$__interval]) > 0'


def spike_annotations() -> list[Any]:
    """Annotations: every robust/window spike (orange, tagged series and detector) and every
    incident the detection policy opened (purple, tagged with its kind)."""
    spikes = PromAnnotation("distgrad spikes", prometheus_b.Dataquery().expr(SPIKES).interval("").ref_id("Spikes")
                            .build(), icon_color="orange", tag_keys="series,detector",
                            title_format="{{series}} spike", text_format="{{instance}} ({{detector}} detector)")
    incidents = PromAnnotation("distgrad incidents", prometheus_b.Dataquery().expr(INCIDENTS).interval("")
                               .ref_id("Incidents").build(), icon_color="purple", tag_keys="incident",
                               title_format="{{incident}} incident", text_format="{{instance}}")
    return [spikes, incidents]


def dashboard(uid: str, title: str, description: str, panels: Sequence[Any],
              extra_vars: Iterable[tuple[str, str, str]] = ()) -> d.Dashboard:
    """A distgrad dashboard: ``panels`` (SDK panel and row builders) laid out left to right by
    the SDK (a row starts a new line; each line of panels must fill the 24 columns), numbered
    1, 2, ... in order, with the shared variables, alert annotations and a link menu to the
    other distgrad dashboards."""
    cfg = config.DASHBOARDS
    b = (dashboard_b.Dashboard(title).uid(f"{cfg['uid_prefix']}-{uid}").description(description).editable()
         .fiscal_year_start_month(0).tooltip(d.DashboardCursorSync.CROSSHAIR).refresh(cfg["refresh"])
         .tags(cfg["tags"]).time(cfg["time_from"], "now").timepicker(dashboard_b.TimePicker())
         .timezone("browser").version(1).week_start("").variables(variables(extra_vars))
         .link(dashboard_b.DashboardLink("distgrad").as_dropdown(False).icon("external link").include_vars(True)
               .keep_time(True).tags(cfg["tags"]).target_blank(False).tooltip("")
               .type(d.DashboardLinkType.DASHBOARDS).url("")))
    for p in panels:
        b = b.with_row(p) if isinstance(p, dashboard_b.Row) else b.with_panel(p)
    model = b.build()
    model.annotations = d.AnnotationContainer(list_val=alert_annotations())
    flat = [q for p in model.panels or [] for q in (p, *(getattr(p, "panels", None) or []))]
    for i, p in enumerate(flat, start=1):  # collapsed rows' panels numbered after their row
        p.id_val = i
    return model


def to_json(model: d.Dashboard) -> str:
    """The dashboard as Grafana imports it (the SDK's JSON encoder, 2-space indent)."""
    return json.dumps(model, cls=JSONEncoder, indent=2) + "\n"
