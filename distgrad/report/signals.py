"""The packed signals (docs/signals.md) in the offline report: their series over steps, downsampled
like the other curves, and FINDINGS, each with what to do and its runbook section
(``docs/runbook.md#signal-<kind>``).

Signals read from the records (a signal absent from every record is simply not reported):

* ``grad_histogram`` (:class:`~distgrad.signals.histogram.GradHistogramSignal.Part`): underflow ratio and
  zero ratio, global and per layer.
* ``noise_scale`` (:class:`distgrad.signals.noise_scale.GradientNoiseScale.Part`): ``B_simple`` with the step's batch,
  and the two moving averages it is the ratio of.
* ``curvature`` (:class:`distgrad.signals.curvature.Curvature.Part`): curvature along the last update,
  global and per layer.
* ``optimizer_signals`` (:class:`~distgrad.signals.adam.AdamSignal.Part`): Adam's update
  RMS, spike fraction, gradient-momentum cosine, moment norms and diagonal Fisher trace, global
  and per layer.
* ``logits`` (:class:`~distgrad.signals.logits.LogitSignal.Part`): the maximum attention logit (over
  layers, and per layer), the output log-sum-exp z (mean, max) and max |logit|.
* ``update_geometry`` (:class:`distgrad.signals.update.UpdateGeometry.Part`): the applied
  update's update/weight ratio and RMS (any optimizer), global and per layer.
* ``fp8`` (:class:`distgrad.signals.fp8.Fp8Signal.Part`): the smallest amax of a float8 cast
  tensor, the underflow and saturation fractions of the casts, over the float8 layers and per
  layer.
* ``underflow`` (:class:`distgrad.signals.underflow.Underflow.Part`): the fraction of gradient
  elements lost to underflow (non-zero in a float32 recomputation, exactly zero in the training
  precision) and the genuinely zero fraction, global and per layer, at each recomputation.
* ``router`` (:class:`distgrad.signals.router.RouterHealth.Part`): per MoE layer the expert load
  max/mean, the router entropy and the dead experts (worst / lowest / sum over layers), and the
  auxiliary loss.

Findings (rules; ``W`` = :data:`WINDOW` sampled steps):

* ``underflow``: a layer whose underflow ratio (elements with ``0 < |g| < tiny`` of the training
  dtype over its elements) has a median over the last ``W`` sampled steps of at least
  :data:`UNDERFLOW_RATIO` (1%); named: the worst such layer, the number of such layers, the
  dtype and the first step the worst one reached the threshold.
  When the run also measured ``underflow``, the finding adds that these elements are subnormal
  (kept with reduced precision), not lost.
* ``lost_to_underflow``: a layer whose lost-to-underflow ratio has a median over the last ``W``
  recomputations (``underflow.enabled``) of at least :data:`UNDERFLOW_RATIO` (1%); named: the
  worst such layers (up to :data:`LOST_NAMED`, most lost first) with their ratios, the number of
  such layers, the loss scale of the last recomputation and the first recomputation step the
  worst one reached the threshold.
* ``noise_scale``: the median ``B_simple`` of the last ``W`` records that have one, once the
  moving averages have seen at least :data:`NOISE_MIN_STEPS` sampled steps, is at least
  :data:`NOISE_FACTOR` (2) times the step's batch (larger batches would be efficient) or at most
  1 / :data:`NOISE_FACTOR` of it (the batch is past the critical batch size: extra samples per
  step buy little); named at the first record of that window.
* ``adam_excursion``: from optimizer step :data:`ADAM_MIN_STEP` (100) on, the median of the last
  ``W`` sampled global update RMS is above :data:`UPDATE_RMS_MAX` (2) or that of the spike
  fraction above :data:`SPIKE_FRACTION_MAX` (1%): the thresholds of the
  ``DistgradAdamUpdateExcursion`` alert; named at the first step it held, with the layer of
  largest update RMS then.
* ``update_rms_rise``: the rise rule (below) on the update RMS.
* ``update_ratio_rise``: the rise rule on the applied update/weight ratio (``update_geometry``).
* ``attention_logit_rise``: the rise rule on the maximum attention logit (over layers or in a
  layer), with the later median at least :data:`RISE_FLOOR` (10); named at the first step it
  held, with the layer of largest rise then.
* ``curvature_rise``: the median curvature of the last ``W`` sampled steps is at least
  :data:`RISE_FACTOR` (3) times the median of the ``W`` before them, both positive, globally or in
  a layer (sharpening); named at the first step it held, with the layer of largest rise then.

* ``router_collapse``: the first record in which a MoE layer's expert load max/mean is above
  :data:`ROUTER_COLLAPSE` (3, DistgradRouterCollapse's default) or a layer has dead experts;
  named: that layer (the highest imbalance, else the most dead experts) and the others.
* ``duplicate_data``: a record whose ``duplicate_data`` part names data-parallel ranks with
  bit-identical losses (:mod:`distgrad.signals.duplicate_data`); named at the first such step,
  with the ranks.
* ``replica_weights``: a record whose ``replica_weights`` part found weights differing across
  data-parallel replicas at a hash step (:mod:`distgrad.signals.weight_hash`); named at that
  hash step, with the rank outside the majority and the parameters. (Both also alert:
  DistgradDuplicateData, DistgradReplicaWeightsDiverged.)

Findings are advice, not problems: they do not change the verdict (``HEALTHY`` / ``PROBLEM``)
nor ``--fail-on-problem``. Memory: the downsampled series (``O(max_points x layers)`` per metric)
plus the last ``2 W`` values of each layer per rule.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distgrad.record import StepRecord
from distgrad.report.downsample import Downsampled, Downsampler

RUNBOOK = "docs/runbook.md"
WINDOW = 10
UNDERFLOW_RATIO = 0.01
LOST_NAMED = 3
NOISE_MIN_STEPS = 20
NOISE_FACTOR = 2.0
RISE_FACTOR = 3.0
#: (signal, metric) -> the level the later median must reach for the rise rule to hold: the
#: maximum attention logit of a healthy small model stays near 10 (docs/runbook.md,
#: DistgradAttentionLogitHigh), and a rise below it (0.3 -> 2 over the first steps from a small
#: initialisation, the example job's healthy run) is the softmax leaving uniform, not growth
RISE_FLOOR = {("logits", "attention_max"): 10.0}
ADAM_MIN_STEP = 100
UPDATE_RMS_MAX = 2.0
SPIKE_FRACTION_MAX = 0.01


@dataclass
class SignalFinding:
    """One finding of a signal rule: ``kind`` (runbook anchor ``signal-<kind>``), the ``step`` it
    refers to (first step the rule held), the ``layer`` implicated (None: global), ``detail``
    (what was seen, what to do and the runbook link; no trailing period)."""

    kind: str
    step: int
    layer: str | None
    detail: str


@dataclass
class SignalSeries:
    """One metric of one signal over the run: ``glob`` downsampled global value (1 column) or
    None; ``per_layer`` downsampled per-layer values (columns aligned with ``layers``) or None."""

    signal: str
    metric: str
    label: str
    log: bool
    glob: Downsampled | None
    layers: list[str]
    per_layer: Downsampled | None


@dataclass
class SignalsReport:
    """What :class:`SignalsAccumulator` found: ``series`` in signal order, ``findings``,
    ``info`` (signal -> facts for the summary, e.g. the histogram's dtype)."""

    series: list[SignalSeries] = field(default_factory=list)
    findings: list[SignalFinding] = field(default_factory=list)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)

    def signals(self) -> list[str]:
        """Signals present, in order."""
        return list(dict.fromkeys(s.signal for s in self.series))


def _f(v: Any) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return math.nan
    return x


Extract = Callable[[Any], tuple[float, dict[str, float] | None]]


def _hist_ratio(attr: str, method: str) -> Extract:
    def get(h: Any) -> tuple[float, dict[str, float]]:
        per = getattr(h, method)()
        num = sum(int(x) for x in getattr(h, attr))
        den = sum(int(x) for x in h.numel)
        return (num / den if den else math.nan), per
    return get


#: signal field of StepRecord -> [(metric, label, log scale, extractor)]
SPECS: dict[str, list[tuple[str, str, bool, Extract]]] = {
    "grad_histogram": [
        ("underflow_ratio", "underflow ratio (0 < |g| < smallest normal of the dtype)", False,
         _hist_ratio("underflow", "underflow_ratio")),
        ("zero_ratio", "zero ratio (g == 0)", False, _hist_ratio("zeros", "zero_ratio")),
    ],
}
SPECS["noise_scale"] = [
    ("noise_scale", "gradient noise scale B_simple (samples; dashed: the step's batch)", True,
     lambda n: (_f(n.noise_scale) if n.noise_scale is not None else math.nan, None)),
    ("ema_noise_trace", "EMA of tr(Sigma) (grad^2)", True, lambda n: (_f(n.ema_noise_trace), None)),
    ("ema_true_grad_sq", "EMA of |G|^2 (grad^2)", True, lambda n: (_f(n.ema_true_grad_sq), None)),
]
SPECS["curvature"] = [
    ("curvature", "curvature along the last update (g_t - g_t-1).dtheta/|dtheta|^2", False,
     lambda c: (_f(c.total) if c.total is not None else math.nan, dict(c.layer))),
]


def _opt(attr: str) -> Extract:
    return lambda o: (_f(getattr(o, attr)), dict(getattr(o, f"layer_{attr}")))


SPECS["optimizer_signals"] = [
    ("update_rms", "Adam update RMS sqrt(mean(g^2 / v_hat)) (~1 healthy)", True, _opt("update_rms")),
    ("spike_fraction", "fraction of elements with g^2 > theta v_hat", False, _opt("spike_fraction")),
    ("grad_momentum_cosine", "cosine(gradient, momentum)", False, _opt("grad_momentum_cosine")),
    ("exp_avg_norm", "|m| (first moment)", True, _opt("exp_avg_norm")),
    ("exp_avg_sq_norm", "|v| (second moment)", True, _opt("exp_avg_sq_norm")),
    ("fisher_trace", "diagonal Fisher trace sum(v_hat)", True, _opt("fisher_trace")),
]
SPECS["logits"] = [
    ("attention_max", "max attention logit q.k/sqrt(d) (over layers; per layer)", True,
     lambda p: (max(p.attention_max.values()) if p.attention_max else math.nan, dict(p.attention_max))),
    ("z_mean", "output log-sum-exp z, mean over positions (nats)", False,
     lambda p: (_f(p.z_mean) if p.z_mean is not None else math.nan, None)),
    ("z_max", "output log-sum-exp z, max over positions (nats)", False,
     lambda p: (_f(p.z_max) if p.z_max is not None else math.nan, None)),
    ("output_abs_max", "output logits max |logit|", True,
     lambda p: (_f(p.output_abs_max) if p.output_abs_max is not None else math.nan, None)),
]
SPECS["update_geometry"] = [
    ("update_ratio", "applied update/weight ratio ||dW|| / ||W|| (any optimizer)", True,
     lambda p: (_f(p.update_ratio) if p.update_ratio is not None else math.nan, dict(p.layer_update_ratio))),
    ("update_rms", "applied update RMS (parameter units)", True,
     lambda p: (_f(p.update_rms), dict(p.layer_update_rms))),
]
SPECS["underflow"] = [
    ("lost_ratio", "lost to underflow (non-zero in float32, exactly zero in the training precision)", False,
     lambda p: (_f(p.total_lost), dict(p.lost))),
    ("genuine_zero_ratio", "genuinely zero (zero in float32 too)", False,
     lambda p: (_f(p.total_zero_ref), dict(p.zero))),
]


def _fp8(kind: str) -> Extract:
    """FP8 scaling health (``StepRecord.fp8``): over the float8 modules and their tensors, and per
    layer: the smallest amax (``kind`` "amax_min"), or the ``underflow`` / ``saturated`` counts
    over the elements."""
    def get(p: Any) -> tuple[float, dict[str, float]]:
        per: dict[str, list[float]] = {}
        for mod, roles in p.stats.items():
            acc = per.setdefault(p.layers.get(mod, mod), [math.inf, 0.0, 0.0])
            for st in roles.values():
                if kind == "amax_min":
                    acc[0] = min(acc[0], _f(st["amax_min"]))
                else:
                    acc[1] += _f(st[kind])
                    acc[2] += _f(st["elements"])
        if kind == "amax_min":
            lay = {k: v[0] for k, v in per.items()}
            return (min(lay.values()) if lay else math.nan), lay
        lay = {k: v[1] / v[2] for k, v in per.items() if v[2] > 0}
        num, den = sum(v[1] for v in per.values()), sum(v[2] for v in per.values())
        return (num / den if den else math.nan), lay
    return get


SPECS["fp8"] = [
    ("amax_min", "FP8 smallest amax of a cast tensor (over float8 layers; per layer; 0: all zeros)", True,
     _fp8("amax_min")),
    ("underflow_ratio", "FP8 underflow: elements flushed to zero by the cast", False, _fp8("underflow")),
    ("saturation_ratio", "FP8 saturation: elements clipped by the cast", False, _fp8("saturated")),
]
SPECS["router"] = [
    ("imbalance", "MoE expert load max/mean (over layers: the worst; per layer)", False,
     lambda p: (max(p.imbalance.values()) if p.imbalance else math.nan, dict(p.imbalance))),
    ("entropy", "MoE router softmax entropy, nats (over layers: the lowest; per layer)", False,
     lambda p: (min(p.entropy.values()) if p.entropy else math.nan, dict(p.entropy))),
    ("dead", "MoE dead experts (over layers: the sum; per layer)", False,
     lambda p: (float(sum(len(v) for v in p.dead.values())), {k: float(len(v)) for k, v in p.dead.items()})),
    ("aux_loss", "MoE auxiliary load-balancing loss", False,
     lambda p: (_f(p.aux_loss) if p.aux_loss is not None else math.nan, None)),
]
TITLES = {"underflow": "Lost to underflow", "grad_histogram": "Gradient value distribution",
          "noise_scale": "Gradient noise scale",
          "curvature": "Curvature along the last update", "optimizer_signals": "Optimizer (Adam) signals",
          "logits": "Logit precursors", "update_geometry": "Applied update geometry",
          "fp8": "FP8 scaling health", "router": "MoE router health", "adaptive_clip": "Adaptive clipping"}
SPECS["adaptive_clip"] = [  # the opt-in action's part (distgrad.diagnostics.adaptive_clip), when it acted
    ("factor", "adaptive clipping: smallest factor applied on the step (1: not clipped)", False,
     lambda p: (_f(p.factor) if p.acted else math.nan, None)),
    ("clipped_steps", "adaptive clipping: optimizer steps clipped so far", False,
     lambda p: (float(p.clipped_steps), None)),
    ("z", "ZClip: z-score of the global gradient norm against its EMA", False,
     lambda p: (_f(p.z) if p.z is not None else math.nan, None)),
]
#: a MoE layer's load max/mean above this is a collapsed router (DistgradRouterCollapse's default)
ROUTER_COLLAPSE = 3.0
#: (signal, metric) -> (finding kind, what rose, what to do) of the rise rule
RISES = {
    ("optimizer_signals", "update_rms"): (
        "update_rms_rise", "Adam update RMS",
        "the gradient is outgrowing Adam's second moment (loss spikes tend to follow within a few steps): lower the "
        "learning rate, lower beta2 (e.g. 0.95) so v follows the gradient faster, raise eps, or enable clipping"),
    ("logits", "attention_max"): (
        "attention_logit_rise", "maximum attention logit",
        "the attention logits are growing (attention-entropy collapse and loss spikes follow): lower the learning "
        "rate of the attention projections, add QK-norm or QK-clip"),
    ("update_geometry", "update_ratio"): (
        "update_ratio_rise", "applied update/weight ratio",
        "the optimizer's steps are growing against the weights (loss spikes tend to follow): lower the learning "
        "rate or check its schedule (a warm-up that ended, a restart at the peak) and the weight decay"),
    ("curvature", "curvature"): (
        "curvature_rise", "curvature along the update",
        "the loss is sharpening along the steps (towards the edge of stability, where loss spikes follow): lower "
        "the learning rate or lengthen the warm-up, and enable gradient clipping"),
}


class _Metric:
    """Downsampled global and per-layer values of one metric, plus the last ``2 W`` per-layer
    values for the rules."""

    def __init__(self, max_points: int) -> None:
        self.max_points = max_points
        self.glob: Downsampler | None = None
        self.lay: Downsampler | None = None
        self.index: dict[str, int] = {}
        self.names: list[str] = []
        self.recent: deque[tuple[int, np.ndarray]] = deque(maxlen=2 * WINDOW)
        self.recent_glob: deque[float] = deque(maxlen=2 * WINDOW)

    def add(self, step: int, g: float, per: dict[str, float] | None) -> None:
        if self.glob is None:
            self.glob = Downsampler(1, 0, self.max_points)
        self.glob.add(step, np.array([g], dtype=np.float64))
        self.recent_glob.append(g)
        if per is None:
            return
        for k in per:
            if k not in self.index:
                self.index[k] = len(self.names)
                self.names.append(k)
        L = len(self.names)
        if self.lay is None:
            self.lay = Downsampler(L, 0, self.max_points)
        self.lay.grow(L)
        row = np.full(L, np.nan)
        for k, v in per.items():
            row[self.index[k]] = _f(v)
        self.lay.add(step, row)
        self.recent.append((step, row))

    def window(self, n: int) -> np.ndarray:
        """float64 [n', L] of the last ``n`` per-layer rows (NaN-padded to the current layers)."""
        rows = list(self.recent)[-n:]
        L = len(self.names)
        out = np.full((len(rows), L), np.nan)
        for i, (_, r) in enumerate(rows):
            out[i, :r.size] = r
        return out


class SignalsAccumulator:
    """Feed every record in file order (:meth:`add`), then :meth:`result` (bounded state, see the
    module doc). ``max_points``: downsampling buckets, as the report's other curves."""

    def __init__(self, max_points: int = 1024) -> None:
        self.max_points = max_points
        self._m: dict[tuple[str, str], _Metric] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._under_first: dict[str, int] = {}  # layer -> first step its underflow ratio >= threshold
        self._lost: deque[tuple[int, dict[str, float], float]] = deque(maxlen=WINDOW)  # recomputations
        self._lost_first: dict[str, int] = {}  # layer -> first recomputation step its lost ratio >= threshold
        self._noise: deque[tuple[int, float, float]] = deque(maxlen=WINDOW)  # (step, B_simple, batch)
        self._adam: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (update RMS, spike fraction)
        self._excursion: list | None = None  # step, worst layer, rms, fraction, its rms, steps held
        self._rises: dict[tuple[str, str], list] = {}  # first firing: step, layer, ratio, before, after, steps held
        self._dup: SignalFinding | None = None  # first step data-parallel ranks shared their data
        self._rw: SignalFinding | None = None  # first hash step whose replica weights differed
        self._router: SignalFinding | None = None  # first step a MoE layer collapsed or lost experts

    def add(self, r: StepRecord) -> None:
        step = int(r.step)
        for fld in ("duplicate_data", "replica_weights"):  # findings only, no series
            part = getattr(r, fld, None)
            if part is not None:
                getattr(self, f"_see_{fld}")(step, part)
        for fld, metrics in SPECS.items():
            part = getattr(r, fld, None)
            if part is None:
                continue
            for metric, _, _, get in metrics:
                try:
                    g, per = get(part)
                except (AttributeError, TypeError, ValueError, ZeroDivisionError):
                    continue  # a malformed part: the metric is skipped for this record
                m = self._m.get((fld, metric))
                if m is None:
                    m = self._m[(fld, metric)] = _Metric(self.max_points)
                m.add(step, _f(g), per)
                if (fld, metric) in RISES:
                    self._rise(fld, metric, m, step)
            getattr(self, f"_see_{fld}", lambda *_: None)(step, part)

    def _rise(self, fld: str, metric: str, m: _Metric, step: int) -> None:
        """The rise rule on the last 2 W values of ``m`` (global and per layer)."""
        if len(m.recent_glob) < 2 * WINDOW:
            return
        cols = np.asarray(m.recent_glob, dtype=np.float64)[:, None]
        names: list[str | None] = [None]
        if m.names and len(m.recent) == 2 * WINDOW:
            cols = np.hstack([cols, m.window(2 * WINDOW)])
            names += m.names
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            before = np.nanmedian(cols[:WINDOW], axis=0)
            after = np.nanmedian(cols[WINDOW:], axis=0)
            ratio = np.where((before > 0) & (after > 0) & (after >= RISE_FLOOR.get((fld, metric), 0.0)),
                             after / before, np.nan)
        hit = np.flatnonzero(np.nan_to_num(ratio, nan=0.0) >= RISE_FACTOR)
        if not hit.size:
            return
        st = self._rises.get((fld, metric))
        if st is None:
            j = int(hit[np.argmax(ratio[hit])])
            self._rises[(fld, metric)] = [step, names[j], float(ratio[j]), float(before[j]), float(after[j]), 1]
        else:
            st[5] += 1

    # ---------------------------------------------------------------- per-signal state
    def _see_grad_histogram(self, step: int, h: Any) -> None:
        info = self._info.setdefault("grad_histogram", {})
        info["dtype"] = getattr(h, "dtype", "?")
        info["tiny"] = _f(getattr(h, "tiny", math.nan))
        m = self._m.get(("grad_histogram", "underflow_ratio"))
        if m is None or not m.recent:
            return
        row = m.recent[-1][1]
        for k in np.flatnonzero(row >= UNDERFLOW_RATIO):
            self._under_first.setdefault(m.names[int(k)], step)

    def _see_underflow(self, step: int, u: Any) -> None:
        """One record's underflow part: a new recomputation (the part is served until the next)."""
        ms = int(u.step)
        if self._lost and self._lost[-1][0] == ms:
            return
        lost = {k: _f(v) for k, v in dict(u.lost).items()}
        self._lost.append((ms, lost, _f(u.loss_scale)))
        for k, v in lost.items():
            if v >= UNDERFLOW_RATIO:
                self._lost_first.setdefault(k, ms)

    def _see_noise_scale(self, step: int, n: Any) -> None:
        info = self._info.setdefault("noise_scale", {})
        info["batch"] = _f(getattr(n, "big_batch", math.nan))
        b = getattr(n, "noise_scale", None)
        if b is not None and int(getattr(n, "ema_steps", 0)) >= NOISE_MIN_STEPS:
            self._noise.append((step, _f(b), _f(n.big_batch)))

    def _see_duplicate_data(self, step: int, d: Any) -> None:
        if self._dup is None and getattr(d, "groups", None):
            self._dup = SignalFinding("duplicate_data", step, None, (
                f"data-parallel ranks {'; '.join(', '.join(str(r) for r in g) for g in d.groups)} had bit-identical "
                f"losses on {d.streak} consecutive sampled steps: they train on the same data (a loader that does "
                f"not shard by rank, a sampler without set_epoch); what to do: shard the data by rank "
                f"({RUNBOOK}#signal-duplicate-data)"))

    def _see_replica_weights(self, step: int, w: Any) -> None:
        if self._rw is None and (w.mismatch_ranks or w.n_mismatch_params) and w.hash_step is not None:
            names = ", ".join(w.mismatch_params[:4]) + (" ..." if w.n_mismatch_params > 4 else "")
            self._rw = SignalFinding("replica_weights", int(w.hash_step), None, (
                f"weights differ across data-parallel replicas at the hash step {w.hash_step}: rank(s) "
                f"{', '.join(str(r) for r in w.mismatch_ranks) or '?'} outside the majority, {w.n_mismatch_params} "
                f"parameter(s) ({names}); what to do: stop, check that rank's device, resume from a checkpoint "
                f"before it ({RUNBOOK}#signal-replica-weights)"))

    def _see_router(self, step: int, r: Any) -> None:
        if self._router is not None:
            return
        over = {k: v for k, v in r.imbalance.items() if v > ROUTER_COLLAPSE}
        dead = {k: v for k, v in r.dead.items() if v}
        if not (over or dead):
            return
        layer = max(over, key=lambda k: over[k]) if over else max(dead, key=lambda k: len(dead[k]))
        what = (f"the busiest expert got {over[layer]:.3g}x the mean tokens per expert (above {ROUTER_COLLAPSE})"
                if over else f"experts {dead[layer]} got no token for router.dead_after sampled steps")
        others = sorted((set(over) | set(dead)) - {layer})
        self._router = SignalFinding("router_collapse", step, layer, (
            f"MoE layer {layer}: {what} at step {step}" + (f" (also layers {', '.join(others)})" if others else "")
            + "; what to do: fix the load balancing (auxiliary-loss coefficient, the balancing bias update, the "
            f"router's learning rate) and restart from before the collapse ({RUNBOOK}#signal-router-collapse)"))

    def _see_optimizer_signals(self, step: int, o: Any) -> None:
        self._adam.append((_f(o.update_rms), _f(o.spike_fraction)))
        if step < ADAM_MIN_STEP or len(self._adam) < WINDOW:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            rms, frac = np.nanmedian(np.asarray(self._adam, dtype=np.float64), axis=0)
        if not (rms > UPDATE_RMS_MAX or frac > SPIKE_FRACTION_MAX):
            return
        if self._excursion is None:
            lay = {k: _f(v) for k, v in dict(o.layer_update_rms).items()}
            worst = max((k for k in lay if math.isfinite(lay[k])), key=lay.__getitem__, default=None)
            self._excursion = [step, worst, float(rms), float(frac), lay.get(worst, math.nan), 1]
        else:
            self._excursion[5] += 1

    # ---------------------------------------------------------------- rules
    def _excursion_finding(self) -> list[SignalFinding]:
        if self._excursion is None:
            return []
        step, worst, rms, frac, wv, held = self._excursion
        where = f"; largest in layer {worst} ({wv:.4g})" if worst is not None else ""
        return [SignalFinding("adam_excursion", step, worst, (
            f"Adam's second moment stopped tracking the gradient at step {step}: median of the last {WINDOW} sampled "
            f"steps' update RMS {rms:.4g} (healthy ~1, limit {UPDATE_RMS_MAX:g}) and spike fraction {100 * frac:.3g}% "
            f"(limit {100 * SPIKE_FRACTION_MAX:g}%){where}; held on {held} sampled step(s); what to do: lower the "
            f"learning rate or lengthen warm-up, lower beta2 (e.g. 0.95), enable gradient clipping; one layer only: "
            f"check its initialisation / normalisation ({RUNBOOK}#signal-adam-excursion)"))]

    def _rise_findings(self) -> list[SignalFinding]:
        out = []
        for key, (step, layer, ratio, before, after, held) in self._rises.items():
            kind, what, todo = RISES[key]
            where = "over the model" if layer is None else f"in layer {layer}"
            out.append(SignalFinding(kind, step, layer, (
                f"{what} rose {ratio:.3g}x {where} ({before:.4g} -> {after:.4g}, medians of the {WINDOW} sampled "
                f"steps before and of the last {WINDOW} up to step {step}; the rule held on {held} sampled step(s)); "
                f"what to do: {todo} ({RUNBOOK}#signal-{kind.replace('_', '-')})")))
        return out

    def _noise_finding(self) -> list[SignalFinding]:
        if not self._noise:
            return []
        win = list(self._noise)
        b = float(np.median([x[1] for x in win]))
        batch = win[-1][2]
        if not (math.isfinite(b) and math.isfinite(batch) and batch > 0):
            return []
        ratio = b / batch
        what = (f"gradient noise scale B_simple ~ {b:.4g} samples (median of the last {len(win)} estimates) vs a batch "
                f"of {batch:.4g}")
        if ratio >= NOISE_FACTOR:
            todo = (f"larger batches would be efficient: up to ~{b:.4g} samples per step cost few extra samples "
                    "for many fewer steps (raise the batch or the accumulation steps, and the learning rate with it)")
        elif ratio <= 1 / NOISE_FACTOR:
            todo = ("the batch is past the critical batch size: extra samples per step buy little progress; a smaller "
                    "batch (more steps for the same samples) would use the compute better")
        else:
            return []
        return [SignalFinding("noise_scale", int(win[0][0]), None,
                              f"{what} ({ratio:.3g}x); what to do: {todo} ({RUNBOOK}#signal-noise-scale)")]

    def _underflow(self) -> list[SignalFinding]:
        m = self._m.get(("grad_histogram", "underflow_ratio"))
        if m is None or not m.names or not m.recent:
            return []
        win = m.window(WINDOW)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN column: a layer absent lately
            med = np.nanmedian(win, axis=0)
        hit = np.flatnonzero(np.nan_to_num(med, nan=-1.0) >= UNDERFLOW_RATIO)
        if not hit.size:
            return []
        worst = int(hit[np.argmax(med[hit])])
        layer = m.names[worst]
        info = self._info.get("grad_histogram", {})
        dtype = info.get("dtype", "?")
        tiny = info.get("tiny", math.nan)
        step = self._under_first.get(layer, m.recent[-len(win)][0])
        if dtype == "fp16":
            todo = ("use dynamic loss scaling or raise the loss scale (DeepSpeed fp16.initial_scale_power, "
                    "torch.amp.GradScaler(init_scale=...)) so the scaled gradients sit above 2^-14, or train in bf16")
        else:
            todo = ("gradients this small are vanishing, not a precision choice: check that layer's initialisation, "
                    "normalisation and the activations feeding it; scaling the loss up only hides it")
        kept = (" (subnormal: kept with reduced precision, not lost; the elements lost to exact zeros are the "
                "lost_to_underflow finding's)" if self._lost else "")
        detail = (f"{100 * med[worst]:.1f}% of layer {layer}'s gradient elements underflow {dtype}{kept} "
                  f"(0 < |g| < {tiny:.3g}; median of the last {len(win)} sampled steps, at or above "
                  f"{100 * UNDERFLOW_RATIO:g}% since step {step}); {hit.size} layer(s) at or above "
                  f"{100 * UNDERFLOW_RATIO:g}%; what to do: {todo} ({RUNBOOK}#signal-underflow)")
        return [SignalFinding("underflow", int(step), layer, detail)]

    def _lost_finding(self) -> list[SignalFinding]:
        if not self._lost:
            return []
        names = sorted({k for _, lost, _ in self._lost for k in lost})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN column: a layer absent lately
            med = np.nanmedian(np.array([[lost.get(k, math.nan) for k in names] for _, lost, _ in self._lost]), axis=0)
        hit = [i for i in np.argsort(-np.nan_to_num(med, nan=-1.0), kind="stable") if med[i] >= UNDERFLOW_RATIO]
        if not hit:
            return []
        worst = [names[i] for i in hit[:LOST_NAMED]]
        scale = self._lost[-1][2]
        step = self._lost_first.get(worst[0], self._lost[0][0])
        if scale == 1.0:
            todo = ("no loss scaling is applied: use dynamic loss scaling (torch.amp.GradScaler, DeepSpeed fp16 "
                    "loss_scale 0) or train in bf16")
        else:
            todo = (f"the loss scale ({scale:.4g}) is too low for these layers: raise the scaler's initial scale / "
                    "floor (GradScaler(init_scale=...), DeepSpeed fp16.initial_scale_power / min_loss_scale), check "
                    "that it is not stuck at its minimum after overflows, or train in bf16")
        lay = ", ".join(f"{k} ({100 * med[names.index(k)]:.1f}%)" for k in worst)
        detail = (f"gradient elements lost to underflow (non-zero in a float32 recomputation, exactly zero in the "
                  f"training precision), median of the last {len(self._lost)} recomputation(s): layer(s) {lay}; "
                  f"{len(hit)} layer(s) at or above {100 * UNDERFLOW_RATIO:g}% since step {step}; their gradient is "
                  f"lost, not genuinely zero; what to do: {todo} ({RUNBOOK}#signal-lost-to-underflow)")
        return [SignalFinding("lost_to_underflow", int(step), worst[0], detail)]

    def result(self) -> SignalsReport:
        """The :class:`SignalsReport` of the records added so far."""
        rep = SignalsReport(info={k: dict(v) for k, v in self._info.items()})
        for fld, metrics in SPECS.items():
            for metric, label, log, _ in metrics:
                m = self._m.get((fld, metric))
                if m is None:
                    continue
                rep.series.append(SignalSeries(fld, metric, label, log, m.glob.result() if m.glob else None,
                                               list(m.names), m.lay.result() if m.lay else None))
        rep.findings = (self._lost_finding() + self._underflow() + self._noise_finding() + self._excursion_finding()
                        + self._rise_findings()
                        + [f for f in (self._dup, self._rw, self._router) if f is not None])
        rep.findings.sort(key=lambda f: f.step)
        return rep


def summary_lines(rep: SignalsReport | None) -> list[str]:
    """The summary's ``FINDINGS`` block and the last value of each signal (empty when the run
    has no signal)."""
    if rep is None or not (rep.series or rep.findings):
        return []
    out = ["signals (last sampled value, global):"] if rep.series else []
    for s in rep.series:
        if s.glob is not None and s.glob.last.size:
            v = float(s.glob.last[-1, 0])
            out.append(f"  {TITLES.get(s.signal, s.signal)}: {s.metric} = {v:.6g}")
    if out:
        out.append("")
    if rep.findings:
        out.append(f"FINDINGS ({len(rep.findings)}; advice, not problems):")
        out += [f"  - step {f.step}: {f.detail}" for f in rep.findings]
    else:
        out.append("FINDINGS: none (signals within their rules)")
    return out


def render(rep: SignalsReport | None, subplots: Callable[..., tuple[Any, Any]],
           top: int = 5) -> list[tuple[str, str, Any]]:
    """One figure per signal: a panel per metric with the global value and the ``top`` layers of
    largest value. Returns ``[(file name, caption, figure)]``."""
    if rep is None:
        return []
    out = []
    for sig in rep.signals():
        series = [s for s in rep.series if s.signal == sig]
        fig, axes = subplots(len(series), 1, figsize=(11, 2.6 * len(series) + 0.8), sharex=True, squeeze=False)
        for ax, s in zip(axes[:, 0], series):
            batch = rep.info.get("noise_scale", {}).get("batch") if s.metric == "noise_scale" else None
            _panel(ax, s, top, batch)
        axes[-1, 0].set_xlabel("optimizer step")
        fig.suptitle(TITLES.get(sig, sig))
        fig.tight_layout(rect=(0, 0, 1, 0.98))
        out.append((f"signal_{sig}.png", f"{TITLES.get(sig, sig)} over steps: global (black, band = min..max per "
                    f"bucket) and the {top} layers of largest value.", fig))
    return out


def _panel(ax: Any, s: SignalSeries, top: int, batch: float | None = None) -> None:
    if s.per_layer is not None and s.layers:
        d = s.per_layer
        with np.errstate(all="ignore"):
            peak = np.where(np.isfinite(d.max), d.max, -np.inf).max(axis=0)
        for j in [int(j) for j in np.argsort(-peak)[:top] if np.isfinite(peak[j])]:
            ax.plot(d.x, d.last[:, j], linewidth=0.8, label=s.layers[j], color=f"C{j % 10}")  # a layer keeps its colour
    if s.glob is not None:
        g = s.glob
        if g.width > 1:
            ax.fill_between(g.x, g.min[:, 0], g.max[:, 0], color="black", alpha=0.15, linewidth=0)
        ax.plot(g.x, g.last[:, 0], color="black", linewidth=1.2, label="global")
    if batch is not None and math.isfinite(batch):
        ax.axhline(batch, color="tab:red", linestyle="--", linewidth=0.9, label=f"batch {batch:.4g}")
    if s.log and s.glob is not None and (np.nan_to_num(s.glob.min, nan=1.0) > 0).all():
        ax.set_yscale("log")
    ax.set_ylabel(s.metric, fontsize=8)
    ax.set_title(s.label, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=7)
