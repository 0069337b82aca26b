"""Per-parameter gradient health, gradient-clipping ratio and update-to-weight ratio.

Host-side, single-process and deterministic; nothing here calls ``torch.distributed``.

* :class:`LayerHealth` -- flags parameters whose gradient norm stays below a vanishing
  threshold or above an exploding threshold for ``patience`` consecutive sampled steps
  (``distgrad_vanishing_params`` / ``distgrad_exploding_params``). The persistence rule is the
  classic "vanishing / exploding gradients" diagnostic (Bengio, Simard, Frasconi 1994; Pascanu,
  Mikolov, Bengio 2013, "On the difficulty of training recurrent neural networks") applied per
  parameter tensor, with a patience counter as in early-stopping / ``ReduceLROnPlateau``.
* :func:`clip_ratio` / :func:`post_clip_norm` -- the scale factor applied by global-norm
  clipping (Pascanu et al. 2013; ``torch.nn.utils.clip_grad_norm_``; DeepSpeed's
  ``gradient_clipping``), ``distgrad_clip_ratio``.
* :class:`UpdateRatioTracker` -- the update-to-weight ratio ``||w_after - w_before|| /
  ||w_before||`` per parameter tensor (Karpathy's "update/data ratio" heuristic, CS231n notes
  "ratio of weights:updates"; You, Gitman, Ginsburg 2017, LARS, for the per-layer trust-ratio
  view), ``distgrad_param_update_ratio``, computed from per-rank partial sums that the caller
  all-reduces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from distgrad.config.sections import HealthConfig

#: the defaults below are the configuration's (``health`` section): one default per setting
_HEALTH = HealthConfig()

__all__ = [
    "HealthReport",
    "LayerHealth",
    "clip_ratio",
    "post_clip_norm",
    "UpdateRatioTracker",
]


# --------------------------------------------------------------------------------------------
# Vanishing / exploding gradients per parameter
# --------------------------------------------------------------------------------------------


@dataclass
class HealthReport:
    """Result of one :meth:`LayerHealth.update`.

    Attributes:
        vanishing: parameters currently flagged as vanishing (norm < vanish threshold for at
            least ``patience`` consecutive finite samples), in the order of the input names.
        exploding: parameters currently flagged as exploding (norm > explode threshold for at
            least ``patience`` consecutive finite samples), in input order.
        nonfinite: parameters whose norm was NaN/Inf in *this* sample, in input order (not part
            of either streak; see :class:`LayerHealth`).
        nonfinite_total: cumulative number of non-finite samples per parameter, only the
            parameters with a non-zero count.
    """

    vanishing: list[str] = field(default_factory=list)
    exploding: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    nonfinite_total: dict[str, int] = field(default_factory=dict)

    @property
    def n_vanishing(self) -> int:
        """``distgrad_vanishing_params``."""
        return len(self.vanishing)

    @property
    def n_exploding(self) -> int:
        """``distgrad_exploding_params``."""
        return len(self.exploding)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (the record carries :class:`distgrad.record.Health`)."""
        return {
            "vanishing": list(self.vanishing),
            "exploding": list(self.exploding),
            "nonfinite": list(self.nonfinite),
            "n_vanishing": self.n_vanishing,
            "n_exploding": self.n_exploding,
            "nonfinite_total": dict(self.nonfinite_total),
        }


class LayerHealth:
    """Persistent vanishing / exploding gradient detection per parameter tensor.

    Feed it, at every sampled step, the names of the parameters that received a gradient and
    their gradient L2 norms (``StepRecord.params.names`` / ``.norm``, i.e. the norm of the full
    reduced, *unscaled* gradient; frozen parameters and parameters without a gradient are simply
    not passed in).

    Rules, per parameter, over the sequence of samples in which it appears:

    * a finite norm ``< vanish_threshold`` extends its vanishing streak, any other finite norm
      resets it; it is flagged *vanishing* while the streak is ``>= patience``;
    * a finite norm ``> explode_threshold`` extends its exploding streak, any other finite norm
      resets it; flagged *exploding* while that streak is ``>= patience``;
    * a non-finite norm (NaN, +/-Inf) is counted separately (``nonfinite`` / ``nonfinite_total``)
      and neither extends nor resets a streak (it carries no information about the magnitude;
      NaN never poisons the state);
    * a parameter absent from a sample (e.g. no gradient that step) loses its streaks.

    So a parameter is flagged on its ``patience``-th consecutive qualifying sample, not before,
    and unflagged on the first finite sample that does not qualify.

    Args:
        vanish_threshold: gradient-norm floor (gradient units; >= 0). Default: the ``health``
            section's (1e-10): far below fp32/bf16 gradient noise of any trained layer, while an
            exactly-zero or underflowed gradient (dead unit, detached branch, fp16 underflow) is
            caught.
        explode_threshold: gradient-norm ceiling (gradient units, > vanish_threshold), or None to
            disable. Default: the ``health`` section's (1e3): LLM runs usually clip the *global*
            norm at 1.0, so a single tensor 1000x above that for ``patience`` samples is a real
            divergence. Tune per model.
        patience: consecutive samples required (>= 1); default the ``health`` section's (3).

    :meth:`from_config` builds one from an already validated ``health`` section (no second
    check).

    Raises:
        ValueError: on invalid thresholds / patience, and in :meth:`update` when ``names`` and
            ``norms`` differ in length or ``names`` has duplicates.
    """

    def __init__(
        self,
        vanish_threshold: float = _HEALTH.vanish_threshold,
        explode_threshold: float | None = _HEALTH.explode_threshold,
        patience: int = _HEALTH.patience,
    ) -> None:
        if not (vanish_threshold >= 0.0 and math.isfinite(vanish_threshold)):
            raise ValueError(f"vanish_threshold must be finite and >= 0, got {vanish_threshold}")
        if explode_threshold is not None and not (
            math.isfinite(explode_threshold) and explode_threshold > vanish_threshold
        ):
            raise ValueError(
                f"explode_threshold must be finite and > vanish_threshold, got {explode_threshold}"
            )
        if int(patience) < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.vanish_threshold = float(vanish_threshold)
        self.explode_threshold = None if explode_threshold is None else float(explode_threshold)
        self.patience = int(patience)
        self.reset()

    @classmethod
    def from_config(cls, cfg: HealthConfig) -> LayerHealth:
        """From the ``health`` section of :class:`~distgrad.config.DistgradConfig`, which was
        validated when the configuration was built (so it is not checked again here)."""
        self = cls.__new__(cls)
        self.vanish_threshold, self.explode_threshold = cfg.vanish_threshold, cfg.explode_threshold
        self.patience = cfg.patience
        self.reset()
        return self

    def reset(self) -> None:
        """Forget all streaks and counts."""
        self._names: list[str] = []
        self._vstreak = np.zeros(0, dtype=np.int64)
        self._estreak = np.zeros(0, dtype=np.int64)
        self._nonfinite_total: dict[str, int] = {}
        self._last_nonfinite: list[str] = []
        self.n_samples = 0

    def _align(self, names: list[str]) -> None:
        """Re-index the streak arrays to ``names`` (absent names drop their streaks)."""
        if names == self._names:
            return
        if len(set(names)) != len(names):
            raise ValueError("LayerHealth.update: duplicate parameter names")
        pos = {n: i for i, n in enumerate(self._names)}
        idx = np.array([pos.get(n, -1) for n in names], dtype=np.int64)
        have = idx >= 0
        v = np.zeros(len(names), dtype=np.int64)
        e = np.zeros(len(names), dtype=np.int64)
        v[have] = self._vstreak[idx[have]]
        e[have] = self._estreak[idx[have]]
        self._names, self._vstreak, self._estreak = list(names), v, e

    def update(self, names: Sequence[str], norms: np.ndarray) -> HealthReport:
        """Fold in one sampled step.

        Args:
            names: parameter names, length P.
            norms: gradient L2 norms, array-like of shape ``[P]`` (any float dtype, cast to
                float64), in the order of ``names``.

        Returns:
            the current :class:`HealthReport`.
        """
        names = list(names)
        x = np.asarray(norms, dtype=np.float64).reshape(-1)
        if x.shape[0] != len(names):
            raise ValueError(f"LayerHealth.update: {len(names)} names but {x.shape[0]} norms")
        self._align(names)
        finite = np.isfinite(x)
        xf = np.where(finite, x, 0.0)
        low = finite & (xf < self.vanish_threshold)
        self._vstreak = np.where(low, self._vstreak + 1, np.where(finite, 0, self._vstreak))
        if self.explode_threshold is not None:
            high = finite & (xf > self.explode_threshold)
            self._estreak = np.where(high, self._estreak + 1, np.where(finite, 0, self._estreak))
        bad = np.flatnonzero(~finite)
        self._last_nonfinite = [names[i] for i in bad]
        for n in self._last_nonfinite:
            self._nonfinite_total[n] = self._nonfinite_total.get(n, 0) + 1
        self.n_samples += 1
        return self.report()

    def report(self) -> HealthReport:
        """The flags as of the last :meth:`update` (empty before the first)."""
        v = np.flatnonzero(self._vstreak >= self.patience)
        e = np.flatnonzero(self._estreak >= self.patience)
        return HealthReport(
            vanishing=[self._names[i] for i in v],
            exploding=[self._names[i] for i in e],
            nonfinite=list(self._last_nonfinite),
            nonfinite_total=dict(self._nonfinite_total),
        )

    @property
    def vanishing(self) -> list[str]:
        """Names currently flagged vanishing."""
        return self.report().vanishing

    @property
    def exploding(self) -> list[str]:
        """Names currently flagged exploding."""
        return self.report().exploding

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (streaks keyed by name)."""
        return {
            "names": list(self._names),
            "vanish_streak": self._vstreak.tolist(),
            "explode_streak": self._estreak.tolist(),
            "nonfinite_total": dict(self._nonfinite_total),
            "last_nonfinite": list(self._last_nonfinite),
            "n_samples": self.n_samples,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (thresholds and patience of this instance are kept).

        Raises:
            ValueError: if the streak arrays do not match the names.
        """
        names = [str(n) for n in sd.get("names", [])]
        v = np.asarray(sd.get("vanish_streak", [0] * len(names)), dtype=np.int64).reshape(-1)
        e = np.asarray(sd.get("explode_streak", [0] * len(names)), dtype=np.int64).reshape(-1)
        if v.shape[0] != len(names) or e.shape[0] != len(names):
            raise ValueError("LayerHealth.load_state_dict: streak length != number of names")
        self._names, self._vstreak, self._estreak = names, v, e
        self._nonfinite_total = {str(k): int(c) for k, c in sd.get("nonfinite_total", {}).items()}
        self._last_nonfinite = [str(n) for n in sd.get("last_nonfinite", [])]
        self.n_samples = int(sd.get("n_samples", 0))


# --------------------------------------------------------------------------------------------
# Gradient clipping
# --------------------------------------------------------------------------------------------


def _check_max_norm(max_norm: float) -> float:
    m = float(max_norm)
    if not (m > 0.0 and math.isfinite(m)):
        raise ValueError(f"max_norm must be finite and > 0, got {max_norm}")
    return m


def clip_ratio(grad_norm: float, max_norm: float, eps: float = 0.0) -> float:
    """Factor by which global-norm clipping scales the gradient,
    ``min(1, max_norm / (norm + eps))``.

    Source: gradient-norm clipping of Pascanu, Mikolov, Bengio 2013 as implemented by
    ``torch.nn.utils.clip_grad_norm_`` (``clip_coef = max_norm / (total_norm + 1e-6)``, clamped
    to 1) and DeepSpeed (``gradient_clipping``: same 1e-6). With the default ``eps=0`` the
    mathematical ratio is returned; pass ``eps=1e-6`` for the coefficient torch / DeepSpeed
    actually apply.

    Args:
        grad_norm: global L2 norm of the unscaled gradient (>= 0).
        max_norm: clipping threshold (finite, > 0).
        eps: added to the norm in the denominator (>= 0).

    Returns:
        the ratio in (0, 1]; 1.0 when ``grad_norm == 0`` or ``grad_norm <= max_norm``; NaN when
        ``grad_norm`` is NaN or +/-Inf (clipping an inf/NaN gradient gives NaN in torch too).

    Raises:
        ValueError: if ``max_norm`` is not finite and > 0, ``eps`` < 0, or ``grad_norm`` < 0.
    """
    m = _check_max_norm(max_norm)
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    g = float(grad_norm)
    if not math.isfinite(g):
        return float("nan")
    if g < 0.0:
        raise ValueError(f"grad_norm must be >= 0, got {grad_norm}")
    d = g + eps
    if d == 0.0:
        return 1.0
    return min(1.0, m / d)


def post_clip_norm(grad_norm: float, max_norm: float, eps: float = 0.0) -> float:
    """Global norm after clipping, ``grad_norm * clip_ratio(grad_norm, max_norm, eps)``
    (``= min(grad_norm, max_norm)`` for ``eps=0``); NaN for a non-finite norm.

    Raises:
        ValueError: as :func:`clip_ratio`.
    """
    r = clip_ratio(grad_norm, max_norm, eps)
    return float(grad_norm) * r if math.isfinite(r) else float("nan")


# --------------------------------------------------------------------------------------------
# Update-to-weight ratio
# --------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), the tensor itself otherwise; detached."""
    to_local = getattr(t, "to_local", None)
    if callable(to_local):
        t = to_local()
    return t.detach()


class UpdateRatioTracker:
    """Update-to-weight ratio ``||w_after - w_before||_2 / ||w_before||_2`` per parameter tensor.

    Source: the "ratio of the updates to the values" diagnostic of Karpathy's CS231n notes
    ("Neural Networks Part 3", ~1e-3 is healthy) and the per-layer trust ratio of LARS
    (You, Gitman, Ginsburg 2017); here for the full (unsharded) tensor, assembled exactly from
    per-rank partial sums of squares.

    Protocol (the caller owns the reduction, nothing here communicates):

    1. before ``optimizer.step()``: :meth:`capture` the local shards (or keep your own copy);
    2. after it: ``s = tracker.local_sums_since_capture(params)`` (or :meth:`local_sums` with
       explicit before/after lists) -> float64 tensor ``[P, 2]`` of
       ``(sum (w_after - w_before)^2, sum w_before^2)`` over this rank's elements;
    3. ``all_reduce(s, SUM)`` over the ranks holding *disjoint* shards (ZeRO / FSDP data-parallel
       group); with replicated parameters (DDP, ZeRO-0) use one rank's sums instead;
    4. :meth:`ratios` on the reduced numpy array.

    Cost: :meth:`capture` keeps one copy of the local parameter shards (same dtype, same device:
    +1x the rank's parameter memory, e.g. +2 bytes/element for bf16 shards, +4 for fp32 master
    shards) from capture until :meth:`local_sums_since_capture` / :meth:`release`, plus float64
    temporaries of at most ``chunk_numel`` elements while summing. This is why distgrad exposes
    it behind an option and only on sampled steps. Pass the fp32 master shards when the
    optimizer has them: a bf16 copy of the weights can miss updates smaller than its ulp.

    Args:
        chunk_numel: elements converted to float64 at a time (bounds temporary memory).

    Raises:
        ValueError: on ``chunk_numel < 1``.
    """

    def __init__(self, chunk_numel: int = 1 << 24) -> None:
        if int(chunk_numel) < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        self.chunk_numel = int(chunk_numel)
        self._before: list[torch.Tensor] | None = None

    @property
    def captured(self) -> bool:
        """True between :meth:`capture` and :meth:`release` / :meth:`local_sums_since_capture`."""
        return self._before is not None

    @torch.no_grad()
    def capture(self, params: Sequence[torch.Tensor]) -> None:
        """Copy the local shards of ``params`` (the "before" weights); replaces a previous copy."""
        self._before = [_local(p).clone() for p in params]

    def release(self) -> None:
        """Drop the captured copy (e.g. when the optimizer skipped the step)."""
        self._before = None

    def local_sums_since_capture(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`local_sums` of the captured copy and ``params``, then :meth:`release`.

        Raises:
            RuntimeError: if nothing was captured.
            ValueError: as :meth:`local_sums`.
        """
        if self._before is None:
            raise RuntimeError("UpdateRatioTracker: capture() was not called before the step")
        before, self._before = self._before, None
        return self.local_sums(before, params)

    @torch.no_grad()
    def local_sums(
        self, before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Per-parameter partial sums over this rank's elements.

        Args:
            before: local shards before the optimizer step, length P (any real dtype/device).
            after: the same shards after the step, same shapes, in the same order.

        Returns:
            float64 tensor of shape ``[P, 2]`` on the device of ``after[0]`` (CPU when P == 0):
            column 0 ``sum (after - before)^2``, column 1 ``sum before^2``, differences taken in
            float64 (exact for fp32/bf16/fp16 inputs). Empty shards give zeros. No host sync.

        Raises:
            ValueError: if the lists differ in length or a pair differs in numel.
        """
        if len(before) != len(after):
            raise ValueError(f"local_sums: {len(before)} 'before' vs {len(after)} 'after' tensors")
        if len(after) == 0:
            return torch.zeros((0, 2), dtype=torch.float64)
        dev = _local(after[0]).device
        rows = []
        for i, (b, a) in enumerate(zip(before, after)):
            b, a = _local(b).reshape(-1), _local(a).reshape(-1)
            if b.numel() != a.numel():
                raise ValueError(f"local_sums: parameter {i}: {b.numel()} vs {a.numel()} elements")
            dw2 = torch.zeros((), dtype=torch.float64, device=a.device)
            w2 = torch.zeros((), dtype=torch.float64, device=a.device)
            for s in range(0, a.numel(), self.chunk_numel):
                ac = a[s : s + self.chunk_numel].to(torch.float64)
                bc = b[s : s + self.chunk_numel].to(device=a.device, dtype=torch.float64)
                dw2 += (ac - bc).square().sum()
                w2 += bc.square().sum()
            rows.append(torch.stack([dw2, w2]).to(dev))
        return torch.stack(rows)

    @staticmethod
    def ratios(reduced: np.ndarray | torch.Tensor) -> np.ndarray:
        """Update ratios from the rank-reduced sums.

        Args:
            reduced: ``[P, 2]`` sums of (squared update, squared weight) over all shards.

        Returns:
            float64 array ``[P]``: ``sqrt(dw2 / w2)`` (dimensionless); inf when the weight was
            all zeros but moved, NaN when it was all zeros and did not move (and NaN/Inf when
            the weights themselves were non-finite).

        Raises:
            ValueError: if ``reduced`` is not of shape ``[P, 2]``.
        """
        if isinstance(reduced, torch.Tensor):
            reduced = reduced.detach().to("cpu", torch.float64).numpy()
        r = np.asarray(reduced, dtype=np.float64)
        if r.ndim != 2 or r.shape[1] != 2:
            raise ValueError(f"ratios: expected shape [P, 2], got {r.shape}")
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.sqrt(r[:, 0]) / np.sqrt(r[:, 1])
