"""Prometheus exporter for global rank 0, built on ``prometheus_client``.

A custom collector (prometheus_client's documented pattern for values computed elsewhere)
renders the latest :class:`~distgrad.record.StepRecord`. The record is swapped atomically by
the training thread, so a scrape sees one step's values, never a mix; label sets of parameters
that leave the exported set (top-k changes) disappear with it. The families are collected once
per change and handed to a helper process that renders and serves them with prometheus_client's
exposition (:mod:`distgrad.export.exporter`, :mod:`distgrad.export.http_server`): a scrape costs
the training process nothing.
Metric names, types, labels and meanings: :mod:`distgrad.export.metrics` (rendered as ``docs/metrics.md``).
"""

from __future__ import annotations

import atexit
import errno
import logging
import math
import os
import signal
import socket
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from distgrad.export import metrics
from distgrad.export.base import Sink
from distgrad.export.exporter import ExporterProcess, PageCache
from distgrad.record import StepRecord
from distgrad.record.incidents import KINDS

log = logging.getLogger("distgrad")

#: values of ``distgrad_run_state``
RUNNING, FINISHED = 1, 2

#: counter keys of :attr:`StepRecord.counters` -> catalogue name (exported from the start at 0
#: so that ``increase()`` sees the first event; ``overflow_steps`` only with an fp16 loss scaler,
#: ``samples`` only for engines that count samples)
COUNTERS = {
    "nonfinite_steps": "distgrad_nonfinite_steps_total",
    "sampled_steps": "distgrad_sampled_steps_total",
    "internal_errors": "distgrad_internal_errors_total",
    "replica_mismatch": "distgrad_replica_mismatch_total",
    "overflow_steps": "distgrad_overflow_steps_total",
    "skipped_steps": "distgrad_skipped_steps_total",
    "samples": "distgrad_samples_total",
    "nonfinite_unsampled_steps": "distgrad_nonfinite_unsampled_steps_total",
    "nonfinite_loss_steps": "distgrad_nonfinite_loss_steps_total",
}

#: per-parameter families: catalogue name -> ParamStats property
_PARAM_GAUGES = {
    "distgrad_param_grad_norm": "norm", "distgrad_param_grad_mean": "mean", "distgrad_param_grad_std": "std",
    "distgrad_param_grad_min": "min", "distgrad_param_grad_max": "max", "distgrad_param_grad_abs_max": "abs_max",
    "distgrad_param_grad_zero_ratio": "zero_ratio",
}
#: unlabelled gauges read from the record's typed parts (None, e.g. part absent: no series)
_PART_GAUGES: dict[str, Callable[[StepRecord], Any]] = {
    "distgrad_replica_mismatch_rank": lambda r: r.replica_mismatch_rank,
    "distgrad_clip_ratio": lambda r: r.clip.ratio if r.clip else None,
    "distgrad_post_clip_norm": lambda r: r.clip.post_clip_norm if r.clip else None,
    "distgrad_loss_scale_at_minimum": lambda r: r.scaler.loss_scale_at_minimum if r.scaler else None,
    "distgrad_consecutive_overflow_steps": lambda r: r.scaler.consecutive_overflow_steps if r.scaler else None,
    "distgrad_loss_scale_drop_factor": lambda r: (
        (math.nan if r.scaler.loss_scale_drop_factor is None else r.scaler.loss_scale_drop_factor)
        if r.scaler else None),
    "distgrad_loss_scale_collapsed": lambda r: r.scaler.loss_scale_collapsed if r.scaler else None,
    "distgrad_vanishing_params": lambda r: r.health.n_vanishing if r.health else None,
    "distgrad_params_without_grad": lambda r: r.health.n_no_grad if r.health else None,
    "distgrad_exploding_params": lambda r: r.health.n_exploding if r.health else None,
    "distgrad_action_stop_requested": lambda r: int(r.action.stop_requested) if r.action else None,
}
#: ``{label value: number}`` dicts of the record's typed parts with one label
_PART_MAPS: dict[str, Callable[[StepRecord], Any]] = {
    "distgrad_layer_grad_norm": lambda r: r.aggregates.layer_norm if r.aggregates else None,
    "distgrad_layer_grad_nonfinite": lambda r: r.aggregates.layer_nonfinite if r.aggregates else None,
    "distgrad_layer_grad_zero_ratio": lambda r: r.aggregates.layer_zero_ratio if r.aggregates else None,
    "distgrad_layer_grad_headroom_ratio": lambda r: r.aggregates.layer_headroom if r.aggregates else None,
    "distgrad_module_kind_grad_norm": lambda r: r.aggregates.module_kind_norm if r.aggregates else None,
    "distgrad_grad_norm_zscore": lambda r: r.spikes.zscore.get("grad_norm") if r.spikes else None,
    "distgrad_loss_zscore": lambda r: r.spikes.zscore.get("loss") if r.spikes else None,
    "distgrad_grad_norm_spikes_total": lambda r: r.spikes.total.get("grad_norm") if r.spikes else None,
    "distgrad_loss_spikes_total": lambda r: r.spikes.total.get("loss") if r.spikes else None,
}


class DistgradCollector(Collector):
    """Renders the latest record with the families declared in :mod:`distgrad.export.metrics`.
    ``static`` holds run-constant info (engine, stage, dtype)."""

    def __init__(self, static: dict[str, str], world_size: int, has_loss_scaler: bool = True,
                 has_samples: bool = True) -> None:
        self._lock = threading.Lock()
        self._record: StepRecord | None = None
        self._last_nonfinite: tuple[list[dict], dict, list[dict], dict | None] = ([], {}, [], None)
        #: the last set part of each holding plug-in (:data:`metrics.PLUGIN_HOLD`) and its step
        self._held: dict[str, tuple[int, Any]] = {}
        self._step_time: float | None = None
        self.has_loss_scaler, self.has_samples = has_loss_scaler, has_samples
        self._counters: dict[str, int] = {k: 0 for k in COUNTERS
                                          if (has_loss_scaler or k != "overflow_steps")
                                          and (has_samples or k != "samples")}
        self._labeled_counters: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
        self.static = dict(static)
        self.world_size = world_size
        self._run_state = RUNNING
        #: change counters of the served state: ``head`` (counters, step time, run info) and
        #: ``body`` (the record's families); the exporter re-renders a part when its version moves
        self.head_version = 0
        self.body_version = 0
        #: called (outside the lock) after every change, e.g. to publish the versions
        self.listener: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.listener is not None:
            self.listener()

    @property
    def step_time(self) -> float | None:
        """Unix time of the last optimizer-step boundary, sampled or not (set by the instrument)."""
        return self._step_time

    @step_time.setter
    def step_time(self, t: float | None) -> None:
        with self._lock:
            self._step_time = t
            self.head_version += 1
        self._changed()

    @property
    def run_state(self) -> int:
        """``distgrad_run_state``: :data:`RUNNING` (1) or :data:`FINISHED` (2)."""
        return self._run_state

    @run_state.setter
    def run_state(self, state: int) -> None:
        with self._lock:
            self._run_state = int(state)
            self.head_version += 1
        self._changed()

    def update(self, record: StepRecord | None, counters: dict[str, int]) -> None:
        """Swap in the latest record (None keeps the current one) and the counter totals."""
        with self._lock:
            if record is not None:
                self._record = record
                for part_name in metrics.PLUGIN_HOLD:
                    part = getattr(record, part_name, None)
                    if part is not None:
                        self._held[part_name] = (int(record.step), part)
                event = record.nonfinite_event
                if event:  # the first step of the last non-finite streak, kept after it ends
                    self._last_nonfinite = ([r.to_dict() for r in event.rows],
                                            event.provenance.to_dict() if event.provenance else {},
                                            [c.to_dict() for c in event.culprits],
                                            event.culprit_module.to_dict() if event.culprit_module else None)
                self.body_version += 1
            new = {k: int(v) for k, v in counters.items() if k in self._counters}
            if any(self._counters[k] != v for k, v in new.items()):
                self._counters.update(new)
                self.head_version += 1
        self._changed()

    def inc_labeled(self, name: str, labels: dict[str, str], by: int = 1) -> None:
        """Add ``by`` to the labelled counter ``name{labels}`` (a catalogue counter, with or
        without ``_total``); ``by=0`` creates it at 0 so that ``increase()`` sees its first event.

        Raises:
            KeyError: ``name`` is not a declared metric.
        """
        key = (metrics.by_name(name).name, tuple(sorted(labels.items())))
        with self._lock:
            self._labeled_counters[key] = self._labeled_counters.get(key, 0) + by
            self.head_version += 1
        self._changed()

    def describe(self) -> Iterable[Metric]:
        """Every family this collector may serve (prometheus_client's registry uses it to route
        ``name[]`` filters): the catalogue minus what this run's engine cannot produce."""
        off = {"loss_scaler"} if not self.has_loss_scaler else set()
        off |= {"samples"} if not self.has_samples else set()
        for m in metrics.CATALOGUE:
            if m.when not in off:
                yield metrics.family(m.name)

    def collect(self) -> Iterable[Metric]:
        """Every served family, from the latest record and counters."""
        yield from self.snapshot_head()[1]
        yield from self.snapshot_body()[1]

    def snapshot_head(self) -> tuple[int, list[Metric]]:
        """``(head_version, families)``: run info, step time and counters, one consistent state."""
        with self._lock:
            version, step_time, state = self.head_version, self._step_time, self._run_state
            counters, labeled = dict(self._counters), dict(self._labeled_counters)
        info = metrics.family("distgrad_info", labels=sorted(self.static))
        info.add_metric([self.static[k] for k in sorted(self.static)], 1.0)
        out: list[Metric] = [info, metrics.family("distgrad_world_size", value=self.world_size),
               metrics.family("distgrad_run_state", value=state)]
        if step_time is not None:
            out.append(metrics.family("distgrad_last_step_timestamp_seconds", value=step_time))
        for key, name in COUNTERS.items():
            if key in counters:
                out.append(metrics.family(name, value=counters[key]))
        by_name: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for (name, labels), v in sorted(labeled.items()):
            fam = by_name.get(name)
            if fam is None:
                fam = by_name[name] = metrics.family(name)
            fam.add_metric([v for _, v in labels], v)
        out.extend(by_name.values())
        return version, out

    def snapshot_body(self) -> tuple[int, list[Metric]]:
        """``(body_version, families)`` of the latest record (none before the first sample)."""
        with self._lock:
            version, rec, held = self.body_version, self._record, dict(self._held)
            nonfinite_rows, provenance, culprits, module = self._last_nonfinite
        if rec is None:
            return version, []
        out = list(_record_metrics(rec, held))
        if culprits:  # the culprit view of the last non-finite event's first step
            fam = metrics.family("distgrad_nonfinite_culprit")
            rows = [(str(c["rank"]), k) for c in culprits for k in ("loss", "grad") if c.get(k)]
            for rank, source in rows[:metrics.by_name("distgrad_nonfinite_culprit").max_series]:
                fam.add_metric([rank, source], 1.0)
            out.append(fam)
        if module:  # the forward replay of the last non-finite event's first step (distgrad.diagnostics.replay)
            if module["outcome"] == "found":
                fam = metrics.family("distgrad_nonfinite_culprit_module")
                fam.add_metric([str(module["rank"]), str(module["module"])], 1.0)
                out.append(fam)
            fam = metrics.family("distgrad_nonfinite_replay_outcome")
            fam.add_metric([str(module["outcome"])], 1.0)
            out.append(fam)
        if nonfinite_rows:  # the last non-finite event stays visible after healthy steps
            fam = metrics.family("distgrad_nonfinite_params")
            for row in nonfinite_rows[:metrics.by_name("distgrad_nonfinite_params").max_series]:
                fam.add_metric([row["param"], str(row["rank"])], float(row["count"]))
            out.append(fam)
        if provenance:  # where the streak started: its first step (rank and module: the views above)
            out.append(metrics.family("distgrad_nonfinite_origin_step", value=float(provenance.get("step", -1))))
        if provenance.get("first_param"):  # the weaker, backward-order view, named for what it is
            fam = metrics.family("distgrad_nonfinite_last_param_in_forward_order")
            fam.add_metric([provenance["first_param"], str(provenance.get("first_layer", ""))],
                           float(provenance.get("step", -1)))
            out.append(fam)
        return version, out


def _record_metrics(rec: StepRecord, held: dict[str, tuple[int, Any]] | None = None) -> Iterable[Metric]:
    p = rec.params
    singles = {
        "distgrad_grad_norm": rec.grad_norm, "distgrad_optimizer_step": rec.step,
        "distgrad_last_sample_timestamp_seconds": rec.timestamp, "distgrad_loss": rec.loss,
        "distgrad_loss_scale": rec.loss_scale,
        **{name: get(rec) for name, get in _PART_GAUGES.items()},
    }
    for name, v in singles.items():
        if v is not None:
            yield metrics.family(name, value=float(v))
    yield from _rank_metrics(rec)
    yield from _loss_metrics(rec)
    yield from _incident_metrics(rec)
    yield from _plugin_metrics(rec, held or {})

    selected = rec.aggregates.exported_params if rec.aggregates is not None else None
    # parameters without a gradient anywhere this step (unused; numel 0 after the reduction)
    # have no statistics: no series rather than a misleading 0
    idx = [i for i in (range(len(p.names)) if selected is None else selected) if p.numel[i] > 0]
    for name, prop in _PARAM_GAUGES.items():
        fam = metrics.family(name)
        arr = getattr(p, prop)
        for i in idx:
            fam.add_metric([p.names[i]], float(arr[i]))
        yield fam
    fam = metrics.family("distgrad_param_grad_nonfinite")
    for i in idx:
        fam.add_metric([p.names[i], "nan"], float(p.nan[i]))
        fam.add_metric([p.names[i], "inf"], float(p.inf[i]))
    yield fam
    headroom = rec.headroom
    if headroom is not None:
        fam = metrics.family("distgrad_param_grad_headroom_ratio")
        for i in idx:
            fam.add_metric([p.names[i]], float(headroom[i]))
        yield fam
    for name, get in _PART_MAPS.items():
        vals = get(rec)
        # spike counters are served from the first sample on, even before any loss was seen
        if vals or (vals is not None and name.endswith("_total")):
            fam = metrics.family(name)
            for label, v in vals.items():
                fam.add_metric([label], float(v))
            yield fam
    ratios = rec.update_ratio
    if ratios:
        fam = metrics.family("distgrad_param_update_ratio")
        for i in idx:
            if p.names[i] in ratios:
                fam.add_metric([p.names[i]], float(ratios[p.names[i]]))
        yield fam


def _plugin_metrics(rec: StepRecord, held: dict[str, tuple[int, Any]]) -> Iterable[Metric]:
    """The metrics declared by plug-ins (a signal's ``METRICS`` and ``samples``,
    :data:`distgrad.export.metrics.PLUGIN_SAMPLES`), from their record parts: a number is an
    unlabelled sample, a ``{label value: number}`` dict the series of a one-label metric (``{(value,
    value): number}`` for several labels; empty: none), None no series. A holding plug-in
    (:data:`distgrad.export.metrics.PLUGIN_HOLD`) whose part is None on ``rec`` serves its last
    part ``held[part_name] = (step, part)``; its step gauge names the step the samples come from."""
    for part_name, samples, declared in metrics.PLUGIN_SAMPLES:
        part = getattr(rec, part_name) if part_name else rec
        if part_name in metrics.PLUGIN_HOLD:
            if part is None and part_name in held:
                step, part = held[part_name]
            elif part is not None:
                step = int(rec.step)
            if part is not None:
                yield metrics.family(metrics.PLUGIN_HOLD[part_name], value=float(step))
        if part is None:
            continue
        for name, v in samples(part).items():
            if name not in declared:
                raise KeyError(f"{name} is not among the metrics its plug-in declares {list(declared)}")
            if v is None:
                continue
            if isinstance(v, dict):
                if v:
                    fam = metrics.family(name)
                    for label, x in v.items():
                        fam.add_metric([str(lv) for lv in label] if isinstance(label, tuple) else [str(label)],
                                       float(x))
                    yield fam
            else:
                yield metrics.family(name, value=float(v))


def _rank_metrics(rec: StepRecord) -> Iterable[Metric]:
    """Per-rank attribution (``StepRecord.ranks``): the highest loss and its rank, the step time,
    the straggler rank and ratio (only the values that are known)."""
    r = rec.ranks
    if r is None:
        return
    if r.loss_max_rank is not None:
        yield metrics.family("distgrad_loss_max", value=float(r.loss_max[r.loss_max_rank]))
        yield metrics.family("distgrad_loss_max_rank", value=float(r.loss_max_rank))
    wall = [t for t in r.step_time if math.isfinite(t)]
    if wall:
        yield metrics.family("distgrad_step_time_seconds", value=max(wall))
    if r.straggler_rank is not None:
        yield metrics.family("distgrad_straggler_rank", value=float(r.straggler_rank))
        if r.straggler_ratio is not None:
            yield metrics.family("distgrad_straggler_ratio", value=float(r.straggler_ratio))


def _incident_metrics(rec: StepRecord) -> Iterable[Metric]:
    """The detection policy's state (:mod:`distgrad.diagnostics.incidents`): the counters of every
    kind (at 0 from the first sampled step, so that ``increase()`` sees the first incident), and
    the last incident of each kind that has had one: its event's step and value, the rank and the
    loss component when it names them."""
    inc = rec.incidents
    if inc is None:
        return
    fam = metrics.family("distgrad_incidents_total")
    for kind in KINDS:
        fam.add_metric([kind], float(inc.total.get(kind, 0)))
    yield fam
    if not inc.last:
        return
    fams = {n: metrics.family(n) for n in ("distgrad_incident_step", "distgrad_incident_value",
                                           "distgrad_incident_rank", "distgrad_incident_component")}
    for i in inc.last:
        fams["distgrad_incident_step"].add_metric([i.kind], float(i.step))
        fams["distgrad_incident_value"].add_metric([i.kind], float(i.value))
        if i.rank is not None:
            fams["distgrad_incident_rank"].add_metric([i.kind], float(i.rank))
        if i.component is not None:
            fams["distgrad_incident_component"].add_metric([i.kind, i.component], 1.0)
    yield from (f for f in fams.values() if f.samples)


def _loss_metrics(rec: StepRecord) -> Iterable[Metric]:
    """Loss components, the per-token loss distribution and the loss trend of the record."""
    c = rec.loss_components
    if c is not None and c.names:
        for name, vals in (("distgrad_loss_component", c.mean), ("distgrad_loss_component_weight", c.weight),
                           ("distgrad_loss_component_share", c.share)):
            fam = metrics.family(name)
            for n, v in zip(c.names, vals):
                fam.add_metric([n], float(v))
            yield fam
        if c.spikes_total:
            fam = metrics.family("distgrad_loss_component_spikes_total")
            for n, per in c.spikes_total.items():
                for det, v in per.items():
                    fam.add_metric([n, det], float(v))
            yield fam
    t = rec.token_loss
    if t is not None and t.tokens > 0:
        for name, v in (("distgrad_token_loss_mean", t.mean), ("distgrad_perplexity", t.perplexity),
                        ("distgrad_token_loss_above_ratio", t.above_fraction), ("distgrad_token_loss_max", t.max)):
            yield metrics.family(name, value=float(v))
        fam = metrics.family("distgrad_token_loss_cumulative_ratio")
        cum = 0.0
        for le, count in zip(metrics.LABELS["le"].values or (), t.hist):
            cum += count
            fam.add_metric([le], cum / t.tokens)
        yield fam
        for name, key in (("distgrad_source_token_loss_mean", "mean"),
                          ("distgrad_source_token_loss_above_ratio", "above_fraction")):
            fam = metrics.family(name)
            for src, d in t.sources.items():
                fam.add_metric([src], float(d[key]))
            yield fam
    tr = rec.loss_trend
    if tr is not None:
        yield metrics.family("distgrad_loss_trend_slope", value=tr.slope_per_1k)
        yield metrics.family("distgrad_loss_trend_stderr", value=tr.stderr_per_1k)
        yield metrics.family("distgrad_loss_plateau", value=float(tr.plateau))


def check_port_free(host: str, port: int) -> None:
    """Raise OSError with a fix if ``host:port`` cannot be bound (port 0 always can)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(e, socket.gaierror):
                raise OSError(
                    f"distgrad cannot serve metrics on {host}:{port}: {e.strerror or e}. '{host}' is not an "
                    f"address of this machine: set exporter.host to '127.0.0.1' (local scrapes) or "
                    f"'0.0.0.0' (all interfaces)") from e
            raise OSError(
                f"distgrad cannot serve metrics on {host}:{port}: {e.strerror or e}. Another process "
                f"(another training job's exporter?) holds the port: set exporter.port=0 to pick a free one, or "
                f"choose another (instrument(engine, exporter={{'port': N}}))") from e


class PrometheusSink(Sink):
    """Serves ``/metrics`` over HTTP from a helper process (:mod:`distgrad.export.http_server`:
    one selector loop, bounded connections with timeouts; prometheus_client's exposition with
    its ``name[]`` filter, OpenMetrics and gzip negotiation) with the families collected here
    once per change (:mod:`distgrad.export.exporter`).

    Args:
        host: bind address (default loopback).
        port: TCP port; 0 picks a free one, available afterwards as ``self.port``.
        static: labels of ``distgrad_info``.
        world_size: value of ``distgrad_world_size``.
        serve: start the HTTP server (False: only ``self.registry``, for tests and embedding).
        has_loss_scaler: export ``distgrad_overflow_steps_total`` (fp16 with a loss scaler only;
            under bf16/fp32 no loss-scale or overflow series exist).
        has_samples: export ``distgrad_samples_total`` (engines that count samples: DeepSpeed).
        timeout_s: connections without a whole request / not taking their response for this
            many seconds are closed (default 10).
        max_connections: open connections kept at most (default 256; a new one replaces the
            least recently active idle one).
        refresh_s: the families are collected again at most this often (default 1 s; a scrape shows
            the state of at most ``refresh_s`` ago); 0 re-renders on every change.
        linger_s: at a clean end (:meth:`close`, or interpreter exit without an uncaught
            exception) ``distgrad_run_state`` turns 2 (finished) and serving goes on until a
            scraper has read it, at most this many seconds (and only for a scraper that keeps
            coming: :meth:`ExporterProcess.wait_served`); 0: stop at once.

    Attributes:
        file_sd_path: a Prometheus file_sd file naming this exporter (written by
            :func:`distgrad.core.startup.write_file_sd`), removed at a clean end after the final
            state was scraped; left in place after a crash, so that the dead target pages.

    Raises:
        OSError: the address cannot be bound; the message says how to fix it.
    """

    name = "prometheus"
    file_sd_path: str | None = None

    def __init__(self, host: str, port: int, static: dict[str, str], world_size: int,
                 serve: bool = True, has_loss_scaler: bool = True, has_samples: bool = True,
                 timeout_s: float = 10.0, max_connections: int = 256, refresh_s: float = 1.0,
                 linger_s: float = 30.0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = DistgradCollector(static, world_size, has_loss_scaler, has_samples)
        self.registry.register(self.collector)
        c = self.collector
        self.cache = PageCache({"head": (lambda: c.head_version, c.snapshot_head),
                                "body": (lambda: c.body_version, c.snapshot_body)})
        self._server: ExporterProcess | None = None
        self.host, self.port = host, port
        self.linger_s = float(linger_s)
        self._ended = False
        if serve:
            check_port_free(host, port)
            try:
                self._server = ExporterProcess(host, port, self.cache, timeout_s, max_connections, refresh_s)
            except OSError as e:
                raise OSError(f"distgrad cannot serve metrics on {host}:{port}: {e}; set exporter.port=0 "
                              f"or another port") from e
            c.listener = self._server.notify
            self.port = self._server.port
            (log.warning if port == 0 else log.info)(  # a picked port must be seen to be found
                "distgrad: serving Prometheus metrics on http://%s:%d/metrics", host, self.port)
            _at_exit(self)

    @property
    def server(self) -> ExporterProcess | None:
        """The HTTP helper process (None when not serving or closed)."""
        return self._server

    def write(self, record: StepRecord) -> None:
        """Serve ``record`` from now on (atomic swap; collected by the exporter thread at the
        next scrape, once)."""
        self.collector.update(record, record.counters)

    def set_counters(self, counters: dict[str, int]) -> None:
        """Update the counters between records (unsampled steps, errors)."""
        self.collector.update(None, counters)

    def finish(self) -> bool:
        """The run ended cleanly: serve ``distgrad_run_state`` 2 (finished) until a scraper has
        read it (at most ``linger_s``; see :meth:`ExporterProcess.wait_served`). Returns True
        when it was scraped. Idempotent; no-op when not serving."""
        if self._ended or self._server is None:
            return False
        self._ended = True
        self.collector.run_state = FINISHED
        try:
            return self._server.wait_served(self.collector.head_version, self.linger_s)
        except Exception:  # noqa: BLE001  never hold up the end of a run
            log.exception("distgrad: waiting for the final scrape failed")
            return False

    def close(self, clean: bool = True) -> None:
        """End serving: when ``clean``, first :meth:`finish` (the final state, scraped), then
        stop the HTTP server, release the port and remove :attr:`file_sd_path` (a crash,
        ``clean=False``, leaves the file: the dead target then pages)."""
        if self._server is not None:
            if clean:
                self.finish()
            self.collector.listener = None
            self._server.close()
            self._server = None
            if clean and self.file_sd_path:
                try:
                    os.remove(self.file_sd_path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("distgrad: cannot remove the scrape target file %s: %s", self.file_sd_path, e)
                self.file_sd_path = None


_live: weakref.WeakSet[PrometheusSink] = weakref.WeakSet()


def _at_exit(sink: PrometheusSink) -> None:
    """Register ``sink`` for :func:`_close_at_exit` (one atexit hook per process) and, where
    SIGTERM still has its default action and this is the main thread, for :func:`_on_sigterm`
    (a handler the program installed itself is never replaced)."""
    if not _live:
        atexit.unregister(_close_at_exit)
        atexit.register(_close_at_exit)
        try:
            if (threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
                signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # not the main interpreter / no signals here
            pass
    _live.add(sink)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM with its default action: a stop on purpose (a scheduler's preemption, a launcher
    passing on Ctrl-C: deepspeed's sends SIGTERM to every rank). End the sinks as a clean exit
    does (``distgrad_run_state`` 2 served until scraped, bounded by ``exporter.linger_seconds``;
    the file_sd target removed), so a deliberate stop does not page as a dead exporter, then
    die of SIGTERM as the process would have. ``kill -9`` and crashes still page."""
    for sink in list(_live):
        try:
            sink.close(clean=True)
        except Exception:  # noqa: BLE001
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _close_at_exit() -> None:
    """Interpreter exit with sinks still serving (the loop never called ``close()``): a clean
    exit finishes them (final state scraped, file_sd target removed); after an uncaught
    exception (``sys.last_value`` is set) they only stop, the target file stays and the
    exporter-down alert pages, as for a crash. ``KeyboardInterrupt`` counts as clean (a person
    stopped the run); ``sys.exit(code)`` too (it sets no ``sys.last_value``)."""
    last = getattr(sys, "last_value", None)
    crashed = last is not None and not isinstance(last, KeyboardInterrupt)  # Ctrl-C: a person ended it
    for sink in list(_live):
        try:
            sink.close(clean=not crashed)
        except Exception:  # noqa: BLE001
            pass


__all__ = ["PrometheusSink", "DistgradCollector", "check_port_free", "COUNTERS", "RUNNING", "FINISHED"]
