"""One streaming pass over a run log (:func:`analyze`, :class:`RunAnalyzer`) into a bounded
:class:`RunAnalysis`: downsampled scalars and per-layer norms, anomaly counts, problems, spikes."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import numpy as np

from distgrad.core.watch import step_ranges
from distgrad.naming.layers import LayerIndex, layer_of, layer_sort_key
from distgrad.record import StepRecord
from distgrad.report.downsample import Downsampled, Downsampler
from distgrad.report.findings import ANOMALY_LABELS, MAX_MARKERS, Problem, RunAnalysis
from distgrad.report.histogram import HistogramAccumulator
from distgrad.report.loss import LossAccumulator
from distgrad.report.signals import SignalsAccumulator
from distgrad.report.spikes import RollingMadSpikes, _to_float
from distgrad.report.verdict import VerdictChecks


class RunAnalyzer:
    """Incremental form of :func:`analyze`: :meth:`add` every record in order, then :meth:`finish`.

    Args:
        path: label stored in the result.
        max_points: downsampling buckets (even, >= 2).
        overflow_streak_limit: consecutive fp16 overflow steps that make an ``overflow_streak``
            problem (default 20).
        spike_detector: factory of the fallback spike rule (default :class:`RollingMadSpikes`).
    """

    def __init__(self, path: str = "", max_points: int = 1024, overflow_streak_limit: int = 20,
                 spike_detector: Callable[[], RollingMadSpikes] = RollingMadSpikes) -> None:
        self.path = path
        self.overflow_streak_limit = overflow_streak_limit
        self._li = LayerIndex()
        self._n = 0
        self._first_step: int | None = None
        self._last: StepRecord | None = None
        self._counts = {k: 0 for k in ANOMALY_LABELS}
        self._first_of: dict[str, int] = {}
        self._problems: dict[str, Problem] = {}
        self._streak = 0
        self._streak_start = 0
        self._max_streak = 0
        self._scal = Downsampler(3, 3, max_points)
        self._lay = Downsampler(0, 0, max_points)
        self._upd: Downsampler | None = None
        self._max_points = max_points
        L = 0
        self._lmax = np.zeros(L)
        self._lmax_step = np.zeros(L, np.int64)
        self._llast = np.zeros(L)
        self._lnf = np.zeros(L)
        self._lnf_steps = np.zeros(L, np.int64)
        self._seen_layer = np.zeros(L, bool)
        self._det = {"grad_norm": spike_detector(), "loss": spike_detector()}
        self._spikes_rec: list[tuple[int, str, float]] = []
        self._spikes_mad: list[tuple[int, str, float]] = []
        self._n_spk_rec = {"grad_norm": 0, "loss": 0}
        self._n_spk_mad = {"grad_norm": 0, "loss": 0}
        self._rec_spikes_seen = False  # a record carried the online detectors' output
        self._mask_src: np.ndarray | None = None
        self._mask = np.zeros(0, bool)
        self._mask_all = True
        self._prev_sampled: int | None = None
        self._gaps: list[tuple[int, int, int]] = []  # (last step before, first step after, records)
        self._bad_lines: list[tuple[int | None, str]] = []
        self._loss = LossAccumulator(max_points)
        self._hist = HistogramAccumulator(max_points)
        self._checks = VerdictChecks()
        self._signals = SignalsAccumulator(max_points)

    def _grow(self) -> None:
        L = len(self._li.layers)
        if L == self._lmax.size:
            return
        extra = L - self._lmax.size
        self._lmax = np.pad(self._lmax, (0, extra), constant_values=np.nan)
        self._lmax_step = np.pad(self._lmax_step, (0, extra), constant_values=-1)
        self._llast = np.pad(self._llast, (0, extra), constant_values=np.nan)
        self._lnf = np.pad(self._lnf, (0, extra))
        self._lnf_steps = np.pad(self._lnf_steps, (0, extra))
        self._seen_layer = np.pad(self._seen_layer, (0, extra))
        self._lay.grow(L, L)
        if self._upd is not None:
            self._upd.grow(L)

    def _count(self, key: str, step: int) -> None:
        self._counts[key] += 1
        self._first_of.setdefault(key, step)

    def _problem(self, p: Problem) -> None:
        self._problems.setdefault(p.kind, p)

    def bad_line(self, msg: str) -> None:
        """A malformed (torn) line met after the records added so far (``read_jsonl``'s
        ``on_bad_line``): a ``malformed_lines`` problem."""
        after = int(self._last.step) if self._last is not None else None
        self._bad_lines.append((after, msg))
        if "malformed_lines" not in self._problems:
            self._problems["malformed_lines"] = Problem("malformed_lines", 0 if after is None else after + 1, detail=(
                f"malformed (torn) line after step {after}: {msg}; the JSONL sink lost that record "
                "(distgrad_sink_errors_total{sink=\"jsonl\"} and rank 0's log say why)"))

    def _missing(self, after: int, before: int, n: int) -> None:
        """``n`` records lost between the records of steps ``after`` and ``before``."""
        self._counts["missing_records"] += n
        self._first_of.setdefault("missing_records", after + 1)
        if len(self._gaps) < MAX_MARKERS:
            self._gaps.append((after, before, n))
        gaps = ", ".join(f"{k} between steps {a} and {b}" for a, b, k in self._gaps[:5])
        more = f" and {len(self._gaps) - 5} more gap(s)" if len(self._gaps) > 5 else ""
        self._problems["missing_records"] = Problem("missing_records", self._gaps[0][0] + 1, detail=(
            f"{self._counts['missing_records']} sampled-step record(s) missing from the log: {gaps}{more} "
            "(lost by the JSONL sink: distgrad_sink_errors_total{sink=\"jsonl\"} and rank 0's log say why)"))
        if "malformed_lines" in self._problems:  # a torn line is one of the records missing: after
            self._problems["malformed_lines"] = self._problems.pop("malformed_lines")

    def _unsampled(self, r: StepRecord, step: int) -> None:
        """Non-finite gradients / losses the instrument flagged on steps it did not sample."""
        un = r.unsampled_nonfinite
        if un is None:
            return
        grad = sorted(int(s) for s in un.grad)
        loss = sorted(int(s) for s in un.loss)
        if grad:
            self._counts["nonfinite_unsampled"] += len(grad)
            self._first_of.setdefault("nonfinite_unsampled", grad[0])
            self._problem(Problem("nonfinite_unsampled", grad[0], detail=(
                f"non-finite gradient on unsampled step(s) {step_ranges(grad)}, reported by sampled step "
                f"{step} without per-parameter detail (sample every step, interval: 1, to see where)")))
        if loss:
            self._counts["nonfinite_loss"] += len(loss)
            self._first_of.setdefault("nonfinite_loss", loss[0])
            self._problem(Problem("nonfinite_loss", loss[0], detail=(
                f"non-finite loss on unsampled step(s) {step_ranges(loss)}")))

    def add(self, r: StepRecord) -> None:
        """Fold one record in (records must come in file order).

        Records lost from the log are found from the cumulative ``counters["sampled_steps"]``:
        when it grows by more than one between consecutive records of one run (the step going
        forward), the records in between were lost (a ``missing_records`` problem)."""
        step = int(r.step)
        self._loss.add(r)
        self._hist.add(r)
        sampled = r.counters.get("sampled_steps") if isinstance(r.counters, dict) else None
        sampled = int(sampled) if isinstance(sampled, (int, float)) and not isinstance(sampled, bool) else None
        if sampled is not None and self._prev_sampled is not None and self._last is not None \
                and step > int(self._last.step) and sampled > self._prev_sampled + 1:
            self._missing(int(self._last.step), step, sampled - self._prev_sampled - 1)
        self._prev_sampled = sampled
        self._unsampled(r, step)
        self._checks.add(r)
        self._signals.add(r)
        if self._first_step is None:
            self._first_step = step
        self._n += 1
        self._last = r
        p = r.params
        idx = self._li.map(p.names)
        present = self._li.present(p.names)
        self._grow()
        L = len(self._li.layers)

        nf = p.nonfinite
        gn = float(r.grad_norm)
        grad_nonfinite = bool(nf.any()) or not math.isfinite(gn)  # == r.nonfinite
        overflow = r.overflow is True
        loss = float(r.loss) if r.loss is not None else math.nan

        # ---- anomalies and problems
        if grad_nonfinite:
            self._count("nonfinite_steps", step)
        if overflow:
            self._count("overflow_steps", step)
            if self._streak == 0:
                self._streak_start = step
            self._streak += 1
            self._max_streak = max(self._max_streak, self._streak)
            if self._streak == self.overflow_streak_limit:
                self._problem(Problem("overflow_streak", step, detail=(
                    f"fp16 overflow on {self._streak} consecutive sampled steps "
                    f"(steps {self._streak_start}..{step}, loss scale now {r.loss_scale!r}): "
                    f"the loss scale is collapsing")))
        else:
            self._streak = 0
        if not r.step_applied:
            self._count("skipped_steps", step)
        if grad_nonfinite and not overflow:
            self._count("nonfinite_grad", step)
            if "nonfinite_grad" not in self._problems:
                self._problem(self._nonfinite_problem(r, idx))
        if r.loss is not None and not math.isfinite(loss):
            self._count("nonfinite_loss", step)
            self._problem(Problem("nonfinite_loss", step, ranks=list(r.nonfinite_ranks),
                                  detail=f"non-finite loss ({loss!r})"))
        if r.replica_mismatch_ranks:
            self._count("replica_mismatch", step)
            ranks = sorted(int(x) for x in r.replica_mismatch_ranks)
            self._problem(Problem("replica_mismatch", step, ranks=ranks, detail=(
                f"replicated gradients differ across ranks; disagreeing rank(s) {ranks}")))
        rr = getattr(r, "rerun", None)  # the opt-in rerun attribution (distgrad.diagnostics.rerun)
        if rr is not None and rr.step == step and rr.verdict is not None:
            q = (f"; quarantine rank {rr.quarantine_rank} on host {rr.quarantine_host}"
                 if rr.quarantine_rank >= 0 else "")
            line = f"rerun attribution: {rr.verdict} ({rr.reason}){q}"
            same = next((k for k in ("nonfinite_grad", "nonfinite_loss", "replica_mismatch")
                         if k in self._problems and self._problems[k].step == step), None)
            if same is not None:  # the step's problem carries the verdict in its own line
                self._problems[same] = dataclasses.replace(self._problems[same],
                                                           detail=f"{self._problems[same].detail}; {line}")
            else:
                self._problem(Problem("rerun", step, ranks=[int(rr.culprit_rank)], detail=line))

        # ---- spikes (both sources; which one is reported is decided in finish())
        for metric, v in (("grad_norm", gn), ("loss", loss if r.loss is not None else None)):
            if v is not None and self._det[metric].update(v):
                self._n_spk_mad[metric] += 1
                if len(self._spikes_mad) < MAX_MARKERS:
                    self._spikes_mad.append((step, metric, float(v)))
        if r.spikes is not None:
            self._rec_spikes_seen = True
            for metric in sorted(set(r.spikes.flagged) & {"grad_norm", "loss"}):
                self._n_spk_rec[metric] += 1
                if len(self._spikes_rec) < MAX_MARKERS:
                    self._spikes_rec.append((step, metric, gn if metric == "grad_norm" else loss))

        # ---- downsampled scalars
        ls = float(r.loss_scale) if r.loss_scale is not None else math.nan
        self._scal.add(step, np.array([loss, gn, ls]),
                       np.array([1.0 if overflow else 0.0, 1.0 if grad_nonfinite and not overflow else 0.0,
                                 0.0 if r.step_applied else 1.0]))

        # ---- per-layer aggregates
        if L:
            lnorm, lnf = self._li.norms_and_nonfinite(p)
            if self._mask_src is not present or self._mask.size != L:
                self._mask = np.zeros(L, bool)
                self._mask[present] = True
                self._mask_all = bool(self._mask.all())
                self._mask_src = present  # reference held: identity check is safe
            mask = self._mask
            vals = lnorm if self._mask_all else np.where(mask, lnorm, np.nan)
            self._lay.add(step, vals, (lnf > 0).astype(np.float64))
            fin = np.isfinite(vals)
            better = fin & ~(vals <= self._lmax)  # NaN current max compares False -> better
            self._lmax[better] = vals[better]
            self._lmax_step[better] = step
            self._llast[mask] = vals[mask]
            self._lnf += lnf
            self._lnf_steps += lnf > 0
            self._seen_layer |= mask

        # ---- update-to-weight ratios
        ur = r.update_ratio
        if isinstance(ur, dict) and ur:
            names = list(ur.keys())
            uidx = self._li.map(names)
            self._grow()
            L = len(self._li.layers)
            if self._upd is None:
                self._upd = Downsampler(L, 0, self._max_points)
            ratios = np.asarray([_to_float(v) for v in ur.values()], dtype=np.float64)
            lmax = np.full(L, -np.inf)
            np.maximum.at(lmax, uidx, np.where(np.isfinite(ratios), ratios, -np.inf))
            lmax[~np.isfinite(lmax)] = np.nan
            self._upd.add(step, lmax)
        elif self._upd is not None:
            self._upd.add(step, np.full(self._upd.n_cols, np.nan))

    def _nonfinite_problem(self, r: StepRecord, idx: np.ndarray) -> Problem:
        """Where a non-finite step's NaN/Inf started, one answer (the page's, docs/runbook.md).

        1. The forward replay found the module (``record.culprit_module``, outcome ``found``):
           the line leads with that module and its rank; ``module``, ``layer`` (the module's) and
           ``ranks`` (the culprit ranks, else the replay's rank) say the same; ``param`` is None.
        2. Else, culprit ranks known (``record.culprits``): the line leads with them (``ranks``);
           ``param`` is the non-finite parameter that comes *last* in forward order (the rule of
           :mod:`distgrad.diagnostics.flight_recorder`: where the backward pass met the NaN first, which for a
           NaN made in the backward pass is where it was made), and the replay's reason for naming
           no module follows.
        3. Else (records without culprit data): ``param`` as in 2., ``ranks`` the ranks whose shard of
           the reduced gradient held it (``record.nonfinite_ranks``, ``provenance.params``,
           ``nonfinite_params``).

        In 1. the last non-finite parameter in forward order is named at the end of the line, for
        what it is; for a NaN made in the forward pass it is the model's last layer, not the origin.
        """
        p = r.params
        nf = p.nonfinite
        prov = r.provenance
        name: str | None = prov.first_param if prov is not None else None
        if name is None:
            hit = np.flatnonzero(nf > 0)
            if hit.size:
                name = p.names[int(hit[-1])]
        ranks = {int(x) for x in r.nonfinite_ranks}
        for e in (prov.params if prov is not None else []):
            if e.name == name:
                ranks.update(int(x) for x in e.ranks)
        ranks.update(int(e.rank) for e in (r.nonfinite_params or []) if e.param == name)
        shard_ranks = sorted(ranks)
        n_params = int(np.count_nonzero(nf > 0))
        layer = None
        if name is not None:
            layer = self._li.layers[int(idx[p.names.index(name)])] if name in p.names else layer_of(name)
            try:
                j = p.index(name)
                counts = f"{int(p.nan[j])} NaN / {int(p.inf[j])} Inf elements"
            except KeyError:
                counts = "element counts unknown"
            last_param = (f"last in forward order in parameter '{name}' (layer {layer}), {counts}, "
                          f"rank(s) {shard_ranks if shard_ranks else 'unknown'}")
        culprit_ranks = [int(c.rank) for c in r.culprits]
        who = (f"culprit rank(s) {culprit_ranks} (own loss / gradient non-finite before the reduction)"
               if culprit_ranks else "")
        cm = r.culprit_module
        if cm is not None and cm.outcome == "found":
            detail = f"non-finite gradient made in the forward pass: {cm.describe()} (forward replay)"
            detail += f"; {who}" if who else ""
            detail += f"; {n_params} parameter(s) non-finite on this step"
            if name is not None:  # the backward-order view, for what it is (not the origin)
                detail += (f"; the last of them in forward order, where the backward pass met the NaN first: "
                           f"'{name}' (layer {layer})")
            rk = culprit_ranks or ([int(cm.rank)] if cm.rank is not None else shard_ranks)
            return Problem("nonfinite_grad", int(r.step), None, layer_of(str(cm.module)), rk, detail,
                           module=str(cm.module))
        if name is not None:
            detail = f"non-finite gradient, {last_param}; {n_params} parameter(s) non-finite on this step"
        else:
            detail = (f"non-finite global grad norm ({r.grad_norm!r}) with no per-parameter count; "
                      f"rank(s) {shard_ranks if shard_ranks else 'unknown'}")
        if who:
            detail = f"non-finite gradient from {who}; " + detail[len("non-finite gradient, "):] \
                if name is not None else f"{detail}; {who}"
        if cm is not None:  # the forward replay of the step (distgrad.diagnostics.replay) named no module: why
            detail += f"; forward replay: {cm.describe()}"
        return Problem("nonfinite_grad", int(r.step), name, layer, culprit_ranks or shard_ranks, detail)

    def finish(self) -> RunAnalysis:
        """The :class:`RunAnalysis` of everything added so far (layers sorted)."""
        order = sorted(range(len(self._li.layers)), key=lambda j: layer_sort_key(self._li.layers[j]))
        o = np.asarray(order, dtype=np.int64)
        layers = [self._li.layers[j] for j in order]
        lay = self._lay.result()
        lay = Downsampled(lay.step_first, lay.step_last, lay.records, lay.min[:, o], lay.max[:, o],
                          lay.last[:, o], lay.counts[:, o], lay.width)
        upd = None
        if self._upd is not None:
            u = self._upd.result()
            upd = Downsampled(u.step_first, u.step_last, u.records, u.min[:, o], u.max[:, o],
                              u.last[:, o], u.counts, u.width)
        counts = dict(self._counts)
        if self._rec_spikes_seen:
            spikes, src = self._spikes_rec, "record"
            counts["grad_norm_spikes"] = self._n_spk_rec["grad_norm"]
            counts["loss_spikes"] = self._n_spk_rec["loss"]
        else:
            spikes, src = self._spikes_mad, "rolling-mad"
            counts["grad_norm_spikes"] = self._n_spk_mad["grad_norm"]
            counts["loss_spikes"] = self._n_spk_mad["loss"]
        first_of = dict(self._first_of)
        for m in ("grad_norm", "loss"):
            s = next((st for st, mm, _ in spikes if mm == m), None)
            if s is not None:
                first_of[f"{m}_spikes"] = s
        for kind, st, detail in self._checks.findings(self._first_step or 0):
            self._problem(Problem(kind, st, detail=detail, ranks=list(self._checks.ranks.get(kind, []))))
        r = self._last
        problems = sorted(self._problems.values(), key=lambda q: (q.step, list(self._problems).index(q.kind)))
        return RunAnalysis(
            path=self.path,
            n_records=self._n,
            first_step=self._first_step,
            last_step=int(r.step) if r is not None else None,
            world_size=int(r.world_size) if r is not None else None,
            last={
                "loss": r.loss if r is not None else None,
                "grad_norm": float(r.grad_norm) if r is not None else None,
                "loss_scale": r.loss_scale if r is not None else None,
            },
            counters=dict(r.counters) if r is not None else {},
            counts=counts,
            first_step_of=first_of,
            max_overflow_streak=self._max_streak,
            problems=problems,
            layers=layers,
            layer_max_norm=self._lmax[o].copy(),
            layer_max_norm_step=self._lmax_step[o].copy(),
            layer_last_norm=self._llast[o].copy(),
            layer_nonfinite_elems=self._lnf[o].copy(),
            layer_nonfinite_steps=self._lnf_steps[o].copy(),
            scalars=self._scal.result(),
            layer_norms=lay,
            update_ratio=upd,
            spikes=list(spikes),
            spikes_source=src,
            loss=self._loss.result(),
            signals=self._signals.result(),
            grad_histogram=self._hist.result(),
        )


def analyze(path: str | os.PathLike[str], *, max_points: int = 1024, include_rotated: bool = True,
            overflow_streak_limit: int = 20) -> RunAnalysis:
    """Stream a JSONL run log once and return its bounded :class:`RunAnalysis`.

    Args:
        path: the run log written by :class:`distgrad.export.jsonl.JsonlSink` (``run.jsonl``).
        max_points: downsampling buckets for plots (even, >= 2; default 1024).
        include_rotated: also read the rotated ``path.N`` files, oldest first (default True).
        overflow_streak_limit: see :class:`RunAnalyzer`.

    Malformed lines in the middle of the log are skipped and counted (``bad_lines`` and
    ``first_bad_line`` on the result) and are a ``malformed_lines`` problem; records missing
    between two records (lost by the sink, see :meth:`RunAnalyzer.add`) are a
    ``missing_records`` problem whose detail names the gaps; steps that go back (another run
    appended to the same file) are counted in ``restarts``. :func:`format_summary` reports them.

    Raises:
        FileNotFoundError: no log at ``path``.
        ValueError: ``max_points`` invalid.
    """
    from distgrad.export.jsonl import read_jsonl

    an = RunAnalyzer(os.fspath(path), max_points=max_points, overflow_streak_limit=overflow_streak_limit)
    bad: list[str] = []
    restarts, prev = 0, None
    def on_bad(msg: str) -> None:
        bad.append(msg)
        an.bad_line(msg)

    for rec in read_jsonl(path, include_rotated=include_rotated, on_bad_line=on_bad):
        if prev is not None and rec.step <= prev:
            restarts += 1  # the step went back: another run appended to the same file
        prev = rec.step
        an.add(rec)
    res = an.finish()
    res.bad_lines, res.first_bad_line, res.restarts = len(bad), (bad[0] if bad else None), restarts
    return res
