"""The record part of the gradient value distribution (:mod:`distgrad.signals.histogram`): per
layer, a histogram of log2|g| over fixed exponent bins plus the zero, underflow and non-finite
counts, exact over all ranks (a typed part of :class:`distgrad.record.StepRecord`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from distgrad.record.base import _Part


@dataclass
class GradHistogram(_Part):
    """Distribution of the reduced gradient's values on one sampled step, per layer.

    Bins are those of the gradient *as the engine holds it* (loss-scaled under fp16): exponent
    bin ``k`` counts the elements with ``2**e <= |g_held| < 2**(e+1)``, ``e = min_exponent + k``.
    The gradient itself is ``g_held / 2**scale_log2``, so the same bin holds the unscaled values
    in ``[2**(e - scale_log2), 2**(e + 1 - scale_log2))``: integer exponents when the loss scale
    is a power of two (DeepSpeed's and ``torch.amp.GradScaler``'s are), fractional ones
    otherwise (the counts are exact either way; only the edges move). Every count is an exact
    element count over all ranks (each element counted once). Lists are per layer, in the
    order of :attr:`layers`.

    Attributes:
        dtype: the training dtype the underflow counts refer to (``"fp16"``, ``"bf16"``,
            ``"fp32"``, ``"fp64"``; ``histogram.dtype``).
        tiny: the smallest positive normal value of ``dtype`` (2**-14 for fp16, 2**-126 for
            bf16 and fp32), in held (loss-scaled) units.
        min_exponent, max_exponent: the exponent bins are ``min_exponent <= e < max_exponent``.
        scale_log2: ``log2(grad_scale)`` of the step (0 without loss scaling).
        layers: layer labels (:func:`distgrad.naming.grouping.group_keys` at ``"layer"``).
        counts: ``[L][max_exponent - min_exponent]`` exponent-bin counts.
        below: ``[L]`` elements with ``0 < |g_held| < 2**min_exponent``.
        above: ``[L]`` finite elements with ``|g_held| >= 2**max_exponent``.
        zeros: ``[L]`` elements exactly 0 (either sign).
        underflow: ``[L]`` elements with ``0 < |g_held| < tiny``: subnormal in the training
            dtype, or flushed to 0 had they been held in it (a subset of ``below`` and the
            lowest exponent bins; zeros are not counted).
        nonfinite: ``[L]`` NaN and +/-Inf elements.
        numel: ``[L]`` elements (``zeros + below + sum(counts) + above + nonfinite``).
    """

    dtype: str
    tiny: float
    min_exponent: int
    max_exponent: int
    scale_log2: float = 0.0
    layers: list[str] = field(default_factory=list)
    counts: list[list[int]] = field(default_factory=list)
    below: list[int] = field(default_factory=list)
    above: list[int] = field(default_factory=list)
    zeros: list[int] = field(default_factory=list)
    underflow: list[int] = field(default_factory=list)
    nonfinite: list[int] = field(default_factory=list)
    numel: list[int] = field(default_factory=list)

    def exponents(self) -> list[int]:
        """The lower exponents ``e`` of the exponent bins (held units), length
        ``max_exponent - min_exponent``."""
        return list(range(self.min_exponent, self.max_exponent))

    def log2_edges(self) -> np.ndarray:
        """Edges of the exponent bins in log2 of the *unscaled* gradient: float64
        ``[max_exponent - min_exponent + 1]``, ``e - scale_log2``."""
        return np.arange(self.min_exponent, self.max_exponent + 1, dtype=np.float64) - self.scale_log2

    def total(self) -> GradHistogram:
        """The whole model: every list summed over the layers (one layer named ``"global"``)."""
        def s(v: list[int]) -> list[int]:
            return [int(sum(v))]
        cols = [int(x) for x in np.asarray(self.counts, dtype=np.int64).reshape(len(self.layers), -1).sum(axis=0)] \
            if self.layers else [0] * (self.max_exponent - self.min_exponent)
        return GradHistogram(self.dtype, self.tiny, self.min_exponent, self.max_exponent, self.scale_log2, ["global"],
                             [cols], s(self.below), s(self.above), s(self.zeros), s(self.underflow),
                             s(self.nonfinite), s(self.numel))

    def underflow_ratio(self) -> dict[str, float]:
        """``{layer: underflow / numel}`` (NaN for a layer without elements), in [0, 1]."""
        return {k: (u / n if n else math.nan) for k, u, n in zip(self.layers, self.underflow, self.numel)}

    def zero_ratio(self) -> dict[str, float]:
        """``{layer: zeros / numel}`` (NaN for a layer without elements), in [0, 1]."""
        return {k: (z / n if n else math.nan) for k, z, n in zip(self.layers, self.zeros, self.numel)}
