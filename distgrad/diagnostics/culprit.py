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
  ``check_for_nan_in_grad`` checks each bucket before its all-reduce); every engine
  (:func:`pre_reduction_leaves`). A tensor hook (``Tensor.register_hook``) on a leaf runs as a
  *tensor pre-hook* of its ``AccumulateGrad`` node, with the micro-batch's incoming gradient,
  before it is accumulated into ``.grad`` and before any hook on that node or a
  post-accumulate-grad hook, which is where every engine starts its reduction (torch
  ``engine.cpp`` ``call_function``: tensor pre-hooks, then pre-hooks, then the node, then
  post-hooks). What the hooks see is therefore purely this rank's gradient:

  - DDP: the reducer copies the gradient into its bucket from a post-hook of that node.
  - DeepSpeed, ZeRO 1/2/3 and no ZeRO (0): the hooks go on the user's parameters
    (``engine.module``); ZeRO-1/2 reduce (``process_gradients`` ->
    ``reduce_ready_partitions_and_remove_grads``) and ZeRO-3 reduce-scatters
    (``reduce_partition_and_remove_grads``) from ``register_post_accumulate_grad_hook``
    (``deepspeed.utils.torch.register_grad_hook``); stage 0 all-reduces after the backward.
    Under ZeRO-3 the parameter is gathered while its gradient is computed: the hook sees the
    full-size local gradient.
  - FSDP1, both parameter modes: the hooks go on each unit's ``FlatParameter`` (the leaf
    the forward's views come from, also with ``use_orig_params=True``), whose
    ``AccumulateGrad`` post-hook (``_post_backward_hook``) reduce-scatters; they see the
    unsharded, padded local gradient of the whole unit.
  - FSDP2: the hooks go on the unsharded parameters (``FSDPParam._unsharded_param``, one
    ``nn.Parameter`` per parameter, created at the unit's first all-gather and reused after),
    which the forward uses; the unit's post-backward reduce-scatters from their ``.grad``.
    They do not exist before the first forward: the hooks are added by a forward hook on each
    ``fully_shard`` module after its forward, so the first micro-batch is covered too.

  A NaN made only in the backward pass (the loss stays finite) is therefore named on the rank
  that made it under every engine. Not covered: gradients that do not reach a leaf tensor of
  the model through autograd (e.g. a custom ``torch.autograd.Function`` that writes ``.grad``
  itself); there the loss flag alone names the culprit.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn as nn

from distgrad.record import Culprit
from distgrad.stats.layout import CULPRIT_GRAD, CULPRIT_LOSS

log = logging.getLogger("distgrad")

__all__ = ["LeafHooks", "LocalGradCheck", "culprit_flags", "decode", "leaf_hooks_paused", "pre_reduction_leaves"]

_PAUSED = [0]  # > 0 while a rerun's own backward runs (distgrad.diagnostics.rerun): hooks ignore it


@contextlib.contextmanager
def leaf_hooks_paused() -> Iterator[None]:
    """Every :class:`LeafHooks` hook does nothing inside this block (nestable). The rerun
    attribution's backward (:mod:`distgrad.diagnostics.rerun`, ``torch.autograd.grad``, which runs
    tensor hooks on leaves too) must not count in the next step's culprit flags or noise scale."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


class LeafHooks:
    """Tensor hooks on leaves whose incoming gradient is this rank's own, before any reduction
    (the hook points of :func:`pre_reduction_leaves`); shared by :class:`LocalGradCheck` and the
    noise scale's :class:`~distgrad.signals.noise_scale.MicroBatchNorms`.

    A hook hands the incoming gradient of one micro-batch (a DTensor's local tensor) to
    :meth:`_on_grad` with the leaf's key; an exception there is passed to :meth:`_failed` and
    never reaches the backward pass.
    """

    def __init__(self, leaves: Iterable[torch.Tensor] = ()) -> None:
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self.add(leaves)

    def add(self, leaves: Iterable[torch.Tensor]) -> int:
        """Hook more leaves (those already hooked and those without ``requires_grad`` are
        skipped); returns how many were added."""
        n = 0
        for p in leaves:
            if p.requires_grad and id(p) not in self._hooked:
                key = id(p)
                self._handles.append(p.register_hook(lambda g, key=key: self._hook(key, g)))
                self._hooked.add(key)
                n += 1
        return n

    def _hook(self, key: int, grad: torch.Tensor) -> None:
        if _PAUSED[0]:
            return None
        try:
            g = grad.detach()
            to_local = getattr(g, "to_local", None)
            if callable(to_local):
                g = to_local()
            self._on_grad(key, g)
        except Exception:  # noqa: BLE001 - a hook must never break the backward pass
            self._failed()
        return None

    def _on_grad(self, key: int, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def _failed(self) -> None:
        """Called when :meth:`_on_grad` raised (default: nothing)."""

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._hooked = set()


class LocalGradCheck(LeafHooks):
    """Flags a NaN/Inf in any gradient this rank computes before the reduction.

    Args:
        params: the trainable parameters (leaf tensors); a tensor hook is registered on each.

    Every hook adds ``grad.sum(dtype=float64)`` into one 0-d float64 accumulator on the
    gradient's device; :meth:`take` reads (on the device) whether the accumulator is finite
    and starts over. Call :meth:`take` or :meth:`reset` at every optimizer-step boundary.
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._acc: torch.Tensor | None = None
        super().__init__(params)

    def _on_grad(self, key: int, g: torch.Tensor) -> None:
        if not g.is_floating_point() or g.numel() == 0:
            return
        s = g.sum(dtype=torch.float64)
        if self._acc is None or self._acc.device != s.device:
            self._acc = torch.zeros((), dtype=torch.float64, device=s.device)
        self._acc.add_(s)

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


def decode(rank_culprit: Iterable[float]) -> list[Culprit]:
    """The reduced per-rank flags (host floats, one per rank) as one
    :class:`~distgrad.record.Culprit` per rank with any flag, ascending."""
    out: list[Culprit] = []
    for r, f in enumerate(rank_culprit):
        f = int(f) if f == f else 0
        if f:
            out.append(Culprit(r, bool(f & CULPRIT_LOSS), bool(f & CULPRIT_GRAD)))
    return out


def pre_reduction_leaves(engine_name: str, module: nn.Module
                         ) -> tuple[list[torch.Tensor], Callable[[LeafHooks], Callable[[], None]] | None]:
    """The leaf tensors whose incoming gradient is this rank's own, before the engine reduces
    it (see the module docstring for the facts per engine).

    Args:
        engine_name: the source's ``engine_name`` ("ddp", "torch", "deepspeed", "fsdp1", "fsdp2").
        module: the model the user's forward runs: the DDP / FSDP1 root, the ``fully_shard``
            root, ``DeepSpeedEngine.module`` (``torch.compile`` unwrapped).

    Returns:
        ``(leaves, lazy)``: the tensors to hook now, and for FSDP2 a function that, given the
        check, registers forward hooks on each ``fully_shard`` module that hook its unsharded
        parameters once they exist, and returns the function removing those forward hooks
        (None for the other engines).

    Raises:
        ValueError: an engine name this function does not know.
    """
    if engine_name in ("ddp", "torch", "deepspeed"):
        return [p for p in module.parameters() if p.requires_grad], None
    if engine_name == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        flats = [u._flat_param for u in module.modules() if isinstance(u, FSDP)]
        return [fp for fp in flats if fp is not None and fp.requires_grad], None
    if engine_name == "fsdp2":
        return [], functools.partial(_fsdp2_lazy, module)
    raise ValueError(f"no pre-reduction gradient hook point known for engine {engine_name!r}")


def _fsdp2_unsharded(unit: nn.Module) -> tuple[list[torch.Tensor], bool]:
    """The unit's unsharded parameters that exist (private FSDP2 state, read in torch 2.13:
    ``_get_fsdp_state()._fsdp_param_groups[*].fsdp_params[*]._unsharded_param``) and whether
    every trainable one exists."""
    state = cast(Any, unit)._get_fsdp_state()  # an FSDPModule method (not on nn.Module's type)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per state
        g = getattr(state, "_fsdp_param_group", None)
        groups = [g] if g is not None else []
    out, complete = [], True
    for g in groups:
        for fp in g.fsdp_params:
            if not fp.sharded_param.requires_grad:
                continue
            p = getattr(fp, "_unsharded_param", None)
            if p is None:
                complete = False
            else:
                out.append(p)
    return out, complete


def _fsdp2_lazy(module: nn.Module, check: LeafHooks) -> Callable[[], None]:
    """Hook the unsharded parameters of every ``fully_shard`` unit in ``module`` that exist,
    and add a forward hook to each unit whose do not yet (created at its first all-gather),
    removed once they are hooked. Returns the function removing the remaining forward hooks."""
    from distgrad.engines.torch_base import _fsdp2_module_type

    kind = _fsdp2_module_type()
    handles: dict[int, Any] = {}

    def after_forward(unit: nn.Module, *_: Any) -> None:
        try:
            params, complete = _fsdp2_unsharded(unit)
            check.add(params)
            if complete and id(unit) in handles:
                handles.pop(id(unit)).remove()
        except Exception:  # noqa: BLE001 - a check must never break the forward pass
            pass

    for unit in module.modules():
        if kind is None or not isinstance(unit, kind):
            continue
        try:
            params, complete = _fsdp2_unsharded(unit)
        except Exception as e:  # noqa: BLE001 - private state of another torch version: no check
            log.warning("distgrad: the pre-reduction gradient check cannot find FSDP2's unsharded "
                        "parameters on this torch version (%s: %s); a culprit rank is then named by its "
                        "loss only", type(e).__name__, e)
            break
        check.add(params)
        if not complete:
            handles[id(unit)] = unit.register_forward_hook(after_forward)

    def remove() -> None:
        for h in handles.values():
            h.remove()
        handles.clear()
    return remove
