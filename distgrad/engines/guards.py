"""Checks that the gradients read at the optimizer-step boundary can be the step's reduced,
pre-clip gradient (PyTorch-native engines). Used by
:class:`distgrad.engines.optimizer_boundary.OptimizerBoundary`.

Three ways a boundary can read the wrong gradient, each detected here without a collective:

- **read before the step's backward**: ``optimizer.step(closure)`` runs forward and backward
  inside ``step()``, after the optimizer's step pre-hooks (PyTorch Lightning's automatic
  optimization does this). Detected from the hook arguments: a closure was passed.
- **already clipped**: ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` /
  ``clip_grads_with_norm_`` or FSDP1's ``FullyShardedDataParallel.clip_grad_norm_`` ran on the
  instrumented parameters between the last boundary and this one, before distgrad read them.
  Detected by :class:`ClipWatch`, which wraps those functions (process-wide, from the first
  PyTorch-model ``instrument()`` on; the wrappers call the originals unchanged) and tells the
  boundaries whose parameters they touch.
- **no backward since the last boundary**: every gradient is the very tensor seen at the last
  boundary with the same version counter (``Tensor._version``, bumped by every in-place
  write: accumulation, DDP's bucket copy, FSDP's reduce-scatter output), or there is no gradient
  at all. Detected by :class:`GradSignature` (weak references, so no gradient is kept alive).

A rank that detects one of these still joins the step's collectives, with a "refused" flag
that encodes the reason (``Instrument.collect(step, refuse=...)``), so every rank drops the step
and nothing false is exported; the reason and its fix are logged once per reason, at ERROR
level, and every rank counts the sampled step in ``Instrument.refused_steps`` (served as
``distgrad_refused_steps_total{reason}``, the reason of the lowest refusing rank).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

log = logging.getLogger("distgrad")

_FIX = {
    "closure": (
        "optimizer.step(closure) computes the gradients inside step(), after distgrad's boundary "
        "(the optimizer's step pre-hook), so distgrad would read the previous step's gradients. "
        "Fix: with PyTorch Lightning use distgrad.integrations.lightning.DistgradCallback; in your "
        "own loop call loss.backward() before optimizer.step()."),
    "clipped": (
        "the gradients were clipped (clip_grad_norm_ / clip_grad_value_) before optimizer.step(), "
        "so distgrad would read the post-clip gradient as if it were the reduced one. Fix: let "
        "distgrad read first: call inst.read_gradients_now() right before clipping (or clip in an "
        "optimizer step pre-hook registered after distgrad.instrument()); with the Hugging Face "
        "Trainer / Accelerate / Lightning use distgrad.integrations, which does this."),
    "no_backward": (
        "no backward pass happened since the last optimizer step (the gradients are unchanged or "
        "absent), so they are not this step's gradient. Fix: call optimizer.step() once per "
        "accumulation boundary, after loss.backward()."),
}


class Refusals:
    """Logs each refusal reason once per instrument (at ERROR level, with the fix) and counts
    refusals per reason (``counts``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def refuse(self, reason: str, step: int) -> str:
        """Record a refusal of ``step`` for ``reason`` (a key of the fix table); returns the
        reason."""
        n = self.counts.get(reason, 0)
        self.counts[reason] = n + 1
        if n == 0:
            log.error("distgrad: step %d is NOT exported: %s (logged once; later steps with the same "
                      "problem are dropped without a message, counted in distgrad_refused_steps_total{reason} and "
                      "Instrument.boundary.refusals.counts)",
                      step, _FIX[reason])
        return reason


class GradSignature:
    """Identity and version of each parameter's gradient, held through weak references.

    ``same_as(prev)`` is True when every gradient is the same tensor object as in ``prev`` with
    the same ``_version`` (no in-place write since), i.e. no backward has touched them."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.refs: list[tuple[Any, int] | None] = []
        for p in params:
            g = p.grad
            if g is None:
                self.refs.append(None)
                continue
            local = getattr(g, "_local_tensor", None)  # DTensor: the local shard's counter
            v = int((local if local is not None else g)._version)
            self.refs.append((weakref.ref(g), v))

    @property
    def empty(self) -> bool:
        """No parameter has a gradient."""
        return all(r is None for r in self.refs)

    def same_as(self, prev: GradSignature | None) -> bool:
        if prev is None or len(prev.refs) != len(self.refs) or self.empty:
            return False
        for a, b in zip(self.refs, prev.refs):
            if (a is None) != (b is None):
                return False
            if a is None or b is None:  # both None (the test above)
                continue
            if a[0]() is None or a[0]() is not b[0]() or a[1] != b[1]:
                return False
        return True


class ClipWatch:
    """Wraps the gradient-clipping functions once per process and tells registered listeners
    which parameters each call touches. Listeners are called as ``fn(param_ids)`` with the set
    of ``id()`` of the parameters passed to the clipping function, before it clips."""

    _lock = threading.Lock()
    _listeners: weakref.WeakSet[Any] = weakref.WeakSet()
    _originals: dict[tuple[Any, str], Callable] = {}

    @classmethod
    def register(cls, listener: Any) -> None:
        """``listener.on_clip(param_ids)`` is called before every clipping call; the wrappers
        are installed on the first registration."""
        with cls._lock:
            if not cls._originals:
                cls._install()
            cls._listeners.add(listener)

    @classmethod
    def unregister(cls, listener: Any) -> None:
        with cls._lock:
            cls._listeners.discard(listener)

    @classmethod
    def _notify(cls, params: Any) -> Any:
        """Materialise ``params`` (a tensor, or an iterable that may be a generator) and tell the
        listeners; returns what to pass on to the real function."""
        if isinstance(params, torch.Tensor):
            lst: Any = params
            ids = {id(params)}
        else:
            lst = list(params)
            ids = {id(p) for p in lst}
        for listener in list(cls._listeners):
            try:
                listener.on_clip(ids)
            except Exception:  # noqa: BLE001 - never break the user's clipping
                log.exception("distgrad: clip watcher failed")
        return lst

    @classmethod
    def _install(cls) -> None:
        import torch.nn.utils as nnu
        import torch.nn.utils.clip_grad as cg

        def wrap(owner: Any, name: str, method: bool = False) -> None:
            orig = getattr(owner, name, None)
            if orig is None or getattr(orig, "_distgrad_clip_watch", False):
                return
            if method:
                @functools.wraps(orig)
                def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
                    ClipWatch._notify(list(self.parameters()))
                    return orig(self, *args, **kwargs)
            else:
                @functools.wraps(orig)
                def wrapped(parameters: Any, *args: Any, **kwargs: Any) -> Any:
                    return orig(ClipWatch._notify(parameters), *args, **kwargs)
            wrapped._distgrad_clip_watch = True  # type: ignore[attr-defined]
            cls._originals[(owner, name)] = orig
            setattr(owner, name, wrapped)

        for owner in (nnu, cg):
            for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grads_with_norm_"):
                wrap(owner, name)
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            wrap(FSDP, "clip_grad_norm_", method=True)
        except Exception:  # noqa: BLE001 - FSDP unavailable
            pass
