"""Prometheus exporter for global rank 0, built on ``prometheus_client``.

A custom collector (prometheus_client's documented pattern for values computed elsewhere)
renders the latest :class:`~distgrad.record.StepRecord` on every scrape. The record is swapped
atomically by the training thread, so a scrape sees one step's values, never a mix; label
sets of parameters that leave the exported set (top-k changes) disappear with it.
Metric names and meanings: ``docs/metrics.md``.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from typing import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from distgrad.record import StepRecord
from distgrad.sinks.base import Sink

log = logging.getLogger("distgrad")

#: counters exported from the start at 0 so that ``increase()`` sees the first event
#: (``overflow_steps`` only for engines with an fp16 loss scaler)
COUNTERS = {
    "nonfinite_steps": ("distgrad_nonfinite_steps", "Sampled optimizer steps with any NaN/Inf gradient element."),
    "sampled_steps": ("distgrad_sampled_steps", "Sampled optimizer steps."),
    "internal_errors": ("distgrad_internal_errors", "Failures inside distgrad; training continued."),
    "replica_mismatch": ("distgrad_replica_mismatch",
                         "Sampled steps where replicated gradients differed across ranks."),
    "overflow_steps": ("distgrad_overflow_steps", "fp16 optimizer steps whose gradients overflowed."),
    "skipped_steps": ("distgrad_skipped_steps", "Optimizer steps the engine did not apply."),
    "samples": ("distgrad_samples", "Training samples consumed (engine's count)."),
}

_LABELED_HELP = {"distgrad_sink_errors": "Failures of one sink (the others and training went on)."}

_PARAM_GAUGES = (
    ("distgrad_param_grad_norm", "Per-parameter L2 norm of the reduced gradient.", "norm"),
    ("distgrad_param_grad_mean", "Per-parameter mean gradient element.", "mean"),
    ("distgrad_param_grad_std", "Per-parameter population std (correction=0) of gradient elements.", "std"),
    ("distgrad_param_grad_min", "Per-parameter minimum gradient element.", "min"),
    ("distgrad_param_grad_max", "Per-parameter maximum gradient element.", "max"),
    ("distgrad_param_grad_abs_max", "Per-parameter maximum absolute gradient element.", "abs_max"),
    ("distgrad_param_grad_zero_ratio", "Per-parameter fraction of gradient elements exactly 0.", "zero_ratio"),
)


class DistgradCollector(Collector):
    """Renders the latest record. ``static`` holds run-constant info (engine, stage, dtype)."""

    def __init__(self, static: dict[str, str], world_size: int, has_loss_scaler: bool = True,
                 has_samples: bool = True) -> None:
        self._lock = threading.Lock()
        self._record: StepRecord | None = None
        self._last_nonfinite: tuple[list[dict], dict] = ([], {})
        #: Unix time of the last optimizer-step boundary, sampled or not (set by the instrument)
        self.step_time: float | None = None
        self._counters: dict[str, int] = {k: 0 for k in COUNTERS
                                          if (has_loss_scaler or k != "overflow_steps")
                                          and (has_samples or k != "samples")}
        self._labeled_counters: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
        self.static = dict(static)
        self.world_size = world_size

    def update(self, record: StepRecord | None, counters: dict[str, int]) -> None:
        """Swap in the latest record (None keeps the current one) and the counter totals."""
        with self._lock:
            if record is not None:
                self._record = record
                event = record.extra.get("nonfinite_event")
                if event:  # the first step of the last non-finite streak, kept after it ends
                    self._last_nonfinite = (list(event["rows"]), event["provenance"])
            self._counters.update({k: int(v) for k, v in counters.items() if k in self._counters})

    def inc_labeled(self, name: str, labels: dict[str, str], by: int = 1) -> None:
        """Add ``by`` to the labelled counter ``name{labels}`` (exported as ``name_total``);
        ``by=0`` creates it at 0 so that ``increase()`` sees its first event."""
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._labeled_counters[key] = self._labeled_counters.get(key, 0) + by

    def collect(self) -> Iterable[Metric]:
        """Called by prometheus_client on every scrape (HTTP thread)."""
        with self._lock:
            rec, counters = self._record, dict(self._counters)
            nonfinite_rows, provenance = self._last_nonfinite
            labeled = dict(self._labeled_counters)
        info = GaugeMetricFamily("distgrad_info", "Static run information.", labels=sorted(self.static))
        info.add_metric([self.static[k] for k in sorted(self.static)], 1.0)
        yield info
        yield GaugeMetricFamily("distgrad_world_size", "Number of ranks.", value=self.world_size)
        if self.step_time is not None:
            yield GaugeMetricFamily("distgrad_last_step_timestamp_seconds",
                                    "Unix time of the last optimizer step (sampled or not).", value=self.step_time)
        for key, (name, doc) in COUNTERS.items():
            if key in counters:
                yield CounterMetricFamily(name, doc, value=counters[key])
        by_name: dict[str, CounterMetricFamily] = {}
        for (name, labels), v in sorted(labeled.items()):
            fam = by_name.get(name)
            if fam is None:
                fam = by_name[name] = CounterMetricFamily(name, _LABELED_HELP.get(name, "distgrad counter."),
                                                          labels=[k for k, _ in labels])
            fam.add_metric([v for _, v in labels], v)
        yield from by_name.values()
        if rec is None:
            return
        yield from _record_metrics(rec)
        if nonfinite_rows:  # the last non-finite event stays visible after healthy steps
            fam = GaugeMetricFamily("distgrad_nonfinite_params",
                                    "First step of the last non-finite streak: NaN/Inf elements per "
                                    "(param, rank shard).",
                                    labels=["param", "rank"])
            for row in nonfinite_rows[:20]:
                fam.add_metric([row["param"], str(row["rank"])], float(row["count"]))
            yield fam
        if provenance.get("first_param"):
            fam = GaugeMetricFamily("distgrad_nonfinite_origin_step",
                                    "Optimizer step where the last non-finite streak started, labelled with its "
                                    "probable origin (the non-finite parameter last in forward order).",
                                    labels=["param", "layer"])
            fam.add_metric([provenance["first_param"], str(provenance.get("first_layer", ""))],
                           float(provenance.get("step", -1)))
            yield fam


def _g(name: str, doc: str, value: float | None) -> GaugeMetricFamily | None:
    if value is None:
        return None
    return GaugeMetricFamily(name, doc, value=float(value))


def _record_metrics(rec: StepRecord) -> Iterable[Metric]:
    p = rec.params
    singles = [
        _g("distgrad_grad_norm", "Global L2 norm of the reduced gradient (NaN when non-finite).", rec.grad_norm),
        _g("distgrad_optimizer_step", "Optimizer step of the last sample.", rec.step),
        _g("distgrad_last_sample_timestamp_seconds", "Unix time of the last sample.", rec.timestamp),
        _g("distgrad_loss", "Training loss averaged over ranks and micro-batches.", rec.loss),
        _g("distgrad_loss_scale", "fp16 dynamic loss scale.", rec.loss_scale),
        _g("distgrad_replica_mismatch_rank", "Rank that disagreed on the last replica mismatch, -1 if none.",
           rec.extra.get("replica_mismatch_rank")),
        _g("distgrad_clip_ratio", "min(1, max_norm / grad_norm).", rec.extra.get("clip_ratio")),
        _g("distgrad_post_clip_norm", "Global grad norm after clipping.", rec.extra.get("post_clip_norm")),
    ]
    for k, (name, doc) in {
        "loss_scale_at_minimum": ("distgrad_loss_scale_at_minimum", "1 when the loss scale sits at its minimum."),
        "consecutive_overflow_steps": ("distgrad_consecutive_overflow_steps", "Current fp16 overflow streak."),
        "vanishing_params": ("distgrad_vanishing_params", "Parameters currently flagged as vanishing."),
        "exploding_params": ("distgrad_exploding_params", "Parameters currently flagged as exploding."),
    }.items():
        singles.append(_g(name, doc, rec.extra.get(k)))
    yield from (m for m in singles if m is not None)

    selected = rec.extra.get("exported_params")
    # parameters without a gradient anywhere this step (unused; numel 0 after the reduction)
    # have no statistics: no series rather than a misleading 0
    idx = [i for i in (range(len(p.names)) if selected is None else selected) if p.numel[i] > 0]
    derived = {"norm": p.norm, "mean": p.mean, "std": p.std, "min": p.min, "max": p.max,
               "abs_max": p.abs_max, "zero_ratio": p.zero_ratio}
    for name, doc, key in _PARAM_GAUGES:
        fam = GaugeMetricFamily(name, doc, labels=["param"])
        arr = derived[key]
        for i in idx:
            fam.add_metric([p.names[i]], float(arr[i]))
        yield fam
    fam = GaugeMetricFamily("distgrad_param_grad_nonfinite",
                            "Non-finite gradient elements in the last sampled step.", labels=["param", "kind"])
    for i in idx:
        fam.add_metric([p.names[i], "nan"], float(p.nan[i]))
        fam.add_metric([p.names[i], "inf"], float(p.inf[i]))
    yield fam
    headroom = rec.extra.get("headroom")
    if headroom is not None:
        fam = GaugeMetricFamily("distgrad_param_grad_headroom_ratio",
                                "max |g| over the largest finite value of the training dtype.", labels=["param"])
        for i in idx:
            fam.add_metric([p.names[i]], float(headroom[i]))
        yield fam
    for key, (name, doc) in {
        "layer_norm": ("distgrad_layer_grad_norm", "Root-sum-square of the layer's parameter grad norms."),
        "layer_nonfinite": ("distgrad_layer_grad_nonfinite", "NaN+Inf gradient elements in the layer."),
        "layer_zero_ratio": ("distgrad_layer_grad_zero_ratio", "Fraction of exact-zero elements in the layer."),
        "layer_headroom": ("distgrad_layer_grad_headroom_ratio", "Max headroom ratio over the layer."),
    }.items():
        vals = rec.extra.get(key)
        if vals:
            fam = GaugeMetricFamily(name, doc, labels=["layer"])
            for layer, v in vals.items():
                fam.add_metric([layer], float(v))
            yield fam
    kinds = rec.extra.get("module_kind_norm")
    if kinds:
        fam = GaugeMetricFamily("distgrad_module_kind_grad_norm",
                                "Root-sum-square grad norm over all parameters of a module kind.",
                                labels=["module_kind"])
        for k, v in kinds.items():
            fam.add_metric([k], float(v))
        yield fam
    for series in ("grad_norm", "loss"):
        z = rec.extra.get(f"{series}_zscore")
        if z:
            fam = GaugeMetricFamily(f"distgrad_{series}_zscore", f"Spike score of the last {series}.",
                                    labels=["detector"])
            for det, v in z.items():
                fam.add_metric([det], float(v))
            yield fam
        spikes = rec.extra.get(f"{series}_spikes_total")
        if spikes is not None:
            fam = CounterMetricFamily(f"distgrad_{series}_spikes", f"Detected {series} spikes.",
                                      labels=["detector"])
            for det, v in spikes.items():
                fam.add_metric([det], float(v))
            yield fam
    ratios = rec.extra.get("update_ratio")
    if ratios:
        fam = GaugeMetricFamily("distgrad_param_update_ratio", "||dw|| / ||w|| of the last applied step.",
                                labels=["param"])
        for i in idx:
            if p.names[i] in ratios:
                fam.add_metric([p.names[i]], float(ratios[p.names[i]]))
        yield fam


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
                    f"address of this machine: use host='127.0.0.1' (local scrapes) or '0.0.0.0' (all "
                    f"interfaces)") from e
            raise OSError(
                f"distgrad cannot serve metrics on {host}:{port}: {e.strerror or e}. Another process "
                f"(another training job's exporter?) holds the port: pass port=0 to pick a free one, "
                f"or choose another with instrument(engine, config={{'port': N}})") from e


class PrometheusSink(Sink):
    """Serves ``/metrics`` over HTTP from a daemon thread (``prometheus_client.start_http_server``).

    Args:
        host: bind address (default loopback).
        port: TCP port; 0 picks a free one, available afterwards as ``self.port``.
        static: labels of ``distgrad_info``.
        world_size: value of ``distgrad_world_size``.
        has_loss_scaler: export ``distgrad_overflow_steps_total`` (fp16 with a loss scaler only;
            under bf16/fp32 no loss-scale or overflow series exist).
        has_samples: export ``distgrad_samples_total`` (engines that count samples: DeepSpeed).

    Raises:
        OSError: the address cannot be bound; the message says how to fix it.
    """

    name = "prometheus"

    def __init__(self, host: str, port: int, static: dict[str, str], world_size: int,
                 serve: bool = True, has_loss_scaler: bool = True, has_samples: bool = True) -> None:
        from prometheus_client import start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = DistgradCollector(static, world_size, has_loss_scaler, has_samples)
        self.registry.register(self.collector)
        self._server = None
        self.host, self.port = host, port
        if serve:
            check_port_free(host, port)
            try:
                self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
            except OSError as e:
                raise OSError(f"distgrad cannot serve metrics on {host}:{port}: {e}; pass port=0 "
                              f"or another port") from e
            self.port = int(self._server.server_address[1])
            (log.warning if port == 0 else log.info)(  # a picked port must be seen to be found
                "distgrad: serving Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def write(self, record: StepRecord) -> None:
        """Serve ``record`` from now on (atomic swap)."""
        self.collector.update(record, record.counters)

    def set_counters(self, counters: dict[str, int]) -> None:
        """Update the counters between records (unsampled steps, errors)."""
        self.collector.update(None, counters)

    def close(self) -> None:
        """Stop the HTTP server and release the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["PrometheusSink", "DistgradCollector", "check_port_free", "COUNTERS"]
