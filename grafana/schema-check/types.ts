/**
 * Types the distgrad dashboards are checked against: @grafana/schema's `Dashboard` (pinned to
 * Grafana 11.6, dashboard schemaVersion 41), narrowed where @grafana/schema is loose
 * (`options`, `fieldConfig.defaults.custom` and `targets` are `Record<string, unknown>` there):
 *
 * - each panel's `options` and `fieldConfig.defaults.custom` are typed by its panel plugin's
 *   generated `Options` / `FieldConfig` (timeseries, stat, bargauge, table, heatmap),
 * - every panel and target must use the `${datasource}` template variable,
 * - `fieldConfig.defaults.unit`, `id` and `gridPos` are required,
 * - Prometheus targets and annotations are typed after Grafana's Prometheus data source
 *   (`PromQuery` lives in @grafana/prometheus, not in @grafana/schema).
 *
 * `Json<T>` turns the schema's TypeScript string enums into their string literals, as they
 * appear in JSON. `_refinesDashboard` below proves a DistgradDashboard is still a Dashboard.
 */
import type {
  AnnotationQuery,
  Dashboard,
  FieldConfig,
  FieldConfigSource,
  GridPos,
  Panel,
  RowPanel,
} from '@grafana/schema';
import type * as bargauge from '@grafana/schema/dist/esm/raw/composable/bargauge/panelcfg/x/BarGaugePanelCfg_types.gen.js';
import type * as heatmap from '@grafana/schema/dist/esm/raw/composable/heatmap/panelcfg/x/HeatmapPanelCfg_types.gen.js';
import type * as stat from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen.js';
import type * as table from '@grafana/schema/dist/esm/raw/composable/table/panelcfg/x/TablePanelCfg_types.gen.js';
import type * as timeseries from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen.js';

/** T as it appears in JSON: string enums become their literal values. */
export type Json<T> = T extends string
  ? `${T}`
  : T extends number | boolean | null | undefined
    ? T
    : T extends ReadonlyArray<infer U>
      ? Array<Json<U>>
      : T extends object
        ? { [K in keyof T]: Json<T[K]> }
        : T;

/** The dashboards' data source: always the `datasource` template variable. */
export type PromDatasource = { type: 'prometheus'; uid: '${datasource}' };

/** A Prometheus query as Grafana's Prometheus data source saves it. */
export type PromTarget = {
  datasource: PromDatasource;
  editorMode?: 'code' | 'builder';
  exemplar?: boolean;
  expr: string;
  format?: 'time_series' | 'table' | 'heatmap';
  hide?: boolean;
  instant?: boolean;
  interval?: string;
  intervalFactor?: number;
  legendFormat?: string;
  range?: boolean;
  refId: string;
};

/** A Prometheus annotation query (Grafana >= 10 keeps the query under `target`). */
export type PromAnnotation = Omit<Json<AnnotationQuery>, 'datasource' | 'target'> & {
  datasource: PromDatasource;
  target: Omit<PromTarget, 'datasource'>;
  tagKeys?: string;
  textFormat?: string;
  titleFormat?: string;
  useValueForTime?: boolean;
};

type FieldConfigSourceOf<Custom> = Omit<Json<FieldConfigSource>, 'defaults'> & {
  defaults: Omit<Json<FieldConfig>, 'custom' | 'unit'> & { unit: string; custom?: Json<Custom> };
};

type PanelOf<Type extends string, Options, Custom> = Omit<
  Json<Panel>,
  'type' | 'id' | 'gridPos' | 'datasource' | 'options' | 'fieldConfig' | 'targets'
> & {
  type: Type;
  id: number;
  gridPos: Json<GridPos>;
  datasource: PromDatasource;
  options: Json<Options>;
  fieldConfig: FieldConfigSourceOf<Custom>;
  targets: PromTarget[];
};

export type DistgradPanel =
  | PanelOf<'timeseries', timeseries.Options, timeseries.FieldConfig>
  | PanelOf<'stat', stat.Options, never>
  | PanelOf<'bargauge', bargauge.Options, never>
  | PanelOf<'table', table.Options, table.FieldConfig>
  | PanelOf<'heatmap', heatmap.Options, heatmap.FieldConfig>;

export type DistgradRow = Omit<Json<RowPanel>, 'gridPos'> & { gridPos: Json<GridPos> };

export type DistgradDashboard = Omit<Json<Dashboard>, 'panels' | 'annotations' | 'schemaVersion'> & {
  schemaVersion: 41;
  panels: Array<DistgradPanel | DistgradRow>;
  annotations: { list: Array<Json<AnnotationQuery> | PromAnnotation> };
};

/** Compiles only while every DistgradDashboard is also a (JSON) Dashboard. */
export const _refinesDashboard = (d: DistgradDashboard): Json<Dashboard> => d;
