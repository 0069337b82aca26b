"""A plain ``nn.Module`` on one process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distgrad.engines.torch_base import TorchSource, _first_float_dtype, _unwrap_compiled
from distgrad.naming.canonical import clean_name


class LocalSource(TorchSource):
    """A plain ``nn.Module`` trained on one process: its full gradients, world size 1.

    A plain module under an initialised ``torch.distributed`` with more than one rank is
    refused: nothing says whether (or over which group) its gradients are reduced, and
    treating every rank's local gradient as the global one would report numbers that are
    neither the per-rank nor the averaged gradient.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``torch.distributed`` is initialised with world size > 1.
    """

    engine_name = "torch"

    def __init__(self, model: Any) -> None:
        root = _unwrap_compiled(model)
        if not isinstance(root, nn.Module):
            raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"distgrad.instrument() got a plain {type(root).__name__} while torch.distributed has "
                f"{dist.get_world_size()} ranks: its gradients are not reduced by a wrapper distgrad "
                "knows. Wrap it in torch.nn.parallel.DistributedDataParallel, FullyShardedDataParallel "
                "or fully_shard and pass the wrapped model (or instrument it on a single process).")
        self._params = []
        self.names, self.numels = [], []
        for name, p in root.named_parameters():
            if p.requires_grad:
                self._params.append(p)
                self.names.append(clean_name(name, strip_module=False))
                self.numels.append(p.numel())
        self.grad_dtype = self.compute_dtype = _first_float_dtype(self._params)
        self._device = self._params[0].device if self._params else torch.device("cpu")

    def local_param_pieces(self) -> Sequence[torch.Tensor | None]:
        """The parameters themselves, flattened."""
        return [p.detach().reshape(-1) for p in self._params]

    def local_pieces(self) -> Sequence[torch.Tensor | None]:
        """P flattened full gradients (views), None for a parameter without gradient."""
        pieces = [p.grad.reshape(-1) if p.grad is not None else None for p in self._params]
        self._note_dtype(pieces)
        return pieces
