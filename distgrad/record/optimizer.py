"""The record part of the optimizer-aware signals (:mod:`distgrad.signals.adam`):
``StepRecord.optimizer_signals``."""

from __future__ import annotations

from dataclasses import dataclass, field

from distgrad.record.base import _Part


@dataclass
class OptimizerSignals(_Part):
    """Adam-family signals of one sampled step, exact over all ranks' shards (see
    :mod:`distgrad.signals.adam` for the definitions). ``g`` is the reduced, unscaled, pre-clip
    gradient read at the boundary; ``m``, ``v`` Adam's ``exp_avg`` / ``exp_avg_sq`` before this
    step's update; ``v_hat = v / (1 - beta2**t)`` with the optimizer's own step count ``t`` (the
    updates already applied) and ``beta2``; ``d = max(v_hat, eps**2)``.

    Attributes:
        optimizer: the optimizer's class name (``"AdamW"``, ``"FusedAdam"``, ...).
        spike_threshold: theta of the spike fraction (``optimizer_signals.spike_threshold``).
        clip_ratio: ``c = min(1, max_norm / (|g| + 1e-6))`` of global-norm clipping (the engine's
            threshold or ``clip.max_grad_norm``; 1.0 when none is known), applied to the update RMS.
        elements: gradient elements with optimizer state (over all ranks, each counted once).
        elements_without_state: gradient elements the optimizer holds no moment for (not in
            the optimizer, or never stepped); left out of every value below.
        update_rms: ``clip_ratio * sqrt(mean(g**2 / d))``: the RMS of the update of the clipped
            gradient the optimizer applies (dimensionless; ~1 when the second moment tracks the
            gradient, >> 1 when the gradient outgrows it: Wortsman et al. 2023).
        spike_fraction: fraction of elements with ``g**2 > spike_threshold * d`` (pre-clip ``g``);
            NaN on a step the clip scales by ``clip_ratio < 0.99``: ``v`` tracks the *clipped*
            gradient, so every pre-clip ratio ``g**2 / d`` is inflated by about ``1 / clip_ratio**2``
            and the count would read as spikes on a healthy, steadily clipped run (not exported to
            Prometheus then; the raw count is kept in ``spike_fraction_preclip``).
        spike_fraction_preclip: the same fraction on every step, clipped or not (JSONL only).
        grad_momentum_cosine: ``g . m / (|g| |m|)`` (NaN when a norm is 0).
        exp_avg_norm, exp_avg_sq_norm: L2 norms of the raw states ``m`` (gradient unit) and ``v``
            (gradient unit squared).
        fisher_trace: ``sum(v_hat)``: trace of the empirical diagonal Fisher estimate Adam keeps
            (gradient unit squared; of the mini-batch gradient, Kunstner et al. 2019's caveats).
        layer_*: the same per layer label (``{layer: value}``; ``layer_spike_fraction`` is empty
            on a step the clip scales, like ``spike_fraction``).
        fisher_top_layers: the ``optimizer_signals.top_layers`` layers of largest Fisher trace,
            largest first.
    """

    optimizer: str = ""
    spike_threshold: float = float("nan")
    clip_ratio: float = 1.0
    elements: float = 0.0
    elements_without_state: float = 0.0
    update_rms: float = float("nan")
    spike_fraction: float = float("nan")
    spike_fraction_preclip: float = float("nan")
    grad_momentum_cosine: float = float("nan")
    exp_avg_norm: float = float("nan")
    exp_avg_sq_norm: float = float("nan")
    fisher_trace: float = float("nan")
    layer_update_rms: dict[str, float] = field(default_factory=dict)
    layer_spike_fraction: dict[str, float] = field(default_factory=dict)
    layer_grad_momentum_cosine: dict[str, float] = field(default_factory=dict)
    layer_exp_avg_norm: dict[str, float] = field(default_factory=dict)
    layer_exp_avg_sq_norm: dict[str, float] = field(default_factory=dict)
    layer_fisher_trace: dict[str, float] = field(default_factory=dict)
    fisher_top_layers: list[str] = field(default_factory=list)
