"""The sections of :class:`distgrad.config.DistgradConfig`, one pydantic model each.

Every setting is declared once here: its type, its one default, its range and its description.
The components take their section (``cfg.spikes``, ``cfg.health``, ...) and trust it: values
are validated here, when the configuration is built (at ``instrument()`` time), and a bad value
raises :class:`~distgrad.config.ConfigError` naming the key (``'spikes.window'``).

``configs/distgrad.yaml`` and ``docs/configuration.md`` are generated from these declarations
(``python -m distgrad.config --write``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


class SettingError(ValueError):
    """A cross-field check of a section failed; ``field`` is the key (inside the section) to
    name in the message, ``value`` its value."""

    def __init__(self, field: str, why: str, value: Any) -> None:
        super().__init__(why)
        self.field, self.why, self.value = field, why, value


def _fspath(v: Any) -> Any:
    return os.fspath(v) if isinstance(v, os.PathLike) else v


def _on_off(v: Any) -> Any:
    return ("on" if v else "off") if isinstance(v, bool) else v  # YAML reads on/off as booleans


def _host(v: Any) -> Any:
    if isinstance(v, str) and not v.strip():
        raise ValueError("must be an address of this machine to bind the exporter to: '127.0.0.1' (scrapes "
                         "from this machine only) or '0.0.0.0' (all interfaces)")
    return v


def _nonempty(v: Any) -> Any:
    if isinstance(v, str) and not v.strip():
        raise ValueError("must not be empty (use null to leave it unset)")
    return v


#: an optional file-system path: a string or ``os.PathLike`` (stored as ``str``), never empty
OptPath = Annotated[str | None, BeforeValidator(_nonempty), BeforeValidator(_fspath)]
#: an optional non-empty string
OptName = Annotated[str | None, BeforeValidator(_nonempty)]


class Section(BaseModel):
    """Base of every section: strict types (``"5"`` is not an integer, ``1`` is not ``true``),
    finite numbers, unknown keys refused, immutable once built. A section built on its own
    raises ``pydantic.ValidationError`` (a ``ValueError``); inside :class:`DistgradConfig` the
    error is a :class:`~distgrad.config.ConfigError` naming the key."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid", allow_inf_nan=False,
                              validate_default=False)
    #: where the section sits in the configuration (``"sinks.jsonl"``), for messages and docs
    section_key: ClassVar[str] = ""


class SamplingConfig(Section):
    """Which optimizer steps are sampled."""

    section_key: ClassVar[str] = "sampling"
    interval: int = Field(1, ge=1, description=(
        "Sample every N optimizer steps: steps s with s % N == 0, counted by the engine's step "
        "counter, identical on every rank."))


class ExporterConfig(Section):
    """The Prometheus exporter, served by global rank 0 only."""

    section_key: ClassVar[str] = "exporter"
    enabled: bool = Field(True, description="Serve metrics over HTTP from global rank 0.")
    host: Annotated[str, BeforeValidator(_host)] = Field("127.0.0.1", description=(
        "Address the exporter binds to; 0.0.0.0 to be scraped from another host."))
    port: int = Field(9400, ge=0, le=65535, description=(
        "Exporter TCP port; 0 picks a free port (logged, and available as Instrument.port)."))
    file_sd_path: OptPath = Field(None, examples=["/shared/prometheus/targets/myrun.json",
                                                  "/shared/prometheus/targets/"], description=(
        "Rank 0 writes its exporter address here as a Prometheus file_sd_configs target file "
        "([{\"targets\": [\"<host>:<port>\"], \"labels\": {\"run\": run_name}}]), so the job is "
        "scraped wherever rank 0 lands with no edit of prometheus.yml. A directory (existing, or "
        "ending in /) gets one file per run: distgrad-<run_name>-<host>-<port>.json. Removed at a "
        "clean end once the final state was scraped; kept after a crash, so that the dead target "
        "pages (see configs/prometheus.yml, docs/runbook.md)."))
    advertise_host: OptName = Field(None, description=(
        "Host name written to file_sd_path (default: host when the exporter is bound to a specific "
        "address; bound to all interfaces, this machine's FQDN when it resolves to a non-loopback "
        "address, else the address of the interface that routes to MASTER_ADDR)."))
    run_name: OptName = Field(None, description="Value of the run label in file_sd_path (default: none).")
    linger_seconds: float = Field(30.0, ge=0, le=600, description=(
        "At a clean end (close(), or interpreter exit without an uncaught exception) rank 0 serves "
        "distgrad_run_state = 2 (finished) until a scraper has read it, so that the exporter-down "
        "alert knows the run finished: at most this many seconds, and only while a scraper keeps "
        "coming (about 2 scrape intervals; a job nobody scrapes exits at once). 0: no wait."))


class StatisticsConfig(Section):
    """What is computed and exported per parameter."""

    section_key: ClassVar[str] = "statistics"
    per_param: bool = Field(True, description=(
        "Export per-parameter series (distgrad_param_*{param}); layer-level series and the global "
        "statistics are always exported."))
    max_param_series: int = Field(2500, ge=50, description=(
        "Upper bound on exported Prometheus series; per-parameter detail is reduced to the top-k "
        "parameters by norm (non-finite ones always kept) when the bound would be exceeded."))
    replica_check: bool = Field(True, description=(
        "On engines whose reduced gradients are replicated on every rank (DDP, ZeRO-0), compare a "
        "per-rank fingerprint (an integer checksum of the bit patterns of the rank's whole copy, "
        "carried in the same SUM collective: any changed element, a sign flip, a swap, one flipped "
        "bit, is caught except with probability about 2**-40; healthy replicas always agree "
        "exactly) and count mismatches, naming the ranks outside the majority. Costs one extra read "
        "of the local gradient per sampled step (about a dozen integer operations per element), "
        "since each rank otherwise reads only its 1/W slice."))
    replica_check_rtol: float = Field(1e-6, gt=0, description=(
        "Accepted for compatibility and ignored: the replica fingerprint is an exact checksum, "
        "compared exactly (the all-reduce gives every replica the same bits)."))
    culprit_grad_check: bool = Field(True, description=(
        "Flag a NaN/Inf in a gradient this rank computed, before the all-reduce / reduce-scatter, "
        "with a tensor hook per trainable parameter (FSDP1: per unit's FlatParameter; FSDP2: per "
        "unsharded parameter), under every engine: one float64 sum of each incoming gradient per "
        "micro-batch, on the device, no host sync; so that a non-finite step names the rank it came "
        "from (distgrad_nonfinite_culprit), also for a NaN made only in the backward pass. The loss "
        "check is always on, under every engine."))
    update_ratio: bool = Field(False, description=(
        "Compute the update-to-weight ratio ||dw||/||w|| per parameter (keeps one copy of the "
        "local parameter shard)."))
    async_records: Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)] = Field("auto", description=(
        "on (or true): the training thread never waits for the device for distgrad: a sampled "
        "step's reduced statistics go to pinned host memory with a non-blocking copy and a CUDA "
        "event, and its record is built and published at the next optimizer-step boundary (one "
        "step late; the last one at close()). off (or false): the record is built at its own "
        "boundary after one blocking device-to-host copy. auto: on for CUDA gradients, off on CPU. "
        "Must be the same on every rank (it decides where the provenance all-gather happens)."))


class SpikesConfig(Section):
    """Spike detectors on the loss and the global gradient norm (NaN-safe)."""

    section_key: ClassVar[str] = "spikes"
    ema_alpha: float = Field(0.97, gt=0, lt=1, description=(
        "EMA z-score detector (ZClip, Kumar et al. 2025): smoothing factor; memory ~1/(1-alpha) "
        "samples."))
    ema_z: float = Field(2.5, gt=0, description="EMA z-score detector: z-score above which a sample is a spike.")
    ema_warmup: int = Field(25, ge=1, description="EMA z-score detector: samples before the first test.")
    window: int = Field(128, ge=2, description=(
        "Rolling-window detector (OLMo 2 spike score): number of previous samples in the reference window."))
    window_sigma: float = Field(6.0, gt=0, description=(
        "Rolling-window detector: a sample more than this many standard deviations from the "
        "window's mean is a spike."))
    robust_window: int = Field(24, ge=3, description=(
        "Robust jump detector (the paging one; distgrad.diagnostics.robust_spike): previous samples whose "
        "Theil-Sen trend and median absolute deviation, on the log of the series, form the reference."))
    robust_warmup: int = Field(8, ge=3, description=(
        "Robust jump detector: samples before the first test (at most robust_window)."))
    robust_k: float = Field(6.0, gt=0, description=(
        "Robust jump detector: a sample this many robust standard deviations above the trend "
        "(and at least the ratio below above it) is a spike."))
    robust_loss_ratio: float = Field(1.5, gt=1, description=(
        "Robust jump detector: the loss must also be at least this many times the trend's prediction."))
    robust_grad_norm_ratio: float = Field(2.0, gt=1, description=(
        "Robust jump detector: the gradient norm must also be at least this many times the trend's "
        "prediction (healthy gradient norms are heavier-tailed than the loss)."))

    @model_validator(mode="after")
    def _robust_warmup(self) -> SpikesConfig:
        if self.robust_warmup > self.robust_window:
            raise SettingError("robust_warmup", f"must be at most spikes.robust_window ({self.robust_window})",
                               self.robust_warmup)
        return self


class IncidentsConfig(Section):
    """The detection policy (distgrad.diagnostics.incidents): what opens an incident, which the
    alerts page on and the offline verdict reports. A single spike training recovers from opens
    none (it is a dashboard annotation: the spikes section's counters)."""

    section_key: ClassVar[str] = "incidents"
    enabled: bool = Field(True, description=(
        "Run the policy (record field incidents, distgrad_incident* metrics). Off: no incident is ever "
        "opened, and the incident alerts cannot fire."))
    level_window: int = Field(16, ge=3, description=(
        "Divergence: finite sampled losses whose median is the loss level before an excursion (the "
        "pre-spike level); frozen while the loss is above factor x level."))
    level_min: int = Field(8, ge=3, description=(
        "Divergence and bad batch: sampled losses (and gradient norms) needed before the first test "
        "(at most level_window)."))
    divergence_factor: float = Field(1.5, gt=1, description=(
        "Divergence: a sampled loss above this many times the level starts an excursion."))
    divergence_steps: int = Field(5, ge=1, description=(
        "Divergence: the excursion opens an incident when the loss has stayed above factor x level for "
        "this many consecutive sampled steps (the alert fires divergence_steps - 1 sampled steps after "
        "the spike at the earliest)."))
    drift_window: int = Field(10, ge=3, description=(
        "Divergence by drift (no single jump): sampled losses of the rolling median compared with its "
        "lowest value so far."))
    drift_factor: float = Field(2.0, gt=1, description=(
        "Divergence by drift: the rolling median above this many times its lowest value so far (and above "
        "that value plus the run's first rolling median) opens an incident."))
    burst_spikes: int = Field(4, ge=2, description=(
        "Spike burst: this many sampled steps with a robust-detector spike (loss or gradient norm; "
        "spikes.robust_*) ..."))
    burst_window: int = Field(25, ge=2, description=(
        "... within this many consecutive sampled steps open a spike_burst incident (a warning). Healthy "
        "small-batch runs have isolated spikes (3 within 30 sampled steps at batch 2 per rank); an unstable "
        "learning rate gives them back to back."))
    rank_ratio: float = Field(2.0, gt=1, description=(
        "Bad batch: the largest rank's loss over the median loss of the other ranks must be at least "
        "this many times what that ratio's recent trend predicts (and rank_k robust deviations above it)."))
    rank_k: float = Field(6.0, gt=0, description=(
        "Bad batch: robust standard deviations (1.4826 x MAD, Theil-Sen detrended, on the log of the "
        "ratio over the last 24 sampled steps) the ratio must exceed its trend by."))
    rank_grad_ratio: float = Field(1.2, gt=1, description=(
        "Bad batch: the step's global gradient norm must also be at least this many times the median of "
        "the last level_window sampled gradient norms (the batch moved the update)."))
    component_share: float = Field(0.5, gt=0, le=1, description=(
        "With loss components: an incident names the component whose weighted contribution (weight x "
        "value) rose the most over its level, if that rise is at least this fraction of the loss's rise."))

    @model_validator(mode="after")
    def _level_min(self) -> IncidentsConfig:
        if self.level_min > self.level_window:
            raise SettingError("level_min", f"must be at most incidents.level_window ({self.level_window})",
                               self.level_min)
        return self


ActionMode = Literal["none", "skip", "stop"]


class ActionConfig(Section):
    """Opt-in action on a non-finite step or a paging spike: skip the optimizer update on every
    rank, or skip it and stop the run after the ``on_stop`` callbacks (docs/action.md). Needs the
    sampled step's reduced statistics on the host before the optimizer runs: sampling.interval 1
    and synchronous records (statistics.async_records auto resolves to off)."""

    section_key: ClassVar[str] = "action"
    on_nonfinite: ActionMode = Field("none", description=(
        "What to do on an optimizer step whose reduced gradient (or observed loss) holds a NaN/Inf: none, "
        "skip (the update is not applied on any rank: parameters and optimizer state unchanged; counted "
        "in distgrad_action_skipped_steps_total{cause=\"nonfinite\"}), or stop (skip, then run the on_stop "
        "callbacks on every rank and set Instrument.should_stop). Under fp16 with a dynamic loss scaler "
        "these steps are overflows the scaler skips itself: no action."))
    on_spike: ActionMode = Field("none", description=(
        "The same on a paging spike: the robust jump detector (spikes.robust_*) fires on the loss or the "
        "global gradient norm of the step."))
    samples_dir: OptPath = Field(None, examples=["runs/skipped"], description=(
        "Directory where each rank appends action-rank<rank>.jsonl: per acted-on step, the sample indices "
        "the loop passed for each micro-batch (observe_loss(samples=...) / observe_samples); null: "
        "flight_recorder.dir, and nothing is written when that is null too."))


class HealthConfig(Section):
    """Per-parameter vanishing / exploding gradient flags."""

    section_key: ClassVar[str] = "health"
    vanish_threshold: float = Field(1e-10, ge=0, description=(
        "A parameter's gradient norm below this for patience consecutive samples is vanishing "
        "(an exactly-zero or underflowed gradient is caught, trained layers' noise is far above)."))
    explode_threshold: float = Field(1e3, gt=0, description=(
        "A parameter's gradient norm above this for patience consecutive samples is exploding."))
    patience: int = Field(3, ge=1, description="Consecutive samples before a parameter is flagged.")

    @model_validator(mode="after")
    def _ordered(self) -> HealthConfig:
        if self.vanish_threshold >= self.explode_threshold:
            raise SettingError("vanish_threshold", f"must be below health.explode_threshold "
                               f"({self.explode_threshold})", self.vanish_threshold)
        return self


class LossScaleConfig(Section):
    """fp16 dynamic loss scale collapse (``distgrad_loss_scale_collapsed``), for any scaler: no
    configured minimum needed (torch ``GradScaler`` has none)."""

    section_key: ClassVar[str] = "loss_scale"
    collapse_factor: float = Field(1024.0, gt=1, description=(
        "The loss scale is collapsed when the largest scale at which a step was applied within the last "
        "collapse_window optimizer steps is at least this many times the current scale (1024: ten net "
        "halvings; a healthy run loses one halving per occasional overflow and grows it back)."))
    collapse_window: int = Field(1000, ge=1, description=(
        "Optimizer steps looked back for the scale at which training last worked (the signal clears this "
        "many steps after training works again at the lower scale)."))


class ClipConfig(Section):
    """Gradient clipping, as seen by the clip ratio."""

    section_key: ClassVar[str] = "clip"
    max_grad_norm: float | None = Field(None, gt=0, description=(
        "Clip threshold used for the clip ratio and the post-clip norm when the engine does not "
        "clip itself (PyTorch loops that call clip_grad_norm_); null: the engine's own "
        "(DeepSpeed gradient_clipping), or none."))


class FlightRecorderConfig(Section):
    """The last sampled steps, dumped on the first non-finite step."""

    section_key: ClassVar[str] = "flight_recorder"
    steps: int = Field(64, ge=0, description="Sampled steps kept in memory (0 disables the recorder).")
    dir: OptPath = Field(None, examples=["runs/flightrec"], description=(
        "Directory for flight-recorder reports (rank 0); null: nothing is written."))


def _sources(v: Any) -> Any:
    if isinstance(v, tuple):
        v = list(v)
    if isinstance(v, list) and (len(v) > 8 or len(set(v)) != len(v) or "other" in v
                                or not all(isinstance(x, str) and x for x in v)):
        raise ValueError("must hold at most 8 distinct non-empty labels, not 'other' (tokens of sequences "
                         "without a listed label are counted as 'other')")
    return v


class LossConfig(Section):
    """Loss analysis: per-token loss distribution by data source, and the loss trend."""

    section_key: ClassVar[str] = "loss"
    sources: Annotated[list[str], BeforeValidator(_sources)] = Field(
        default_factory=list, examples=[["web", "code", "books"]], description=(
            "Data-source labels the loop may pass per sequence with per-token losses (at most 8; "
            "others count as 'other'). The same on every rank: it sizes the step's collective."))
    token_threshold: float = Field(10.0, ge=0, description=(
        "Tokens whose loss exceeds this many nats are counted in distgrad_token_loss_above_ratio."))
    trend_window: int = Field(1000, ge=3, description=(
        "Optimizer steps over which the loss trend (least-squares slope per 1000 steps) is fitted."))
    plateau_z: float = Field(2.0, gt=0, description=(
        "The loss is on a plateau when |slope| <= plateau_z * its standard error over a covered "
        "trend_window."))


class TracerConfig(Section):
    """Forward-pass tracing of a non-finite step: the replay that names the culprit module, and
    tracing after the event."""

    section_key: ClassVar[str] = "tracer"
    replays: int = Field(4, ge=0, description=(
        "On the first sampled step of a non-finite streak, replay the step's micro-batches' forward "
        "under the overflow tracer at the boundary (before the update; RNG, buffers and optimizer "
        "untouched) and name the first module whose output went NaN/Inf on the culprit rank "
        "(distgrad_nonfinite_culprit_module); at most this many replays per run; 0 disables it (and "
        "the forward pre-hook that keeps references to the step's inputs). The same on every rank: "
        "on sharded engines the replay's forward makes collectives."))
    micro_batches: int = Field(0, ge=0, description=(
        "After the first non-finite step, trace the forward pass of this many micro-batches per "
        "module (abs-min/abs-max of inputs, outputs and weights); 0 disables."))


class JsonlConfig(Section):
    """One JSON line per sampled step."""

    section_key: ClassVar[str] = "sinks.jsonl"
    path: OptPath = Field(None, examples=["runs/distgrad.jsonl"], description=(
        "JSON Lines file written by rank 0, one line per sampled step, flushed each step; null "
        "disables it."))
    max_bytes: int = Field(128 << 20, ge=0, description=(
        "Rotate the file at this size (bytes; 0 = never). About 190 bytes per parameter per line: "
        "size it (with backups) for the steps you want to keep."))
    backups: int = Field(8, ge=0, description="Rotated files kept (run.jsonl.1 ...).")


class TensorBoardConfig(Section):
    """TensorBoard scalars and per-layer histograms."""

    section_key: ClassVar[str] = "sinks.tensorboard"
    dir: OptPath = Field(None, examples=["runs/tb"], description=(
        "TensorBoard log directory written by rank 0; null disables it."))


class SinksConfig(Section):
    """Outputs besides Prometheus, written by rank 0."""

    section_key: ClassVar[str] = "sinks"
    jsonl: JsonlConfig = Field(default_factory=JsonlConfig, description=JsonlConfig.__doc__)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig,
                                           description=TensorBoardConfig.__doc__)


def _rule(v: Any) -> Any:
    if isinstance(v, (list, tuple)) and len(v) == 3:  # (regex, layer_template, module_kind)
        return {"pattern": v[0], "layer": v[1], "module_kind": v[2]}
    return v


class NamingRule(Section):
    """One user rule: the first rule whose ``pattern`` is found in a parameter's canonical name
    gives its layer and module kind (before the built-in tables of :mod:`distgrad.naming.classify`)."""

    section_key: ClassVar[str] = "naming.rules[]"
    pattern: str = Field(min_length=1, description=(
        "Regular expression searched (re.search) in the canonical parameter name (wrappers such "
        "as module. and _fsdp_wrapped_module. removed), e.g. ^encoder\\.stages\\.(\\d+)\\."))
    layer: str = Field(min_length=1, description=(
        "Layer label, expanded with the match (\\1 is the first group): a block index N gives "
        "layer \"N\"; embed, norm, head or any other string are allowed."))
    module_kind: str = Field(min_length=1, description="module_kind label, used verbatim.")

    @model_validator(mode="after")
    def _compiles(self) -> NamingRule:
        try:
            rx = re.compile(self.pattern)
        except re.error as e:
            raise SettingError("pattern", f"is not a valid regular expression ({e})", self.pattern) from None
        try:  # the template may only name groups the pattern has: expand it on an empty match
            m = re.compile(f"(?:{rx.pattern})|", rx.flags).match("")
        except re.error:  # e.g. global inline flags: leave the template to classify()
            m = None
        if m is not None:
            try:
                m.expand(self.layer)
            except (re.error, IndexError) as e:
                raise SettingError("layer", f"refers to a group that pattern {self.pattern!r} does not "
                                   f"have ({e})", self.layer) from None
        return self

    def as_tuple(self) -> tuple[str, str, str]:
        """``(pattern, layer, module_kind)``, the form :func:`distgrad.naming.classify.classify` takes."""
        return (self.pattern, self.layer, self.module_kind)


class NamingConfig(Section):
    """How parameter names map to layer and module_kind labels."""

    section_key: ClassVar[str] = "naming"
    rules: list[Annotated[NamingRule, BeforeValidator(_rule)]] = Field(default_factory=list, description=(
        "User rules tried in order before the built-in tables, each {pattern, layer, module_kind} "
        "(or a [pattern, layer, module_kind] list). Example: {pattern: '^encoder\\.stages\\.(\\d+)\\.', "
        "layer: '\\1', module_kind: stage}. They label the layer and module-kind series."))

    @property
    def tuples(self) -> tuple[tuple[str, str, str], ...]:
        """The rules as ``(pattern, layer, module_kind)`` tuples (for :func:`distgrad.naming.classify.classify`)."""
        return tuple(r.as_tuple() for r in self.rules)


#: the sections of DistgradConfig, in the order of the generated files
SECTIONS: dict[str, type[Section]] = {
    "sampling": SamplingConfig, "exporter": ExporterConfig, "statistics": StatisticsConfig,
    "spikes": SpikesConfig, "incidents": IncidentsConfig, "health": HealthConfig, "loss_scale": LossScaleConfig,
    "clip": ClipConfig,
    "flight_recorder": FlightRecorderConfig, "tracer": TracerConfig, "sinks": SinksConfig,
    "naming": NamingConfig, "loss": LossConfig,
    "action": ActionConfig,
}

#: the sections declared by plug-ins (a signal's nested ``Config``, see :mod:`distgrad.signals`),
#: in registration order; also in :data:`SECTIONS`, after the sections above
PLUGIN_SECTIONS: list[type[Section]] = []
#: called with each plug-in section as it is registered (:class:`distgrad.config.DistgradConfig`
#: adds its field)
_LISTENERS: list[Callable[[type[Section]], None]] = []


def register_section(cls: type[Section]) -> None:
    """Add a plug-in's section to the configuration under ``cls.section_key`` (done by defining
    a :class:`~distgrad.signals.PackedSignal` with a nested ``Config``).

    Raises:
        ValueError: no ``section_key``, or another section already uses that key.
    """
    key = getattr(cls, "section_key", None)
    if not isinstance(key, str) or not key:
        raise ValueError(f"{cls.__qualname__}: a configuration section needs a section_key")
    if key in SECTIONS:
        if SECTIONS[key] is cls:
            return
        raise ValueError(f"configuration section {key!r} declared twice ({SECTIONS[key].__qualname__}, "
                         f"{cls.__qualname__})")
    SECTIONS[key] = cls
    PLUGIN_SECTIONS.append(cls)
    for fn in _LISTENERS:
        fn(cls)
