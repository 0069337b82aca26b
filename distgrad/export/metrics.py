"""The metric catalogue: every Prometheus metric distgrad serves, declared once.

Each :class:`Metric` names a metric as users query it (counters end in ``_total``), its type,
labels, unit, help text and the condition under which it exists (:data:`CONDITIONS`: e.g. only
with an fp16 loss scaler, only with ``update_ratio: true``). Everything else derives from it:

* the Prometheus collector (:mod:`distgrad.export.prometheus`) builds every family with
  :func:`family` (help, type and label names from here) and answers ``describe()`` from here;
* ``docs/metrics.md`` is generated: ``python -m distgrad.export.metrics --markdown > docs/metrics.md``
  (a test checks that the committed file is up to date);
* the series budget (:mod:`distgrad.naming.grouping`: ``PARAM_SERIES``, ``LAYER_SERIES``,
  ``KIND_SERIES``, ``GLOBAL_SERIES``) is counted with :func:`series_per`;
* the Grafana generator imports :data:`CATALOGUE` / :func:`by_name`.

Adding a metric: one :class:`Metric` entry in :data:`CATALOGUE` plus the code that computes it
in the collector; ``tests/test_metric_catalogue.py`` fails if a declared metric is not served
(with the features that enable it) or a served one is not declared.

Standard library only (importable without torch or prometheus_client).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["Label", "Metric", "LABELS", "CONDITIONS", "CATALOGUE", "SCOPES", "PLUGIN_SAMPLES", "condition", "label",
           "gauge", "counter", "register", "by_name", "names", "family", "series_per", "markdown",
           "SWITCHES", "switched_off"]


@dataclass(frozen=True)
class Label:
    """A label name used by distgrad metrics.

    Attributes:
        name: the label name.
        doc: what its values are (Markdown).
        values: the complete set of values when it is a fixed set (e.g. ``("nan", "inf")``),
            else None (bounded by the run: parameters, layers, ranks ...).
    """

    name: str
    doc: str
    values: tuple[str, ...] | None = None


#: every label of every metric; a metric may only use these
LABELS: dict[str, Label] = {lab.name: lab for lab in (
    Label("param", "one value per trainable parameter tensor (the user's own name, wrapper prefixes "
                   "stripped), bounded by the series budget (`max_param_series`, top-k by norm; "
                   "non-finite parameters always kept)"),
    Label("kind", "kind of non-finite element", ("nan", "inf")),
    Label("layer", "one value per block (`0`, `enc.3`, ...) plus `embed`/`head`/`norm`/`other`; LoRA "
                   "adapters as `<layer>/lora_<role>`"),
    Label("module_kind", "a fixed canonical set (`attn_q`, `mlp_up`, ...; named so because `kind` is "
                         "taken by `nan`/`inf`)"),
    Label("detector", "spike detector: `ema` (ZClip's EMA z-score), `window` (OLMo's 128-sample 6-sigma "
                      "test), `robust` (Theil-Sen detrended MAD jump test of the log value, the paging one; "
                      "loss components: ema and window only)", ("ema", "window", "robust")),
    Label("rank", "rank in [0, world size)"),
    Label("source", "what of a culprit rank's own contribution was non-finite before the reduction: its "
                    "observed `loss`, or a `grad`ient its backward produced", ("loss", "grad")),
    Label("module", "dotted name of a module in the user's model (wrapper prefixes removed; `<root>` for the "
                    "root module); one series at most"),
    Label("outcome", "what the forward replay of a non-finite step came to (`distgrad.record.culprit.OUTCOMES`)",
          ("found", "finite", "weights_nonfinite", "no_input", "not_kept", "failed", "off", "budget",
           "async_records", "model_parallel", "uneven_micro_batches")),
    Label("sink", "sink name (`flight_recorder`: its reports)", ("prometheus", "jsonl", "tensorboard",
                                                                  "flight_recorder")),
    Label("reason", "why a rank could not vouch for its gradients: `closure` (read before the step's "
                    "backward: `optimizer.step(closure)`), `clipped` (clipped before distgrad read them), "
                    "`no_backward` (no backward since the last step)", ("closure", "clipped", "no_backward")),
    Label("cause", "why the opt-in action skipped an optimizer update: `nonfinite` (NaN/Inf in the reduced gradient "
                   "or the loss), `spike` (the paging detector fired on the loss or the gradient norm)",
          ("nonfinite", "spike")),
    Label("engine", "engine adapter (`deepspeed`, `ddp`, `fsdp`, `fsdp2`, ...)"),
    Label("zero_stage", "DeepSpeed ZeRO stage, empty for other engines"),
    Label("dtype", "training (compute) dtype: `fp32`, `fp16`, `bf16`"),
    Label("version", "distgrad version"),
    Label("component", "loss component, as passed to `observe_loss(components=...)` (declared at first use, at "
                       "most 8)"),
    Label("source", "data source of per-token losses: the configured `loss.sources` (at most 8) and `other`"),
    Label("incident", "kind of incident the detection policy opened (`distgrad.diagnostics.incidents`): "
                      "`divergence` (the loss did not come back after a spike, or drifted up; critical), "
                      "`bad_batch` (one rank's loss an outlier and the gradient norm up; critical), "
                      "`spike_burst` (robust spikes recurring; warning)", ("divergence", "bad_batch", "spike_burst")),
    Label("le", "upper edge of a fixed token-loss bin, in nats (`distgrad.loss.token.EDGES`)",
          ("0.01", "0.05", "0.1", "0.25", "0.5", "1", "2", "3", "4", "5", "6", "8", "10", "15", "20")),
)}

#: when a metric exists (``Metric.when``): key -> Markdown description
CONDITIONS: dict[str, str] = {
    "always": "from `instrument()` on",
    "step": "after the first optimizer step",
    "sample": "after the first sampled step",
    "loss": "after a sampled step with an observed loss",
    "loss_scaler": "fp16 with a dynamic loss scaler only (never under bf16/fp32)",
    "samples": "engines that count samples (DeepSpeed)",
    "replicated": ("replicated gradients (DDP, ZeRO-0, HSDP, tensor-parallel-replicated parameters) with "
                   "`replica_check`, world size > 1"),
    "clip": "with a clip threshold (the engine's or `max_grad_norm`)",
    "per_param": "`per_param: true`, for the parameters selected by the series budget",
    "update_ratio": "`update_ratio: true` (and `per_param`), for the selected parameters",
    "nonfinite": "after the first non-finite step; kept after the streak ends",
    "components": "after a sampled step whose loop passed `components=` to `observe_loss`",
    "tokens": "after a sampled step whose loop passed per-token losses (or logits and labels) to `observe_loss`",
    "action": "with an opt-in action configured (`action.on_nonfinite` / `action.on_spike`): the counter from "
              "`instrument()` on, at 0 for each cause; the gauge after the first sampled step",
    "incident": "after the detection policy opened an incident of that kind (`incidents.enabled`, the default); "
                "`distgrad_incident_rank` only for incidents that name a rank (`bad_batch`), "
                "`distgrad_incident_component` only for incidents that name a loss component",
    "data_time": "after a sampled step whose data time is known on some rank (the boundary sees the forward: "
                 "PyTorch models with `optimizer=`, DeepSpeed engines; or the loop calls `observe_data_time`)",
}

#: label sets whose size grows with the model; every other label takes a fixed or capped set
SCOPES = ("param", "layer", "module_kind")


@dataclass(frozen=True)
class Metric:
    """One metric as served by rank 0.

    Attributes:
        name: the name users query; counters end in ``_total`` (``distgrad_`` prefix always).
        type: ``"gauge"`` or ``"counter"``.
        labels: label names (keys of :data:`LABELS`), in exposition order.
        unit: base unit of the value (``seconds``, ``ratio`` (0-1), ``elements``, ``steps``,
            ``1`` for dimensionless, ``grad`` for the gradient's own unit, ...).
        help: the one-line HELP text of the exposition.
        when: key of :data:`CONDITIONS`.
        doc: longer meaning for ``docs/metrics.md`` (default: ``help``).
        max_series: cap on the number of series (e.g. ``distgrad_nonfinite_params``: 20); None
            when the count follows from the labels (see :meth:`series`).
    """

    name: str
    type: str
    labels: tuple[str, ...]
    unit: str
    help: str
    when: str = "sample"
    doc: str = ""
    max_series: int | None = None

    def __post_init__(self) -> None:
        if not self.name.startswith("distgrad_"):
            raise ValueError(f"{self.name}: metric names start with distgrad_")
        if self.type not in ("gauge", "counter"):
            raise ValueError(f"{self.name}: type must be gauge or counter, not {self.type!r}")
        if (self.type == "counter") != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters and only counters end in _total")
        unknown = [lab for lab in self.labels if lab not in LABELS]
        if unknown:
            raise ValueError(f"{self.name}: undeclared label(s) {unknown}: add them to LABELS")
        if self.when not in CONDITIONS:
            raise ValueError(f"{self.name}: when={self.when!r} is not one of {sorted(CONDITIONS)}")

    @property
    def family(self) -> str:
        """The family name of the exposition (a counter's name without ``_total``)."""
        return self.name[: -len("_total")] if self.type == "counter" else self.name

    @property
    def scope(self) -> str | None:
        """``"param"``, ``"layer"`` or ``"module_kind"`` when the series count grows with that
        label's values (and is not capped); None for a fixed number of series."""
        if self.max_series is not None:
            return None
        return next((s for s in SCOPES if s in self.labels), None)

    def series(self) -> int:
        """Series per value of :attr:`scope` (or in all, when ``scope`` is None): ``max_series``
        if set, else the product of the sizes of the fixed-value labels (``kind``: 2,
        ``detector``: 2, ``sink``: 3); labels of run-constant values (``distgrad_info``) count 1."""
        if self.max_series is not None:
            return self.max_series
        return math.prod(len(LABELS[lab].values or ()) or 1 for lab in self.labels)


def _g(name: str, unit: str, help: str, when: str = "sample", labels: Iterable[str] = (), doc: str = "",
       max_series: int | None = None) -> Metric:
    return Metric(name, "gauge", tuple(labels), unit, help, when, doc, max_series)


def _c(name: str, unit: str, help: str, when: str = "always", labels: Iterable[str] = (), doc: str = "",
       max_series: int | None = None) -> Metric:
    return Metric(name, "counter", tuple(labels), unit, help, when, doc, max_series)


def gauge(name: str, unit: str, help: str, when: str = "sample", labels: Iterable[str] = (), doc: str = "",
          max_series: int | None = None) -> Metric:
    """A gauge entry (:class:`Metric` with ``type="gauge"``), e.g. for a plug-in's ``METRICS``.

    Raises:
        ValueError: as :class:`Metric` (bad name, undeclared label or condition).
    """
    return _g(name, unit, help, when, labels, doc, max_series)


def counter(name: str, unit: str, help: str, when: str = "always", labels: Iterable[str] = (), doc: str = "",
            max_series: int | None = None) -> Metric:
    """A counter entry (:class:`Metric` with ``type="counter"``; the name ends in ``_total``).

    Raises:
        ValueError: as :class:`Metric`.
    """
    return _c(name, unit, help, when, labels, doc, max_series)


_P = ("param",)
CATALOGUE: tuple[Metric, ...] = (
    # --- run info ---------------------------------------------------------------------------
    _g("distgrad_info", "1", "Static run information.", "always", ("engine", "zero_stage", "dtype", "version"),
       doc="static run info (value 1)"),
    _g("distgrad_world_size", "ranks", "Number of ranks.", "always"),
    _g("distgrad_run_state", "1", "Run lifecycle: 1 = running (from instrument() on), 2 = finished (closed "
       "cleanly: close(), interpreter exit without an uncaught exception, or SIGTERM; served until scraped "
       "once).", "always",
       doc="run lifecycle: 1 running (from `instrument()` on), 2 finished (closed cleanly by `close()`, at "
           "interpreter exit without an uncaught exception, or on SIGTERM with its default action; rank 0 keeps "
           "serving until a scrape has read it, at most "
           "`exporter.linger_seconds`). The exporter-down alerts page only for a target whose last state was 1"),
    # --- global statistics --------------------------------------------------------------------
    _g("distgrad_grad_norm", "grad", "Global L2 norm of the reduced gradient (NaN if an element is NaN, "
       "+Inf if one is +-Inf).",
       doc="global L2 norm of the reduced gradient, non-finite as `torch.linalg.vector_norm` is: NaN when an "
           "element is NaN, +Inf when one is +-Inf (and none is NaN)"),
    _g("distgrad_optimizer_step", "steps", "Optimizer step of the last sample."),
    _g("distgrad_last_sample_timestamp_seconds", "seconds", "Unix time of the last sample."),
    _g("distgrad_last_step_timestamp_seconds", "seconds", "Unix time of the last optimizer step (sampled or not).",
       "step", doc="Unix time of the last optimizer step, sampled or not (the stall alert's input)"),
    _g("distgrad_loss", "loss", "Mean training loss of the optimizer step over all micro-batches and ranks, "
       "as the user's loss function defines it (whatever the framework divides it by before backward).", "loss",
       doc="mean training loss of the optimizer step over all its micro-batches and ranks, as the user's "
           "loss function defines it (see below)"),
    # --- per-rank attribution (each rank's own values ride in the SUM collective) --------------
    _g("distgrad_loss_max", "loss", "Highest micro-batch training loss of the optimizer step on any rank.", "loss",
       doc="highest micro-batch loss of the optimizer step over all ranks (losses a framework pre-scales for "
           "gradient accumulation: the highest rank step loss); NaN when a rank's loss was NaN"),
    _g("distgrad_loss_max_rank", "rank", "Rank whose batch had the highest loss (the first with a NaN/Inf loss "
       "if any) on the last sampled step.", "loss",
       doc="rank whose batch had the highest loss on the last sampled step: the first rank whose loss was NaN/Inf "
           "if any, else the argmax of the per-rank maxima (ties: lowest rank); every rank's mean and max are in "
           "the JSONL record (`ranks`)"),
    _g("distgrad_step_time_seconds", "seconds", "Longest per-rank wall time of the last sampled optimizer step.",
       doc="longest per-rank wall time of the last sampled optimizer step (end of the previous boundary to this "
           "one, host clock)"),
    _g("distgrad_straggler_rank", "rank", "Rank with the longest data time (before its first forward) on the last "
       "sampled step: the rank the others waited for.", "data_time",
       doc="rank with the longest data time on the last sampled step (reported by `observe_data_time`, else the "
           "time from the previous boundary to its first forward): the rank the others waited for; a rank slow "
           "inside the model is not attributed (see `distgrad/loss/tracker.py`)"),
    _g("distgrad_straggler_ratio", "1", "Step wall time over the wall time had the straggler's data time been the "
       "median rank's (>= 1).", "data_time",
       doc="slowest over median step time: the step's wall time over the wall time had the straggler's data time "
           "been the median rank's, `max(step) / (max(step) - (max(data) - median(data)))` (>= 1; 1 when balanced)"),
    # --- loss analysis: components, per-token distribution, trend --------------------------------
    _g("distgrad_loss_component", "loss", "Mean of a loss component over the step's micro-batches and ranks.",
       "components", ("component",), max_series=8),
    _g("distgrad_loss_component_weight", "1", "Mean weight of a loss component in the total loss.", "components",
       ("component",), max_series=8),
    _g("distgrad_loss_component_share", "ratio", "sum(weight * component) / sum(loss): the component's share of "
       "the total loss.", "components", ("component",), max_series=8),
    _c("distgrad_loss_component_spikes_total", "spikes",
       "Detected spikes of a loss component's weighted contribution (weight x mean).", "components",
       ("component", "detector"), max_series=16),
    _g("distgrad_token_loss_mean", "nats", "Token-weighted mean per-token loss of the step over all ranks.", "tokens"),
    _g("distgrad_perplexity", "1", "exp(mean per-token loss) of the step over all ranks.", "tokens"),
    _g("distgrad_token_loss_above_ratio", "ratio", "Fraction of the step's tokens whose loss exceeds "
       "loss.token_threshold.", "tokens"),
    _g("distgrad_token_loss_max", "nats", "Largest per-token loss of the step over all ranks.", "tokens"),
    _g("distgrad_token_loss_cumulative_ratio", "ratio", "Fraction of the step's tokens whose loss is <= le (fixed "
       "bins; a cumulative histogram).", "tokens", ("le",)),
    _g("distgrad_source_token_loss_mean", "nats", "Token-weighted mean per-token loss of one data source.", "tokens",
       ("source",), max_series=9),
    _g("distgrad_source_token_loss_above_ratio", "ratio", "Fraction of one data source's tokens whose loss exceeds "
       "loss.token_threshold.", "tokens", ("source",), max_series=9),
    _g("distgrad_loss_trend_slope", "loss", "Least-squares slope of the loss over the last trend_window steps, per "
       "1000 steps.", "loss",
       doc="least-squares slope of the loss against the step over the last `trend_window` optimizer steps, in loss "
           "units per 1000 steps (NaN with fewer than 3 sampled steps)"),
    _g("distgrad_loss_trend_stderr", "loss", "Standard error of distgrad_loss_trend_slope (per 1000 steps).", "loss"),
    _g("distgrad_loss_plateau", "1", "1 when the loss slope over a covered trend_window is within plateau_z "
       "standard errors of 0.", "loss"),
    # --- counters ---------------------------------------------------------------------------
    _c("distgrad_nonfinite_steps_total", "steps", "Sampled optimizer steps with any NaN/Inf gradient element, "
       "other than the fp16 steps a dynamic loss scaler skipped.",
       doc="sampled optimizer steps with any NaN/Inf gradient element that were *not* fp16 overflows skipped by "
           "the loss scaler (those count in `distgrad_overflow_steps_total` only, under torch `GradScaler` and "
           "DeepSpeed fp16 alike)"),
    _c("distgrad_nonfinite_unsampled_steps_total", "steps",
       "Unsampled optimizer steps (interval > 1) with any NaN/Inf gradient element, counted at the next "
       "sampled step (steps the fp16 loss scaler skips are not counted here).",
       doc="optimizer steps *not* sampled (`interval` > 1) with any NaN/Inf gradient element (fp16 overflow "
           "steps left out: see `distgrad_overflow_steps_total`), counted at the next sampled step (a "
           "device-side flag per step carried in that step's MAX collective; the JSONL record of that step "
           "names them in `unsampled_nonfinite`)"),
    _c("distgrad_nonfinite_loss_steps_total", "steps",
       "Optimizer steps whose observed training loss was NaN/Inf on some rank.",
       doc="optimizer steps, sampled or not, whose observed training loss was NaN/Inf on some rank"),
    _c("distgrad_sampled_steps_total", "steps", "Sampled optimizer steps."),
    _c("distgrad_internal_errors_total", "errors", "Failures inside distgrad; training continued."),
    _c("distgrad_replica_mismatch_total", "steps", "Sampled steps where replicated gradients differed across ranks."),
    _c("distgrad_overflow_steps_total", "steps", "fp16 optimizer steps whose gradients overflowed.", "loss_scaler"),
    _c("distgrad_skipped_steps_total", "steps", "Optimizer steps the engine did not apply.",
       doc="optimizer steps the engine did not apply (fp16 overflow); updates distgrad's opt-in action skipped "
           "are counted in `distgrad_action_skipped_steps_total` instead"),
    _c("distgrad_samples_total", "samples", "Training samples consumed (engine's count).", "samples",
       doc="training samples consumed (engine's global_samples)"),
    _c("distgrad_sink_errors_total", "errors", "Failures of one sink (the others and training went on).",
       labels=("sink",), doc="records (or flight-recorder reports) one sink failed to write, exported at 0 for "
                             "every configured sink; for `jsonl` it equals the JSONL records lost"),
    _c("distgrad_refused_steps_total", "steps",
       "Sampled optimizer steps not exported because a rank could not vouch for its gradients.",
       labels=("reason",),
       doc="sampled optimizer steps distgrad did not export because the gradients it read at the boundary "
           "could not be the step's reduced, pre-clip gradient on some rank (labelled with the reason of the "
           "lowest such rank; rank logs name the fix once per reason); exported at 0 for every reason. "
           "PyTorch-native engines only: the DeepSpeed boundary cannot read in the wrong order",
       ),
    _c("distgrad_action_skipped_steps_total", "steps",
       "Optimizer updates distgrad's opt-in action skipped on every rank (not the engine's own skips).", "action",
       labels=("cause",),
       doc="optimizer steps whose update distgrad's opt-in action skipped on every rank (`action.on_nonfinite` / "
           "`action.on_spike`: `skip`, or `stop`, which skips the offending update too), by cause; the engine's own "
           "skips (fp16 overflow) are in `distgrad_skipped_steps_total` instead. Skipping hides the cause: "
           "`DistgradUpdatesSkipped` fires on every increase"),
    _g("distgrad_action_stop_requested", "1", "1 once distgrad's opt-in action requested a stop of the run.",
       "action",
       doc="1 from the step on which the opt-in action (`stop`) requested a stop of the run, else 0 "
           "(`Instrument.should_stop`); the process normally exits soon after, so the rank logs and the "
           "JSONL record carry the same fact"),
    # --- per parameter ------------------------------------------------------------------------
    _g("distgrad_param_grad_norm", "grad", "Per-parameter L2 norm of the reduced gradient.", "per_param", _P),
    _g("distgrad_param_grad_mean", "grad", "Per-parameter mean gradient element.", "per_param", _P),
    _g("distgrad_param_grad_std", "grad", "Per-parameter population std (correction=0) of gradient elements.",
       "per_param", _P),
    _g("distgrad_param_grad_min", "grad", "Per-parameter minimum gradient element.", "per_param", _P),
    _g("distgrad_param_grad_max", "grad", "Per-parameter maximum gradient element.", "per_param", _P),
    _g("distgrad_param_grad_abs_max", "grad", "Per-parameter maximum absolute gradient element.", "per_param", _P),
    _g("distgrad_param_grad_zero_ratio", "ratio", "Per-parameter fraction of gradient elements exactly 0.",
       "per_param", _P),
    _g("distgrad_param_grad_nonfinite", "elements", "Non-finite gradient elements in the last sampled step.",
       "per_param", ("param", "kind")),
    _g("distgrad_param_grad_headroom_ratio", "ratio", "max |g| over the largest finite value of the training dtype.",
       "per_param", _P, doc="abs max / largest finite value of the training dtype (1 = overflow)"),
    _g("distgrad_param_update_ratio", "ratio", "||dw|| / ||w|| of the last applied step.", "update_ratio", _P),
    # --- per layer / module kind ------------------------------------------------------------
    _g("distgrad_layer_grad_norm", "grad", "Root-sum-square of the layer's parameter grad norms.", labels=("layer",)),
    _g("distgrad_layer_grad_nonfinite", "elements", "NaN+Inf gradient elements in the layer.", labels=("layer",)),
    _g("distgrad_layer_grad_zero_ratio", "ratio", "Fraction of exact-zero elements in the layer.", labels=("layer",)),
    _g("distgrad_layer_grad_headroom_ratio", "ratio", "Max headroom ratio over the layer.", labels=("layer",)),
    _g("distgrad_module_kind_grad_norm", "grad", "Root-sum-square grad norm over all parameters of a module kind.",
       labels=("module_kind",)),
    # --- non-finite events ----------------------------------------------------------------------
    _g("distgrad_nonfinite_params", "elements",
       "First step of the last non-finite streak: NaN/Inf elements per (param, rank shard of the reduced "
       "gradient): where the NaN landed, not where it came from (see distgrad_nonfinite_culprit).", "nonfinite",
       ("param", "rank"), max_series=20,
       doc="first step of the last non-finite streak (where it started, before it spread): NaN+Inf "
           "elements per (param, rank shard). This is the *shard view*: `rank` is whose shard of the "
           "reduced gradient held them (after an all-reduce: every rank), not who produced them; "
           "`distgrad_nonfinite_culprit` names that. At most 20 series"),
    _g("distgrad_nonfinite_culprit", "1",
       "First step of the last non-finite streak: 1 for each rank whose own loss or gradient was NaN/Inf "
       "before the cross-rank reduction (the culprit rank).", "nonfinite", ("rank", "source"), max_series=8,
       doc="the *culprit view* of the first step of the last non-finite streak: 1 per rank whose own "
           "contribution was NaN/Inf *before* the reduction spread it: `source=\"loss\"` its observed loss "
           "(every engine), `source=\"grad\"` a gradient its backward produced before the reduction (every "
           "engine: tensor hooks, `statistics.culprit_grad_check`, see docs/engines.md); no series when no rank's own "
           "contribution was non-finite (e.g. a NaN made by the reduction or the optimizer). At most 8 series "
           "(the lowest ranks; more culprits than that is a problem of every rank, not of one)"),
    _g("distgrad_nonfinite_culprit_module", "1",
       "First step of the last non-finite streak: 1 for the module whose forward output first went NaN/Inf "
       "when the offending micro-batch was replayed on the culprit rank.", "nonfinite", ("rank", "module"),
       max_series=1,
       doc="the *culprit module*: at the boundary of the first non-finite step of a streak, before the update, "
           "the step's micro-batches are replayed through the forward under the overflow tracer on the culprit "
           "rank (RNG streams, buffers and optimizer untouched; `tracer.replays`); `module` is the first module "
           "(children before parents) whose output held NaN/Inf, `rank` the rank whose batch it was. No series "
           "when no module can be vouched for: `distgrad_nonfinite_replay_outcome` says why"),
    _g("distgrad_nonfinite_replay_outcome", "1",
       "First step of the last non-finite streak: 1 for the outcome of its forward replay (found, or why no "
       "culprit module is named).", "nonfinite", ("outcome",), max_series=1,
       doc="`found` when `distgrad_nonfinite_culprit_module` names the module; otherwise why not: `finite` (the "
           "replayed forward stayed finite: the NaN came from the backward pass, the reduction or the optimizer), "
           "`weights_nonfinite`, `no_input` (no input kept, or modified in place after its forward), `not_kept`, "
           "`failed`, `off`, `budget`, `async_records`, `model_parallel`, `uneven_micro_batches` "
           "(docs/runbook.md)"),
    _g("distgrad_nonfinite_origin_step", "steps",
       "Optimizer step where the last non-finite streak started (its first non-finite sampled step).",
       "nonfinite",
       doc="the step where the last non-finite streak started: its first non-finite sampled step, which the "
           "other `distgrad_nonfinite_*` views describe (the culprit rank, the replay's culprit module, the "
           "shard view). Where the NaN started: that step, `distgrad_nonfinite_culprit` (rank) and "
           "`distgrad_nonfinite_culprit_module` (module)"),
    _g("distgrad_nonfinite_last_param_in_forward_order", "steps",
       "Optimizer step where the last non-finite streak started, labelled with the non-finite parameter that "
       "comes last in forward order (where the backward pass met the NaN first; not where it was made).",
       "nonfinite", ("param", "layer"), max_series=1,
       doc="a weaker view, for a NaN made in the backward pass: the non-finite parameter of the streak's first "
           "step that comes *last* in forward order (backpropagation meets it first). For a NaN made in the "
           "forward pass every gradient goes NaN and this names the last layer (e.g. `lm_head.weight`), not the "
           "origin: use `distgrad_nonfinite_culprit_module`. Kept off the alert pages"),
    # --- replicas, fp16, clipping ---------------------------------------------------------------
    _g("distgrad_replica_mismatch_rank", "rank", "Rank that disagreed on the last replica mismatch, -1 if none.",
       "replicated"),
    _g("distgrad_loss_scale", "1", "fp16 dynamic loss scale.", "loss_scaler"),
    _g("distgrad_loss_scale_at_minimum", "1", "1 when the loss scale sits at its minimum.", "loss_scaler"),
    _g("distgrad_consecutive_overflow_steps", "steps", "Current fp16 overflow streak.", "loss_scaler"),
    _g("distgrad_loss_scale_drop_factor", "1", "Largest loss scale of an applied step in the collapse window "
       "over the current loss scale (>= 1).", "loss_scaler",
       doc="largest loss scale at which a step was applied within the last `loss_scale.collapse_window` "
           "optimizer steps (else the last such scale seen) over the current loss scale (>= 1; NaN before any "
           "step was applied); needs no configured minimum, so it works for torch `GradScaler`"),
    _g("distgrad_loss_scale_collapsed", "1", "1 when the loss scale fell by at least loss_scale.collapse_factor "
       "below the scale training last worked at (see distgrad_loss_scale_drop_factor).", "loss_scaler"),
    _g("distgrad_clip_ratio", "ratio", "min(1, max_norm / grad_norm).", "clip"),
    _g("distgrad_post_clip_norm", "grad", "Global grad norm after clipping.", "clip"),
    # --- diagnostics ------------------------------------------------------------------------------
    _g("distgrad_grad_norm_zscore", "1", "Spike score of the last grad_norm.", labels=("detector",)),
    _g("distgrad_loss_zscore", "1", "Spike score of the last loss.", labels=("detector",),
       doc="spike score of the last loss (NaN while no loss is observed)"),
    _c("distgrad_incidents_total", "incidents", "Incidents the detection policy opened (what the alerts page "
       "on), by kind.", "sample", ("incident",),
       doc="incidents the detection policy opened since the start, by kind, at 0 for every kind from the first sampled "
           "step (`distgrad.diagnostics.incidents`; a single spike training recovers from is none); the alerts "
           "`DistgradLossDivergence`, `DistgradBadBatch` and `DistgradRecurringSpikes` fire on its increase"),
    _g("distgrad_incident_step", "steps", "Optimizer step of the event that opened the last incident of a kind "
       "(the spike step, the bad batch's step).", "incident", ("incident",)),
    _g("distgrad_incident_value", "1", "Value at the event's step of the last incident of a kind (loss units for "
       "divergence and bad_batch, gradient units for a grad-norm spike burst).", "incident", ("incident",),
       doc="the value at `distgrad_incident_step` of the last incident of a kind: the loss (divergence), the "
           "culprit rank's loss (bad_batch), the gradient norm or the loss of the spike that completed the burst "
           "(spike_burst)"),
    _g("distgrad_incident_rank", "1", "Rank named by the last incident of a kind (bad_batch: the rank whose loss "
       "was the outlier).", "incident", ("incident",)),
    _g("distgrad_incident_component", "1", "1 for the loss component whose weighted contribution rose the most in "
       "the last incident of a kind.", "incident", ("incident", "component"), max_series=3),
    _c("distgrad_grad_norm_spikes_total", "spikes", "Detected grad_norm spikes.", "sample", ("detector",)),
    _c("distgrad_loss_spikes_total", "spikes", "Detected loss spikes.", "sample", ("detector",)),
    _g("distgrad_vanishing_params", "params", "Parameters currently flagged as vanishing (parameters without "
       "any gradient count as zero gradients)."),
    _g("distgrad_params_without_grad", "params", "Trainable parameters that received no gradient at all in the "
       "last sampled step (.grad None on every rank).",
       doc="trainable parameters (`requires_grad=True`) that received no gradient at all in the last sampled "
           "step: `.grad` None on every rank (a detached branch or an unused module under DDP "
           "`find_unused_parameters=True`, FSDP2, or FSDP1 when the whole unit got none). Engines that write "
           "zeros instead (DeepSpeed ZeRO 0-3; FSDP1 when the unit has used parameters) show the same bug as exact "
           "zeros: both are fed to the vanishing test (`distgrad_vanishing_params`) as a zero gradient"),
    _g("distgrad_exploding_params", "params", "Parameters currently flagged as exploding."),
)

_BY_NAME: dict[str, Metric] = {}
for _m in CATALOGUE:
    for _k in {_m.name, _m.family}:
        if _k in _BY_NAME:
            raise ValueError(f"metric {_k} declared twice")
        _BY_NAME[_k] = _m


#: the metrics declared by plug-ins (a signal's ``METRICS``, :mod:`distgrad.signals`):
#: ``(record part attribute, part -> {metric name: value}, their names)``, in registration order;
#: the Prometheus sink serves them generically
PLUGIN_SAMPLES: list[tuple[str | None, Callable[[Any], dict[str, Any]], tuple[str, ...]]] = []
#: plug-ins whose last samples the Prometheus sink keeps serving on records where their part is
#: None (``Declares.hold``): ``{record part attribute: name of the gauge of the step they come from}``
PLUGIN_HOLD: dict[str, str] = {}


#: conditions that the configuration switches on or off: ``{condition: enabled(config) -> bool}``
#: (``config`` a :class:`distgrad.config.DistgradConfig`); the series budget counts a family
#: whose switch is off as no series (:func:`series_per`, ``config=``). Conditions without a
#: switch (the loss components, the loss scaler, ...) depend on the run and are always counted.
SWITCHES: dict[str, Callable[[Any], bool]] = {
    "incident": lambda c: bool(c.incidents.enabled),
    "action": lambda c: c.action.on_nonfinite != "none" or c.action.on_spike != "none",
    "replicated": lambda c: bool(c.statistics.replica_check),
    "update_ratio": lambda c: bool(c.statistics.per_param and c.statistics.update_ratio),
}


def condition(key: str, text: str, enabled: Callable[[Any], bool] | None = None) -> str:
    """Declare a plug-in's condition (a :attr:`Metric.when` key and its sentence for
    ``docs/metrics.md``) and return ``key``, for its metrics' ``when`` (declare it before them:
    a :class:`Metric` checks its ``when``). ``enabled``: the configuration switch of the family,
    ``enabled(config) -> bool`` on a :class:`distgrad.config.DistgradConfig` (e.g.
    ``lambda c: c.router.enabled``), added to :data:`SWITCHES`: the series budget counts its
    metrics only when it is True. Without it the family is counted whatever the configuration.

    Raises:
        ValueError: ``key`` already declared with another text.
    """
    if CONDITIONS.get(key, text) != text:
        raise ValueError(f"metric condition {key!r} declared twice")
    CONDITIONS[key] = text
    if enabled is not None:
        SWITCHES[key] = enabled
    return key


def switched_off(config: Any) -> set[str]:
    """The conditions of :data:`SWITCHES` that ``config`` (a ``DistgradConfig``) leaves off: their
    metrics are never served in that run."""
    return {k for k, on in SWITCHES.items() if not on(config)}


def label(name: str, text: str, values: tuple[str, ...] | None = None) -> str:
    """Declare a plug-in's label (a :class:`Label` in :data:`LABELS`) and return ``name``, for
    its metrics' ``labels`` (declare it before them: a :class:`Metric` checks its labels).
    ``values``: the fixed set of values (bounded), or None (a run-constant value, one series).
    A plug-in's ``samples`` gives a metric of several labels as ``{(value, value, ...): number}``.

    Raises:
        ValueError: ``name`` already declared with another text or values.
    """
    old = LABELS.get(name)
    if old is not None and (old.doc, old.values) != (text, values):
        raise ValueError(f"metric label {name!r} declared twice")
    LABELS[name] = Label(name, text, values)
    return name


def register(entries: Iterable[Metric], part: str | None,
             samples: Callable[[Any], dict[str, Any]], hold: bool = False) -> None:
    """Add a plug-in's metrics to :data:`CATALOGUE` (after the built-in ones) and its sampler
    to :data:`PLUGIN_SAMPLES`: ``samples(record.<part>)`` gives ``{metric name: value}`` for a
    record whose part is set. ``hold``: serve the last part's samples on records whose part is
    None, with the optimizer step it comes from as the gauge ``distgrad_<part>_step``
    (:data:`PLUGIN_HOLD`), which ``entries`` must declare.

    Raises:
        ValueError: a name already declared (or a bad entry, see :class:`Metric`); ``hold``
            without a part or without its step gauge among ``entries``.
    """
    global CATALOGUE
    entries = tuple(entries)
    if hold:
        step = f"distgrad_{part}_step"
        if part is None or step not in {m.name for m in entries}:
            raise ValueError(f"a plug-in that holds its samples (part {part!r}) must declare the gauge {step}")
    for m in entries:
        for k in {m.name, m.family}:
            if k in _BY_NAME:
                raise ValueError(f"metric {k} declared twice")
    for m in entries:
        for k in {m.name, m.family}:
            _BY_NAME[k] = m
    CATALOGUE = CATALOGUE + entries
    PLUGIN_SAMPLES.append((part, samples, tuple(m.name for m in entries)))
    if hold and part is not None:
        PLUGIN_HOLD[part] = f"distgrad_{part}_step"


def by_name(name: str) -> Metric:
    """The declared metric called ``name`` (the queried name, or a counter's family name
    without ``_total``). Raises KeyError naming the metric when it is not declared."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in distgrad's metric catalogue (distgrad/export/metrics.py)") from None


def names(when: Iterable[str] | None = None) -> list[str]:
    """Names of the declared metrics, in catalogue order; only those whose condition is in
    ``when`` when given."""
    keep = None if when is None else set(when)
    return [m.name for m in CATALOGUE if keep is None or m.when in keep]


def family(name: str, value: float | None = None,
           labels: Iterable[str] | None = None) -> GaugeMetricFamily | CounterMetricFamily:
    """A prometheus_client metric family for the declared metric ``name`` (help, type, label
    names from the catalogue): ``GaugeMetricFamily`` or ``CounterMetricFamily``. With
    ``value``, an unlabelled family holding that one sample. ``labels`` overrides the label
    names only for ``distgrad_info``-like metrics whose names are run-constant.

    Raises:
        KeyError: ``name`` is not declared.
    """
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    m = by_name(name)
    cls: type[GaugeMetricFamily | CounterMetricFamily] = (CounterMetricFamily if m.type == "counter"
                                                           else GaugeMetricFamily)
    if value is not None:
        return cls(m.family, m.help, value=value)
    return cls(m.family, m.help, labels=list(labels if labels is not None else m.labels))


def series_per(scope: str | None, *, when: Iterable[str] | None = None, exclude: Iterable[str] = (),
               config: Any = None) -> int:
    """Series of the declared metrics of ``scope`` (``"param"``, ``"layer"``, ``"module_kind"``,
    or None for the fixed/capped ones), summed, restricted to conditions ``when`` (default all)
    minus ``exclude``: e.g. ``series_per("param", exclude=["update_ratio"])`` = 10. With
    ``config`` (a ``DistgradConfig``), the families it switches off (:func:`switched_off`) are
    excluded too."""
    keep, drop = (None if when is None else set(when)), set(exclude)
    if config is not None:
        drop |= switched_off(config)
    return sum(m.series() for m in CATALOGUE
               if m.scope == scope and m.when not in drop and (keep is None or m.when in keep))


# ---------------------------------------------------------------------------------------------
_INTRO = """\
# distgrad metric catalogue

<!-- generated by `python -m distgrad.export.metrics --markdown > docs/metrics.md` from
distgrad/export/metrics.py: edit that file, not this one -->

Served by global rank 0 only (default `127.0.0.1:9400/metrics`). Values are those of the last
sampled optimizer step. Counters are exported at 0 from `instrument()` on, so that
`increase()` sees the first event. Units are base units; `grad` is the unit of the gradient
itself, `1` a dimensionless number.

The exporter (a helper process of rank 0, `distgrad/export/http_server.py`) serves a cached page:
the training process collects the metric families at most once per change of the state and at
most once per second (`refresh_s`), so a scrape shows the state of at most a second ago; the
helper renders them with `prometheus_client`'s exposition: text format 0.0.4, or OpenMetrics
1.0.0 when the `Accept` header asks for it; gzip when `Accept-Encoding` allows it; Prometheus'
`name[]` query parameter (`/metrics?name[]=distgrad_loss`) selects the samples of those names
(sample names: `distgrad_sampled_steps_total`, not the counter family's name). When none of the
requested names is served the full page is returned (never an empty 200).
Connections without a whole request for 10 s are closed; at most 256 are kept open.

## Labels

| label | values |
|---|---|
"""


_LOSS = """
## What `distgrad_loss` means

`distgrad_loss` is the **mean training loss of the optimizer step over all micro-batches and all
ranks, as the user's loss function defines it**, whatever scaling the framework applies before
backward (division by the gradient-accumulation steps, normalisation by `num_items_in_batch`,
multiplication by the world size). It is the loss whose gradient is the reduced gradient distgrad
reports. How each way of training gets there:

| how you train | what distgrad observes | how it is combined |
|---|---|---|
| raw DeepSpeed `engine.backward(loss)` | each micro-batch's loss (DeepSpeed divides by GA itself) | mean over micro-batches and ranks |
| raw PyTorch loop (DDP / FSDP / one process) | the loss the model's forward returns, or each `dg.observe_loss(loss)` (pass the unscaled micro-batch loss) | mean over micro-batches and ranks |
| Hugging Face `Trainer` (`distgrad.integrations.hf.attach`), DeepSpeed or FSDP/DDP | the loss the Trainer hands to backward (already divided by GA, or by `num_items_in_batch` and multiplied by the world size) | sum over the step's micro-batches, mean over ranks: the Trainer's own step loss (with `num_items_in_batch`: the mean per-token loss of all tokens of the step) |
| Accelerate loop (`distgrad.integrations.hf.instrument_accelerate`) | DDP / FSDP / one process: the loss handed to `accelerator.backward`, divided by Accelerate's `gradient_accumulation_steps` as Accelerate does; DeepSpeed plugin: each micro-batch's loss (DeepSpeed divides by GA itself) | DDP / FSDP: sum over micro-batches, mean over ranks; DeepSpeed: mean over micro-batches and ranks |
| PyTorch Lightning (`distgrad.integrations.lightning.DistgradCallback`) | the loss handed to backward (`training_step`'s loss / `accumulate_grad_batches` under automatic optimization) | sum over micro-batches, mean over ranks (one exception to "its gradient is the reduced gradient": under `DeepSpeedStrategy` with `accumulate_grad_batches` = GA > 1, DeepSpeed divides the loss by GA again, so the gradient it applies, and distgrad reports, is this loss's gradient / GA; the callback warns once) |

With equal-sized micro-batches the two coincide with the plain mean of the micro-batch losses.
The tests compare it with a float64 recomputation of the step's loss for each integration
(tests/test_integrations_hf.py, tests/test_integrations_lightning.py).
"""  # noqa: E501  (a markdown table: one row a line)


def markdown() -> str:
    """The text of ``docs/metrics.md`` (labels, then one table row per metric)."""
    out = [_INTRO]
    for lab in LABELS.values():
        vals = " \\| ".join(f"`{v}`" for v in lab.values) if lab.values else ""
        out.append(f"| `{lab.name}` | {lab.doc}{': ' + vals if vals else ''} |\n")
    out.append("\n## Metrics\n\n| name | type | labels | unit | exists | meaning |\n|---|---|---|---|---|---|\n")
    for m in CATALOGUE:
        cap = f"; at most {m.max_series} series" if m.max_series and m.max_series > 1 else ""
        meaning = (m.doc or m.help.rstrip(".")) + ("" if m.doc else cap)
        out.append(f"| `{m.name}` | {m.type} | {', '.join(m.labels)} | {m.unit} | {CONDITIONS[m.when]} | "
                   f"{meaning} |\n")
    out.append(_LOSS)
    return "".join(out)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m distgrad.export.metrics", description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print docs/metrics.md")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(), end="")
    else:
        for m in CATALOGUE:
            print(f"{m.name}\t{m.type}\t{','.join(m.labels)}\t{m.when}")
    return 0


if __name__ == "__main__":
    # run as a script this file is the module ``__main__``; the plug-ins (imported with
    # ``distgrad``) registered their metrics in ``distgrad.export.metrics``: print that catalogue
    from distgrad.export import metrics as _registered  # noqa: PLW0406

    raise SystemExit(_registered._main())
