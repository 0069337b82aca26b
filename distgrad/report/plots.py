"""The PNG plots of the report (matplotlib, object-oriented ``Figure`` + Agg canvas: no pyplot,
no global backend switch, nothing left open)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np

from distgrad.report.analysis import RunAnalysis
from distgrad.report.downsample import Downsampled
from distgrad.report.histogram import render as render_histogram
from distgrad.report.loss import render as render_loss
from distgrad.report.signals import render as render_signals


def _log10(a: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.log10(a)
    r[~np.isfinite(r)] = np.nan
    return r


def _mark_buckets(ax: Any, ds: Downsampled, col: int, color: str, label: str) -> None:
    hit = ds.counts[:, col] > 0
    if hit.any():
        ax.vlines(ds.x[hit], 0, 1, transform=ax.get_xaxis_transform(), colors=color, alpha=0.5,
                  linewidth=1.0, label=label)


def _plot_series(ax: Any, ds: Downsampled, col: int, color: str, label: str) -> bool:
    x = ds.x
    mn, mx, last = ds.min[:, col], ds.max[:, col], ds.last[:, col]
    if not np.isfinite(mx).any():
        return False
    if ds.width > 1:
        ax.fill_between(x, mn, mx, color=color, alpha=0.25, linewidth=0, label=f"{label} min..max per bucket")
    ax.plot(x, np.where(np.isfinite(last), last, np.nan), color=color, linewidth=0.9, label=label)
    return True


def _heatmap(fig: Any, ax: Any, data: np.ndarray, ds: Downsampled, layers: list[str], cbar_label: str,
             bad: np.ndarray | None = None) -> None:
    import matplotlib.colors as mcolors

    edges = np.append(ds.step_first, ds.step_last[-1] + 1).astype(np.float64)
    if not np.all(np.diff(edges) > 0):  # restarted run: steps not increasing -> index axis
        edges = np.arange(len(ds.step_first) + 1, dtype=np.float64)
        ax.set_xlabel("bucket (steps not monotonic)")
    else:
        ax.set_xlabel("optimizer step")
    yedges = np.arange(len(layers) + 1) - 0.5
    m = ax.pcolormesh(edges, yedges, np.ma.masked_invalid(data.T), cmap="viridis", shading="flat")
    fig.colorbar(m, ax=ax, label=cbar_label)
    if bad is not None and bad.any():
        cmap = mcolors.ListedColormap(["red"])
        ax.pcolormesh(edges, yedges, np.ma.masked_where(~bad.T, np.ones_like(data.T)), cmap=cmap, shading="flat")
    n = len(layers)
    stride = max(1, int(math.ceil(n / 40)))
    ticks = list(range(0, n, stride))
    ax.set_yticks(ticks)
    ax.set_yticklabels([layers[t] for t in ticks], fontsize=7)
    ax.set_ylabel("layer")
    ax.set_ylim(n - 0.5, -0.5)


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=7)


def _save(fig: Any, path: Path) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    data = buf.getvalue()
    path.write_bytes(data)
    return data


def render_plots(a: RunAnalysis, out: Path) -> tuple[list[tuple[str, str, bytes]], list[str]]:
    """Write the plots of ``a`` into ``out`` (see :func:`distgrad.report.write_report` for the
    files).

    Returns:
        ``(images, notes)``: ``(file name, caption, PNG bytes)`` per plot written, in page order,
        and notes on plots omitted.

    Raises:
        ImportError: matplotlib is missing (``pip install 'distgrad[report]'``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def subplots(nrows: int = 1, ncols: int = 1, **kw: Any) -> tuple[Any, Any]:
        # object-oriented Agg figures: no pyplot, no global backend switch, nothing left open
        fig = Figure(figsize=kw.pop("figsize", None))
        FigureCanvasAgg(fig)
        return fig, fig.subplots(nrows, ncols, **kw)

    images: list[tuple[str, str, bytes]] = []  # (file, caption, png)
    notes: list[str] = []
    s = a.scalars

    if a.n_records:
        # 1. loss and grad norm with spikes and non-finite steps
        fig, axes = subplots(2, 1, figsize=(11, 6.5), sharex=True)
        for ax, col, metric, color, label in ((axes[0], 0, "loss", "tab:blue", "loss"),
                                              (axes[1], 1, "grad_norm", "tab:green", "global grad norm")):
            if not _plot_series(ax, s, col, color, label):
                ax.text(0.5, 0.5, f"no finite {label} recorded", ha="center", va="center", transform=ax.transAxes)
            pts = [(st, v) for st, m, v in a.spikes if m == metric and v is not None and math.isfinite(v)]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker="x", color="red", zorder=5, s=30,
                           label=f"spike ({'detector' if a.spikes_source == 'record' else 'rolling median/MAD'})")
            _mark_buckets(ax, s, 1, "magenta", "non-finite gradient (not overflow)")
            ax.set_ylabel(label)
            if col == 1:
                v = s.max[:, 1]
                if np.isfinite(v).any() and np.nanmin(s.min[:, 1]) > 0:
                    ax.set_yscale("log")
            _legend(ax)
            ax.grid(alpha=0.3)
        axes[1].set_xlabel("optimizer step")
        fig.suptitle("Loss and global gradient norm")
        fig.tight_layout()
        images.append(("loss_grad_norm.png", "Loss and global gradient norm. Red x: spikes; magenta lines: "
                       "non-finite gradients outside fp16 overflows.", _save(fig, out / "loss_grad_norm.png")))

        # 2. loss scale and overflow steps
        if np.isfinite(s.max[:, 2]).any():
            fig, axes = subplots(2, 1, figsize=(11, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
            _plot_series(axes[0], s, 2, "tab:purple", "loss scale")
            axes[0].set_yscale("log", base=2)
            axes[0].set_ylabel("loss scale")
            _mark_buckets(axes[0], s, 0, "red", "overflow step(s)")
            _legend(axes[0])
            axes[0].grid(alpha=0.3)
            widths = np.maximum(s.step_last - s.step_first + 1, 1)
            axes[1].bar(s.step_first, s.counts[:, 0], width=widths, align="edge", color="red")
            axes[1].set_ylabel("overflows")
            axes[1].set_xlabel("optimizer step")
            fig.suptitle(f"fp16 loss scale ({a.counts['overflow_steps']} overflow steps, "
                         f"longest streak {a.max_overflow_streak})")
            fig.tight_layout()
            images.append(("loss_scale.png", "Dynamic loss scale; bottom: overflow steps per bucket.",
                           _save(fig, out / "loss_scale.png")))
        else:
            notes.append("No fp16 loss scale in this run (bf16/fp32): loss-scale plot omitted.")

        # 3. per-layer grad-norm heatmap
        L = len(a.layers)
        if L:
            ln = a.layer_norms
            fig, ax = subplots(figsize=(11, min(2.5 + 0.18 * L, 30)))
            _heatmap(fig, ax, _log10(ln.max), ln, a.layers, "log10(max layer grad norm in bucket)",
                     bad=ln.counts > 0)
            ax.set_title("Per-layer gradient norm (log10 of bucket max); red: non-finite")
            fig.tight_layout()
            images.append(("layer_grad_norm.png", "Per-layer gradient norm, log10 of the max within each bucket "
                           "of steps; red cells hold a non-finite gradient.", _save(fig, out / "layer_grad_norm.png")))

            # 4. per-layer non-finite counts
            fig, axes = subplots(2, 1, figsize=(11, 5.5), sharex=True)
            xs = np.arange(L)
            axes[0].bar(xs, a.layer_nonfinite_elems, color="red")
            axes[0].set_ylabel("non-finite elements")
            if a.layer_nonfinite_elems.max() > 0:
                axes[0].set_yscale("log")
            axes[1].bar(xs, a.layer_nonfinite_steps, color="darkred")
            axes[1].set_ylabel("steps affected")
            stride = max(1, int(math.ceil(L / 60)))
            axes[1].set_xticks(xs[::stride])
            axes[1].set_xticklabels([a.layers[j] for j in xs[::stride]], rotation=90, fontsize=7)
            axes[1].set_xlabel("layer")
            total = int(a.layer_nonfinite_elems.sum())
            fig.suptitle(f"Per-layer non-finite gradient elements (total {total})")
            fig.tight_layout()
            images.append(("layer_nonfinite.png", "NaN+Inf gradient elements per layer over the run, and the "
                           "number of sampled steps on which the layer had any.",
                           _save(fig, out / "layer_nonfinite.png")))

        # 5. update-to-weight ratio
        if a.update_ratio is not None and np.isfinite(a.update_ratio.max).any():
            u = a.update_ratio
            fig, ax = subplots(figsize=(11, min(2.5 + 0.18 * L, 30)))
            _heatmap(fig, ax, _log10(u.max), u, a.layers, "log10(max update/weight ratio)")
            ax.set_title("Update-to-weight ratio ||dw||/||w|| (max over the layer's parameters, bucket max)")
            fig.tight_layout()
            images.append(("update_ratio.png", "Update-to-weight ratio per layer (log10; about -3 is typical "
                           "for Adam at a sane learning rate).", _save(fig, out / "update_ratio.png")))
        else:
            notes.append("No update-to-weight ratios in the records: plot omitted.")

        # 6. loss analysis: components, token-loss distribution, trend
        loss = getattr(a, "loss", None)
        got = render_loss(loss, subplots) if loss is not None else None
        if got is not None:
            images.append(("loss_analysis.png", got[1], _save(got[0], out / "loss_analysis.png")))

        # 7. packed signals (docs/signals.md): one figure per signal present in the records
        for fname, caption, fig in render_signals(getattr(a, "signals", None), subplots):
            images.append((fname, caption, _save(fig, out / fname)))
        # 8. gradient value distribution (histogram.enabled runs)
        hist = getattr(a, "grad_histogram", None)
        if hist is not None:
            fig, caption = render_histogram(hist, subplots)
            images.append(("grad_histogram.png", caption, _save(fig, out / "grad_histogram.png")))
    return images, notes
