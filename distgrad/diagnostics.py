"""Everything distgrad derives from a step's statistics beyond the statistics themselves: spike
detection, layer health, clip ratio, layer / module-kind aggregation and the series budget,
non-finite provenance, the flight recorder and the forward overflow tracer.

Runs on every rank after each sampled step (host-side numpy only, no collective: every rank
holds the same reduced record), and writes its results into ``StepRecord.extra`` (keys listed
in :meth:`Diagnostics.on_record`), from which the sinks export. Files (flight-recorder reports)
are written by global rank 0; the tracer report by every rank that saw the event.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from distgrad.config import DistgradConfig
from distgrad.detectors import EmaZScoreDetector, SpikeMonitor, WindowSpikeDetector
from distgrad.flight_recorder import FlightRecorder, provenance_from
from distgrad.grouping import aggregate, group_keys, select_series, series_count
from distgrad.health import LayerHealth, clip_ratio, post_clip_norm
from distgrad.naming import classify, forward_order_key
from distgrad.record import StepRecord
from distgrad.sinks.base import SinkError

log = logging.getLogger("distgrad")

#: how many parameter names the health lists carry in a record (counts are exact)
_LIST_CAP = 20


class Diagnostics:
    """Per-run diagnostic state, fed one :class:`StepRecord` per sampled step.

    Args:
        config: thresholds and options (one place: :class:`DistgradConfig`).
        names: P parameter names in registration (forward) order.
        global_rank: this process's global rank (rank 0 writes files).
        max_norm: gradient-clipping threshold the engine applies (DeepSpeed
            ``gradient_clipping``), or None; ``config.max_grad_norm`` wins when set.
        model: the module, for the forward overflow tracer (None disables tracing).
        run_info: JSON-serialisable description of the run for flight-recorder reports.
    """

    def __init__(self, config: DistgradConfig, names: Sequence[str], global_rank: int = 0,
                 max_norm: float | None = None, model: Any = None,
                 run_info: dict[str, Any] | None = None) -> None:
        self.config = config
        self.names = list(names)
        self.global_rank = global_rank
        self.max_norm = config.max_grad_norm if config.max_grad_norm is not None else (
            max_norm if max_norm and max_norm > 0 else None)
        self.monitors = {s: SpikeMonitor(s, EmaZScoreDetector(config.spike_ema_alpha, config.spike_ema_z,
                                                                config.spike_ema_warmup),
                                         WindowSpikeDetector(config.spike_window, config.spike_window_sigma))
                         for s in ("grad_norm", "loss")}
        self.health = LayerHealth(config.vanish_threshold, config.explode_threshold, config.health_patience)
        self._flagged: set[str] = set()
        self.groups = [classify(n) for n in self.names]
        self.layer_keys = group_keys(self.names, "layer")
        self.kind_keys = [g.module_kind if g.lora is None else f"{g.module_kind}/lora_{g.lora}"
                          for g in self.groups]
        n_layers, n_kinds = len(set(self.layer_keys)), len(set(self.kind_keys))
        self.all_params_fit = config.per_param and series_count(
            len(self.names), n_layers, n_kinds, len(self.names),
            update_ratio=config.update_ratio) <= config.max_param_series
        self.n_layers, self.n_kinds = n_layers, n_kinds
        # forward order: the naming table's where every parameter is recognised, else the
        # registration order (which is the definition order, forward order for most models)
        if all(g.layer != "other" for g in self.groups):
            self._order_key = {n: forward_order_key(n) for n in self.names}
        else:
            self._order_key = {n: i for i, n in enumerate(self.names)}
        self.recorder = FlightRecorder(max(1, config.flight_recorder_steps),
                                       config.flight_recorder_dir or ".", run_info or config.to_dict(),
                                       dump_on_overflow=False) if config.flight_recorder_steps else None
        self._loss_scale_history: list[tuple[int, float]] = []
        self._dump_failed = False
        #: the current non-finite event: a streak of consecutive non-finite sampled steps,
        #: described by its first step (where it started; later steps show it spreading)
        self._event: dict[str, Any] | None = None
        self.tracer = None
        if model is not None and config.trace_micro_batches > 0:
            from distgrad.tracer import OverflowTracer

            self.tracer = OverflowTracer(model, max_micro_batches=config.trace_micro_batches)
        self._traced = False
        self.reports: list[Path] = []

    # --------------------------------------------------------------------------------------
    def on_record(self, rec: StepRecord) -> None:
        """Attach diagnostics to ``rec.extra``:

        ``grad_norm_zscore`` / ``loss_zscore`` ({detector: score}), ``grad_norm_spikes_total`` /
        ``loss_spikes_total`` ({detector: count}), ``spikes`` (series spiking on this step),
        ``vanishing_params`` / ``exploding_params`` (counts) with ``vanishing`` / ``exploding``
        (up to 20 names), ``clip_ratio`` / ``post_clip_norm`` (with a max norm),
        ``layer_norm`` / ``layer_nonfinite`` / ``layer_zero_ratio`` / ``layer_headroom``
        ({layer: value}), ``module_kind_norm``, ``exported_params`` (indices with per-parameter
        series, None = all), ``provenance`` (non-finite steps), ``flight_recorder_report``.
        """
        x = rec.extra
        self._spikes(rec)
        self._health(rec)
        if self.max_norm is not None:
            x["clip_ratio"] = clip_ratio(rec.grad_norm, self.max_norm, eps=1e-6)
            x["post_clip_norm"] = post_clip_norm(rec.grad_norm, self.max_norm, eps=1e-6)
        self._groups(rec)
        if rec.loss_scale is not None:
            self._loss_scale_history.append((rec.step, rec.loss_scale))
            del self._loss_scale_history[:-1024]
        if rec.nonfinite:
            self._nonfinite(rec)
        else:
            self._event = None
            self._dump_failed = False  # a failed report is retried at the next non-finite event
        if self.recorder is not None:
            self.recorder.record(rec)
            if rec.nonfinite and self.config.flight_recorder_dir and self.global_rank == 0 \
                    and not self.recorder.dumped_nonfinite and not rec.overflow and not self._dump_failed:
                self._dump_failed = True  # until it succeeds: a failing dump is reported once, not per step
                try:
                    path = self.recorder.maybe_dump_on_nonfinite(
                        rec, provenance=x.get("provenance"), loss_scale_history=self._loss_scale_history)
                except OSError as e:  # a full or unwritable directory: a sink failure, not distgrad's
                    log.warning("distgrad: flight-recorder report for step %d not written to "
                                "flight_recorder_dir=%r: %s (counted in distgrad_sink_errors_total"
                                "{sink=\"flight_recorder\"})", rec.step, self.config.flight_recorder_dir, e)
                    raise SinkError(f"flight recorder: {e}") from e
                self._dump_failed = False
                if path is not None:
                    self.reports.append(Path(path))
                    x["flight_recorder_report"] = str(path)
                    log.warning("distgrad: flight-recorder report written to %s", path)

    def _spikes(self, rec: StepRecord) -> None:
        spiking = []
        for series, value in (("grad_norm", rec.grad_norm), ("loss", rec.loss)):
            mon = self.monitors[series]
            # a skipped (overflow) step carries no usable value: never fed, never re-reported
            res = mon.update(None if rec.overflow else value, step=rec.step)
            rec.extra[f"{series}_zscore"] = {k: r.score for k, r in res.items()}
            rec.extra[f"{series}_spikes_total"] = dict(mon.spikes)
            if any(r.is_spike for r in res.values()):
                spiking.append(series)
                log.warning("distgrad: step %d: %s spike (%s = %.4g; z %s)", rec.step, series, series,
                            value, {k: round(r.score, 2) for k, r in res.items()})
        rec.extra["spikes"] = spiking

    def _health(self, rec: StepRecord) -> None:
        # a parameter with no gradient element anywhere (unused this step) is not "vanishing":
        # it is left out, which also resets its streaks
        has = rec.params.numel > 0
        rep = self.health.update([n for n, h in zip(rec.params.names, has) if h], rec.params.norm[has])
        rec.extra["vanishing_params"] = rep.n_vanishing
        rec.extra["exploding_params"] = rep.n_exploding
        rec.extra["vanishing"] = list(rep.vanishing[:_LIST_CAP])
        rec.extra["exploding"] = list(rep.exploding[:_LIST_CAP])
        flagged = set(rep.vanishing) | set(rep.exploding)
        new = flagged - self._flagged
        if new and self.global_rank == 0:
            log.warning("distgrad: step %d: vanishing %s, exploding %s", rec.step,
                        sorted(new & set(rep.vanishing))[:_LIST_CAP], sorted(new & set(rep.exploding))[:_LIST_CAP])
        self._flagged = flagged

    def _groups(self, rec: StepRecord) -> None:
        p = rec.params
        headroom = np.asarray(rec.extra.get("headroom", np.full(len(p.names), np.nan)), dtype=np.float64)
        layers = aggregate(p, self.layer_keys)
        rec.extra["layer_norm"] = dict(zip(layers.names, layers.norm.tolist()))
        rec.extra["layer_nonfinite"] = dict(zip(layers.names, layers.nonfinite.tolist()))
        rec.extra["layer_zero_ratio"] = dict(zip(layers.names, layers.zero_ratio.tolist()))
        hr: dict[str, float] = {}
        for key, h in zip(self.layer_keys, headroom.tolist()):
            hr[key] = h if key not in hr or (math.isnan(h) or h > hr[key]) else hr[key]
        rec.extra["layer_headroom"] = hr
        kinds = aggregate(p, self.kind_keys)
        rec.extra["module_kind_norm"] = dict(zip(kinds.names, kinds.norm.tolist()))
        if not self.config.per_param:
            rec.extra["exported_params"] = []
        elif self.all_params_fit:
            rec.extra["exported_params"] = None
        else:
            top_k = max(1, min(len(p.names), self.config.max_param_series))
            rec.extra["exported_params"] = select_series(
                p, budget=self.config.max_param_series, top_k=top_k, update_ratio=self.config.update_ratio)

    def _nonfinite(self, rec: StepRecord) -> None:
        rows = rec.extra.get("nonfinite_params") or []
        W = max(rec.world_size, 1)
        idx = {n: i for i, n in enumerate(self.names)}
        nan = np.zeros((W, len(self.names)))
        inf = np.zeros((W, len(self.names)))
        for r in rows:
            if r["param"] in idx and r["rank"] < W:
                nan[r["rank"], idx[r["param"]]] += r["nan"]
                inf[r["rank"], idx[r["param"]]] += r["inf"]
        prov = provenance_from(self.names, nan, inf, order_key=self._order_key)
        prov["step"] = rec.step
        if prov["first_param"] is not None:
            prov["first_layer"] = classify(prov["first_param"]).layer
        rec.extra["provenance"] = prov
        if self._event is None:  # first step of a streak: this is the event (logged once)
            self._event = {"step": rec.step, "rows": rows[:_LIST_CAP], "provenance": prov}
            if self.global_rank == 0 and not rec.overflow:  # fp16 overflows are routine: counted, not logged
                n = len(prov["params"])
                log.warning("distgrad: step %d: non-finite gradients in %d parameter(s); probable origin %s "
                            "(layer %s; the non-finite parameter last in forward order); %s%s", rec.step, n,
                            prov["first_param"], prov.get("first_layer"),
                            "; ".join(f"{r['name']}: {r['nan']} NaN, {r['inf']} Inf, ranks {r['ranks']}"
                                      for r in prov["params"][:5]), f"; and {n - 5} more" if n > 5 else "")
        rec.extra["nonfinite_event"] = self._event
        if self.tracer is not None and not self._traced:
            self._traced = True
            self.tracer.arm()
            log.warning("distgrad: forward overflow tracer armed for %d micro-batch(es)",
                        self.config.trace_micro_batches)

    def tracer_report(self) -> dict[str, Any] | None:
        """The overflow tracer's report once it has run (None before)."""
        if self.tracer is None or not self._traced or self.tracer.armed:
            return None
        return self.tracer.report()

    def write_tracer_report(self, rank: int) -> Path | None:
        """Write the tracer's text report to ``flight_recorder_dir`` once it has disarmed."""
        rep = self.tracer_report()
        if rep is None or not self.config.flight_recorder_dir:
            return None
        path = Path(self.config.flight_recorder_dir) / f"tracer-rank{rank}.txt"
        if path.exists():
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.tracer.render())
        self.reports.append(path)
        return path
