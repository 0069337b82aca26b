"""FSDP2 (``fully_shard``) adapter (facts: :mod:`distgrad.engines.torch_native`)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from distgrad.canonical import clean_name
from distgrad.engines.torch_base import (TorchSource, _comm_device, _first_float_dtype, _fsdp2_module_type,
    _unwrap_compiled, is_fsdp2)


class FSDP2Source(TorchSource):
    """A module sharded with ``fully_shard`` (FSDP2): each trainable parameter is a ``DTensor``
    sharded on dim 0 over a 1-D mesh; the reduced gradient's ``to_local()`` is this rank's chunk.

    Raises:
        TypeError: no ``fully_shard`` module in ``model``.
        ValueError: a parameter is not ``(Shard(0),)`` on a 1-D mesh (HSDP, tensor parallel),
            or parameters live on different meshes.
    """

    engine_name = "fsdp2"

    def __init__(self, model: Any) -> None:
        from torch.distributed.tensor import DTensor, Shard

        root = _unwrap_compiled(model)
        if not is_fsdp2(root):
            raise TypeError(f"no fully_shard module in {type(model).__name__}")
        self._params: list[torch.Tensor] = []
        self.names, self.numels, skipped = [], [], []
        mesh = None
        for name, p in root.named_parameters():
            if not p.requires_grad:
                continue
            if not isinstance(p, DTensor):
                skipped.append(clean_name(name, strip_module=False))
                continue
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ValueError(f"parameter {name!r} has placements {p.placements} on a "
                                 f"{p.device_mesh.ndim}-D mesh; distgrad supports FSDP2 on a 1-D mesh "
                                 "(Shard(0)) only, not HSDP or tensor parallelism")
            if mesh is None:
                mesh = p.device_mesh
            elif p.device_mesh != mesh:
                raise ValueError("FSDP2 parameters live on different device meshes; distgrad "
                                 "needs one data-parallel mesh")
            self._params.append(p)
            self.names.append(clean_name(name, strip_module=False))
            self.numels.append(p.numel())  # DTensor.numel() is the global element count
        self._exclude_unmanaged(skipped, "plain tensors (not sharded by fully_shard; apply "
                                "fully_shard to the root module)")
        self.group = mesh.get_group() if mesh is not None else None
        self.grad_dtype = _first_float_dtype(self._params)
        self.compute_dtype = self._param_dtype(root) or self.grad_dtype
        first = self._params[0].to_local().device if self._params else torch.device("cpu")
        self._device = _comm_device(self.group, first)

    @staticmethod
    def _param_dtype(root: nn.Module) -> torch.dtype | None:
        """``MixedPrecisionPolicy.param_dtype`` of the root FSDP2 state (private
        ``_get_fsdp_state()._mp_policy``; None when it cannot be read)."""
        t = _fsdp2_module_type()
        for m in root.modules():
            if t is not None and isinstance(m, t):
                try:
                    return m._get_fsdp_state()._mp_policy.param_dtype
                except Exception:  # noqa: BLE001 - label only
                    return None
        return None

    def local_offsets(self) -> list[tuple[int, int] | None]:
        """``Shard(0)`` follows ``torch.chunk`` on dim 0 (FSDP2 ``FSDPParam`` pads the last
        chunks): rank r holds rows ``[r*c, min(d0, (r+1)*c))`` with ``c = ceil(d0 / W)``."""
        out: list[tuple[int, int] | None] = []
        rank, world = self._rank_world()
        for p, n in zip(self._params, self.numels):
            d0 = p.shape[0] if p.dim() else 1
            row = n // d0 if d0 else 0
            c = -(-d0 // world)
            rows = max(0, min(c, d0 - rank * c))
            out.append((rank * c * row, rows * row) if rows else None)
        return out

    def local_param_pieces(self) -> Sequence[torch.Tensor | None]:
        """This rank's chunk of each sharded parameter, ``p.to_local()`` flattened."""
        return [p.detach().to_local().reshape(-1) for p in self._params]

    def _rank_world(self) -> tuple[int, int]:
        if self.group is None or not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def local_pieces(self) -> Sequence[torch.Tensor | None]:
        """P 1-D views of ``p.grad.to_local()``: this rank's rows of the dim-0 sharded reduced
        gradient (possibly empty), None without gradient. dtype: the sharded parameter's (fp32
        under ``MixedPrecisionPolicy(param_dtype=bf16)``; measured, pinned by the tests)."""
        pieces = [p.grad.to_local().reshape(-1) if p.grad is not None else None for p in self._params]
        self._note_dtype(pieces)
        return pieces
