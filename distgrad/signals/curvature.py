"""Curvature along the last update (opt-in, ``curvature.enabled``), per layer and overall::

    c = (g_t - g_{t-1}) . dtheta / |dtheta|^2,    dtheta = theta_t - theta_{t-1}

the change of the gradient along the update the optimizer applied at the previous step, per
unit step: a finite-difference estimate of the directional second derivative
``dtheta^T H dtheta / |dtheta|^2`` (exact for a quadratic loss, whatever the optimizer). It is
the "curvature from successive gradients" of the gradient-analysis seeds; negative values
mean the loss curves down along the step (a saddle direction or a too-large step).

Exact under sharding: the dot products and squared norms are sums over elements, so each rank
computes them over the elements it owns (the gradient pieces and the weight pieces of
:func:`distgrad.core.step_collectives.weight_pieces`, aligned and counted once) and the step's SUM
collective adds them; per layer the sums of the layer's parameters are divided on the host.

State kept between steps on each rank (:class:`Curvature`), float32 on the gradients' device:
a copy of this rank's owned gradient shard ``g_{t-1}``, copied at step t-1's boundary (the
engines free or overwrite the gradients after the optimizer step), and a copy of its owned
weight shard, copied at the same boundary and turned in place into the update
``dtheta = theta_t - theta_{t-1}`` after the optimizer step (``after_step``). Memory: two
float32 copies of the rank's owned share of the model (8 bytes per owned parameter element;
under DDP the owned share is 1/W of the model), plus one temporary of the largest parameter
shard during the dot products. The weight copy cannot be replaced by a scalar: the dot with
``g_t`` needs the update vector, and the gradient copy cannot be dropped either, since no
engine keeps ``g_{t-1}`` after its step (DeepSpeed frees it).

Consecutive steps only: the sampled step must be the one after the update, so the signal needs
``sampling.interval: 1`` (refused otherwise at ``instrument()``). A step whose previous step was
not read (the first step, a refused step, a failure on any rank) has no estimate; nor does a
step whose gradients carry a different fp16 loss scale than the previous one (the two would
need unscaling first); a layer that did not move (skipped step, frozen) is left out.

Collectives: ``1 + 2 P`` float64 in the SUM part (a per-rank "have the copies" count and, per
parameter, the dot product and the squared update norm); nothing in the MAX part.

Everything the signal adds lives in this module (the contract of :mod:`distgrad.signals`): its
configuration section ``curvature`` (:class:`Curvature.Config`), its record part
``StepRecord.curvature`` (:class:`Curvature.Part`), its metrics ``distgrad_curvature`` and
``distgrad_layer_curvature{layer}`` (:attr:`Curvature.METRICS`, :meth:`Curvature.samples`), its factory
(:meth:`Curvature.build`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from distgrad.config.errors import ConfigError
from distgrad.config.sections import Section
from distgrad.engines.base import GradSource
from distgrad.export.metrics import Metric, condition
from distgrad.naming.grouping import group_keys
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal
from distgrad.stats.eager import sum_of_squares

_CHUNK = 1 << 16


def dot64(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x . y`` of two 1-D float32 tensors of one length as a 0-d float64 tensor: fp32 dot
    products over chunks of 2**16 elements, summed in float64 (as
    :func:`distgrad.stats.eager.sum_of_squares`)."""
    n = x.numel()
    if n <= _CHUNK:
        return torch.dot(x, y).double()
    return torch.stack([torch.dot(a, b) for a, b in zip(x.split(_CHUNK), y.split(_CHUNK))]).double().sum()


class Curvature(PackedSignal):
    """The curvature signal (see the module docstring).

    Args:
        names: the P exported parameter names (``inst.names``).
        layer_keys: the layer of each (``group_keys(names, "layer", rules)``).

    SUM part (float64 ``[1 + 2P]``): ``[1 if this rank held the copies of the previous step,
    then per parameter (g_t - g_{t-1}) . dtheta and |dtheta|^2]`` over this rank's owned
    elements, the gradients still carrying the loss scale. Record part: :class:`Curvature.Part`
    (``StepRecord.curvature``).
    """

    name = "curvature"

    class Config(Section):
        """Curvature along the last update, per layer: (g_t - g_{t-1}) . dtheta / |dtheta|^2 (see
        docs/signals.md, "Curvature along the last update")."""

        section_key: ClassVar[str] = "curvature"
        enabled: bool = Field(False, description=(
            "Estimate the curvature along the last update per layer. Keeps two float32 copies of "
            "this rank's owned shard (the last gradient and the last update); two numbers per "
            "parameter ride in the SUM collective. Needs sampling.interval: 1 (consecutive steps)."))

    @dataclass
    class Part(_Part):
        """Curvature along the last update, ``(g_t - g_{t-1}) . dtheta / |dtheta|^2`` with
        ``dtheta = theta_t - theta_{t-1}`` the update the optimizer applied at the previous step
        (for a quadratic loss with Hessian H exactly ``dtheta^T H dtheta / |dtheta|^2``).
        Unit: gradient per parameter unit (1/parameter^2 times the loss unit).

        Attributes:
            layer: ``{layer: curvature}`` over the layer's parameters (sums of the dot products over
                the sums of the squared update norms; layers of
                :func:`distgrad.naming.grouping.group_keys` ``"layer"``); a layer whose parameters
                did not move is left out.
            total: the same over all parameters, or None when nothing moved.
            update_sq: |dtheta|^2 over all parameters (parameter^2).
        """

        layer: dict[str, float] = field(default_factory=dict)
        total: float | None = None
        update_sq: float = 0.0

    _when = condition("curvature", "`curvature.enabled: true`, from the second sampled step on (see docs/signals.md)",
                      enabled=lambda c: c.curvature.enabled)
    METRICS = (
        Metric("distgrad_curvature", "gauge", (), "loss/param^2", "(g_t - g_{t-1}) . dtheta / |dtheta|^2 over all "
               "parameters: the curvature along the last update.", _when,
               doc="curvature along the last update over all parameters, `(g_t - g_{t-1}) . dtheta / |dtheta|^2` "
                   "with `dtheta` the update of the previous step (for a quadratic loss exactly `dtheta^T H dtheta / "
                   "|dtheta|^2`); negative: the loss curves down along the step. Absent when nothing moved"),
        Metric("distgrad_layer_curvature", "gauge", ("layer",), "loss/param^2",
               "Curvature along the last update over the layer's parameters.", _when,
               doc="`distgrad_curvature` over the layer's parameters (layers that did not move: no series)"),
    )

    @staticmethod
    def samples(part: Curvature.Part) -> dict[str, Any]:
        """``distgrad_curvature`` (absent when nothing moved) and ``distgrad_layer_curvature``
        per layer."""
        return {"distgrad_curvature": part.total, "distgrad_layer_curvature": part.layer}

    @classmethod
    def build(cls, inst: Any) -> Curvature | None:
        """``curvature.enabled``: the signal, or None when off.

        Raises:
            ConfigError: ``sampling.interval`` is not 1, or the engine does not locate its
                weight shards.
        """
        cfg = inst.config
        if not cfg.curvature.enabled:
            return None
        if cfg.sampling.interval != 1:
            raise ConfigError(f"distgrad config: 'curvature.enabled' needs sampling.interval: 1 (got "
                              f"{cfg.sampling.interval}): the curvature compares the gradients of consecutive steps")
        if type(inst.source).local_param_pieces is GradSource.local_param_pieces:
            raise ConfigError(f"distgrad config: 'curvature.enabled' is not supported on engine "
                              f"{inst.source.engine_name!r}: its weight shards are not located")
        return cls(inst.names, group_keys(inst.names, "layer", cfg.naming.tuples))

    def __init__(self, names: Sequence[str], layer_keys: Sequence[str]) -> None:
        self.n = len(names)
        self.layer_keys = list(layer_keys)
        self._layers = sorted(set(self.layer_keys))
        self._inv = np.array([self._layers.index(k) for k in self.layer_keys], dtype=np.int64)
        self._grad: list[torch.Tensor | None] | None = None  # g_{t-1}, owned pieces, float32
        self._update: list[torch.Tensor | None] | None = None  # theta_{t-1}, then dtheta after the step
        self._fresh = False  # local() of this step copied the gradient and the weights
        self._moved = False  # after_step of the copies' step turned the weights into the update
        self._scales: dict[int, float] = {}  # step -> gradient scale, from finish()

    @property
    def sum_size(self) -> int:
        return 1 + 2 * self.n

    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, None]:
        from distgrad.core.step_collectives import weight_pieces

        grad, update, moved = self._grad, self._update, self._moved
        self._grad = self._update = None
        self._fresh = self._moved = False
        out = torch.zeros(1 + 2 * self.n, dtype=torch.float64, device=device)
        if grad is not None and update is not None and moved:
            sums = []
            for g, gp, u in zip(pieces, grad, update):
                if g is None or gp is None or u is None or g.numel() == 0 or g.numel() != u.numel():
                    z = torch.zeros((), dtype=torch.float64, device=device)
                    sums += [z, z]
                    continue
                sums += [dot64(g.detach().float() - gp, u).to(device), sum_of_squares(u).to(device)]
            out[0] = 1.0
            if sums:
                out[1:] = torch.stack(sums)
        # the copies for the next step: this step's gradient and weights (before the optimizer)
        self._grad = [None if g is None else g.detach().float().clone() for g in pieces]
        self._update = [None if w is None else w.detach().float().clone() for w in weight_pieces(inst)]
        self._fresh = True
        return out, None

    def after_step(self, inst: Any, step_applied: bool) -> None:
        from distgrad.core.step_collectives import weight_pieces

        if not self._fresh or self._update is None:  # this step was not read: no copies to pair
            self._grad = self._update = None
            return
        self._fresh = False
        for u, w in zip(self._update, weight_pieces(inst)):
            if u is not None and w is not None:
                torch.sub(w.detach().float(), u, out=u)  # theta_{t+1} - theta_t, in place
        self._moved = True

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray,
               grad_scale: float) -> None:
        self._scales = {s: v for s, v in self._scales.items() if s >= rec.step - 1}
        self._scales[rec.step] = float(grad_scale)
        if sum_part[0] < inst.world_size or self._scales.get(rec.step - 1) != float(grad_scale):
            return  # a rank lacked the previous step's copies, or the loss scale changed
        dots = np.asarray(sum_part[1::2], dtype=np.float64) / grad_scale
        sq = np.asarray(sum_part[2::2], dtype=np.float64)
        g = len(self._layers)
        ldot = np.bincount(self._inv, weights=dots, minlength=g)
        lsq = np.bincount(self._inv, weights=sq, minlength=g)
        total_sq = float(sq.sum())
        rec.curvature = Curvature.Part(
            layer={k: float(d / s) for k, d, s in zip(self._layers, ldot, lsq) if s > 0},
            total=(float(dots.sum() / total_sq) if total_sq > 0 else None), update_sq=total_sq)

