"""A stand-in for distgrad's rank-0 exporter: metrics of distgrad's catalogue (distgrad/export/metrics.py:
name, type, help and label names from there) on a custom prometheus_client registry, served on
127.0.0.1, with a background "training loop" that
advances the step, timestamp, samples and loss a few times per second.

    with FakeDistgradRun(fp16=True) as run:      # serves http://{run.address}/metrics
        run.nan_step("layers.1.mlp.weight", layer="1", rank=1, elements=12)

Counters are exported at 0 from the start, as distgrad does, so that ``increase()`` sees the
first event.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from distgrad.export import metrics as catalogue

PARAMS = {  # parameter -> layer
    "embed.weight": "embed",
    "layers.0.attn.q_proj.weight": "0",
    "layers.0.mlp.weight": "0",
    "layers.1.attn.q_proj.weight": "1",
    "layers.1.mlp.weight": "1",
    "head.weight": "head",
}


class FakeDistgradRun:
    def __init__(self, *, fp16: bool = False, step_period: float = 0.25) -> None:
        self.fp16 = fp16
        self.step_period = step_period
        self.registry = r = CollectorRegistry()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.address = ""
        self.last_step = 0

        def gauge(name: str) -> Gauge:
            m = catalogue.by_name(name)
            assert m.type == "gauge", m
            return Gauge(name, m.help, m.labels, registry=r)

        def counter(name: str) -> Counter:
            m = catalogue.by_name(name)
            assert m.type == "counter", m
            return Counter(m.family, m.help, m.labels, registry=r)

        self._gauge = gauge  # for series that appear only with an event
        gauge("distgrad_info").labels(
            "deepspeed", "2", "fp16" if fp16 else "bf16", "0.0.0-fake").set(1)
        gauge("distgrad_world_size").set(2)
        self.step = gauge("distgrad_optimizer_step")
        self.timestamp = gauge("distgrad_last_sample_timestamp_seconds")
        self.step_timestamp = gauge("distgrad_last_step_timestamp_seconds")
        self.loss = gauge("distgrad_loss")
        self.grad_norm = gauge("distgrad_grad_norm")
        self.sampled = counter("distgrad_sampled_steps_total")
        self.samples = counter("distgrad_samples_total")
        self.nonfinite_steps = counter("distgrad_nonfinite_steps_total")
        self.skipped = counter("distgrad_skipped_steps_total")
        counter("distgrad_internal_errors_total")
        counter("distgrad_replica_mismatch_total")
        gauge("distgrad_replica_mismatch_rank").set(-1)
        gauge("distgrad_vanishing_params").set(0)
        gauge("distgrad_exploding_params").set(0)
        for name in ("distgrad_grad_norm_spikes_total", "distgrad_loss_spikes_total"):
            c = counter(name)
            for d in ("ema", "window"):
                c.labels(d)
        for name in ("distgrad_grad_norm_zscore", "distgrad_loss_zscore"):
            g = gauge(name)
            for d in ("ema", "window"):
                g.labels(d).set(0.3)
        self.param_norm = gauge("distgrad_param_grad_norm")
        self.param_nonfinite = gauge("distgrad_param_grad_nonfinite")
        param_zero = gauge("distgrad_param_grad_zero_ratio")
        param_headroom = gauge("distgrad_param_grad_headroom_ratio")
        self.layer_norm = gauge("distgrad_layer_grad_norm")
        self.layer_nonfinite = gauge("distgrad_layer_grad_nonfinite")
        layer_zero = gauge("distgrad_layer_grad_zero_ratio")
        layer_headroom = gauge("distgrad_layer_grad_headroom_ratio")
        module_kind = gauge("distgrad_module_kind_grad_norm")
        for kind in ("attn_q", "mlp_up"):
            module_kind.labels(kind).set(0.5)
        self.nonfinite_params = gauge("distgrad_nonfinite_params")
        for p, layer in PARAMS.items():
            for kind in ("nan", "inf"):
                self.param_nonfinite.labels(p, kind).set(0)
            param_zero.labels(p).set(0.01)
            param_headroom.labels(p).set(1e-3)
            self.layer_nonfinite.labels(layer).set(0)
            layer_zero.labels(layer).set(0.01)
            layer_headroom.labels(layer).set(1e-3)
        if fp16:
            gauge("distgrad_loss_scale").set(65536)
            gauge("distgrad_loss_scale_at_minimum").set(0)
            gauge("distgrad_consecutive_overflow_steps").set(0)
            counter("distgrad_overflow_steps_total")
        self._sample(0)

    def _sample(self, step: int) -> None:
        """Export one healthy sampled step."""
        with self._lock:
            self.step.set(step)
            self.timestamp.set(time.time())
            self.step_timestamp.set(time.time())
            self.loss.set(3.0 / (1.0 + 0.01 * step))
            self.grad_norm.set(1.0 + 0.1 * math.sin(step))
            self.sampled.inc()
            self.samples.inc(32)
            for i, (p, layer) in enumerate(PARAMS.items()):
                self.param_norm.labels(p).set(0.1 * (i + 1))
                self.layer_norm.labels(layer).set(0.2 * (i + 1))

    def nan_step(self, param: str, *, layer: str, rank: int, elements: int) -> None:
        """Export a sampled step whose gradient of ``param`` (on ``rank``'s shard) held NaNs,
        and stop the training loop there (so the values stay what the next scrape sees)."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        with self._lock:
            self.grad_norm.set(float("nan"))
            self.param_nonfinite.labels(param, "nan").set(elements)
            self.layer_nonfinite.labels(layer).set(elements)
            self.nonfinite_params.labels(param, str(rank)).set(elements)
            # the streak starts here (exported from the first non-finite step on, as distgrad does)
            self._gauge("distgrad_nonfinite_origin_step").set(self.last_step)
            self.nonfinite_steps.inc()
            self.skipped.inc()

    def _loop(self) -> None:
        step = 0
        while not self._stop.wait(self.step_period):
            step += 1
            self._sample(step)
            self.last_step = step

    def start(self) -> "FakeDistgradRun":
        self._server, _ = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.address = f"127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._loop, name=f"fake-run-{self.address}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    def metric_names(self) -> set[str]:
        """Every sample name this exporter serves."""
        return {s.name for m in self.registry.collect() for s in m.samples}

    def __enter__(self) -> "FakeDistgradRun":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
