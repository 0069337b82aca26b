"""The record of one sampled optimizer step: what every sink (Prometheus, JSONL, TensorBoard)
and every diagnostic (detectors, flight recorder, report) consumes.

A :class:`StepRecord` is built on every rank after the cross-rank reduction, from host-side
numpy arrays (the one device-to-host copy of the step). It holds per-parameter *sufficient
statistics* (sums, sums of squares, counts, extrema) from which every exported statistic is
derived exactly, and which can be re-aggregated exactly over groups of parameters
(norms by root-sum-square, counts summed, max of max).

What distgrad derives beyond the statistics is held in typed parts, one per diagnostic
(:class:`Spikes`, :class:`Health`, :class:`Clip`, :class:`Aggregates`, :class:`ScalerState`,
:class:`Provenance` / :class:`NonfiniteEvent`); a part is None when its diagnostic did not run
or does not apply (e.g. :attr:`StepRecord.scaler` under bf16).

JSON form (:meth:`StepRecord.to_dict`): columnar per-parameter arrays, floats written by
Python's :mod:`json` (non-finite values as the ``NaN`` / ``Infinity`` literals that Python,
pandas and JavaScript's JSON5 read; :meth:`StepRecord.from_dict` reverses it exactly, the parts
validated and built by pydantic from the dataclasses' own annotations: a new part needs its
dataclass and its annotated :class:`StepRecord` field, no registration).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distgrad.record.base import PLUGIN_PARTS, _Part, adapter

#: Sufficient statistics kept per parameter, all float64 numpy arrays of shape ``[P]``.
STAT_FIELDS = ("numel", "sum", "sumsq", "nan", "inf", "zeros", "min", "max")


@dataclass
class ParamStats:
    """Per-parameter gradient statistics of one step, combined over all ranks.

    Every array has shape ``[P]`` (P = number of trainable parameter tensors, in the order of
    ``names``) and dtype float64. Counts (``numel``, ``nan``, ``inf``, ``zeros``) are exact
    integers stored as float64 (exact up to 2**53 elements).

    Semantics follow ``torch`` on the full, unsharded gradient: ``min``/``max`` are NaN when
    the parameter holds a NaN (as ``torch.amin``/``amax``), ``sum``/``sumsq`` are NaN or Inf
    when elements are.
    """

    names: list[str]
    numel: np.ndarray
    sum: np.ndarray
    sumsq: np.ndarray
    nan: np.ndarray
    inf: np.ndarray
    zeros: np.ndarray
    min: np.ndarray
    max: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.names)
        for f in STAT_FIELDS:
            a = np.asarray(getattr(self, f), dtype=np.float64)
            if a.shape != (n,):
                raise ValueError(f"ParamStats.{f} has shape {a.shape}, expected ({n},)")
            setattr(self, f, a)

    # Derived statistics. Source: the textbook moment formulas
    # mean = S1/n, population variance = S2/n - mean^2 (correction=0, as torch.std(correction=0)),
    # evaluated in float64 from float64 sums so that cancellation stays below 1e-9 relative for
    # gradients whose std is not many orders of magnitude below their mean.
    @property
    def norm(self) -> np.ndarray:
        """L2 norm per parameter, ``sqrt(sum g^2)``; NaN/Inf when the gradient holds NaN/Inf."""
        return np.sqrt(self.sumsq)

    @property
    def mean(self) -> np.ndarray:
        """Arithmetic mean per parameter (NaN for a parameter with no elements)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.sum / self.numel

    @property
    def std(self) -> np.ndarray:
        """Population standard deviation (correction=0) per parameter."""
        with np.errstate(invalid="ignore", divide="ignore"):
            m = self.sum / self.numel
            var = self.sumsq / self.numel - m * m
        return np.sqrt(np.maximum(var, 0.0, where=~np.isnan(var), out=var.copy()))

    @property
    def abs_max(self) -> np.ndarray:
        """``max |g|`` per parameter (NaN when the gradient holds a NaN)."""
        return np.maximum(np.abs(self.min), np.abs(self.max))

    @property
    def zero_ratio(self) -> np.ndarray:
        """Fraction of elements exactly equal to 0, in [0, 1]."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.zeros / self.numel

    @property
    def nonfinite(self) -> np.ndarray:
        """NaN plus +/-Inf element count per parameter."""
        return self.nan + self.inf

    def index(self, name: str) -> int:
        """Position of parameter ``name``; raises KeyError if it is not tracked."""
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(name) from None

    def to_dict(self) -> dict[str, Any]:
        """Columnar JSON-serialisable form: ``{"names": [...], "<field>": [P floats], ...}``."""
        d: dict[str, Any] = {"names": list(self.names)}
        for f in STAT_FIELDS:
            d[f] = getattr(self, f).tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamStats:
        """Inverse of :meth:`to_dict`; raises KeyError / ValueError on a malformed dict."""
        return cls(names=list(d["names"]), **{f: np.asarray(d[f], dtype=np.float64) for f in STAT_FIELDS})



# --------------------------------------------------------------------------------------------
# Typed parts written by the diagnostics
# --------------------------------------------------------------------------------------------


@dataclass
class Spikes(_Part):
    """Online spike detectors on the scalar series (``"grad_norm"``, ``"loss"``).

    Attributes:
        flagged: series judged a spike on this step by at least one detector, in the order
            grad_norm, loss (empty on most steps).
        zscore: ``{series: {detector: z}}``, the z-score of this step's value against each
            detector's statistics before it (dimensionless; NaN during warm-up, for a
            non-finite or missing value, and on an fp16 overflow step); detectors are
            :data:`distgrad.diagnostics.detectors.DETECTOR_LABELS`. ``distgrad_<series>_zscore``.
        total: ``{series: {detector: count}}``, spikes since the start of the run (carried
            over a checkpoint restore), ``distgrad_<series>_spikes_total``.
        fired: ``{series: [detector, ...]}``: which detectors judged this step's value of
            each flagged series a spike (the record of a spike names detector and series).
    """

    flagged: list[str] = field(default_factory=list)
    zscore: dict[str, dict[str, float]] = field(default_factory=dict)
    total: dict[str, dict[str, int]] = field(default_factory=dict)
    fired: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class Health(_Part):
    """Vanishing / exploding gradients per parameter (:class:`distgrad.diagnostics.health.LayerHealth`).

    Attributes:
        n_vanishing: parameters flagged vanishing (norm below ``vanish_threshold`` for
            ``health_patience`` sampled steps), exact count, ``distgrad_vanishing_params``.
        n_exploding: parameters flagged exploding, exact count, ``distgrad_exploding_params``.
        vanishing: names of the flagged vanishing parameters, in parameter order, at most 20.
        exploding: names of the flagged exploding parameters, at most 20.
        n_no_grad: trainable parameters that received no gradient at all on this step (the
            engine left ``.grad`` None on every rank: a detached branch, an unused module
            under DDP ``find_unused_parameters=True``, FSDP2, FSDP1 when its whole unit got
            none), exact count, ``distgrad_params_without_grad``. They are fed to the vanishing
            test with norm 0, like the exact zeros other engines write for the same bug
            (DeepSpeed ZeRO 0-3; FSDP1 units with used parameters; see docs/engines.md).
        no_grad: their names, in parameter order, at most 20.
    """

    n_vanishing: int = 0
    n_exploding: int = 0
    vanishing: list[str] = field(default_factory=list)
    exploding: list[str] = field(default_factory=list)
    n_no_grad: int = 0
    no_grad: list[str] = field(default_factory=list)


@dataclass
class Clip(_Part):
    """Global-norm gradient clipping (present when a clipping threshold is known).

    Attributes:
        max_norm: the clipping threshold (gradient-norm units).
        ratio: ``min(1, max_norm / (grad_norm + 1e-6))``, the factor clipping multiplies the
            gradient by (dimensionless, in (0, 1]), ``distgrad_clip_ratio``.
        post_clip_norm: the global norm after clipping, ``grad_norm * ratio``,
            ``distgrad_post_clip_norm``.
    """

    max_norm: float | None = None
    ratio: float = float("nan")
    post_clip_norm: float = float("nan")


@dataclass
class Aggregates(_Part):
    """Per-layer and per-module-kind aggregates and the per-parameter series selection.

    Layers are the keys of :func:`distgrad.naming.grouping.group_keys` (``"layer"``), module kinds
    :func:`distgrad.naming.classify.classify`'s ``module_kind`` (``"<kind>/lora_<A|B>"`` for adapters).

    Attributes:
        layer_norm: ``{layer: root-sum-square of its parameters' gradient norms}``.
        layer_nonfinite: ``{layer: NaN + Inf gradient elements}`` (float, an exact count).
        layer_zero_ratio: ``{layer: fraction of exactly-zero gradient elements}``, in [0, 1].
        layer_headroom: ``{layer: max over its parameters of max|g| / largest finite value of
            the gradient dtype}`` (NaN when unknown).
        module_kind_norm: ``{module kind: root-sum-square gradient norm}``.
        exported_params: indices into ``params.names`` that get per-parameter series this step
            (the series budget); None means all, ``[]`` none (``per_param`` off).
    """

    layer_norm: dict[str, float] = field(default_factory=dict)
    layer_nonfinite: dict[str, float] = field(default_factory=dict)
    layer_zero_ratio: dict[str, float] = field(default_factory=dict)
    layer_headroom: dict[str, float] = field(default_factory=dict)
    module_kind_norm: dict[str, float] = field(default_factory=dict)
    exported_params: list[int] | None = None


@dataclass
class ScalerState(_Part):
    """fp16 dynamic loss-scaler state (the record's ``scaler`` is None without a scaler).

    Attributes:
        consecutive_overflow_steps: current streak of optimizer steps (sampled or not) the
            scaler skipped for overflow, ``distgrad_consecutive_overflow_steps``.
        loss_scale_at_minimum: the loss scale sits at the scaler's floor (further overflows
            cannot lower it), ``distgrad_loss_scale_at_minimum``.
        loss_scale_drop_factor: the largest loss scale of an applied step within the last
            ``loss_scale.collapse_window`` optimizer steps (else the last one seen) over this
            step's loss scale (>= 1; None before any step was applied),
            ``distgrad_loss_scale_drop_factor`` (see :mod:`distgrad.diagnostics.loss_scale`).
        loss_scale_collapsed: ``loss_scale_drop_factor >= loss_scale.collapse_factor``: the
            scale collapsed (no configured minimum needed), ``distgrad_loss_scale_collapsed``.
    """

    consecutive_overflow_steps: int = 0
    loss_scale_at_minimum: bool = False
    loss_scale_drop_factor: float | None = None
    loss_scale_collapsed: bool = False


@dataclass
class UnsampledNonfinite(_Part):
    """Non-finite values on optimizer steps the instrument did not sample, reported by the next
    sampled step (without per-parameter detail; ``interval: 1`` gives it).

    Attributes:
        grad: optimizer steps since the last sampled step whose reduced gradient held NaN/Inf
            (``distgrad_nonfinite_unsampled_steps_total`` counts them).
        loss: optimizer steps whose training loss was NaN/Inf
            (``distgrad_nonfinite_loss_steps_total``).
    """

    grad: list[int] = field(default_factory=list)
    loss: list[int] = field(default_factory=list)


@dataclass
class Culprit(_Part):
    """A culprit rank of a step: its own contribution was NaN/Inf before the cross-rank
    reduction (:mod:`distgrad.diagnostics.culprit`).

    Attributes:
        rank: the rank (in the instrument's process group).
        loss: the loss it observed since the last boundary was NaN/Inf.
        grad: a gradient its backward produced was NaN/Inf before the reduction (the local
            gradient check, every engine; see :mod:`distgrad.diagnostics.culprit`).
    """

    rank: int
    loss: bool = False
    grad: bool = False


@dataclass
class RankCount(_Part):
    """Non-finite gradient elements of one parameter in one rank's local shard."""

    param: str
    rank: int
    nan: int
    inf: int
    count: int  #: nan + inf


@dataclass
class ParamProvenance(_Part):
    """Non-finite elements of one parameter, summed over ranks (a :class:`Provenance` row).

    Attributes:
        name: parameter name; nan, inf: element counts summed over ranks;
        ranks: ranks whose local shard held any, ascending.
    """

    name: str
    nan: int
    inf: int
    ranks: list[int] = field(default_factory=list)


@dataclass
class Provenance(_Part):
    """Where a non-finite step's NaN/Inf are (:func:`distgrad.diagnostics.flight_recorder.provenance_from`).

    Attributes:
        step: the optimizer step.
        params: the non-finite parameters in forward order.
        first_param: the non-finite parameter last in forward order (where the backward pass met
            the NaN first: the origin of a NaN made in the backward pass, not of one made in the
            forward pass; :mod:`distgrad.diagnostics.flight_recorder`); None when no parameter row.
        first_layer: layer of ``first_param`` (None with it).
    """

    step: int
    params: list[ParamProvenance] = field(default_factory=list)
    first_param: str | None = None
    first_layer: str | None = None


@dataclass
class NonfiniteEvent(_Part):
    """The current non-finite event: a streak of consecutive non-finite sampled steps,
    described by its first step (later steps of the streak show it spreading).

    Attributes:
        step: first step of the streak; rows: its per-rank counts of the reduced gradient's
        shards (at most 20, the shard view); provenance: its :class:`Provenance`;
        culprits: the ranks whose own contribution was non-finite before the reduction on
        that step (:class:`Culprit`, the culprit view); culprit_module: its forward replay
        (:class:`~distgrad.record.culprit.CulpritModule`), None when not replayed.
    """

    step: int
    rows: list[RankCount] = field(default_factory=list)
    provenance: Provenance | None = None
    culprits: list[Culprit] = field(default_factory=list)
    culprit_module: CulpritModule | None = None


@functools.lru_cache(maxsize=1)
def _part_fields() -> dict[str, Any]:
    """:class:`StepRecord` field -> its annotation, for the fields that hold parts (a part,
    ``Part | None``, ``list[Part]``...), read from the dataclass's type hints."""

    def holds_part(tp: Any) -> bool:
        return (isinstance(tp, type) and issubclass(tp, _Part)) or any(holds_part(a) for a in typing.get_args(tp))

    hints = typing.get_type_hints(StepRecord)
    return {f.name: hints[f.name] for f in dataclasses.fields(StepRecord) if holds_part(hints[f.name])}


@dataclass
class StepRecord:
    """Everything distgrad knows about one sampled optimizer step.

    Attributes:
        step: optimizer step index, counting every gradient-accumulation boundary reached
            before this one (skipped fp16 steps included), i.e. DeepSpeed's ``global_steps``
            at the time the gradients were read. 0-based.
        micro_step: micro-batches (forward/backward passes) processed since ``instrument()`` up to
            this boundary, this step's included: ``g * (step + 1)`` with ``g`` micro-batches per
            step, under every engine and integration.
        timestamp: Unix time in seconds when the statistics became available.
        world_size: number of ranks whose shards were combined.
        params: per-parameter statistics (see :class:`ParamStats`).
        grad_norm: global L2 norm ``sqrt(sum over params of sumsq)``; NaN/Inf if any element is.
        loss: training loss averaged over ranks and the micro-batches of this step, or None
            when no loss was observed.
        loss_scale: fp16 dynamic loss scale in force for this step's backward (None under
            bf16/fp32, where no loss-scale wording appears anywhere).
        overflow: True if the engine detected an fp16 overflow and skipped this step; None
            when the engine has no scaler.
        step_applied: False if the optimizer skipped the update.
        counters: monotonically increasing counts since ``instrument()`` (carried over a
            checkpoint restore): ``nonfinite_steps``, ``overflow_steps``, ``skipped_steps``,
            ``replica_mismatch``, ``internal_errors``, ``sampled_steps``, ``samples``.
        replica_mismatch_ranks: ranks whose replicated gradient fingerprint disagreed with the
            majority on this step (empty when consistent or not replicated).
        nonfinite_ranks: the shard view: ranks whose shard of the *reduced* gradient (their
            1/W slice on replicated engines) held NaN/Inf on this step; after an all-reduce
            that says where the NaN landed, not where it came from (see ``culprits``).
        culprits: the culprit view: one :class:`Culprit` per rank whose own contribution was
            NaN/Inf before the reduction (its observed loss; a gradient its backward produced,
            on engines with the local gradient check), in rank order; empty when none was
            (see :mod:`distgrad.diagnostics.culprit`).
        grad_dtype: dtype of the gradients read (``"fp32"``, ``"bf16"``, ``"fp16"``, ...).
        grad_scale: factor the engine's gradients were divided by to give ``params`` (the fp16
            loss scale where the engine reads scaled gradients, else 1.0).
        headroom: per parameter, shape ``[P]``, ``max|g| * grad_scale / finfo(grad_dtype).max``
            (dimensionless; near 1 = about to overflow the gradient dtype; NaN when non-finite).
        replica_mismatch_rank: first rank of the last replica mismatch of the run, -1 if none
            yet; None when the replica check is off or does not apply.
        update_ratio: ``{param: ||w_after - w_before|| / ||w_before||}`` of this step (0 for a
            skipped step); None unless the ``update_ratio`` option is on.
        scaler: fp16 loss-scaler state, None without a scaler.
        nonfinite_params: per-rank non-finite counts (one row per rank and parameter holding
            any), on non-finite steps only.
        spikes, health, clip, aggregates: the diagnostics' typed parts (None when that
            diagnostic did not run).
        provenance: where this step's NaN/Inf are (non-finite steps only).
        nonfinite_event: the first step of the current non-finite streak (non-finite steps only).
        flight_recorder_report: path of the flight-recorder dump written on this step.
        unsampled_nonfinite: non-finite gradients/losses on the unsampled steps since the last
            sampled one (see :class:`UnsampledNonfinite`), None when there were none.
        ranks: each rank's loss and step time (:class:`RankStats`), None when not computed.
        loss_spike_report: path of the loss-spike report this rank wrote on this step (only on
            the rank whose batch had the highest loss; see :mod:`distgrad.loss.tracker`).
        loss_components: :class:`LossComponents`, None unless the loop passes components.
        token_loss: :class:`TokenLossStats`, None unless the loop passes per-token losses.
        loss_trend: :class:`LossTrend`, None before the first observed loss.
        action: :class:`~distgrad.record.action.ActionPart` with an opt-in action configured, else None.
        culprit_module: the first step of a non-finite streak replayed: the module whose forward
            output first went NaN/Inf on the culprit rank, or why none is named
            (:class:`~distgrad.record.culprit.CulpritModule`, :mod:`distgrad.diagnostics.replay`).
        incidents: the detection policy's state (:class:`~distgrad.record.incidents.Incidents`: incidents
            opened so far, the one opened on this step), None when ``incidents.enabled`` is false.

    The parts declared by plug-ins (a packed signal's or a diagnostic's nested ``Part``,
    :mod:`distgrad.config.contract`; :data:`~distgrad.record.base.PLUGIN_PARTS`) are attributes
    too, None when unset: ``grad_histogram`` (the per-layer distribution of gradient values,
    :mod:`distgrad.signals.histogram`), ``optimizer_signals`` (Adam-family signals,
    :mod:`distgrad.signals.adam`; None when off, on the first optimizer step and on overflow
    steps), ``logits`` (the logit precursors, :mod:`distgrad.signals.logits`; None unless
    ``logits.attention`` / ``logits.output`` and observed on every rank), ``noise_scale``
    (:mod:`distgrad.signals.noise_scale`), ``curvature`` (:mod:`distgrad.signals.curvature`),
    ``duplicate_data`` and ``replica_weights``
    (:mod:`distgrad.signals.duplicate_data`, :mod:`distgrad.signals.weight_hash`).
    """

    step: int
    micro_step: int
    timestamp: float
    world_size: int
    params: ParamStats
    grad_norm: float
    loss: float | None = None
    loss_scale: float | None = None
    overflow: bool | None = None
    step_applied: bool = True
    counters: dict[str, int] = field(default_factory=dict)
    replica_mismatch_ranks: list[int] = field(default_factory=list)
    nonfinite_ranks: list[int] = field(default_factory=list)
    culprits: list[Culprit] = field(default_factory=list)
    grad_dtype: str | None = None
    grad_scale: float | None = None
    headroom: list[float] | None = None
    replica_mismatch_rank: int | None = None
    update_ratio: dict[str, float] | None = None
    scaler: ScalerState | None = None
    nonfinite_params: list[RankCount] | None = None
    spikes: Spikes | None = None
    health: Health | None = None
    clip: Clip | None = None
    aggregates: Aggregates | None = None
    provenance: Provenance | None = None
    nonfinite_event: NonfiniteEvent | None = None
    flight_recorder_report: str | None = None
    unsampled_nonfinite: UnsampledNonfinite | None = None
    ranks: RankStats | None = None
    loss_spike_report: str | None = None
    loss_components: LossComponents | None = None
    token_loss: TokenLossStats | None = None
    loss_trend: LossTrend | None = None
    action: ActionPart | None = None
    culprit_module: CulpritModule | None = None
    incidents: Incidents | None = None

    @property
    def nonfinite(self) -> bool:
        """True if any gradient element of the step was NaN or +/-Inf."""
        return bool(self.params.nonfinite.sum() > 0) or not np.isfinite(self.grad_norm)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (columnar per-parameter arrays, parts as dicts, absent parts
        as None); inverse of :meth:`from_dict`."""
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (_Part, ParamStats)):
                v = v.to_dict()
            elif isinstance(v, list) and v and isinstance(v[0], _Part):
                v = [x.to_dict() for x in v]
            d[f.name] = v
        for name in PLUGIN_PARTS:  # the plug-ins' parts (distgrad.signals), after the fields
            v = self.__dict__.get(name)
            d[name] = None if v is None else v.to_dict()
        return d

    def __getattr__(self, name: str) -> Any:
        """A plug-in's record part (a signal's ``Part``, :mod:`distgrad.signals`) that was not
        set on this record: None. Raises AttributeError for any other unknown name."""
        if name in PLUGIN_PARTS:
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        """Inverse of :meth:`to_dict` (unknown keys, e.g. a sink's ``schema``, are ignored).

        Raises:
            KeyError / TypeError / ValueError: on a malformed dict (a malformed part:
                pydantic.ValidationError, a ValueError naming the field).
        """
        kw = dict(d)
        kw["params"] = ParamStats.from_dict(d["params"])
        for k, tp in _part_fields().items():  # the parts: validated and built by pydantic
            if kw.get(k) is not None:
                kw[k] = adapter(tp).validate_python(kw[k])
        names = {f.name for f in dataclasses.fields(cls)}
        rec = cls(**{k: v for k, v in kw.items() if k in names})
        for k, tp in PLUGIN_PARTS.items():  # the plug-ins' parts, by their registered classes
            if d.get(k) is not None:
                # a class object is hashable (type.__hash__); mypy applies the part dataclass's
                # instance-level __hash__ = None to type[_Part] and rejects it as the cache's key
                setattr(rec, k, adapter(tp).validate_python(d[k]))  # type: ignore[arg-type]
        return rec


# the parts defined in their own modules; StepRecord's annotations name them, and
# _part_fields() resolves those names on first use
from distgrad.record.action import ActionPart  # noqa: E402,F401
from distgrad.record.culprit import CulpritModule  # noqa: E402,F401
from distgrad.record.incidents import Incidents  # noqa: E402,F401
from distgrad.record.loss import LossComponents, LossTrend, RankStats, TokenLossStats  # noqa: E402,F401
