"""Gradient value distribution: per layer, a histogram of log2|g| over fixed exponent bins, with
the zero, underflow (below the training dtype's smallest normal) and non-finite counts.

Counts of a fixed set of bins add across shards, so the histogram rides in the sampled step's
SUM collective as a :class:`~distgrad.signals.PackedSignal` and is exact under any sharding
(each element is counted once, on the rank that owns it).

How it is computed, on the device, with no host synchronisation (on CPU by one C function,
:mod:`distgrad.signals.histogram_native`, that does the same in one pass): each piece is read as the bit
pattern of its float format (bf16 and fp16 pieces are first widened to fp32, which is exact), its
biased exponent field ``bits(|x|) >> mantissa_bits`` is counted into a per-layer table of raw
exponents (``index_add_`` into a table of fixed size; ``torch.bincount`` is not used because on
CUDA it reads its input's extrema on the host to size its output, a host synchronisation; 256
entries for fp32 bits, 2048 for fp64 bits), and the number of
non-zero elements of each piece is added to its layer (``count_nonzero``). After the loop a
float64 matrix product maps the raw exponents onto the fixed bins (an exact integer sum). For a
normal value ``floor(log2|g|)`` is the unbiased exponent, so the bins are exact: no ``log2`` is
evaluated. Raw exponent 0 holds the zeros and the held format's subnormals (their difference is
the non-zero count), the all-ones exponent the NaN and Inf elements.

Per layer the SUM part holds ``[Z, U, B, E_lo .. E_hi-1, A, N, nonzero]`` (``n + 6`` float64,
``n = max_exponent - min_exponent``): Z raw exponent 0, U normal values below
``min(2**lo, tiny)``, B normal values in ``[tiny, 2**lo)`` (when ``tiny < 2**lo``), E the exponent
bins, A finite values ``>= 2**hi``, N non-finite, and the count of non-zero elements.
Source of the method: the IEEE 754 binary formats (exponent field = ``floor(log2|x|)`` + bias for
normal numbers); TensorBoard's gradient histograms and the "gradient distribution" of the
LLaMA-Factory article are the displays it feeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from distgrad.config.sections import Section, SettingError
from distgrad.export.metrics import condition, gauge
from distgrad.naming.grouping import group_keys
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal, histogram_native

#: training dtype name -> (torch dtype, exponent of its smallest positive normal value)
TRAINING_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "fp16": (torch.float16, -14), "bf16": (torch.bfloat16, -126), "fp32": (torch.float32, -126),
    "fp64": (torch.float64, -1022)}
_NAMES = {v[0]: k for k, v in TRAINING_DTYPES.items()}

#: raw bit formats read: dtype -> (integer view, mantissa bits, exponent mask, bias, smallest normal exponent)
_FORMATS = {torch.float32: (torch.int32, 23, 0xFF, 127, -126), torch.float64: (torch.int64, 52, 0x7FF, 1023, -1022)}

#: elements read per kernel call of the torch path (bounds its temporaries to 16 bytes per element of one chunk)
CHUNK = 1 << 22

#: ``"auto"``: contiguous CPU pieces go through the native kernel (:mod:`histogram_native`, one
#: pass) when it compiled and passed its check, everything else through torch kernels; ``"torch"``:
#: torch kernels only (tests). Both give the same counts.
KERNEL = "auto"


class GradHistogramSignal(PackedSignal):
    """Per-layer histogram of log2|g| (see the module docstring for the method and the layout).

    Args:
        names: the P parameter names (``inst.names``), grouped into layers by
            :func:`distgrad.naming.grouping.group_keys` (``"layer"``, with ``rules``).
        min_exponent, max_exponent: exponent bins ``lo <= e < hi`` of the held gradient
            (``-126 <= lo < hi <= 128``).
        dtype: training dtype name (``"fp16"``, ``"bf16"``, ``"fp32"``, ``"fp64"``) whose smallest
            normal value bounds the underflow count.
        rules: user naming rules (``naming.rules``).

    Cost per sampled step: on CPU (native kernel) one read of each local gradient piece; with
    torch kernels (CUDA) two reads (the exponent count and the non-zero count) and two
    temporaries per chunk of at most :data:`CHUNK` elements (its absolute value, bf16/fp16
    widened to fp32, and its exponents); no extra collective; ``L * (hi - lo + 6)`` float64 in
    the SUM collective (L layers).

    Raises:
        ValueError: bad exponent range or dtype.
    """

    name = "grad_histogram"

    class Config(Section):
        """Gradient value distribution (distgrad.signals.histogram): per layer and globally, a histogram of
        log2|g| over fixed exponent bins, and the zero, underflow and non-finite counts, carried in the
        sampled step's SUM collective."""

        section_key: ClassVar[str] = "histogram"
        enabled: bool = Field(False, description=(
            "Compute the histogram on every sampled step (about five elementwise passes over the local "
            "gradient shard and (max_exponent - min_exponent + 6) float64 per layer in the SUM collective; "
            "see docs/signals.md for the measured cost)."))
        min_exponent: int = Field(-64, ge=-126, le=127, description=(
            "Lowest exponent bin: |g| in [2**e, 2**(e+1)) for min_exponent <= e < max_exponent, of the "
            "gradient as the engine holds it (loss-scaled under fp16); smaller non-zero values are "
            "counted in one 'below' bin. At least -126 (the smallest fp32/bf16 normal exponent)."))
        max_exponent: int = Field(16, ge=-125, le=128, description=(
            "One past the highest exponent bin; larger finite values are counted in one 'above' bin "
            "(16 covers every finite fp16 value, 128 every fp32/bf16 one)."))
        dtype: Literal["auto", "fp16", "bf16", "fp32", "fp64"] = Field("auto", description=(
            "The training dtype the underflow counts refer to (|g| below its smallest normal, as held, "
            "i.e. loss-scaled): auto = the dtype the engine's backward computes gradients in (DeepSpeed "
            "fp16/bf16, FSDP MixedPrecision param_dtype, else the parameters' dtype). Set it under "
            "torch.autocast, whose dtype distgrad cannot see."))

        @model_validator(mode="after")
        def _range(self) -> GradHistogramSignal.Config:
            if self.max_exponent <= self.min_exponent:
                raise SettingError("max_exponent", f"must be greater than min_exponent ({self.min_exponent})",
                                   self.max_exponent)
            return self

    @dataclass
    class Part(_Part):
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

        def total(self) -> GradHistogramSignal.Part:
            """The whole model: every list summed over the layers (one layer named ``"global"``)."""
            def s(v: list[int]) -> list[int]:
                return [int(sum(v))]
            cols = [int(x) for x in np.asarray(self.counts, dtype=np.int64).reshape(len(self.layers), -1).sum(axis=0)] \
                if self.layers else [0] * (self.max_exponent - self.min_exponent)
            return type(self)(self.dtype, self.tiny, self.min_exponent, self.max_exponent, self.scale_log2, ["global"],
                                 [cols], s(self.below), s(self.above), s(self.zeros), s(self.underflow),
                                 s(self.nonfinite), s(self.numel))

        def underflow_ratio(self) -> dict[str, float]:
            """``{layer: underflow / numel}`` (NaN for a layer without elements), in [0, 1]."""
            return {k: (u / n if n else math.nan) for k, u, n in zip(self.layers, self.underflow, self.numel)}

        def zero_ratio(self) -> dict[str, float]:
            """``{layer: zeros / numel}`` (NaN for a layer without elements), in [0, 1]."""
            return {k: (z / n if n else math.nan) for k, z, n in zip(self.layers, self.zeros, self.numel)}

    #: the record attribute (``StepRecord.grad_histogram``; the section is ``histogram``)
    part_name = "grad_histogram"

    _when = condition("histogram", "`histogram.enabled: true`, after a sampled step",
                      enabled=lambda c: c.histogram.enabled)
    METRICS = (
        gauge("distgrad_grad_underflow_ratio", "ratio", "Fraction of all gradient elements that are non-zero but "
              "below the smallest normal value of the training dtype (as held, loss-scaled).", _when,
              doc="`distgrad_layer_grad_underflow_ratio` over the whole model"),
        gauge("distgrad_grad_zero_ratio", "ratio", "Fraction of all gradient elements exactly 0.", _when),
        gauge("distgrad_layer_grad_underflow_ratio", "ratio", "Fraction of the layer's gradient elements that are "
              "non-zero but below the smallest normal value of the training dtype (as held, loss-scaled).", _when,
              ("layer",),
              doc="fraction of the layer's gradient elements with `0 < |g| < tiny`, `tiny` the smallest normal value "
                  "of the training dtype (`histogram.dtype`; 2^-14 for fp16, 2^-126 for bf16/fp32), compared with the "
                  "gradient as held, i.e. loss-scaled under fp16: subnormal in that dtype, or lost to 0 (see "
                  "docs/signals.md)"),
    )

    @staticmethod
    def samples(part: GradHistogramSignal.Part) -> dict[str, Any]:
        """The model's underflow and zero ratios (``"global"`` of :meth:`Part.total`) and the
        underflow ratio per layer (NaN for a layer without elements, as the ratios give it)."""
        total = part.total()
        return {"distgrad_grad_underflow_ratio": total.underflow_ratio()["global"],
                "distgrad_grad_zero_ratio": total.zero_ratio()["global"],
                "distgrad_layer_grad_underflow_ratio": part.underflow_ratio()}

    @classmethod
    def build(cls, inst: Any) -> GradHistogramSignal | None:
        """``histogram.enabled``: the signal for ``inst``'s parameters (``histogram.dtype``
        ``auto``: the source's compute dtype), else None.

        Raises:
            ValueError: as the constructor.
        """
        cfg = inst.config.histogram
        if not cfg.enabled:
            return None
        dtype = cfg.dtype
        if dtype == "auto":
            dtype = _NAMES.get(getattr(inst.source, "compute_dtype", torch.float32), "fp32")
        return cls(inst.names, cfg.min_exponent, cfg.max_exponent, dtype, inst.config.naming.tuples)

    def __init__(self, names: Sequence[str], min_exponent: int, max_exponent: int, dtype: str,
                 rules: Any = None) -> None:
        if not -126 <= min_exponent < max_exponent <= 128:
            raise ValueError(f"histogram exponents need -126 <= min_exponent < max_exponent <= 128, got "
                             f"{min_exponent}, {max_exponent}")
        if dtype not in TRAINING_DTYPES:
            raise ValueError(f"histogram.dtype must be one of {sorted(TRAINING_DTYPES)}, got {dtype!r}")
        self.lo, self.hi, self.dtype = int(min_exponent), int(max_exponent), dtype
        self.et = TRAINING_DTYPES[dtype][1]
        keys = group_keys(list(names), "layer", rules)
        self.layers: list[str] = list(dict.fromkeys(keys))
        index = {k: j for j, k in enumerate(self.layers)}
        self.group = [index[k] for k in keys]
        self.n = self.hi - self.lo
        self.nb = self.n + 5  # Z, U, B, E..., A, N
        self._maps: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @property
    def sum_size(self) -> int:
        return len(self.layers) * (self.nb + 1)

    def _map(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """float64 ``[mask + 1, nb]`` 0/1 matrix from the raw biased exponents of bit format
        ``dtype`` to the bins (module docstring), built on ``device`` with device operations (no
        host-to-device copy, which would wait for the device) and cached per device."""
        key = (dtype, device)
        m = self._maps.get(key)
        if m is None:
            _, _, mask, bias, _ = _FORMATS[dtype]
            raw = torch.arange(mask + 1, device=device)
            e = raw - bias  # floor(log2|x|) of a normal value
            b = torch.full_like(raw, 3 + self.n)  # finite, >= 2**hi
            b = torch.where(e < self.hi, 3 + e - self.lo, b)
            b = torch.where(e < self.lo, torch.full_like(raw, 2), b)
            b = torch.where(e < min(self.lo, self.et), torch.full_like(raw, 1), b)
            b = torch.where(raw == mask, torch.full_like(raw, self.nb - 1), b)  # NaN, Inf
            b = torch.where(raw == 0, torch.zeros_like(raw), b)  # zeros and subnormals of the format
            m = torch.zeros((mask + 1, self.nb), dtype=torch.float64, device=device)
            m = self._maps[key] = m.scatter_(1, b.unsqueeze(1), 1.0)
        return m

    @staticmethod
    def _torch_counts(todo: Sequence[tuple[torch.Tensor, int, torch.dtype]], L: int, device: torch.device
                      ) -> tuple[dict[torch.dtype, torch.Tensor], torch.Tensor]:
        """Raw-exponent counts per bit format (int64 ``[L, mask + 1]``) and non-zero counts (int64
        ``[L]``) with torch kernels, on ``device``, no host sync: per chunk of :data:`CHUNK`
        elements, ``abs`` (bf16/fp16 widened to fp32 first), a shift, an ``index_add_``."""
        raw: dict[torch.dtype, torch.Tensor] = {}
        nonzero = torch.zeros(L, dtype=torch.int64, device=device)
        one = torch.ones(1, dtype=torch.int64, device=device)
        for x, g, dt in todo:
            fmt = _FORMATS[dt]
            if dt not in raw:
                raw[dt] = torch.zeros((L, fmt[2] + 1), dtype=torch.int64, device=device)
            row = raw[dt][g]
            widen = x.dtype != dt
            for s in range(0, x.numel(), CHUNK):
                c = x[s:s + CHUNK].float().abs_() if widen else x[s:s + CHUNK].abs()  # sign cleared
                e = c.view(fmt[0]) >> fmt[1]  # the biased exponent
                row.index_add_(0, e, one.expand(e.numel()))
            nonzero[g:g + 1].add_(torch.count_nonzero(x))
        return raw, nonzero

    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, None]:
        """This rank's counts, float64 ``[L * (nb + 1)]`` on ``device`` (no host sync)."""
        L = len(self.layers)
        todo: list[tuple[torch.Tensor, int, torch.dtype]] = []  # (flat piece, layer, bit format)
        for i, p in enumerate(pieces):
            if p is None or p.numel() == 0:
                continue
            x = p.detach().reshape(-1)
            dt = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype  # widened exactly
            fmt = _FORMATS.get(dt)
            if fmt is None:
                raise TypeError(f"gradient histogram: unsupported gradient dtype {p.dtype}")
            if fmt[4] > self.et:  # its subnormals would not all be below the training dtype's normals
                raise ValueError(f"gradient histogram: {p.dtype} gradients under training dtype {self.dtype}")
            todo.append((x, self.group[i], dt))
        fn = histogram_native.native() if KERNEL == "auto" and device.type == "cpu" else None
        if fn is not None and all(x.device.type == "cpu" and x.is_contiguous() for x, _, _ in todo):
            raw32, raw64, nonzero = histogram_native.run(fn, [x for x, _, _ in todo], [g for _, g, _ in todo], L)
            raw = {torch.float32: raw32}
            if any(dt == torch.float64 for _, _, dt in todo):
                raw[torch.float64] = raw64
        else:
            raw, nonzero = self._torch_counts(todo, L, device)
        bins = torch.zeros((L, self.nb), dtype=torch.float64, device=device)
        for dt in sorted(raw, key=str):  # fixed order
            bins += raw[dt].to(torch.float64) @ self._map(dt, device)
        return torch.cat([bins, nonzero.to(torch.float64).unsqueeze(1)], dim=1).reshape(-1), None

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray, grad_scale: float) -> None:
        rec.grad_histogram = self.decode(sum_part, grad_scale)

    def decode(self, sum_part: np.ndarray, grad_scale: float) -> GradHistogramSignal.Part:
        """The record part from the reduced SUM part (float64 ``[L * (nb + 1)]``) and the step's
        ``grad_scale`` (> 0).

        Raises:
            ValueError: a count that is not a non-negative integer (a corrupted reduction).
        """
        a = np.asarray(sum_part, dtype=np.float64).reshape(len(self.layers), self.nb + 1)
        if not (np.all(a >= 0) and np.all(a == np.round(a))):
            raise ValueError("gradient histogram: reduced counts are not non-negative integers")
        c = a.astype(np.int64)
        z, u, b = c[:, 0], c[:, 1], c[:, 2]
        ebins, above, nonfinite, nz = c[:, 3:3 + self.n], c[:, 3 + self.n], c[:, 4 + self.n], c[:, 5 + self.n]
        numel = c[:, :self.nb].sum(axis=1)
        zeros = numel - nz
        held_sub = z - zeros  # non-zero values below the held format's smallest normal
        under = held_sub + u
        if self.et > self.lo:
            under = under + ebins[:, :min(self.et, self.hi) - self.lo].sum(axis=1)
        scale = float(grad_scale) if grad_scale else 1.0
        return GradHistogramSignal.Part(
            dtype=self.dtype, tiny=math.ldexp(1.0, self.et), min_exponent=self.lo, max_exponent=self.hi,
            scale_log2=math.log2(scale), layers=list(self.layers), counts=ebins.tolist(),
            below=(held_sub + u + b).tolist(), above=above.tolist(), zeros=zeros.tolist(),
            underflow=under.tolist(), nonfinite=nonfinite.tolist(), numel=numel.tolist())



#: the record part (``StepRecord.grad_histogram``), by its earlier name
GradHistogram = GradHistogramSignal.Part
