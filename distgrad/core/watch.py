"""Non-finite detection on the optimizer steps that are not sampled (``interval`` > 1).

On every unsampled step the instrument calls :meth:`UnsampledWatch.observe` before the optimizer
consumes the gradients. It works on the device only -- no collective, no host sync: one flag,
1.0 when this rank's gradient piece holds NaN/Inf, and one when the loss observed since the
last boundary is not finite, stored in the slot ``step % interval - 1`` of a
``[2, interval - 1]`` float64 tensor. The next sampled step appends that tensor to its MAX
collective (:meth:`UnsampledWatch.take`), which ORs the flags over ranks, and
:meth:`UnsampledWatch.fold` turns the reduced flags back into step numbers.

The gradient test is ``torch._foreach_norm(pieces, inf)`` (max ``|g|`` per piece; NaN and Inf
propagate, and unlike a sum of squares it cannot overflow for finite values): one read of the
local piece, the same 1/W slice of the reduced gradient a sampled step reads on replicated
engines (DDP, ZeRO-0). The gradient after the reduction is identical on every replica, so a NaN
on one replica only (replicas that diverged) is left to the sampled steps' replica check.

fp16 overflow steps reported by the engine (a host flag it has anyway) are left out of the
gradient steps: their Inf gradients are expected under dynamic loss scaling and counted as
overflow steps. A NaN on the steps after the last sampled step of a run is not seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["UnsampledWatch", "step_ranges"]


def step_ranges(steps: Sequence[int], limit: int = 10) -> str:
    """``[3, 4, 5, 9]`` -> ``"3..5, 9"`` (sorted input; at most ``limit`` runs, then a count)."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs[:limit])
    return text + (f" and {len(runs) - limit} more range(s)" if len(runs) > limit else "")


class UnsampledWatch:
    """Per-rank state of the non-finite flags of the unsampled steps between two sampled ones.

    Args:
        interval: the sampling interval (>= 1; with 1 every step is sampled and this does
            nothing: :meth:`take` returns None and :meth:`fold` returns its input).
    """

    #: its name among the step's blocks (:class:`distgrad.stats.layout.StepBlocks`); MAX part only
    name = "unsampled"
    #: no SUM part
    sum_size = 0

    def __init__(self, interval: int) -> None:
        self.k = max(0, int(interval) - 1)
        self._flags: torch.Tensor | None = None  # [2, k] float64: row 0 gradient, row 1 loss
        self._slot: int | None = None  # slot of the last observed step, until overflow() is told
        self._overflow: set[int] = set()
        self._taken_overflow: set[int] = set()  # overflow slots of the flags last taken

    def observe(self, step: int, pieces: Sequence[torch.Tensor | None], loss_sum: torch.Tensor | None,
                device: torch.device) -> None:
        """Flag unsampled step ``step`` (``step % interval != 0``) from this rank's gradient
        ``pieces`` (1-D, any float dtypes; empty ones allowed) and the summed ``loss_sum`` (0-d
        or None). Device work only."""
        slot = step % (self.k + 1) - 1
        if self.k == 0 or slot < 0:
            return
        if self._flags is None:
            self._flags = torch.zeros((2, self.k), dtype=torch.float64, device=device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in pieces:
            if p is not None and p.numel():
                by_dtype.setdefault(p.dtype, []).append(p)
        flag = torch.zeros((), dtype=torch.float64, device=device)
        for group in by_dtype.values():
            amax = torch.stack(torch._foreach_norm(group, float("inf"))).amax()
            flag = torch.maximum(flag, (~torch.isfinite(amax)).to(device=device, dtype=torch.float64))
        self._flags[0, slot] = flag
        if loss_sum is not None:
            self._flags[1, slot] = (~torch.isfinite(loss_sum)).to(device=device, dtype=torch.float64)
        self._slot = slot

    def overflow(self, overflow: bool | None) -> None:
        """The engine's overflow flag for the step last passed to :meth:`observe` (host value)."""
        if overflow and self._slot is not None:
            self._overflow.add(self._slot)
        self._slot = None

    def take(self, device: torch.device) -> torch.Tensor | None:
        """The flags to append to a sampled step's MAX block (``2 * (interval - 1)`` float64
        elements, zeros for steps not observed; the same size on every rank), then start over.
        None when ``interval`` is 1."""
        if self.k == 0:
            return None
        flags = self._flags if self._flags is not None else torch.zeros((2, self.k), dtype=torch.float64)
        self._flags, self._slot = None, None
        self._taken_overflow, self._overflow = self._overflow, set()
        return flags.reshape(-1).to(device)

    @property
    def max_size(self) -> int:
        """Elements :meth:`take` appends to the MAX block (``2 * (interval - 1)``)."""
        return 2 * self.k

    def flagged(self, step: int, flags: np.ndarray) -> dict[str, list[int]] | None:
        """The steps the reduced flags (of the last :meth:`take`, :attr:`max_size` elements) of
        sampled step ``step`` flag: ``{"grad": [steps], "loss": [steps]}``, None when nothing was
        flagged. fp16 overflow steps are left out of ``grad``."""
        if self.k == 0:
            return None
        flags = flags.reshape(2, self.k)
        overflow = self._taken_overflow
        first = step - self.k  # the step of slot 0
        grad = [first + int(i) for i in np.nonzero(flags[0] > 0)[0] if int(i) not in overflow]
        loss = [first + int(i) for i in np.nonzero(flags[1] > 0)[0]]
        return {"grad": grad, "loss": loss} if grad or loss else None
