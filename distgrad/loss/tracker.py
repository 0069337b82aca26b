"""The training loss of each rank, per optimizer step: what a rank observed (micro-batch losses,
their maximum and which micro-batch it was, the sample indices the loop passed) and how long its
step took, carried to every rank in the sampled step's existing SUM collective.

Each rank writes its own slots of a ``[W, len(RANK_LOSS_COLS)]`` float64 block (the other
ranks' slots stay 0), which is appended to the step's SUM block: after the all-reduce every rank
holds every rank's values exactly (``x + 0 = x`` in floating point, NaN and Inf included). No
collective and no host synchronisation is added; the block costs ``8 * W * 7`` bytes of the
SUM all-reduce (112 KiB at 2048 ranks).

Per-rank loss (``loss_reduction`` as in :class:`~distgrad.Instrument`): in ``"mean"`` mode the
rank's mean over its micro-batches and its largest micro-batch loss; in ``"sum"`` mode (losses
pre-scaled by a framework for gradient accumulation) the rank's step loss (the sum) for both,
and the micro-batch index is that of the largest pre-scaled micro-batch loss (NaN wins), i.e.
the micro-batch whose loss made the step's loss non-finite or contributed most to it.
The rank with the highest loss (:attr:`RankStats.loss_max_rank`) is the first rank whose loss
is NaN/Inf if any rank's is (the culprit of a non-finite loss), else the argmax of the per-rank
maxima (ties: the lowest rank).

Time (host wall clock, ``time.perf_counter``), per rank:

* ``step_time``: seconds from the end of the rank's previous optimizer-step boundary to its
  arrival at this one (NaN on the first step: nothing to measure from). In synchronous training every rank waits for
  the slowest inside the gradient collectives, so this is nearly the same on every rank.
* ``data_time``: seconds the loop reported with :meth:`~distgrad.Instrument.observe_data_time`
  during the step (data loading), else the measured time from the end of the previous boundary
  to the step's first forward (boundaries that see the forward: PyTorch models with
  ``optimizer=``, DeepSpeed engines; not on the first step), else NaN. No rank waits for another in that interval,
  so the rank with the longest is the one the others waited for: the **straggler**
  (:attr:`RankStats.straggler_rank`). A rank that is slow *inside* the model (a slower GPU) is
  not attributed: its lateness is absorbed by the other ranks' waits in the collectives.
* :attr:`RankStats.straggler_ratio`: ``max(step_time) / (max(step_time) - (max(data_time) -
  median(data_time)))``, the step's wall time over the wall time had the straggler taken the
  median rank's data time (>= 1; 1 when balanced).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from distgrad.loss.components import ComponentError, LossComponents
from distgrad.loss.token import TokenLoss, TokenLossError, summarize
from distgrad.record import LossComponents as ComponentsPart
from distgrad.record import RankStats, TokenLossStats

if TYPE_CHECKING:
    from distgrad.core.instrument import Instrument

log = logging.getLogger("distgrad")

#: per-rank slots of the loss block (SUM-reduced; each rank writes only its own row)
RANK_LOSS_COLS = ("loss_sum", "loss_count", "loss_max", "loss_max_micro", "step_time", "data_time",
                  "data_reported")

#: sample indices kept per micro-batch for the loss-spike report (the first ones)
MAX_SAMPLES = 4096


class StepLoss:
    """One rank's losses, sample indices and times of one optimizer step (host values and 0-d
    float64 device tensors; no host sync)."""

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None  # 0-d float64, on the loss's device
        self.max: torch.Tensor | None = None  # 0-d float64, largest micro-batch loss (NaN wins)
        self.argmax: torch.Tensor | None = None  # 0-d float64, its micro-batch index
        self.count = 0
        self.samples: dict[int, Any] = {}  # micro-batch index -> the sample indices the loop passed
        self.sources: dict[int, Any] = {}  # micro-batch index -> the per-sequence data sources passed
        self.first_forward: float | None = None  # perf_counter of the step's first forward
        self.data_reported: float | None = None  # seconds reported by the loop
        self.step_time = float("nan")
        self.data_time = float("nan")
        self.reported = False


class LossTracker:
    """Per-rank loss and timing accumulation between two optimizer-step boundaries, and the
    per-rank block of the sampled step's SUM collective.

    Args:
        world_size: W, ranks in the instrument's process group.
        sources: configured data-source labels of per-token losses (config ``loss.sources``).
        threshold: token-loss threshold in nats (config ``loss.token_threshold``).
    """

    #: its name among the step's blocks (:class:`distgrad.stats.layout.StepBlocks`)
    name = "loss"

    def __init__(self, world_size: int, sources: Sequence[str] = (), threshold: float = 10.0) -> None:
        self.world_size = world_size
        self.components = LossComponents()
        self.tokens = TokenLoss(sources, threshold)
        self.cur = StepLoss()
        self.last_exit: float | None = None  # end of the previous boundary (None: first step)
        self.pending_samples: Any = None  # observe_samples: for the next loss observed
        self._spike_report_failed = False

    # -- during the step ----------------------------------------------------------------------
    def add(self, t: torch.Tensor, samples: Any = None) -> None:
        """Add one micro-batch loss (0-d float64 tensor) and its sample indices (any sequence
        or 1-D integer tensor; kept by reference, read only for a spike report)."""
        s = self.cur
        micro = s.count
        if s.sum is None or s.max is None or s.argmax is None:  # all None or all set
            s.sum, s.max = t, t
            s.argmax = torch.zeros((), dtype=torch.float64, device=t.device)
        else:
            t = t.to(s.sum.device)
            s.sum = s.sum + t
            better = (t > s.max) | (torch.isnan(t) & ~torch.isnan(s.max))
            s.max = torch.where(better, t, s.max)
            s.argmax = torch.where(better, torch.full_like(s.argmax, micro), s.argmax)
        s.count += 1
        if samples is None:
            samples, self.pending_samples = self.pending_samples, None
        if samples is not None:
            s.samples[micro] = samples

    def clear_losses(self) -> None:
        """Drop the losses observed so far this step (timing kept)."""
        ff, dr = self.cur.first_forward, self.cur.data_reported
        self.cur = StepLoss()
        self.cur.first_forward, self.cur.data_reported = ff, dr

    def forward_started(self) -> None:
        """A forward pass of the step starts (the first one fixes the measured data time)."""
        if self.cur.first_forward is None:
            self.cur.first_forward = time.perf_counter()

    def add_data_time(self, seconds: float) -> None:
        """Seconds the loop spent loading this micro-batch's data (summed over the step)."""
        self.cur.data_reported = (self.cur.data_reported or 0.0) + float(seconds)

    # -- at the boundary ----------------------------------------------------------------------
    def arrive(self) -> StepLoss:
        """This step's accumulation, timed to now (the boundary); a new one starts."""
        s, now = self.cur, time.perf_counter()
        if self.last_exit is not None:
            s.step_time = now - self.last_exit
        if s.data_reported is not None:
            s.data_time, s.reported = s.data_reported, True
        elif s.first_forward is not None and self.last_exit is not None:
            s.data_time = s.first_forward - self.last_exit
        self.cur = StepLoss()
        return s

    def exit(self) -> None:
        """The boundary is done: the next step's time starts now."""
        self.last_exit = time.perf_counter()

    def drop(self) -> None:
        """Drop the step's losses, components, token losses and times (an unsampled step)."""
        self.arrive()
        self.components.clear()
        self.tokens.clear()

    def block(self, s: StepLoss | None, rank: int, device: torch.device,
              reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's float64 contributions ``(sum_part [sum_size], max_part [max_size])``: its
        row of the ``[W, len(RANK_LOSS_COLS)]`` per-rank block (the other rows 0), then the
        components' and the token losses' parts; ``s`` None: identities (a rank that refused
        the step or failed; its components and token losses are dropped)."""
        out = torch.zeros((self.world_size, len(RANK_LOSS_COLS)), dtype=torch.float64, device=device)
        if s is not None:
            if s.sum is not None and s.max is not None and s.argmax is not None and s.count:
                total = s.sum.to(device)
                out[rank, 0] = total
                out[rank, 1] = float(s.count if reduction == "mean" else 1)
                out[rank, 2] = s.max.to(device) if reduction == "mean" else total
                out[rank, 3] = s.argmax.to(device)  # "sum": the micro-batch of largest pre-scaled loss
            out[rank, 4] = s.step_time
            out[rank, 5] = s.data_time
            out[rank, 6] = 1.0 if s.reported else 0.0
        cs, cm = self.components.take(device)
        ts, tm = self.tokens.take(device)
        if s is None:
            cs, ts = torch.zeros_like(cs), torch.zeros_like(ts)
            cm, tm = torch.full_like(cm, -math.inf), torch.full_like(tm, -math.inf)
        return torch.cat([out.reshape(-1), cs, ts]), torch.cat([cm, tm])

    @property
    def sum_size(self) -> int:
        return self.world_size * len(RANK_LOSS_COLS) + self.components.sum_size + self.tokens.sum_size

    @property
    def max_size(self) -> int:
        return self.components.max_size + self.tokens.max_size

    # -- after the reduction --------------------------------------------------------------------
    def unpack(self, s: np.ndarray, m: np.ndarray
               ) -> tuple[RankStats, ComponentsPart | None, TokenLossStats | None]:
        """The record parts from the reduced ``(sum_part, max_part)`` of :meth:`block`."""
        n = self.world_size * len(RANK_LOSS_COLS)
        nc = self.components.sum_size
        ranks = rank_stats(s[:n].reshape(self.world_size, len(RANK_LOSS_COLS)))
        comp = self.components.unpack(s[n:n + nc], m[:2])
        if comp is not None and "error" in comp:
            log.error("distgrad: %s; the step's components are not exported", comp["error"])
        comp_part = ComponentsPart.from_dict(comp) if comp is not None else None
        tok = self.tokens.unpack(s[n + nc:], m[2:])
        tok_part = TokenLossStats.from_dict(summarize(tok, self.tokens.threshold)) if tok is not None else None
        return ranks, comp_part, tok_part

    def report_spike(self, rec: Any, s: StepLoss | None, rank: int, directory: str | None) -> Path | None:
        """On a loss spike (``"loss"`` in the record's flagged spikes) or a non-finite loss, the
        rank named by ``rec.ranks.loss_max_rank`` writes
        ``<directory>/lossspike-step{step}-rank{rank}.json``: its micro-batch with the largest
        loss, that loss, the sample indices the loop passed for it (``samples=`` of
        :meth:`~distgrad.Instrument.observe_loss`) and its sequences' data sources (``sources=``).
        Returns the path, or None (not this rank, no directory, nothing flagged). Raises OSError
        when the file cannot be written."""
        ranks = getattr(rec, "ranks", None)
        if ranks is None or ranks.loss_max_rank != rank or not directory or s is None:
            return None
        flagged = rec.spikes is not None and "loss" in rec.spikes.flagged
        if not flagged and math.isfinite(ranks.loss_max[rank]):
            return None
        micro = ranks.loss_max_micro[rank]
        micro = int(micro) if micro is not None and math.isfinite(micro) else None
        samples = s.samples.get(micro) if micro is not None else None
        doc = {"step": rec.step, "rank": rank, "reason": "loss_spike" if flagged else "nonfinite_loss",
               "loss": rec.loss, "rank_loss_mean": ranks.loss_mean[rank], "rank_loss_max": ranks.loss_max[rank],
               "micro_batch": micro, "samples": _indices(samples),
               "sources": [str(x) for x in s.sources[micro]] if micro in s.sources else None,
               "samples_by_micro_batch": {str(k): _indices(v) for k, v in sorted(s.samples.items())}}
        path = Path(directory) / f"lossspike-step{rec.step}-rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1))
        log.warning("distgrad: step %d: %s on rank %d (micro-batch %s, samples %s): %s", rec.step, doc["reason"],
                    rank, micro, (doc["samples"] or [])[:8], path)
        return path


class BadLoss(ValueError):
    """observe_loss got something that is not one loss value (message: what it got)."""


def observe(inst: Instrument, loss: Any, automatic: bool, samples: Any, components: Any, weights: Any,
            token_losses: Any, token_mask: Any, logits: Any, labels: Any, ignore_index: int, sources: Any) -> None:
    """The body of :meth:`distgrad.Instrument.observe_loss` (see there). Never raises."""
    if automatic and not inst._auto_loss:
        return
    if not automatic and inst._auto_loss:
        inst._auto_loss = False
        if inst._auto_seen:
            inst.loss.clear_losses()
            inst.loss.components.clear()
            inst.loss.tokens.clear()
    try:
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1 or loss.is_complex():
                raise BadLoss(f"a tensor of shape {list(loss.shape)} and dtype {loss.dtype}")
            t = loss.detach().reshape(()).to(torch.float64)
        else:
            try:
                t = torch.tensor(float(loss), dtype=torch.float64)
            except (TypeError, ValueError):
                raise BadLoss(f"a {type(loss).__name__}") from None
        inst.loss.add(t, samples)
        inst._auto_seen = inst._auto_seen or automatic
    except BadLoss as e:
        inst.counters["internal_errors"] += 1
        if "observe_loss" not in inst._logged_bad_input:
            inst._logged_bad_input.add("observe_loss")
            log.error("distgrad: observe_loss(loss) needs the scalar training loss (a tensor with one "
                      "element, or a float), got %s: pass the reduced loss, e.g. loss.mean(); until "
                      "then losses are ignored (each call counted in distgrad_internal_errors_total, "
                      "not logged again)", e)
        inst._publish_counters()
        return
    except Exception:  # noqa: BLE001 - never break training
        inst.count_error("observe_loss")
        return
    if components is not None:
        _guarded(inst, lambda: inst.loss.components.add(t, components, weights))
    if sources is not None and inst.loss.cur.count:
        inst.loss.cur.sources[inst.loss.cur.count - 1] = sources  # for a loss-spike report
    if token_losses is not None or logits is not None or labels is not None:
        _guarded(inst, lambda: _tokens(inst.loss.tokens, token_losses, token_mask, logits, labels, ignore_index,
                                       sources))


def _tokens(tl: TokenLoss, token_losses: Any, token_mask: Any, logits: Any, labels: Any, ignore_index: int,
            sources: Any) -> None:
    if logits is not None or labels is not None:
        if logits is None or labels is None or token_losses is not None:
            raise TokenLossError("pass either token_losses or both logits and labels")
        token_losses, token_mask = tl.from_logits(logits, labels, ignore_index)
    tl.add(token_losses, token_mask, sources)


def _guarded(inst: Instrument, fn: Any) -> None:
    """Run ``fn``; a ComponentError / TokenLossError is counted and logged once per kind, any
    other failure counted as distgrad's own."""
    try:
        fn()
    except (ComponentError, TokenLossError) as e:
        inst.counters["internal_errors"] += 1
        kind = f"observe_loss {type(e).__name__}"
        if kind not in inst._logged_bad_input:
            inst._logged_bad_input.add(kind)
            log.error("distgrad: observe_loss: %s; ignored (each call counted in distgrad_internal_errors_total, "
                      "not logged again)", e)
        inst._publish_counters()
    except Exception:  # noqa: BLE001 - never break training
        inst.count_error("observe_loss (components or token losses)")


def observe_data_time(inst: Instrument, seconds: Any) -> None:
    """The body of :meth:`distgrad.Instrument.observe_data_time` (see there). Never raises."""
    try:
        v = float(seconds)
        if not (v >= 0.0 and math.isfinite(v)):
            raise ValueError(v)
        inst.loss.add_data_time(v)
    except (TypeError, ValueError):
        inst.counters["internal_errors"] += 1
        if "observe_data_time" not in inst._logged_bad_input:
            inst._logged_bad_input.add("observe_data_time")
            log.error("distgrad: observe_data_time(seconds) needs a finite number of seconds >= 0, got %r: "
                      "ignored (each call counted in distgrad_internal_errors_total, not logged again)", seconds)
        inst._publish_counters()


def _indices(v: Any) -> list[Any] | None:
    """Sample indices as a JSON list (at most :data:`MAX_SAMPLES`); None when not given."""
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        v = v.detach().reshape(-1)[:MAX_SAMPLES].cpu().tolist()
    return [x if isinstance(x, (int, str)) else (int(x) if float(x).is_integer() else float(x))
            for x in list(v)[:MAX_SAMPLES]]


def rank_stats(rows: np.ndarray) -> RankStats:
    """Per-rank loss and time summary from the reduced ``[W, len(RANK_LOSS_COLS)]`` rows."""
    rows = np.asarray(rows, dtype=np.float64)
    count = rows[:, 1]
    has = count > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(has, rows[:, 0] / np.where(has, count, 1.0), np.nan)
    mx = np.where(has, rows[:, 2], np.nan)
    micro = np.where(has, rows[:, 3], np.nan)
    step_time, data_time = rows[:, 4], rows[:, 5]
    loss_max_rank = None
    bad = np.nonzero(has & ~np.isfinite(mx))[0]
    if len(bad):
        loss_max_rank = int(bad[0])
    elif has.any():
        loss_max_rank = int(np.nanargmax(np.where(has, mx, -np.inf)))
    straggler, ratio = None, None
    known = np.isfinite(data_time)
    if known.any():
        straggler = int(np.nanargmax(np.where(known, data_time, -np.inf)))
        excess = float(data_time[straggler] - np.median(data_time[known]))
        wall = float(np.nanmax(step_time)) if np.isfinite(step_time).any() else float("nan")
        ratio = wall / (wall - excess) if wall > excess >= 0 else None  # None: not known
    return RankStats(loss_mean=mean.tolist(), loss_max=mx.tolist(), loss_max_micro=micro.tolist(),
                     step_time=step_time.tolist(), data_time=data_time.tolist(),
                     data_reported=[bool(x) for x in rows[:, 6] > 0], loss_max_rank=loss_max_rank,
                     straggler_rank=straggler, straggler_ratio=ratio)


__all__: Sequence[str] = ["RANK_LOSS_COLS", "LossTracker", "StepLoss", "rank_stats"]
