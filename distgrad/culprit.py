"""The culprit rank of a non-finite step: the rank(s) whose *own* contribution was NaN/Inf
before the cross-rank reduction spread it to every rank.

After an all-reduce every rank holds the same NaN, so the per-rank view of the reduced
gradient (``StepRecord.nonfinite_ranks``, ``distgrad_nonfinite_params{rank}``: whose *shard*
of the reduced gradient held NaN/Inf) cannot say where it came from. Each rank therefore
flags its own contribution and writes the flags into its slot of the step's SUM collective
(``RANK_COLS`` "culprit", no extra collective, no host sync):

* :data:`~distgrad.stats.layout.CULPRIT_LOSS`: the loss this rank observed since the last
  optimizer-step boundary (``observe_loss``, or the loss DeepSpeed's ``engine.backward`` and
  the PyTorch boundary capture) was NaN/Inf; every engine.
* :data:`~distgrad.stats.layout.CULPRIT_GRAD`: a gradient this rank's backward produced was
  NaN/Inf *before* the reduction (:class:`LocalGradCheck`, as Megatron-LM's
  ``check_for_nan_in_grad`` checks each bucket before its all-reduce). Tensor hooks on the
  trainable parameters see each micro-batch's incoming local gradient before it is
  accumulated into ``.grad`` and before DDP's reducer (a post-hook of the same accumulation
  node) copies it into its bucket, so what they see is purely this rank's. Installed for
  DistributedDataParallel and a plain module. Not for FSDP1/FSDP2 and DeepSpeed, whose hooks
  on the (flat / sharded) parameters run inside the engines' own reduction machinery; there
  the loss flag alone names the culprit (a NaN made in the forward pass makes the loss NaN;
  a NaN made only in the backward pass is then seen in the shard view only).

Cost of :class:`LocalGradCheck`: per trainable parameter and micro-batch, one float64 sum of
the incoming gradient (one read, no temporary the size of the gradient; a float64 sum of
fp32/bf16/fp16 values is non-finite if and only if an element is, as it cannot overflow) and
one in-place add on the device; no host sync. Switched off with ``statistics.culprit_grad_check: false``.
"""

from __future__ import annotations

from typing import Iterable

import torch

from distgrad.record import Culprit
from distgrad.stats.layout import CULPRIT_GRAD, CULPRIT_LOSS

__all__ = ["LocalGradCheck", "culprit_flags", "decode"]


class LocalGradCheck:
    """Flags a NaN/Inf in any gradient this rank computes before the reduction.

    Args:
        params: the trainable parameters (leaf tensors); a tensor hook is registered on each.

    Every hook adds ``grad.sum(dtype=float64)`` into one 0-d float64 accumulator on the
    gradient's device; :meth:`take` reads (on the device) whether the accumulator is finite
    and starts over. Call :meth:`take` or :meth:`reset` at every optimizer-step boundary.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._acc: torch.Tensor | None = None
        self._handles = [p.register_hook(self._hook) for p in params if p.requires_grad]

    def _hook(self, grad: torch.Tensor) -> None:
        try:
            g = grad.detach()
            to_local = getattr(g, "to_local", None)
            if callable(to_local):
                g = to_local()
            if not g.is_floating_point() or g.numel() == 0:
                return None
            s = g.sum(dtype=torch.float64)
            if self._acc is None or self._acc.device != s.device:
                self._acc = torch.zeros((), dtype=torch.float64, device=s.device)
            self._acc.add_(s)
        except Exception:  # noqa: BLE001 - a check must never break the backward pass
            pass
        return None

    def take(self, device: torch.device) -> torch.Tensor:
        """0-d float64 tensor on ``device``: 1.0 when a gradient since the last take/reset was
        NaN/Inf, else 0.0; then starts over. No host sync."""
        acc, self._acc = self._acc, None
        if acc is None:
            return torch.zeros((), dtype=torch.float64, device=device)
        return (~torch.isfinite(acc)).to(device=device, dtype=torch.float64)

    def reset(self) -> None:
        """Forget what was seen (an optimizer step that is not sampled)."""
        self._acc = None

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def culprit_flags(loss_sum: torch.Tensor | None, grad_flag: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor:
    """This rank's culprit flags as a 0-d float64 tensor on ``device`` (device work only):
    :data:`CULPRIT_LOSS` when ``loss_sum`` (the summed observed losses, or None) is NaN/Inf,
    plus :data:`CULPRIT_GRAD` when ``grad_flag`` (from :meth:`LocalGradCheck.take`) is 1."""
    flags = torch.zeros((), dtype=torch.float64, device=device)
    if loss_sum is not None:
        flags = flags + CULPRIT_LOSS * (~torch.isfinite(loss_sum.detach())).to(device=device, dtype=torch.float64)
    if grad_flag is not None:
        flags = flags + CULPRIT_GRAD * grad_flag.to(device=device, dtype=torch.float64)
    return flags


def decode(rank_culprit: "Iterable[float]") -> list[Culprit]:
    """The reduced per-rank flags (host floats, one per rank) as one
    :class:`~distgrad.record.Culprit` per rank with any flag, ascending."""
    out: list[Culprit] = []
    for r, f in enumerate(rank_culprit):
        f = int(f) if f == f else 0
        if f:
            out.append(Culprit(r, bool(f & CULPRIT_LOSS), bool(f & CULPRIT_GRAD)))
    return out
