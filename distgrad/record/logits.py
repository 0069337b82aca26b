"""Logit precursors (:mod:`distgrad.signals.logits`): the typed part ``StepRecord.logits``."""

from __future__ import annotations

from dataclasses import dataclass, field

from distgrad.record.base import _Part


@dataclass
class LogitStats(_Part):
    """Attention and output logit statistics of a sampled step, over the training forward
    passes of the step's micro-batches on every rank (max over ranks; sums over ranks).

    Attributes:
        attention_max: ``{layer: max over heads, batch, query and allowed key positions of
            q . k * scale}`` (the pre-softmax attention logit, dimensionless; masked positions
            left out); layers whose attention was not observed on some rank are left out.
        attention_head_max: ``{layer: [per-head max]}`` (heads in the module's order), for the
            layers whose head count distgrad knows.
        output_abs_max: ``max |logit|`` of the output head's logits (dimensionless), or None when
            the output head is not observed.
        z_mean, z_sq_mean, z_max: over every position the head computed (padding included),
            ``z = log sum_v exp(logit_v)`` (nats): mean, mean of ``z^2`` (PaLM's z-loss
            quantity, arXiv 2204.02311 sec. 5) and max; None when not observed.
        positions: the number of positions the z statistics are over (all ranks).
    """

    attention_max: dict[str, float] = field(default_factory=dict)
    attention_head_max: dict[str, list[float]] = field(default_factory=dict)
    output_abs_max: float | None = None
    z_mean: float | None = None
    z_sq_mean: float | None = None
    z_max: float | None = None
    positions: int = 0
