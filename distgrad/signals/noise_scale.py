"""Gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish, Kaplan, Amodei et al.
2018, "An Empirical Model of Large-Batch Training", arXiv 1812.06162, Appendix A), the batch
size around which training stops gaining from larger batches (the critical batch size).

Estimator (Appendix A.1): the expected squared norm of a gradient averaged over B samples is
``E|G_B|^2 = |G|^2 + tr(Sigma) / B`` (Sigma: the per-sample gradient covariance), so two batch
sizes give unbiased estimates of both terms::

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

each smoothed by its own exponential moving average; the exported noise scale is the ratio of
the two averages (the paper's recipe: the ratio of noisy estimates would be biased).

The two batch sizes, per optimizer step (:class:`GradientNoiseScale`):

* big: the step's reduced gradient, the mean over all N micro-batch gradients of all ranks:
  ``|G_big|^2`` is the core's sum of squares (``StepRecord.grad_norm ** 2``), ``B_big = N b``;
* small: each micro-batch's gradient on its rank *before* the reduction (b = samples per
  micro-batch): :class:`MicroBatchNorms` hooks each trainable leaf (``Tensor.register_hook``:
  it runs with the micro-batch's incoming gradient before it is accumulated into ``.grad``
  and before the engine's reduction starts, see :func:`distgrad.diagnostics.culprit`) and adds its squared
  norm on the device; ``|G_small|^2`` is the mean over the step's N micro-batches of all ranks.
  The engines reduce a *sum* over micro-batches and a *mean* over the W ranks
  (``reduced = (1/W) sum_{r,m} h_{r,m}``, whatever the loop or the engine divides the loss by),
  so the micro-batch gradient on the reduced gradient's scale is ``(N/W) h``; its squared norm
  is ``(N/W)^2 |h|^2``. This needs N (micro-batches of all ranks: each rank counts the hook
  calls per leaf and takes the largest count) and no other knowledge of the loop's scaling.

Per rank the SUM collective carries ``[sum over hook calls of |h|^2, micro-batches, 1]`` and
the MAX collective ``-micro-batches`` (the smallest count: a rank whose hooks saw nothing makes
the step's estimate absent). Cost: per micro-batch one read of every gradient (a chunked fp32
dot product accumulated in float64, on the device, no host sync) and a Python counter per leaf;
3 + 1 float64 in the collectives; no copy of any tensor.

Assumptions (docs/signals.md): each micro-batch's loss is a mean over its b samples (a
sum-reduced loss scales the gradient by b and the estimate is wrong), micro-batches of one
size, one backward per micro-batch. Engines: a plain module, DDP, DeepSpeed ZeRO 0-3, FSDP1
(not hybrid; the hooks see each unit's unsharded padded flat gradient, whose padding is zero),
FSDP2 on a 1-D mesh (the hooks go on the unsharded parameters once they exist); refused at
``instrument()`` elsewhere (no honest small batch known yet). Framework integrations
(``distgrad/integrations/``) fill ``micro_batch_size``; their loss scaling and the Hugging Face
Trainer's ``num_items_in_batch`` token weighting: docs/signals.md, "Under the framework
integrations".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from distgrad.config.errors import ConfigError
from distgrad.config.sections import Section
from distgrad.diagnostics.culprit import LeafHooks, pre_reduction_leaves
from distgrad.export.metrics import condition, gauge
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal
from distgrad.stats.eager import sum_of_squares

log = logging.getLogger("distgrad")

#: engines whose pre-reduction micro-batch gradients the hooks see (tests/test_noise_scale.py,
#: tests/test_noise_scale_multirank.py); FSDP1 without hybrid sharding, FSDP2 on a 1-D mesh
SUPPORTED = ("torch", "ddp", "deepspeed", "fsdp1", "fsdp2")


class MicroBatchNorms(LeafHooks):
    """Squared norms of this rank's micro-batch gradients before the reduction.

    A tensor hook on each leaf (:class:`~distgrad.diagnostics.culprit.LeafHooks`) adds ``|grad|^2``
    (float64, on the gradient's device) into one accumulator and counts its calls per leaf.
    :meth:`take` returns the accumulator and the number of micro-batches (the largest per-leaf
    count) and starts over.
    """

    def __init__(self, leaves: Iterable[torch.Tensor] = ()) -> None:
        self._acc: torch.Tensor | None = None
        self._calls: dict[int, int] = {}
        self.failed = False
        super().__init__(leaves)

    def _on_grad(self, key: int, g: torch.Tensor) -> None:
        self._calls[key] = self._calls.get(key, 0) + 1
        if not g.is_floating_point() or g.numel() == 0:
            return
        s = sum_of_squares(g.reshape(-1))
        if self._acc is None or self._acc.device != s.device:
            self._acc = torch.zeros((), dtype=torch.float64, device=s.device)
        self._acc.add_(s)

    def _failed(self) -> None:
        self.failed = True

    def take(self, device: torch.device) -> tuple[torch.Tensor, int, bool]:
        """``(sum of |h|^2 as a 0-d float64 tensor on device, micro-batches, failed)`` since
        the last take/reset; then starts over. No host sync."""
        acc, calls, failed = self._acc, self._calls, self.failed
        self.reset()
        total = (torch.zeros((), dtype=torch.float64, device=device) if acc is None
                 else acc.to(device=device, dtype=torch.float64))
        return total, max(calls.values(), default=0), failed

    def reset(self) -> None:
        """Forget what was seen (an unsampled step, a refused step)."""
        self._acc, self._calls, self.failed = None, {}, False



def _leaves(engine_name: str, module: Any, norms: MicroBatchNorms) -> Callable[[], None] | None:
    """Hook the leaves whose incoming gradient is this rank's own before the reduction; returns
    an extra undo function (lazy hooks) or None."""
    leaves, lazy = pre_reduction_leaves(engine_name, module)  # every engine's hook point
    norms.add(leaves)
    return lazy(norms) if lazy is not None else None


def estimate(grad_sq_small: float, grad_sq_big: float, n: int, b: float) -> tuple[float, float]:
    """The per-step estimates of McCandlish et al. Appendix A.1 with ``B_small = b``,
    ``B_big = n b``: ``(|G|^2, tr(Sigma))`` (grad^2), from the mean squared norm of the ``n``
    small-batch gradients and the squared norm of their mean. Raises ValueError for n < 2."""
    if n < 2:
        raise ValueError("the noise scale needs two batch sizes: at least 2 micro-batches per step")
    big = n * b
    g2 = (big * grad_sq_big - b * grad_sq_small) / (big - b)
    tr = (grad_sq_small - grad_sq_big) / (1.0 / b - 1.0 / big)
    return g2, tr


class GradientNoiseScale(PackedSignal):
    """The gradient noise scale signal (see the module docstring).

    Args:
        micro_batch_size: b, samples per micro-batch on each rank (float, > 0).
        decay: the EMAs' decay per sampled step, in (0, 1).
        world_size: W, the ranks the gradient is averaged over.
        engine_name: the source's engine (hook points, loss-scale handling).

    SUM part (float64 [3]): ``[sum over this rank's hook calls of |h|^2 (loss-scaled), this
    rank's micro-batches, 1]``; MAX part (float64 [1]): ``-micro-batches``.
    Record part: :class:`GradientNoiseScale.Part` (``StepRecord.noise_scale``); its configuration
    section (``noise_scale``), metrics and factory are declared on this class too (the contract of
    :mod:`distgrad.signals`).
    """


    name = "noise_scale"

    class Config(Section):
        """Gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, Appendix A),
        from the micro-batch gradients each rank computes before the reduction and the step's
        reduced gradient (see docs/signals.md, "Gradient noise scale")."""

        section_key: ClassVar[str] = "noise_scale"
        enabled: bool = Field(False, description=(
            "Estimate the gradient noise scale: one tensor hook per trainable parameter adds the "
            "squared norm of each micro-batch's incoming gradient on the device (one extra read of "
            "each gradient per micro-batch, no host sync); three numbers ride in the step's SUM "
            "collective and one in its MAX. A plain module, DDP, DeepSpeed (ZeRO 0-3), FSDP1 (not "
            "hybrid) and FSDP2 (1-D mesh); needs several micro-batches per step (gradient accumulation "
            "or several ranks)."))
        micro_batch_size: int | None = Field(None, ge=1, description=(
            "Samples per micro-batch on each rank (the small batch B_small; the step's batch is it "
            "times the micro-batches of all ranks). DeepSpeed: read from "
            "train_micro_batch_size_per_gpu when unset; PyTorch engines: required with enabled, except "
            "under the Hugging Face Trainer (per_device_train_batch_size) and Lightning (the train "
            "dataloader's batch_size), which fill it when unset. In the unit the noise scale is wanted "
            "in (samples, or tokens per micro-batch)."))
        ema_decay: float = Field(0.99, gt=0, lt=1, description=(
            "Decay of the two exponential moving averages (of |G|^2 and of tr(Sigma)) whose ratio is "
            "the exported noise scale, per sampled step."))

    @dataclass
    class Part(_Part):
        """Gradient noise scale of one sampled step (McCandlish et al. 2018, "An Empirical Model of
        Large-Batch Training", Appendix A), from the squared gradient norm at two batch sizes.

        Gradients are on the scale of the step's reduced gradient (the loss scale divided out):
        the small-batch gradient of a micro-batch is the one the reduced gradient is the mean of.

        Attributes:
            micro_batches: N, the micro-batch gradients of the step over all ranks.
            small_batch: B_small, samples per micro-batch (``noise_scale.micro_batch_size`` or
                DeepSpeed's ``train_micro_batch_size_per_gpu``).
            big_batch: B_big = N * B_small, the step's batch in samples.
            grad_sq_small: |G_small|^2, the mean squared norm of the N micro-batch gradients
                (grad^2).
            grad_sq_big: |G_big|^2, the squared norm of the step's reduced gradient (grad^2).
            true_grad_sq: this step's unbiased estimate of |G|^2,
                ``(B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)`` (grad^2; may be
                negative on a noisy step).
            noise_trace: this step's unbiased estimate of tr(Sigma), Sigma the per-sample gradient
                covariance, ``(|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)`` (grad^2).
            ema_true_grad_sq, ema_noise_trace: their exponential moving averages over the sampled
                steps (decay ``noise_scale.ema_decay``, bias-corrected as Adam's moments are).
            noise_scale: B_simple = ema_noise_trace / ema_true_grad_sq in samples, the critical
                batch size it implies (B_crit ~ B_noise >= B_simple); None while
                ema_true_grad_sq <= 0 (not enough signal yet).
            ema_steps: sampled steps the moving averages have seen.
        """

        micro_batches: int = 0
        small_batch: float = 0.0
        big_batch: float = 0.0
        grad_sq_small: float = 0.0
        grad_sq_big: float = 0.0
        true_grad_sq: float = 0.0
        noise_trace: float = 0.0
        ema_true_grad_sq: float = 0.0
        ema_noise_trace: float = 0.0
        noise_scale: float | None = None
        ema_steps: int = 0

    _when = condition("noise_scale", "`noise_scale.enabled: true`, after a sampled step with an estimate "
                      "(several micro-batches per step; see docs/signals.md)",
                      enabled=lambda c: c.noise_scale.enabled)
    METRICS = (
        gauge("distgrad_gradient_noise_scale", "samples", "Gradient noise scale B_simple = tr(Sigma) / |G|^2 "
              "(ratio of the two EMAs): the critical batch size it implies.", _when,
           doc="gradient noise scale `B_simple = EMA(tr(Sigma)) / EMA(|G|^2)` (McCandlish et al. 2018, Appendix A), in "
               "samples (the unit of `noise_scale.micro_batch_size`): about the critical batch size, above which a "
               "larger batch buys little; compare with `distgrad_gradient_noise_batch_size`. Absent while the "
               "|G|^2 average is not positive"),
        gauge("distgrad_gradient_noise_trace", "grad^2", "EMA of the per-step unbiased estimate of tr(Sigma), "
              "the trace of the per-sample gradient covariance.", _when),
        gauge("distgrad_gradient_noise_true_grad_sq", "grad^2", "EMA of the per-step unbiased estimate of |G|^2, the "
           "squared norm of the full-batch gradient.", _when),
        gauge("distgrad_gradient_noise_batch_size", "samples", "The step's batch (all micro-batches of all ranks): the "
           "big batch of the noise-scale estimate.", _when),
        gauge("distgrad_gradient_noise_micro_batch_size", "samples", "Samples per micro-batch: the small batch of the "
           "noise-scale estimate.", _when),
    )

    @staticmethod
    def samples(part: GradientNoiseScale.Part) -> dict[str, Any]:
        """The EMA noise scale (absent while the |G|^2 average is not positive), the two EMAs,
        and the two batch sizes."""
        return {"distgrad_gradient_noise_scale": part.noise_scale,
                "distgrad_gradient_noise_trace": part.ema_noise_trace,
                "distgrad_gradient_noise_true_grad_sq": part.ema_true_grad_sq,
                "distgrad_gradient_noise_batch_size": part.big_batch,
                "distgrad_gradient_noise_micro_batch_size": part.small_batch}

    @classmethod
    def build(cls, inst: Any) -> GradientNoiseScale | None:
        """``noise_scale.enabled``: the signal, or a ConfigError naming the key for an engine or a
        configuration it cannot serve."""
        cfg = inst.config.noise_scale
        if not cfg.enabled:
            return None
        engine = inst.source.engine_name
        why = None
        if engine not in SUPPORTED:
            why = f"engine {engine!r}"
        elif getattr(inst, "job", None) is not None:
            why = f"engine {engine!r} with parameters split over ranks (pipeline / experts)"
        elif engine == "fsdp1" and getattr(inst.source, "_own", None) is not None:
            why = "FSDP1 hybrid sharding"
        elif engine == "fsdp2" and getattr(getattr(inst.source, "mesh", None), "ndim", 1) != 1:
            why = "FSDP2 on a multi-dimensional mesh (HSDP, tensor parallel)"
        if why is not None:
            raise ConfigError(
                f"distgrad config: 'noise_scale.enabled' is not supported with {why}: the micro-batch gradients "
                f"before the reduction are known for {', '.join(SUPPORTED)} (FSDP1 without hybrid sharding, FSDP2 "
                "on a 1-D mesh) only; set noise_scale.enabled: false")
        b = cfg.micro_batch_size
        if b is None and engine == "deepspeed":
            b = int(inst.source.engine.train_micro_batch_size_per_gpu())
        if b is None:
            raise ConfigError(
                "distgrad config: 'noise_scale.micro_batch_size' is required with noise_scale.enabled on a PyTorch "
                "engine: set it to the samples per micro-batch on each rank (the noise scale is in that unit)")
        return cls(b, cfg.ema_decay, inst.world_size, engine)

    def __init__(self, micro_batch_size: float, decay: float, world_size: int, engine_name: str) -> None:
        self.b = float(micro_batch_size)
        self.decay = float(decay)
        self.world_size = int(world_size)
        self.engine_name = engine_name
        self.norms = MicroBatchNorms()
        self.ema_g2 = 0.0
        self.ema_tr = 0.0
        self.ema_steps = 0
        self._warned: set[str] = set()

    @property
    def sum_size(self) -> int:
        return 3

    @property
    def max_size(self) -> int:
        return 1

    def attach(self, inst: Any, module: Any) -> Callable[[], None] | None:
        lazy = _leaves(self.engine_name, module, self.norms)

        def undo() -> None:
            self.norms.remove()
            if lazy is not None:
                lazy()
        return undo

    def skip(self, inst: Any, step: int) -> None:
        self.norms.reset()

    def after_step(self, inst: Any, step_applied: bool) -> None:
        self.norms.reset()  # a refused or failed step never reached local(): start the next afresh

    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        acc, micro, failed = self.norms.take(device)
        if failed:
            raise RuntimeError("a micro-batch gradient hook failed")
        counts = torch.tensor([float(micro), 1.0], dtype=torch.float64).to(device, non_blocking=True)
        s = torch.cat([acc.reshape(1), counts])
        m = torch.tensor([-float(micro)], dtype=torch.float64).to(device, non_blocking=True)
        return s, m

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("distgrad: gradient noise scale: " + msg, *args)

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray,
               grad_scale: float) -> None:
        hooks_sq, n_total, ranks = float(sum_part[0]), int(round(sum_part[1])), int(round(sum_part[2]))
        fewest = -float(max_part[0])
        if rec.overflow or not np.isfinite(rec.grad_norm) or not math.isfinite(hooks_sq):
            return  # an fp16 overflow / non-finite step: no estimate, the averages unchanged
        if fewest < 1:
            self._warn_once("none", "a rank's hooks saw no micro-batch gradient on step %d (gradients that do "
                            "not reach the model's parameters through autograd?): no estimate", rec.step)
            return
        if n_total < 2:
            self._warn_once("one", "one micro-batch per step (no gradient accumulation, one rank): the "
                            "estimator needs two batch sizes; nothing is exported")
            return
        # the loss scale of the hooked gradients. DeepSpeed: the one the reduced pieces carry
        # (engine.backward scales the loss by it under ZeRO 1-3 fp16 and not at stage 0, whose
        # pieces are unscaled too; tests/test_noise_scale_multirank.py pins both). PyTorch:
        # GradScaler's scale read before scaler.step (StepRecord.loss_scale), which unscales the
        # pieces before distgrad reads them (the fused path's leftover scale is grad_scale)
        hook_scale = grad_scale if self.engine_name == "deepspeed" else float(rec.loss_scale or 1.0)
        c = n_total / ranks  # micro-batch gradient on the reduced gradient's scale: (N/W) h
        small = c * c * hooks_sq / n_total / (hook_scale * hook_scale)
        big = float(rec.grad_norm) ** 2
        g2, tr = estimate(small, big, n_total, self.b)
        d = self.decay
        self.ema_g2 = d * self.ema_g2 + (1 - d) * g2
        self.ema_tr = d * self.ema_tr + (1 - d) * tr
        self.ema_steps += 1
        corr = 1.0 - d ** self.ema_steps  # Adam's bias correction (cancels in the ratio)
        ema_g2, ema_tr = self.ema_g2 / corr, self.ema_tr / corr
        rec.noise_scale = GradientNoiseScale.Part(
            micro_batches=n_total, small_batch=self.b, big_batch=n_total * self.b, grad_sq_small=small,
            grad_sq_big=big, true_grad_sq=g2, noise_trace=tr, ema_true_grad_sq=ema_g2, ema_noise_trace=ema_tr,
            noise_scale=(ema_tr / ema_g2 if ema_g2 > 0 else None), ema_steps=self.ema_steps)

    def state_dict(self) -> dict:
        return {"ema_g2": self.ema_g2, "ema_tr": self.ema_tr, "ema_steps": self.ema_steps}

    def load_state_dict(self, state: dict) -> None:
        self.ema_g2 = float(state["ema_g2"])
        self.ema_tr = float(state["ema_tr"])
        self.ema_steps = int(state["ema_steps"])
