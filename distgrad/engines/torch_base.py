"""Common part of the PyTorch-native adapters: recognising the wrappers, the compiled-module
unwrapping, the communication device and :class:`TorchSource` (see
:mod:`distgrad.engines.torch_native` for the facts relied on)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distgrad.engines.base import GradSource

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

log = logging.getLogger("distgrad")


SUPPORTED = ("torch.nn.parallel.DistributedDataParallel, "
             "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1, use_orig_params True or False, "
             "FULL_SHARD / SHARD_GRAD_OP / NO_SHARD / HYBRID_SHARD / _HYBRID_SHARD_ZERO2), a module "
             "sharded with torch.distributed.fsdp.fully_shard (FSDP2 on a 1-D mesh, HSDP on a 2-D mesh, with "
             "tensor parallelism on a (dp, tp) mesh), a plain torch.nn.Module on one process (optionally "
             "torch.compile'd)")


def _unwrap_compiled(model: Any) -> Any:
    """The module inside ``torch.compile(model)`` (``OptimizedModule._orig_mod``), else model."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner
    return model


def _fsdp2_module_type() -> type[FSDPModule] | None:
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def is_ddp(model: Any) -> bool:
    return isinstance(_unwrap_compiled(model), nn.parallel.DistributedDataParallel)


def is_fsdp1(model: Any) -> bool:
    """True when ``model`` is, or contains, a ``FullyShardedDataParallel`` unit."""
    m = _unwrap_compiled(model)
    if not isinstance(m, nn.Module):
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return any(isinstance(x, FSDP) for x in m.modules())


def is_fsdp2(model: Any) -> bool:
    """True when ``model`` or one of its submodules was passed to ``fully_shard``."""
    m = _unwrap_compiled(model)
    t = _fsdp2_module_type()
    return t is not None and isinstance(m, nn.Module) and any(isinstance(x, t) for x in m.modules())


def is_torch_module(model: Any) -> bool:
    return isinstance(model, nn.Module)


def _first_float_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    for p in params:
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _comm_device(group: Any, fallback: torch.device) -> torch.device:
    """Device on which to pack statistics: CUDA under NCCL (NCCL needs device tensors even when
    the gradients were offloaded to the CPU), else where the gradients are."""
    try:
        if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
            return torch.device("cuda", torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - a group without a backend string: keep the fallback
        pass
    return fallback


class TorchSource(GradSource):
    """Common part of the PyTorch-native adapters.

    Attributes (besides :class:`GradSource`'s):
        group: the process group the gradients are reduced over (None on one process); the
            :class:`~distgrad.core.instrument.Instrument` combines statistics over this group.
        scaler: the ``torch.amp.GradScaler`` given to ``instrument()``, or None.
    """

    group: Any = None
    scaler: Any = None
    #: the ``torch.optim.Optimizer`` given to ``instrument()`` (set there), for its state
    optimizer: Any = None
    _device: torch.device = torch.device("cpu")

    def _state_entries(self) -> list[tuple[torch.Tensor, Any] | None]:
        """Per parameter, the tensor the optimizer state is keyed by and the cut of a state
        tensor into the gradient piece (:mod:`distgrad.engines.optimizer_state`); default: the
        parameter itself, whole (plain module, DDP: the core takes this rank's share)."""
        from distgrad.engines.optimizer_state import flat

        return [(p, flat) for p in self._params]  # type: ignore[attr-defined]

    def optimizer_slots(self) -> list[Any] | None:
        """Slots of the optimizer given to ``instrument()`` (None without one)."""
        from distgrad.engines.optimizer_state import torch_slots

        return None if self.optimizer is None else torch_slots(self.optimizer, self._state_entries())

    def device(self) -> torch.device:
        return self._device

    def _note_dtype(self, pieces: Sequence[torch.Tensor | None]) -> None:
        """The gradient dtype is read from the gradients themselves (FSDP casts reduced
        gradients back to the parameter dtype unless ``keep_low_precision_grads``)."""
        for p in pieces:
            if p is not None:
                self.grad_dtype = p.dtype
                return

    # GradScaler state (torch.amp.GradScaler / ShardedGradScaler)
    def has_loss_scaler(self) -> bool:
        return self.scaler is not None and bool(self.scaler.is_enabled())

    def loss_scale(self) -> float | None:
        """``scaler.get_scale()`` (a host sync); None without an enabled scaler."""
        return float(self.scaler.get_scale()) if self.has_loss_scaler() else None

    def user_module(self, model: Any) -> nn.Module:
        """The module whose forward the user's code defines (for the forward overflow tracer):
        the model inside ``torch.compile`` and, for DDP, inside the wrapper."""
        return _unwrap_compiled(model)

    def local_offsets(self) -> list[tuple[int, int] | None]:
        """Per parameter, ``(start, numel)`` of :meth:`local_pieces` within the flattened full
        parameter (None if this rank holds none); replicated sources: the whole parameter."""
        return [(0, n) for n in self.numels]

    def scale_grads(self, factors: Sequence[float]) -> None:
        """Multiply each parameter's gradient in place by its factor (adaptive clipping,
        :mod:`distgrad.diagnostics.adaptive_clip`): ``factors`` is aligned with :attr:`names`;
        a factor of 1 and a parameter without gradient are left alone. One process and DDP:
        ``p.grad`` (the full reduced gradient); FSDP2: ``p.grad`` is the DTensor of this rank's
        shard, scaled locally (the factor comes from the full parameter's reduced norm, the same
        on every rank). ``p.grad`` keeps its dtype (a low-precision gradient is rounded)."""
        for p, f in zip(self._params, factors):  # type: ignore[attr-defined]
            if f != 1.0 and p.grad is not None:
                p.grad.mul_(float(f))

    def _exclude_unmanaged(self, unmanaged: list[str], why: str) -> None:
        if unmanaged:
            log.warning("distgrad: %d trainable parameter(s) are not managed by %s and are not "
                        "reported (their gradients are %s): %s", len(unmanaged), self.engine_name,
                        why, unmanaged[:10])
