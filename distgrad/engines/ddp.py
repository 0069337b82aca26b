"""``DistributedDataParallel`` adapter (facts: :mod:`distgrad.engines.torch_native`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from distgrad.engines.torch_base import TorchSource, _comm_device, _first_float_dtype, _unwrap_compiled
from distgrad.naming.canonical import clean_name


class DDPSource(TorchSource):
    """``torch.nn.parallel.DistributedDataParallel``: full gradients averaged over the DDP
    process group, identical on every rank (``replicated``).

    Names come from ``ddp.module.named_parameters()`` (so no ``module.`` prefix), trainable
    only, tied weights once (``named_parameters`` removes duplicates), registration order.
    Parameters DDP ignores (``_ddp_params_and_buffers_to_ignore``) are excluded with a warning.

    Raises:
        TypeError: ``model`` is not a DistributedDataParallel.
        ValueError: from ``distgrad.core.job`` when the process group is part of the job (pipeline
            stages) and names collide across groups.
    """

    engine_name = "ddp"
    replicated = True

    def __init__(self, model: Any) -> None:
        ddp = _unwrap_compiled(model)
        if not isinstance(ddp, nn.parallel.DistributedDataParallel):
            raise TypeError(f"expected DistributedDataParallel, got {type(model).__name__}")
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        self.group = ddp.process_group
        self._params: list[torch.Tensor] = []
        self.names, self.numels, skipped = [], [], []
        for name, p in ddp.module.named_parameters():
            if not p.requires_grad:
                continue
            if name in ignored:
                skipped.append(name)
                continue
            self._params.append(p)
            self.names.append(clean_name(name, strip_module=False))
            self.numels.append(p.numel())
        self._exclude_unmanaged(skipped, "not all-reduced by DDP")
        mp = getattr(ddp, "mixed_precision", None)
        self.grad_dtype = _first_float_dtype(self._params)
        self.compute_dtype = getattr(mp, "param_dtype", None) or self.grad_dtype
        first = self._params[0].device if self._params else torch.device("cpu")
        self._device = _comm_device(self.group, first)

    def user_module(self, model: Any) -> nn.Module:
        return _unwrap_compiled(model).module

    def local_param_pieces(self) -> Sequence[torch.Tensor | None]:
        """The full parameters (the optimizer's own, identical on every rank), flattened."""
        return [p.detach().reshape(-1) for p in self._params]

    def local_pieces(self) -> Sequence[torch.Tensor | None]:
        """P flattened full gradients ``p.grad.reshape(-1)`` (views, ``numels[i]`` elements, the
        parameters' dtype), None for a parameter without gradient (unused this step). The core
        slices them per rank."""
        pieces = [p.grad.reshape(-1) if p.grad is not None else None for p in self._params]
        self._note_dtype(pieces)
        return pieces
