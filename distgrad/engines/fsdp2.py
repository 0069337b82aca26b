"""FSDP2 (``fully_shard``) adapter (facts: :mod:`distgrad.engines.torch_native`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from distgrad.engines.base import Ownership
from distgrad.engines.torch_base import (
    TorchSource,
    _comm_device,
    _first_float_dtype,
    _fsdp2_module_type,
    _unwrap_compiled,
    is_fsdp2,
)
from distgrad.naming.canonical import clean_name

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class FSDP2Source(TorchSource):
    """A module sharded with ``fully_shard`` (FSDP2), alone on a 1-D mesh or with more mesh
    dimensions: HSDP (``fully_shard(mesh=2-D (replicate, shard) mesh)``) and FSDP2 + tensor
    parallelism (``parallelize_module`` on the ``tp`` dimension of a ``(dp, tp)`` mesh, then
    ``fully_shard(mesh=mesh["dp"])``). Each trainable parameter is a ``DTensor``; the reduced
    gradient's ``to_local()`` is this rank's block, counted once over the job by
    :func:`distgrad.engines.mesh.mesh_ownership` (facts there).

    Statistics are combined over the parameters' mesh: its process group for a 1-D mesh, the
    default group (the whole job) for more dimensions; a mesh smaller than the job (pipeline
    stages) joins the job-wide parameter list of :mod:`distgrad.core.job`.

    Raises:
        TypeError: no ``fully_shard`` module in ``model``.
        ValueError: a ``Partial`` placement, or meshes that are not one mesh and its named
            sub-meshes.
    """

    engine_name = "fsdp2"

    def __init__(self, model: Any) -> None:
        from torch.distributed.tensor import DTensor

        from distgrad.engines.mesh import full_placements, mesh_ownership, root_mesh

        root = _unwrap_compiled(model)
        if not is_fsdp2(root):
            raise TypeError(f"no fully_shard module in {type(model).__name__}")
        self._params: list[DTensor] = []
        self.names, self.numels, skipped = [], [], []
        for name, p in root.named_parameters():
            if not p.requires_grad:
                continue
            if not isinstance(p, DTensor):
                skipped.append(clean_name(name, strip_module=False))
                continue
            self._params.append(p)
            self.names.append(clean_name(name, strip_module=False))
            self.numels.append(p.numel())  # DTensor.numel() is the global element count
        self._exclude_unmanaged(skipped, "plain tensors (not sharded by fully_shard; apply "
                                "fully_shard to the root module)")
        mesh = root_mesh([p.device_mesh for p in self._params]) if self._params else None
        self._placements = []
        for name, p in zip(self.names, self._params):
            try:
                self._placements.append(full_placements(p, mesh))
            except ValueError as e:
                raise ValueError(f"parameter {name!r} has placements {p.placements}: {e}; distgrad reads "
                                 "gradients after their reduction (Shard / Replicate placements)") from None
        self.mesh = mesh
        if mesh is None or mesh.ndim == 1:
            self.group = mesh.get_group() if mesh is not None else None
        else:
            self.group = None  # the whole job (a mesh smaller than the job: see distgrad.core.job)
        self._own = mesh_ownership(self._placements, mesh, self.group) if mesh is not None else None
        self.grad_dtype = _first_float_dtype(self._params)
        self.compute_dtype = self._param_dtype(root) or self.grad_dtype
        first = self._params[0].to_local().device if self._params else torch.device("cpu")
        self._device = _comm_device(self.group, first)

    def param_holders(self) -> list[tuple[int, ...]]:
        """Per parameter, the global ranks of the mesh (pipeline stages: this stage's mesh)."""
        ranks = tuple(int(r) for r in self.mesh.mesh.reshape(-1).tolist()) if self.mesh is not None else ()
        return [ranks] * len(self.names)

    def ownership(self, rank: int, world: int) -> Ownership:
        """From the placements over the mesh (:func:`distgrad.engines.mesh.mesh_ownership`)."""
        return self._own if self._own is not None else super().ownership(rank, world)

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
        chunks): the rank of coordinate c on the sharding mesh dimension (of size W) holds rows
        ``[c*k, min(d0, (c+1)*k))`` with ``k = ceil(d0 / W)``; ``Replicate`` dimensions hold
        copies. Only for layouts with at most one ``Shard(0)`` dimension and otherwise
        ``Replicate`` (FSDP2, HSDP); tensor-parallel blocks are not contiguous.

        Raises:
            NotImplementedError: a tensor-parallel (other sharding) placement."""
        from torch.distributed.tensor import Shard

        out: list[tuple[int, int] | None] = []
        mesh = self.mesh  # None only without parameters
        coord = list(mesh.get_coordinate() or []) if mesh is not None else []
        for p, n, pls in zip(self._params, self.numels, self._placements):
            shard = [d for d, pl in enumerate(pls) if not pl.is_replicate()]
            if len(shard) > 1 or any(type(pls[d]) is not Shard or pls[d].dim != 0 for d in shard):
                raise NotImplementedError(f"local_offsets: placements {pls} are not contiguous blocks")
            rank, world = (coord[shard[0]], mesh.size(shard[0])) if shard and mesh is not None else (0, 1)
            d0 = p.shape[0] if p.dim() else 1
            row = n // d0 if d0 else 0
            c = -(-d0 // world)
            rows = max(0, min(c, d0 - rank * c))
            out.append((rank * c * row, rows * row) if rows else None)
        return out

    def _state_entries(self) -> list[tuple[torch.Tensor, Any] | None]:
        """State tensors are DTensors placed like their parameter: ``to_local()`` flattened."""
        return [(p, _local_flat) for p in self._params]

    def local_param_pieces(self) -> Sequence[torch.Tensor | None]:
        """This rank's chunk of each sharded parameter, ``p.to_local()`` flattened."""
        return [p.to_local().detach().reshape(-1) for p in self._params]

    def local_pieces(self) -> Sequence[torch.Tensor | None]:
        """P 1-D views of ``p.grad.to_local()``: this rank's rows of the dim-0 sharded reduced
        gradient (possibly empty), None without gradient. dtype: the sharded parameter's (fp32
        under ``MixedPrecisionPolicy(param_dtype=bf16)``; measured, pinned by the tests)."""
        pieces = [_local_flat(p.grad) if p.grad is not None else None for p in self._params]
        self._note_dtype(pieces)
        return pieces


def _local_flat(t: torch.Tensor) -> torch.Tensor:
    """A DTensor state tensor's local block (a plain tensor as is), flattened."""
    return (t.to_local() if hasattr(t, "to_local") else t).reshape(-1)
