"""The record of one sampled optimizer step: what every sink (Prometheus, JSONL, TensorBoard)
and every diagnostic (detectors, flight recorder, report) consumes.

A :class:`StepRecord` is built on every rank after the cross-rank reduction, from host-side
numpy arrays (the one device-to-host copy of the step). It holds per-parameter *sufficient
statistics* (sums, sums of squares, counts, extrema) from which every exported statistic is
derived exactly, and which can be re-aggregated exactly over groups of parameters
(norms by root-sum-square, counts summed, max of max).

JSON form (:meth:`StepRecord.to_dict`): columnar per-parameter arrays, floats written by
Python's :mod:`json` (non-finite values as the ``NaN`` / ``Infinity`` literals that Python,
pandas and JavaScript's JSON5 read; :meth:`StepRecord.from_dict` reverses it exactly).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
    def from_dict(cls, d: dict[str, Any]) -> "ParamStats":
        """Inverse of :meth:`to_dict`; raises KeyError / ValueError on a malformed dict."""
        return cls(names=list(d["names"]), **{f: np.asarray(d[f], dtype=np.float64) for f in STAT_FIELDS})


@dataclass
class StepRecord:
    """Everything distgrad knows about one sampled optimizer step.

    Attributes:
        step: optimizer step index, counting every gradient-accumulation boundary reached
            before this one (skipped fp16 steps included), i.e. DeepSpeed's ``global_steps``
            at the time the gradients were read. 0-based.
        micro_step: micro-batches processed before this boundary (DeepSpeed ``micro_steps``).
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
        counters: monotonically increasing counts since ``instrument()``:
            ``nonfinite_steps``, ``overflow_steps``, ``skipped_steps``,
            ``replica_mismatch``, ``internal_errors``, ``sampled_steps``.
        replica_mismatch_ranks: ranks whose replicated gradient fingerprint disagreed with the
            majority on this step (empty when consistent or not replicated).
        nonfinite_ranks: ranks whose local shards held NaN/Inf on this step.
        extra: diagnostics attached by later stages (detector z-scores, spikes, layer health,
            provenance, clip ratio, ...), JSON-serialisable.
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
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nonfinite(self) -> bool:
        """True if any gradient element of the step was NaN or +/-Inf."""
        return bool(self.params.nonfinite.sum() > 0) or not np.isfinite(self.grad_norm)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (columnar per-parameter arrays); inverse of :meth:`from_dict`."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "params"}
        d["params"] = self.params.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepRecord":
        """Inverse of :meth:`to_dict` (unknown keys, e.g. a sink's ``schema``, are ignored)."""
        kw = dict(d)
        kw["params"] = ParamStats.from_dict(d["params"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in kw.items() if k in names})
