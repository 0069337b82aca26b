"""Opt-in adaptive gradient clipping (config section ``adaptive_clip``, docs/action.md "Adaptive
clipping"), decided from the sampled step's reduced per-parameter norms that distgrad already
has on the host at the optimizer-step boundary: no extra collective, no extra host sync.

Two rules, each as its paper states it:

- ``zclip`` (Kumar et al., "ZClip: Adaptive Spike Mitigation for LLM Pre-Training", arXiv
  2504.02507; reference code github.com/bluorion-com/ZClip, mode ``zscore``): EMA mean ``mu`` and
  variance ``v`` of the global gradient norm ``g`` (float64). The first ``zclip_warmup_steps``
  norms are only collected; then ``mu`` is their mean and ``v`` their (population) variance. At
  each later step ``z = (g - mu) / (sqrt(v) + eps)``; when ``z > z_thres`` the gradient is scaled
  to the norm ``g* = mu + (z_thres**2 / z) * sqrt(v)`` (``zclip_target: reciprocal``, the paper's
  reciprocal clipping, the reference code's default ``adaptive_scaling``) or
  ``g* = mu + z_thres * sqrt(v)`` (``zclip_target: threshold``); the factor is ``g* / g``. Then
  ``mu <- alpha mu + (1 - alpha) g*``, ``v <- alpha v + (1 - alpha) (g* - mu)**2`` (with the new
  ``mu``), ``g*`` being the clipped norm, or ``g`` on a step not clipped. Defaults: the paper's
  (alpha 0.97, z_thres 2.5, 25 warm-up steps, eps 1e-6).
- ``adagc`` (Wang et al., "AdaGC: Enhancing LLM Pretraining Stability via Adaptive Gradient
  Clipping", arXiv 2502.11034): per parameter tensor ``i`` with reduced-gradient norm ``n_i``,
  an EMA ``gamma_i`` of its clipped norms. For the first ``adagc_warmup_steps`` steps, global
  clipping at ``lambda_abs``: factor ``h = min(lambda_abs / ||g||, 1)`` for every tensor and
  ``gamma_i <- min(gamma_i, h n_i)`` (``gamma_i`` starts at +inf). Afterwards
  ``h_i = min(lambda_rel gamma_i / n_i, 1)`` and ``gamma_i <- beta gamma_i + (1 - beta) h_i n_i``.
  Defaults: the paper's (lambda_rel 1.05, beta 0.98, 100 warm-up steps, lambda_abs 1.0).

Every rank holds the same reduced norms and the same state, so every rank computes the same
factors with no collective (tested: 2 gloo ranks, DDP and FSDP2). The factors scale the gradients in place
after distgrad's read (the exported statistics, ``distgrad_grad_norm`` included, are the pre-clip
ones) and before the optimizer consumes them (:meth:`distgrad.engines.optimizer_boundary.OptimizerBoundary`).

Requirements, checked at ``instrument()`` (:func:`check_config`, :func:`check_engine`): every
optimizer step sampled (``sampling.interval: 1``: an unsampled step's norms never reach the host,
so it could be neither clipped nor folded into the EMA), synchronous records, and a PyTorch engine
whose gradients distgrad can scale per parameter (one process, DDP, FSDP2; not DeepSpeed, FSDP1
or a pipeline / expert job view). A step whose statistics some rank could not vouch for (a
refused read, e.g. the user's own ``clip_grad_norm_`` ran before distgrad's read) is neither
clipped nor folded in: it is not exported (``distgrad_refused_steps_total``) and rank 0 logs that
adaptive clipping did not act (once per episode).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from distgrad.config.sections import Section
from distgrad.diagnostics.base import Diagnostic, DiagnosticContext, register
from distgrad.export.metrics import Metric, condition
from distgrad.record import StepRecord
from distgrad.record.base import _Part

log = logging.getLogger("distgrad")

#: engines whose gradients :meth:`~distgrad.engines.torch_base.TorchSource.scale_grads` scales
SUPPORTED_ENGINES = ("torch", "ddp", "fsdp2")


def enabled(config: Any) -> bool:
    """Whether ``config`` (a DistgradConfig) asks for adaptive clipping."""
    return bool(config.enabled and config.adaptive_clip.mode != "off")


def check_config(config: Any) -> None:
    """Refuse settings under which adaptive clipping could not act on every step.

    Raises:
        ConfigError: ``sampling.interval`` > 1 or ``statistics.async_records: on`` with
            ``adaptive_clip.mode`` set (the message names the keys and the fix).
    """
    from distgrad.config.errors import ConfigError

    if not enabled(config):
        return
    mode = config.adaptive_clip.mode
    if config.sampling.interval != 1:
        raise ConfigError(
            f"distgrad config: adaptive_clip.mode: {mode} needs 'sampling.interval' 1 (got "
            f"{config.sampling.interval}): the clipping factor is decided from every optimizer step's reduced "
            "norms on the host before the optimizer runs, and the EMA must see every step; an unsampled step "
            "would be neither clipped nor counted. Set sampling.interval: 1, or adaptive_clip.mode: off")
    if config.statistics.async_records == "on":
        raise ConfigError(
            f"distgrad config: adaptive_clip.mode: {mode} needs synchronous records: with "
            "'statistics.async_records' on the reduced norms reach the host one step late, after the optimizer "
            "ran; set statistics.async_records: off (or auto), or adaptive_clip.mode: off")


def check_engine(config: Any, engine_name: str, job_view: bool) -> None:
    """Refuse an engine whose gradients distgrad cannot scale per parameter.

    Raises:
        ConfigError: adaptive clipping on with an engine other than one process, DDP or FSDP2, or
            with a pipeline / expert job view.
    """
    from distgrad.config.errors import ConfigError

    if not enabled(config):
        return
    if engine_name not in SUPPORTED_ENGINES or job_view:
        what = f"engine {engine_name!r}" + (" with a pipeline / expert job view" if job_view else "")
        raise ConfigError(
            f"distgrad config: adaptive_clip.mode: {config.adaptive_clip.mode} is not supported on {what}: "
            "distgrad scales the gradients itself, per parameter, between its read and the optimizer step, "
            f"which it implements for {', '.join(SUPPORTED_ENGINES)} (one process, DDP, FSDP2) only. Set "
            "adaptive_clip.mode: off (DeepSpeed: use its gradient_clipping)")


def zclip_target(g: float, mu: float, var: float, z_thres: float, target: str, eps: float = 1e-6) -> float | None:
    """ZClip's clipped norm for the global norm ``g`` (arXiv 2504.02507; module docstring), or
    None when ``z = (g - mu) / (sqrt(var) + eps)`` is not above ``z_thres``.

    Args:
        g: the step's global gradient norm (gradient units, >= 0).
        mu, var: the EMA mean (gradient units) and variance (squared units) before this step.
        z_thres: the z-score threshold.
        target: ``"reciprocal"`` (``mu + z_thres**2 / z * std``) or ``"threshold"``
            (``mu + z_thres * std``).
    """
    std = math.sqrt(var)
    z = (g - mu) / (std + eps)
    if not z > z_thres:
        return None
    return mu + (z_thres * z_thres / z) * std if target == "reciprocal" else mu + z_thres * std


@register
class AdaptiveClip(Diagnostic):
    """Adaptive clipping (module docstring): :meth:`decide` at the boundary (from
    :class:`~distgrad.diagnostics.action.Action`), :meth:`on_record` writes the record's part.

    Attributes:
        clipped_steps: optimizer steps on which some gradient was scaled down (checkpointed).
        steps: optimizer steps folded into the state (warm-up included; checkpointed).
    """

    name = "adaptive_clip"

    class Config(Section):
        """Opt-in adaptive gradient clipping driven by distgrad's own reduced norms (docs/action.md,
        "Adaptive clipping"): ZClip (z-score of the global norm against its EMA) or AdaGC (each
        tensor against the EMA of its own clipped norms). Needs sampling.interval 1 and one process,
        DDP or FSDP2."""

        section_key: ClassVar[str] = "adaptive_clip"
        mode: Literal["off", "zclip", "adagc"] = Field("off", description=(
            "off; zclip: clip the global gradient norm when its z-score against the EMA of past norms "
            "exceeds zclip_z_threshold (arXiv 2504.02507); adagc: clip each parameter tensor to "
            "adagc_lambda_rel times the EMA of its clipped norms (arXiv 2502.11034)"))
        zclip_alpha: float = Field(0.97, gt=0.0, lt=1.0, description="ZClip EMA factor of the norm's mean and "
                                   "variance (the paper's 0.97)")
        zclip_z_threshold: float = Field(2.5, gt=0.0, description="ZClip z-score above which the step is clipped "
                                         "(the paper's 2.5)")
        zclip_warmup_steps: int = Field(25, ge=2, description="ZClip: steps whose norms only initialise the "
                                        "mean and variance, never clipped (the paper's 25)")
        zclip_target: Literal["reciprocal", "threshold"] = Field("reciprocal", description=(
            "ZClip clipped norm: reciprocal: mu + z_thres^2/z * std (the paper's reciprocal clipping, its "
            "code's default); threshold: mu + z_thres * std"))
        adagc_lambda_rel: float = Field(1.05, gt=0.0, description="AdaGC: a tensor is clipped to this times the "
                                        "EMA of its clipped norms (the paper's 1.05)")
        adagc_beta: float = Field(0.98, gt=0.0, lt=1.0, description="AdaGC EMA factor (the paper's 0.98)")
        adagc_warmup_steps: int = Field(100, ge=1, description="AdaGC: steps of global clipping at "
                                        "adagc_lambda_abs while the per-tensor EMA starts as the running "
                                        "minimum of clipped norms (the paper's 100)")
        adagc_lambda_abs: float = Field(1.0, gt=0.0, description="AdaGC warm-up global norm threshold, in "
                                        "gradient units (the paper's 1.0)")

    @dataclass
    class Part(_Part):
        """What adaptive clipping did on this step (``StepRecord.adaptive_clip``).

        Attributes:
            mode: ``"zclip"`` or ``"adagc"``.
            acted: the step's norms were folded in (False: warm-up of nothing, a refused or
                non-finite step, or an update the action skipped).
            clipped: some gradient of this step was scaled down.
            factor: the smallest factor applied (1.0 when none; ZClip: the one global factor).
            tensors_clipped: parameter tensors scaled down on this step.
            threshold: ZClip: the clipped norm ``g*`` when clipped; AdaGC: the global norm after
                clipping (gradient units); None when not clipped.
            z: ZClip: the step's z-score (None in warm-up or when not acted).
            warmup: the step was in the rule's warm-up.
            clipped_steps: steps clipped so far in the run (``distgrad_adaptive_clip_steps_total``).
            reason: why the step was not acted on, else None.
        """

        mode: str
        acted: bool = False
        clipped: bool = False
        factor: float = 1.0
        tensors_clipped: int = 0
        threshold: float | None = None
        z: float | None = None
        warmup: bool = False
        clipped_steps: int = 0
        reason: str | None = None

    _when = condition("adaptive_clip", "`adaptive_clip.mode` is zclip or adagc (opt-in; every step sampled)",
                      enabled=lambda c: c.adaptive_clip.mode != "off")
    METRICS = (
        Metric("distgrad_adaptive_clip_steps_total", "counter", (), "steps", "Optimizer steps on which "
               "distgrad's adaptive clipping scaled gradients down.", _when,
               doc="optimizer steps clipped by `adaptive_clip` (ZClip: global norm z-score above its threshold; "
                   "AdaGC: some tensor above lambda_rel times its EMA, or the warm-up's global threshold); "
                   "distgrad/diagnostics/adaptive_clip.py"),
        Metric("distgrad_adaptive_clip_factor", "gauge", (), "ratio", "Smallest factor adaptive clipping applied "
               "to a gradient on the last step (1: none clipped).", _when,
               doc="the factor the last step's gradients were multiplied by (ZClip: one global factor g*/g; "
                   "AdaGC: the smallest per-tensor factor); 1 when nothing was clipped"),
        Metric("distgrad_adaptive_clip_tensors", "gauge", (), "params", "Parameter tensors adaptive clipping "
               "scaled down on the last step.", _when),
    )

    @staticmethod
    def samples(part: AdaptiveClip.Part) -> dict[str, Any]:
        """The counter (run total), the last step's smallest factor and clipped tensor count."""
        return {"distgrad_adaptive_clip_steps_total": part.clipped_steps,
                "distgrad_adaptive_clip_factor": part.factor,
                "distgrad_adaptive_clip_tensors": part.tensors_clipped}

    def __init__(self, ctx: DiagnosticContext) -> None:
        super().__init__(ctx)
        self.cfg = AdaptiveClip.section_of(ctx.config)
        self.mode: str = self.cfg.mode
        self.steps = 0
        self.clipped_steps = 0
        # ZClip state (float64 Python floats)
        self.buffer: list[float] = []
        self.mu: float | None = None
        self.var: float | None = None
        # AdaGC state: per-parameter EMA of clipped norms (+inf: not seen yet)
        self.gamma = np.full(len(ctx.names), np.inf)
        self._pending: dict[str, Any] | None = None
        self._refused_logged = False

    @classmethod
    def create(cls, ctx: DiagnosticContext) -> AdaptiveClip | None:
        return cls(ctx) if enabled(ctx.config) else None

    # -- boundary side ----------------------------------------------------------------------
    def not_acted(self, step: int, reason: str) -> None:
        """Record that ``step`` was neither clipped nor folded in (``reason`` in the record);
        rank 0 logs the first of an episode of refused steps."""
        self._pending = {"step": step, "acted": False, "reason": reason}
        if reason.startswith("refused"):
            if not self._refused_logged and self.ctx.global_rank == 0:
                log.warning("distgrad: step %d: adaptive clipping (adaptive_clip.mode: %s) did NOT act: %s. A "
                            "clip_grad_norm_ before optimizer.step() runs before distgrad's read; drop it "
                            "(adaptive clipping replaces it) or set adaptive_clip.mode: off", step, self.mode,
                            reason)
            self._refused_logged = True
        else:
            self._refused_logged = False

    def decide(self, step: int, sumsq: np.ndarray, numel: np.ndarray) -> np.ndarray | None:
        """Fold in the step's reduced per-parameter norms and return the per-parameter factors
        to multiply the gradients by (float64, shape (P,), values in (0, 1]), or None when nothing
        is clipped. Same on every rank (same inputs, same state).

        Args:
            step: the optimizer step.
            sumsq: (P,) float64, each parameter's sum of squared reduced-gradient elements
                (already divided by the loss scale the gradients carry).
            numel: (P,) elements counted per parameter (0: no gradient this step).
        """
        norms = np.sqrt(np.asarray(sumsq, dtype=np.float64))
        have = (np.asarray(numel) > 0) & np.isfinite(norms)
        g = float(np.sqrt(np.sum(np.asarray(sumsq, dtype=np.float64))))
        if not math.isfinite(g):
            self.not_acted(step, "non-finite gradient norm")
            return None
        self._refused_logged = False
        self.steps += 1
        if self.mode == "zclip":
            return self._zclip(step, g, len(norms))
        return self._adagc(step, norms, have, g)

    def _zclip(self, step: int, g: float, p: int) -> np.ndarray | None:
        c = self.cfg
        if self.mu is None or self.var is None:
            self.buffer.append(g)
            if len(self.buffer) >= c.zclip_warmup_steps:
                b = np.asarray(self.buffer, dtype=np.float64)
                self.mu, self.var = float(b.mean()), float(((b - b.mean()) ** 2).mean())
                self.buffer = []
            self._pending = {"step": step, "acted": True, "warmup": True}
            return None
        std = math.sqrt(self.var)
        z = (g - self.mu) / (std + 1e-6)
        target = zclip_target(g, self.mu, self.var, c.zclip_z_threshold, c.zclip_target)
        eff = g if target is None else target
        a = c.zclip_alpha
        self.mu = a * self.mu + (1 - a) * eff
        self.var = a * self.var + (1 - a) * (eff - self.mu) ** 2
        if target is None or not target < g:
            self._pending = {"step": step, "acted": True, "z": z}
            return None
        f = target / g
        self.clipped_steps += 1
        self._pending = {"step": step, "acted": True, "clipped": True, "factor": f, "tensors": p,
                         "threshold": target, "z": z}
        return np.full(p, f)

    def _adagc(self, step: int, norms: np.ndarray, have: np.ndarray, g: float) -> np.ndarray | None:
        c = self.cfg
        warm = self.steps <= c.adagc_warmup_steps
        if warm:
            h = min(c.adagc_lambda_abs / g, 1.0) if g > 0 else 1.0
            f = np.ones_like(norms)
            f[have] = h
            self.gamma[have] = np.minimum(self.gamma[have], h * norms[have])
        else:
            f = np.ones_like(norms)
            known = have & np.isfinite(self.gamma) & (norms > 0)
            f[known] = np.minimum(c.adagc_lambda_rel * self.gamma[known] / norms[known], 1.0)
            new = have & ~np.isfinite(self.gamma)  # a tensor first seen after the warm-up: starts its EMA
            self.gamma[new] = norms[new]
            b = c.adagc_beta
            self.gamma[known] = b * self.gamma[known] + (1 - b) * f[known] * norms[known]
        n_clipped = int(np.sum(f < 1.0))
        pending: dict[str, Any] = {"step": step, "acted": True, "warmup": warm}
        self._pending = pending
        if n_clipped == 0:
            return None
        self.clipped_steps += 1
        pending.update(clipped=True, factor=float(f.min()), tensors=n_clipped,
                       threshold=float(np.sqrt(np.sum((f * norms)[have] ** 2))))
        return f

    # -- record side ------------------------------------------------------------------------
    def on_record(self, rec: StepRecord) -> None:
        """Write ``rec.adaptive_clip`` from this step's decision (a step without one: not acted)."""
        d = self._pending if self._pending is not None and self._pending.get("step") == rec.step else None
        self._pending = None
        if d is None:
            d = {"acted": False, "reason": "not decided (the update was skipped, or no read before the update)"}
        AdaptiveClip.set_part(rec, AdaptiveClip.Part(
            mode=self.mode, acted=bool(d.get("acted")), clipped=bool(d.get("clipped", False)),
            factor=float(d.get("factor", 1.0)), tensors_clipped=int(d.get("tensors", 0)) if d.get("clipped") else 0,
            threshold=d.get("threshold"), z=d.get("z"), warmup=bool(d.get("warmup", False)),
            clipped_steps=self.clipped_steps, reason=d.get("reason")))

    # -- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The EMA state: ZClip's warm-up buffer, mean and variance; AdaGC's per-parameter EMA
        (None for +inf) by parameter name; step and clipped-step counts."""
        return {"mode": self.mode, "steps": self.steps, "clipped_steps": self.clipped_steps,
                "buffer": list(self.buffer), "mu": self.mu, "var": self.var,
                "gamma": {n: (None if not np.isfinite(v) else float(v)) for n, v in zip(self.ctx.names, self.gamma)}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (parameters absent from it start fresh).

        Raises:
            ValueError: the state was saved with another mode.
        """
        if sd["mode"] != self.mode:
            raise ValueError(f"adaptive_clip state of mode {sd['mode']!r}, this run has {self.mode!r}")
        self.steps, self.clipped_steps = int(sd["steps"]), int(sd["clipped_steps"])
        self.buffer = [float(x) for x in sd["buffer"]]
        self.mu = None if sd["mu"] is None else float(sd["mu"])
        self.var = None if sd["var"] is None else float(sd["var"])
        gamma = sd["gamma"]
        self.gamma = np.array([np.inf if gamma.get(n) is None else float(gamma[n]) for n in self.ctx.names])


__all__ = ["AdaptiveClip", "SUPPORTED_ENGINES", "check_config", "check_engine", "enabled", "zclip_target"]
