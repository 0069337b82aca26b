"""The gradient value distribution of a run log for the report (``StepRecord.grad_histogram``,
written with ``histogram.enabled``): per layer and for the whole model, the log2|g| bin counts
summed per bucket of steps (downsampled like every other series of the report), and a heat-map
of bins over steps for the whole model and the layers with the most underflow.

Bounded memory: one :class:`~distgrad.report.downsample.Downsampler` of count columns per layer
(at most ``max_points`` buckets) on a fixed grid of *unscaled* exponents
``[min_exponent - SHIFT_MARGIN, max_exponent)`` plus one column below and one above it: a
record's exponent bin ``e`` lands in column ``e - round(scale_log2)`` (exact for the power-of-two
loss scales of DeepSpeed and ``torch.amp.GradScaler``; a fractional scale is rounded to the
nearest whole exponent, said in the caption), its ``below``/``above`` counts and anything beyond
the grid in the edge columns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distgrad.record import StepRecord
from distgrad.report.downsample import Downsampled, Downsampler

#: the grid reaches this many exponents below ``min_exponent`` (fp16 loss scales up to 2**32)
SHIFT_MARGIN = 32
#: at most this many layers get a heat-map of their own (those with the highest underflow ratio)
MAX_LAYER_MAPS = 3


@dataclass
class HistogramReport:
    """The gradient value distribution of a run.

    Attributes:
        exponents: int ``[C - 2]``, the unscaled exponent of each inner grid column (bin
            ``[2**e, 2**(e+1))``); column 0 holds everything below, column ``C - 1`` everything above.
        series: name (``"global"`` and each layer) -> downsampled counts (``counts`` ``[B, C]``,
            summed over the records of each bucket).
        underflow_ratio: name -> underflow elements / elements over the run.
        zero_ratio: name -> zero elements / elements over the run.
        dtype: the training dtype of the underflow counts (last record); fractional: whether a
            record had a loss scale that is not a power of two.
    """

    exponents: np.ndarray
    series: dict[str, Downsampled] = field(default_factory=dict)
    underflow_ratio: dict[str, float] = field(default_factory=dict)
    zero_ratio: dict[str, float] = field(default_factory=dict)
    dtype: str = ""
    fractional: bool = False

    def top_layers(self, k: int = MAX_LAYER_MAPS) -> list[str]:
        """The ``k`` layers with the highest run underflow ratio (ties: first seen), those with none left out."""
        lay = [(n, r) for n, r in self.underflow_ratio.items() if n != "global" and r > 0]
        return [n for n, _ in sorted(lay, key=lambda t: -t[1])[:k]]


class HistogramAccumulator:
    """Folds records' ``grad_histogram`` parts into a :class:`HistogramReport` (file order)."""

    def __init__(self, max_points: int = 1024) -> None:
        self.max_points = max_points
        self._lo: int | None = None
        self._hi = 0
        self._ds: dict[str, Downsampler] = {}
        self._tot: dict[str, np.ndarray] = {}  # name -> [underflow, zeros, numel]
        self._dtype = ""
        self._fractional = False

    def add(self, r: StepRecord) -> None:
        h = r.grad_histogram
        if h is None:
            return
        if self._lo is None:
            self._lo, self._hi = h.min_exponent - SHIFT_MARGIN, h.max_exponent
        k = int(round(h.scale_log2))
        self._fractional |= k != h.scale_log2
        self._dtype = h.dtype
        ncol = self._hi - self._lo + 2
        cols = np.clip(np.arange(h.min_exponent, h.max_exponent) - k - self._lo + 1, 0, ncol - 1)
        for part in (h.total(), h):
            for j, name in enumerate(part.layers):
                row = np.zeros(ncol)
                np.add.at(row, cols, np.asarray(part.counts[j], dtype=np.float64))
                row[0] += part.below[j]
                row[-1] += part.above[j]
                ds = self._ds.get(name)
                if ds is None:
                    ds = self._ds[name] = Downsampler(0, ncol, self.max_points)
                ds.add(int(r.step), np.zeros(0), row)
                t = self._tot.setdefault(name, np.zeros(3))
                t += (part.underflow[j], part.zeros[j], part.numel[j])

    def result(self) -> HistogramReport | None:
        """The report, or None when no record held a histogram."""
        if self._lo is None:
            return None
        with np.errstate(invalid="ignore", divide="ignore"):
            under = {n: float(t[0] / t[2]) for n, t in self._tot.items()}
            zero = {n: float(t[1] / t[2]) for n, t in self._tot.items()}
        return HistogramReport(np.arange(self._lo, self._hi), {n: d.result() for n, d in self._ds.items()},
                               under, zero, self._dtype, self._fractional)


def render(rep: HistogramReport, subplots: Any) -> tuple[Any, str]:
    """Heat-maps of log2|g| bins (rows) over steps (columns), colour = log10 of the fraction of the
    bucket's non-zero finite elements in the bin; the whole model first, then the
    :meth:`HistogramReport.top_layers`. Returns ``(figure, caption)``."""
    import matplotlib.colors as mcolors

    names = ["global"] + rep.top_layers()
    fig, axes = subplots(len(names), 1, figsize=(11, 3.2 * len(names)), squeeze=False)
    yedges = np.concatenate([[rep.exponents[0] - 1], rep.exponents, [rep.exponents[-1] + 1, rep.exponents[-1] + 2]])
    for ax, name in zip(axes[:, 0], names):
        ds = rep.series[name]
        counts = ds.counts
        used = np.flatnonzero(counts.sum(axis=0))
        if used.size == 0:
            ax.text(0.5, 0.5, f"{name}: no non-zero finite gradient element", ha="center", va="center",
                    transform=ax.transAxes)
            continue
        lo, hi = max(used[0] - 1, 0), min(used[-1] + 2, counts.shape[1])
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = counts / counts.sum(axis=1, keepdims=True)
            data = np.log10(frac[:, lo:hi])
        data[~np.isfinite(data)] = np.nan
        xedges = np.append(ds.step_first, ds.step_last[-1] + 1).astype(np.float64)
        if not np.all(np.diff(xedges) > 0):  # restarted run: steps not increasing -> index axis
            xedges = np.arange(len(ds.step_first) + 1, dtype=np.float64)
        m = ax.pcolormesh(xedges, yedges[lo:hi + 1], np.ma.masked_invalid(data.T), cmap="magma",
                          norm=mcolors.Normalize(vmin=max(np.nanmin(data), -8.0), vmax=0.0), shading="flat")
        fig.colorbar(m, ax=ax, label="log10(fraction)")
        u = rep.underflow_ratio.get(name, float("nan"))
        ax.set_title(f"{name}: log2|g| distribution (underflow {u:.3g}, zeros {rep.zero_ratio.get(name, 0):.3g} of "
                     f"all elements over the run)", fontsize=9)
        ax.set_ylabel("log2 |g|")
    axes[-1, 0].set_xlabel("optimizer step")
    fig.tight_layout()
    caption = (f"Distribution of log2|g| (unscaled) over steps: the whole model, then the layers with the most "
               f"underflow (|g| below the smallest normal {rep.dtype} value). Colour: log10 of the fraction of the "
               f"non-zero finite elements in each exponent bin; the bottom and top rows of the grid hold everything "
               f"below and above the fixed bins.")
    if rep.fractional:
        caption += " A loss scale that is not a power of two was rounded to the nearest whole exponent here."
    return fig, caption
