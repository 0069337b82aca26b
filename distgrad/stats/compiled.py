"""The ``torch.compile`` statistics kernel: one compiled reduction per piece, eager on any
compilation failure (logged once)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from distgrad.stats.eager import _piece_stats_eager

log = logging.getLogger("distgrad")


def _fused_reduction(x: torch.Tensor) -> torch.Tensor:
    """All statistics but numel of one piece as float64 ``[7]``, written so that
    ``torch.compile`` turns it into a single reduction over ``x``."""
    xf = x.float()
    f64 = torch.float64
    return torch.stack([
        xf.sum().to(f64), (xf * xf).sum().to(f64), (xf != xf).sum().to(f64),
        (xf.abs() == float("inf")).sum().to(f64), (xf == 0).sum().to(f64),
        xf.amax().to(f64), -xf.amin().to(f64)])


# compiled _fused_reduction, False once compilation failed
_compiled: Callable[[torch.Tensor], torch.Tensor] | bool | None = None


def _compiled_fn() -> Callable[[torch.Tensor], torch.Tensor] | None:
    global _compiled
    if _compiled is None:
        try:
            _compiled = torch.compile(_fused_reduction, dynamic=True)
        except Exception as e:  # noqa: BLE001
            log.warning("distgrad: torch.compile unavailable for the statistics, using eager (%s)", e)
            _compiled = False
    return _compiled if callable(_compiled) else None


def _piece_stats_compiled(x: torch.Tensor) -> torch.Tensor:
    global _compiled
    fn = _compiled_fn()
    if fn is not None:
        try:
            r = fn(x)
            n = torch.full((1,), float(x.numel()), dtype=torch.float64, device=r.device)
            return torch.cat([n, r])
        except Exception as e:  # noqa: BLE001
            log.warning("distgrad: compiled statistics failed, using eager from now on (%s: %s)",
                        type(e).__name__, e)
            _compiled = False
    return _piece_stats_eager(x)
