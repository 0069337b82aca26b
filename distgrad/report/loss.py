"""The loss analysis of a run log for the report: loss components, the per-token loss
distribution, the loss trend and the per-rank attribution (``StepRecord.loss_components``,
``token_loss``, ``loss_trend``, ``ranks``), in bounded memory: downsampled series (at most 8
component columns, perplexity, trend slope), the token-loss histogram summed over the run (one
count per fixed bin), per-source last values, and per-rank counts (bounded by the world size)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distgrad.loss.token import EDGES
from distgrad.record import StepRecord
from distgrad.report.downsample import Downsampled, Downsampler


@dataclass
class LossReport:
    """The loss analysis of a run (see the module docstring).

    Attributes:
        components: component names (as declared by the loop; empty without components).
        component_mean: downsampled component means (columns aligned with ``components``).
        component_share: downsampled shares of the total loss (same columns).
        tokens: tokens counted over the run; token_hist: counts per bin over the run (``len(EDGES)
            + 1``); edges: the bin edges (nats); token_mean: token-weighted mean over the run.
        perplexity: downsampled perplexity (one column), None without token losses.
        sources: per data source, over the run: ``{"tokens", "mean", "perplexity"}``.
        trend: the last record's trend (``slope_per_1k``, ``stderr_per_1k``, ``plateau``,
            ``points``, ``window``, ``step``), None without a loss.
        slope: downsampled trend slope per 1000 steps (columns slope, stderr), None without.
        plateau_steps: sampled steps flagged as a plateau; first_plateau: first such step.
        loss_max_rank: rank -> sampled steps on which its batch had the highest loss.
        stragglers: rank -> sampled steps on which it was the straggler; max_straggler_ratio.
    """

    components: list[str] = field(default_factory=list)
    component_mean: Downsampled | None = None
    component_share: Downsampled | None = None
    tokens: float = 0.0
    token_hist: list[float] = field(default_factory=list)
    edges: list[float] = field(default_factory=lambda: list(EDGES))
    token_mean: float = float("nan")
    perplexity: Downsampled | None = None
    sources: dict[str, dict[str, float]] = field(default_factory=dict)
    trend: dict[str, Any] | None = None
    slope: Downsampled | None = None
    plateau_steps: int = 0
    first_plateau: int | None = None
    loss_max_rank: dict[int, int] = field(default_factory=dict)
    stragglers: dict[int, int] = field(default_factory=dict)
    max_straggler_ratio: float = float("nan")


class LossAccumulator:
    """Folds records into a :class:`LossReport` (records in file order)."""

    def __init__(self, max_points: int = 1024) -> None:
        self.max_points = max_points
        self.components: list[str] = []
        self._mean: Downsampler | None = None
        self._share: Downsampler | None = None
        self._ppl: Downsampler | None = None
        self._slope: Downsampler | None = None
        self._hist = np.zeros(len(EDGES) + 1)
        self._tok = 0.0
        self._tok_sum = 0.0
        self._src: dict[str, list[float]] = {}  # source -> [tokens, sum]
        self.rep = LossReport()

    def add(self, r: StepRecord) -> None:
        step = int(r.step)
        c = r.loss_components
        if c is not None and c.names and not c.error:
            if self._mean is None or self._share is None:
                self.components = list(c.names)
                self._mean = Downsampler(len(c.names), 0, self.max_points)
                self._share = Downsampler(len(c.names), 0, self.max_points)
            if list(c.names) == self.components:
                self._mean.add(step, np.asarray(c.mean, dtype=np.float64))
                self._share.add(step, np.asarray(c.share, dtype=np.float64))
        t = r.token_loss
        if t is not None and t.tokens > 0:
            if len(t.hist) == len(self._hist):
                self._hist += np.asarray(t.hist, dtype=np.float64)
            self._tok += t.tokens
            self._tok_sum += t.mean * t.tokens
            if self._ppl is None:
                self._ppl = Downsampler(1, 0, self.max_points)
            self._ppl.add(step, np.array([t.perplexity]))
            for s, d in t.sources.items():
                acc = self._src.setdefault(s, [0.0, 0.0])
                acc[0] += d.get("tokens", 0.0)
                acc[1] += d.get("mean", float("nan")) * d.get("tokens", 0.0)
        tr = r.loss_trend
        if tr is not None:
            self.rep.trend = {"step": step, "slope_per_1k": tr.slope_per_1k, "stderr_per_1k": tr.stderr_per_1k,
                              "plateau": tr.plateau, "points": tr.points, "window": tr.window}
            if self._slope is None:
                self._slope = Downsampler(2, 0, self.max_points)
            self._slope.add(step, np.array([tr.slope_per_1k, tr.stderr_per_1k]))
            if tr.plateau:
                self.rep.plateau_steps += 1
                if self.rep.first_plateau is None:
                    self.rep.first_plateau = step
        rk = r.ranks
        if rk is not None:
            if rk.loss_max_rank is not None:
                self.rep.loss_max_rank[rk.loss_max_rank] = self.rep.loss_max_rank.get(rk.loss_max_rank, 0) + 1
            if rk.straggler_rank is not None:
                self.rep.stragglers[rk.straggler_rank] = self.rep.stragglers.get(rk.straggler_rank, 0) + 1
            if rk.straggler_ratio is not None and math.isfinite(rk.straggler_ratio):
                self.rep.max_straggler_ratio = float(np.fmax(self.rep.max_straggler_ratio, rk.straggler_ratio))

    def result(self) -> LossReport:
        rep = self.rep
        rep.components = list(self.components)
        rep.component_mean = self._mean.result() if self._mean is not None else None
        rep.component_share = self._share.result() if self._share is not None else None
        rep.tokens = self._tok
        rep.token_hist = self._hist.tolist()
        rep.token_mean = self._tok_sum / self._tok if self._tok else float("nan")
        rep.perplexity = self._ppl.result() if self._ppl is not None else None
        rep.slope = self._slope.result() if self._slope is not None else None
        with np.errstate(over="ignore"):
            rep.sources = {s: {"tokens": n, "mean": tot / n if n else float("nan"),
                               "perplexity": float(np.exp(tot / n)) if n else float("nan")}
                           for s, (n, tot) in sorted(self._src.items())}
        return rep


def _f(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"


def summary_lines(rep: LossReport) -> list[str]:
    """The report's text lines on the loss analysis (empty when the run had none of it)."""
    out: list[str] = []
    if rep.trend is not None:
        t = rep.trend
        out.append(f"loss trend at step {t['step']}: {_f(t['slope_per_1k'])} +- {_f(t['stderr_per_1k'])} per 1000 "
                   f"steps over {t['points']} sampled steps (window {t['window']}); "
                   + (f"plateau on {rep.plateau_steps} sampled step(s), first at step {rep.first_plateau}"
                      if rep.plateau_steps else "no plateau"))
    cm, cs = rep.component_mean, rep.component_share
    if rep.components and cm is not None and cs is not None:
        out.append("loss components (last sampled step): " + ", ".join(
            f"{n} {_f(float(cm.last[-1, i]))} (share {_f(float(cs.last[-1, i]))})"
            for i, n in enumerate(rep.components)))
    if rep.tokens:
        ppl = math.exp(rep.token_mean) if math.isfinite(rep.token_mean) and rep.token_mean < 700 else float("nan")
        out.append(f"token losses: {int(rep.tokens)} tokens, mean {_f(rep.token_mean)} nats, perplexity {_f(ppl)}")
        labels = [f"<={e:g}" for e in rep.edges] + [f">{rep.edges[-1]:g}"]
        tot = sum(rep.token_hist) or 1.0
        out.append("  distribution: " + ", ".join(f"{lab} {100 * n / tot:.1f}%"
                                                  for lab, n in zip(labels, rep.token_hist) if n))
        for s, d in rep.sources.items():
            out.append(f"  source {s}: {int(d['tokens'])} tokens, mean {_f(d['mean'])} nats, "
                       f"perplexity {_f(d['perplexity'])}")
    if rep.loss_max_rank:
        out.append("highest-loss rank (sampled steps): " + ", ".join(
            f"rank {k}: {v}" for k, v in sorted(rep.loss_max_rank.items())))
    if rep.stragglers:
        out.append("straggler rank (sampled steps): " + ", ".join(f"rank {k}: {v}" for k, v in
                                                                 sorted(rep.stragglers.items()))
                   + f"; max straggler ratio {_f(rep.max_straggler_ratio)}")
    return out


def render(rep: LossReport, subplots: Any) -> tuple[Any, str] | None:
    """A figure (component shares, token-loss histogram, perplexity and trend slope) and its
    caption, or None when the run has none of them. ``subplots`` makes an Agg figure."""
    # each panel with its downsampled series (None for the histogram, drawn from rep's counts)
    series: list[tuple[str, Downsampled | None]] = [
        (p, d) for p, d, ok in (("comp", rep.component_share, rep.component_share is not None),
                                ("hist", None, rep.tokens > 0), ("ppl", rep.perplexity, rep.perplexity is not None),
                                ("slope", rep.slope, rep.slope is not None)) if ok]
    panels = [p for p, _ in series]
    if not panels:
        return None
    fig, axes = subplots(len(panels), 1, figsize=(11, 2.8 * len(panels)), squeeze=False)
    for ax, (p, s) in zip(axes[:, 0], series):
        if p == "comp":
            assert s is not None
            for i, n in enumerate(rep.components):
                ax.plot(s.x, s.last[:, i], label=n)
            ax.set_ylabel("share of loss")
            ax.legend(fontsize=8)
        elif p == "hist":
            labels = [f"<={e:g}" for e in rep.edges] + [f">{rep.edges[-1]:g}"]
            ax.bar(range(len(labels)), rep.token_hist, color="tab:blue")
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, fontsize=7)
            ax.set_ylabel("tokens")
            ax.set_xlabel("per-token loss (nats), whole run")
        elif p == "ppl":
            assert s is not None
            ax.plot(s.x, s.last[:, 0], color="tab:orange")
            ax.set_ylabel("perplexity")
        else:
            assert s is not None
            ax.plot(s.x, s.last[:, 0], color="tab:green", label="slope per 1000 steps")
            ax.fill_between(s.x, s.last[:, 0] - 2 * s.last[:, 1], s.last[:, 0] + 2 * s.last[:, 1], color="tab:green",
                            alpha=0.2, label="+-2 standard errors")
            ax.axhline(0.0, color="grey", lw=0.8)
            ax.set_ylabel("loss trend")
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step" if panels[-1] != "hist" else "per-token loss (nats), whole run")
    fig.suptitle("Loss analysis")
    fig.tight_layout()
    return fig, ("Loss analysis: share of each loss component in the total loss; histogram of per-token losses "
                 "over the run (fixed bins); perplexity; least-squares loss slope per 1000 steps with +-2 standard "
                 "errors (a plateau when the band contains 0 over a covered window).")
