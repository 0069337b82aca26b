"""Loss components (multi-task losses, auxiliary losses such as MoE load balancing or z-loss):
``observe_loss(loss, components={"lm": lm, "aux": aux}, weights={"aux": 0.01})``.

The set of component names is declared by the first call that passes components (sorted; at
most :data:`MAX_COMPONENTS`); a later call with another set is refused (its components are
ignored, logged once, counted). Per component and step this rank accumulates on the device
``sum(value)``, ``count``, ``sum(weight * value)`` and ``sum(weight)``, plus the sum of the
micro-batch losses that came with components; the float64 ``[MAX_COMPONENTS * 4 + 2]`` block
rides in the step's SUM collective, and a fingerprint of the declared names (``h``, ``-h``) in
its MAX collective, so ranks that declared different sets are caught (the step's components are
then dropped and the disagreement logged) without another collective.

After the reduction, per component (exactly over all micro-batches and ranks):
``mean = sum(value) / count``; ``weight = sum(weight) / count`` (the mean weight, for weights
that follow a schedule); ``share = sum(weight * value) / sum(loss)``, the fraction of the total
loss the weighted component makes (the shares sum to 1 when the loss is exactly the weighted sum
of its components).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from distgrad.loss.token import to_device

#: at most this many components (bounded label set of ``distgrad_loss_component{component}``)
MAX_COMPONENTS = 8
COMP_COLS = ("sum", "count", "weighted_sum", "weight_sum")


class ComponentError(ValueError):
    """observe_loss got components it cannot use (message: what and the fix)."""


def _fingerprint(names: list[str]) -> float:
    """A float64-exact integer (< 2**52) identifying the ordered name list."""
    return float(int(hashlib.sha1("\0".join(names).encode()).hexdigest()[:13], 16))


def _scalar(v: Any, what: str, device: torch.device) -> torch.Tensor:
    """0-d float64 on ``device``; a Python number is filled in on the device (no copy)."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_complex():
            raise ComponentError(f"{what} is a tensor of shape {list(v.shape)}: pass one value per component "
                                 "(e.g. its .mean())")
        return v.detach().reshape(()).to(device=device, dtype=torch.float64)
    try:
        return torch.full((), float(v), dtype=torch.float64, device=device)
    except (TypeError, ValueError):
        raise ComponentError(f"{what} is a {type(v).__name__}: pass a number or a 0-d tensor") from None


class LossComponents:
    """One rank's component accumulation between two optimizer-step boundaries."""

    sum_size = MAX_COMPONENTS * len(COMP_COLS) + 2
    max_size = 2

    def __init__(self) -> None:
        self.names: list[str] | None = None
        self.block: torch.Tensor | None = None  # [sum_size] float64 on the loss's device

    def add(self, loss: torch.Tensor, components: Mapping[str, Any], weights: Mapping[str, Any] | None) -> None:
        """Add one micro-batch's components (``loss``: its 0-d float64 total). Device work only.

        Raises:
            ComponentError: not a mapping of names to scalars, too many names, a set other than
                the declared one, a weight for an unknown component."""
        if not isinstance(components, Mapping) or not components:
            raise ComponentError("components must be a non-empty dict {name: value}")
        names = sorted(str(k) for k in components)
        if self.names is None:
            if len(names) > MAX_COMPONENTS:
                raise ComponentError(f"{len(names)} components {names}: at most {MAX_COMPONENTS} (a bounded "
                                     "label set); sum the minor ones into one")
            self.names = names
        elif names != self.names:
            raise ComponentError(f"components {names} differ from those declared at first use {self.names}: "
                                 "pass the same names on every call (0 for a component absent from a batch)")
        w = dict(weights or {})
        unknown = sorted(set(map(str, w)) - set(names))
        if unknown:
            raise ComponentError(f"weights for {unknown}, which are not components ({names})")
        dev = loss.device
        comp = {str(k): v for k, v in components.items()}
        w = {str(k): v for k, v in w.items()}
        vals = torch.stack([_scalar(comp[n], f"component {n!r}", dev) for n in names])
        try:
            wts = to_device([float(w.get(n, 1.0)) for n in names], torch.float64, dev)
        except (TypeError, ValueError):
            raise ComponentError(f"weights {w} must be numbers") from None
        block = torch.zeros(self.sum_size, dtype=torch.float64, device=dev)
        rows = block[: MAX_COMPONENTS * len(COMP_COLS)].view(MAX_COMPONENTS, len(COMP_COLS))
        k = len(names)
        rows[:k, 0] = vals
        rows[:k, 1] = 1.0
        rows[:k, 2] = vals * wts
        rows[:k, 3] = wts
        block[-2] = loss.to(dev)
        block[-1] = 1.0
        self.block = block if self.block is None else self.block + block.to(self.block.device)

    def take(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum_part, max_part)`` of this step for the collectives, then start over."""
        s = (self.block.to(device) if self.block is not None
             else torch.zeros(self.sum_size, dtype=torch.float64, device=device))
        if self.names is not None:
            h = _fingerprint(self.names)
            m = torch.tensor([h, -h], dtype=torch.float64, device=device)
        else:
            m = torch.full((2,), -math.inf, dtype=torch.float64, device=device)
        self.block = None
        return s, m

    def clear(self) -> None:
        self.block = None

    def unpack(self, s: np.ndarray, m: np.ndarray) -> dict[str, Any] | None:
        """``{"names", "mean", "weight", "share"}`` (lists in name order) from the reduced parts;
        None when no rank passed components this step. ``{"error": ...}`` when ranks declared
        different sets or this rank declared none while others did."""
        rows = np.asarray(s[: MAX_COMPONENTS * len(COMP_COLS)], dtype=np.float64).reshape(MAX_COMPONENTS, -1)
        if rows[:, 1].sum() <= 0:
            return None
        if self.names is None or m[0] != -m[1] or m[0] != _fingerprint(self.names):
            return {"error": "ranks declared different loss components (or this rank none): "
                             "pass the same components on every rank"}
        k = len(self.names)
        total = float(s[-2])
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = rows[:k, 0] / rows[:k, 1]
            weight = rows[:k, 3] / rows[:k, 1]
            share = rows[:k, 2] / total if total else np.full(k, np.nan)
        return {"names": list(self.names), "mean": mean.tolist(), "weight": weight.tolist(), "share": share.tolist(),
                "count": rows[:k, 1].tolist()}
