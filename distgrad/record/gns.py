"""The record part of the gradient noise scale (:mod:`distgrad.signals.noise_scale`): a typed part
of :class:`distgrad.record.StepRecord` (field ``noise_scale``)."""

from __future__ import annotations

from dataclasses import dataclass

from distgrad.record.base import _Part


@dataclass
class NoiseScale(_Part):
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
