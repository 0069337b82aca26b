"""fp16 loss-scale collapse without a configured minimum: :class:`LossScaleCollapse` and its
plug-in :class:`LossScaleDiagnostic` (``distgrad_loss_scale_drop_factor``,
``distgrad_loss_scale_collapsed``).

Why: torch ``GradScaler`` has no minimum scale (it halves on every overflow, down to 0), so
``distgrad_loss_scale_at_minimum`` never becomes 1 for it. The signal here compares the current
loss scale with the **largest scale at which a step was applied** (``step_applied``) within the
last ``W`` optimizer steps (``loss_scale.collapse_window``; when no step was applied in the
window, the last applied step's scale, however old). The scale only falls by overflows (each
halves it under torch's and DeepSpeed's default backoff), so a drop factor ``>= F``
(``loss_scale.collapse_factor``, default 1024) means at least ``log2(F)`` net overflows since
training last worked: the overflows repeat and the scale cannot catch them.

What it does not trip on:

* the start of a run, when the scaler calibrates from a large initial scale (2^16, 2^32) with
  a burst of consecutive overflows: no step was applied at those scales, so they are never the
  reference;
* a healthy run with occasional overflows: each halves the scale once and the scaler grows it
  back (``growth_interval`` / ``loss_scale_window``); ten net halvings within ``W`` steps do
  not happen.

A run that never applies a step (overflow from step 0 on) has no reference: the repeated
overflow streak (``distgrad_consecutive_overflow_steps``) covers it.

Input: the sampled records (``loss_scale`` is read on sampled steps only: ``get_scale()`` syncs
with the device), host-side, no collective. State is checkpointed (:meth:`state_dict`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from distgrad.diagnostics.base import Diagnostic, DiagnosticContext, register
from distgrad.record import StepRecord


class LossScaleCollapse:
    """Drop factor of the loss scale from the scale training last worked at.

    Args:
        factor: ``F`` (> 1, dimensionless): drop factor at and above which the scale collapsed.
        window: ``W`` (>= 1, optimizer steps) looked back for the reference scale.
    """

    def __init__(self, factor: float = 1024.0, window: int = 1000) -> None:
        self.factor, self.window = float(factor), int(window)
        self._applied: deque[tuple[int, float]] = deque()  # (step, scale) of applied sampled steps
        self._last_applied: float | None = None

    def update(self, step: int, loss_scale: float | None, applied: bool) -> tuple[float | None, bool]:
        """Fold in one sampled step.

        Args:
            step: optimizer step (int, increasing).
            loss_scale: the scale this step's backward used (None/non-finite/<= 0: not usable).
            applied: the optimizer applied the step.

        Returns:
            ``(drop_factor, collapsed)``: reference scale / ``loss_scale`` (None when there is no
            reference yet or ``loss_scale`` is not usable; ``inf`` for a scale of 0) and
            ``drop_factor >= factor``.
        """
        ls = float(loss_scale) if loss_scale is not None and math.isfinite(loss_scale) and loss_scale >= 0 else None
        if ls is not None and applied and ls > 0:
            while self._applied and self._applied[-1][1] <= ls:
                self._applied.pop()  # a monotone deque: the window max is at the left
            self._applied.append((int(step), ls))
            self._last_applied = ls
        while self._applied and self._applied[0][0] <= step - self.window:
            self._applied.popleft()
        ref = self._applied[0][1] if self._applied else self._last_applied
        if ls is None or ref is None:
            return None, False
        drop = math.inf if ls == 0 else max(1.0, ref / ls)
        return drop, drop >= self.factor

    def state_dict(self) -> dict[str, Any]:
        return {"applied": [list(x) for x in self._applied], "last_applied": self._last_applied}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._applied = deque((int(s), float(v)) for s, v in sd["applied"])
        la = sd["last_applied"]
        self._last_applied = None if la is None else float(la)


@register
class LossScaleDiagnostic(Diagnostic):
    """Writes ``rec.scaler.loss_scale_drop_factor`` / ``loss_scale_collapsed`` on records that
    carry a loss scale (fp16 with a dynamic scaler; no-op otherwise)."""

    name = "loss_scale"

    def __init__(self, ctx: DiagnosticContext) -> None:
        super().__init__(ctx)
        c = ctx.config.loss_scale
        self.collapse = LossScaleCollapse(c.collapse_factor, c.collapse_window)

    def on_record(self, rec: StepRecord) -> None:
        if rec.scaler is None or rec.loss_scale is None:
            return
        drop, collapsed = self.collapse.update(rec.step, rec.loss_scale, rec.step_applied)
        rec.scaler.loss_scale_drop_factor = drop
        rec.scaler.loss_scale_collapsed = collapsed

    def state_dict(self) -> dict[str, Any]:
        return self.collapse.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd:
            self.collapse.load_state_dict(sd)
