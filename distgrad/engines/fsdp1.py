"""FSDP1 (``FullyShardedDataParallel``) adapter, both parameter modes (facts:
:mod:`distgrad.engines.torch_native`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from distgrad.engines.base import Ownership
from distgrad.engines.torch_base import TorchSource, _comm_device, _first_float_dtype, _unwrap_compiled
from distgrad.naming.canonical import clean_name


def _check_flat_layout(fp: Any, where: str) -> None:
    """Pin the private ``FlatParameter`` attributes the flat-mode adapter reads.

    Requires ``_fqns``, ``_numels``, ``_param_infos``, ``_shard_param_infos`` of equal length
    and, for each in-shard entry, ``offset_in_shard``/``numel_in_shard`` inside the local
    shard, with ``sum(numel_in_shard) + _shard_numel_padded == fp.numel()`` (torch 2.4-2.13,
    ``FlatParamHandle._init_shard_metadata``; ``use_orig_params=False`` has no alignment
    padding between parameters).

    Raises:
        RuntimeError: the layout is not the one distgrad was written against (names the unit).
    """
    try:
        n = len(fp._fqns)
        ok = n == len(fp._numels) == len(fp._shard_param_infos) == len(fp._param_infos)
        infos = fp._shard_param_infos
        used = sum(int(i.numel_in_shard) for i in infos if i.in_shard)
        local = fp.numel()
        ok = ok and all(0 <= i.offset_in_shard and i.offset_in_shard + i.numel_in_shard <= local
                        for i in infos if i.in_shard)
        ok = ok and used + int(fp._shard_numel_padded) == local
    except (AttributeError, TypeError) as e:
        raise RuntimeError(f"FSDP FlatParameter of unit {where!r} lacks an attribute distgrad reads "
                           f"({e}); this torch version is not supported with use_orig_params=False, "
                           "use use_orig_params=True") from e
    if not ok:
        raise RuntimeError(f"FSDP FlatParameter of unit {where!r} has a shard layout distgrad does not "
                           "understand (sum of numel_in_shard + _shard_numel_padded != local shard "
                           "size); use use_orig_params=True")


def _intra(info: Any, numel: int, replicated: bool) -> tuple[int, int] | None:
    """``(start, numel)`` of a ``_ShardParamInfo``'s piece within the flattened parameter."""
    if replicated:
        return (0, numel)
    if not info.in_shard:
        return None
    return (int(info.intra_param_start_idx), int(info.numel_in_shard))


class FSDP1Source(TorchSource):
    """``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1), either parameter mode.

    ``use_orig_params=True``: the original parameters are real parameters whose ``.grad`` is
    this rank's 1-D slice (or None); full sizes come from each unit's ``FlatParameter``
    (``_params`` and ``_numels``, private). ``use_orig_params=False``: each trainable
    ``FlatParameter``'s shard gradient is split back into the original parameters with
    ``_fqns`` / ``_shard_param_infos`` (see :func:`_check_flat_layout`); names are the user's
    own (``prefix + fqn`` with wrapper components removed), sorted into registration order by
    the position of the owning module (``_param_infos[i].module``) in ``model.modules()``.

    ``NO_SHARD`` units hold full, identical gradients: the source is then ``replicated``.
    ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: shards as FULL_SHARD / SHARD_GRAD_OP within the
    shard group, one identical copy per rank of the replica group: each rank counts its share of
    its shard (:meth:`ownership`); statistics are combined over the whole job.

    Raises:
        TypeError: no FSDP unit in ``model``.
        ValueError: units mixing strategies (hybrid with others, ``NO_SHARD`` with sharded
            ones), or hybrid units on different groups or not spanning the job.
        RuntimeError: the private FlatParameter layout is not the expected one.
    """

    engine_name = "fsdp1"

    def __init__(self, model: Any) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        root = _unwrap_compiled(model)
        units = [m for m in root.modules() if isinstance(m, FSDP)]
        if not units:
            raise TypeError(f"no FullyShardedDataParallel unit in {type(model).__name__}")
        strategies = {u.sharding_strategy for u in units}
        hybrid = {s for s in strategies if "HYBRID" in s.name}
        if hybrid and len(strategies) > 1:
            raise ValueError("FSDP1 units mix hybrid sharding with other strategies "
                             f"({sorted(s.name for s in strategies)}); use one strategy for all units")
        if ShardingStrategy.NO_SHARD in strategies and len(strategies) > 1:
            raise ValueError("FSDP1 units mix NO_SHARD with sharded strategies "
                             f"({sorted(s.name for s in strategies)}); use one strategy for all units")
        self.replicated = strategies == {ShardingStrategy.NO_SHARD}
        self.group = units[0].process_group
        self._own: Ownership | None = None
        if hybrid:
            self._own = self._hybrid_ownership(units)
            self.group = None  # shard groups x replica groups: the whole job
        mp = units[0].mixed_precision
        flat = [(n, p) for n, p in root.named_parameters() if getattr(p, "_is_flat_param", False)]
        self.use_orig_params = not flat
        self._params: list[torch.Tensor] = []
        self._slices: list[tuple[torch.Tensor, int, int] | None] = []
        self.names, self.numels = [], []
        if self.use_orig_params:
            self._init_orig(root, units)
        else:
            self._init_flat(root)
        ref = self._params or [p for _, p in flat]
        self.grad_dtype = _first_float_dtype(ref)
        if mp is not None and mp.keep_low_precision_grads and mp.param_dtype is not None:
            self.grad_dtype = mp.param_dtype
        self.compute_dtype = (mp.param_dtype if mp is not None and mp.param_dtype is not None
                              else _first_float_dtype(ref))
        # set by FSDP's initialisation (None only before it): the fallback is never taken on a wrapped model
        dev = units[0].compute_device
        self._device = _comm_device(self.group, dev if dev is not None else torch.device("cpu"))

    def ownership(self, rank: int, world: int) -> Ownership:
        """Hybrid sharding: of its shard, held identically by the ranks of its replica group
        (``_inter_node_pg``), this rank counts slice ``rank in that group``; the replica check
        compares ranks of equal shard index."""
        if self._own is None:
            return super().ownership(rank, world)
        n, o = len(self.names), self._own
        return Ownership(o.index[:1] * n, o.copies[:1] * n, [True] * n, o.groups, o.describe)

    @staticmethod
    def _hybrid_ownership(units: list) -> Ownership:
        """``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: gradients are reduce-scattered in the shard
        group (``process_group``) and all-reduced over the replica group (``_inter_node_pg``, read
        in ``torch/distributed/fsdp/_init_utils.py``), so each shard has one copy per replica
        group rank. One ``all_gather_object`` of every rank's (replica, shard) index, at
        ``instrument()``.

        Raises:
            ValueError: units on different process groups, or groups that do not tile the job."""
        import torch.distributed as dist

        intra, inter = units[0].process_group, getattr(units[0], "_inter_node_pg", None)
        if inter is None or any(u.process_group is not intra or getattr(u, "_inter_node_pg", None) is not inter
                                for u in units):
            raise ValueError("FSDP1 hybrid-sharded units use different process groups; distgrad needs one "
                             "(shard group, replica group) pair for the whole model")
        world = dist.get_world_size()
        if intra.size() * inter.size() != world:
            raise ValueError(f"FSDP1 hybrid sharding over {intra.size()} x {inter.size()} ranks in a job of "
                             f"{world}: ranks outside these groups (pipeline stages?) are not combined yet; "
                             "instrument a model sharded over every rank")
        mine = (dist.get_rank(inter), dist.get_rank(intra))
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        groups: dict[int, list[int]] = {}
        for r, (_, shard) in enumerate(every):
            groups.setdefault(shard, []).append(r)

        def describe(r: int) -> str:
            return f"global rank {r} (replica {every[r][0]}, shard {every[r][1]})"
        # per-parameter lists are filled in by ownership() once the names are known
        return Ownership([mine[0]], [inter.size()], [True], sorted(groups.values()), describe)

    def _init_orig(self, root: nn.Module, units: list) -> None:
        full: dict[int, int] = {}
        self._offsets: list[tuple[int, int] | None] = []
        where: dict[int, tuple[int, int] | None] = {}
        for u in units:
            fp = u._flat_param
            if fp is None:
                continue
            if fp._params is None or not len(fp._params) == len(fp._numels) == len(fp._shard_param_infos):
                raise RuntimeError("FSDP FlatParameter._params / _numels / _shard_param_infos are not "
                                   "aligned; this torch version is not supported with use_orig_params=True")
            for p, n, info in zip(fp._params, fp._numels, fp._shard_param_infos):
                full[id(p)] = int(n)
                where[id(p)] = _intra(info, int(n), self.replicated)
        skipped = []
        for name, p in root.named_parameters():
            if not p.requires_grad:
                continue
            if id(p) not in full:
                skipped.append(clean_name(name, strip_module=False))
                continue
            self._params.append(p)
            self.names.append(clean_name(name, strip_module=False))
            self.numels.append(full[id(p)])
            self._offsets.append(where[id(p)])
        self._exclude_unmanaged(skipped, "not reduced by FSDP (ignored_modules?)")

    def _init_flat(self, root: nn.Module) -> None:
        # isinstance(t, FlatParameter) is FSDP's own test of the ``_is_flat_param`` flag
        from torch.distributed.fsdp._flat_param import FlatParameter

        order = {id(m): i for i, m in enumerate(root.modules())}
        rows, skipped = [], []
        for pname, fp in root.named_parameters():
            if not fp.requires_grad:
                continue
            if not isinstance(fp, FlatParameter):
                skipped.append(clean_name(pname, strip_module=False))
                continue
            prefix = pname[: -len("_flat_param")] if pname.endswith("_flat_param") else ""
            _check_flat_layout(fp, prefix.rstrip("."))
            for i, (fqn, numel, info, pinfo) in enumerate(
                    zip(fp._fqns, fp._numels, fp._shard_param_infos, fp._param_infos)):
                off, cnt = info.offset_in_shard, info.numel_in_shard  # both set when in_shard
                where = (fp, int(off), int(cnt)) if info.in_shard and off is not None and cnt is not None else None
                key = (order.get(id(pinfo.module), len(order)), i)
                rows.append((key, clean_name(prefix + fqn, strip_module=False), int(numel), where,
                             _intra(info, int(numel), self.replicated)))
        self._exclude_unmanaged(skipped, "not reduced by FSDP (ignored_modules?)")
        rows.sort(key=lambda r: r[0])
        self.names = [r[1] for r in rows]
        self.numels = [r[2] for r in rows]
        self._slices = [r[3] for r in rows]
        self._offsets = [r[4] for r in rows]

    def local_offsets(self) -> list[tuple[int, int] | None]:
        """From ``_shard_param_infos[i].intra_param_start_idx`` / ``numel_in_shard`` (private)."""
        return list(self._offsets)

    def _state_entries(self) -> list[tuple[torch.Tensor, Any] | None]:
        """``use_orig_params=True``: each original parameter's state has the shape of its local
        1-D shard view (cut like its gradient: whole)."""
        from distgrad.engines.optimizer_state import flat

        return [(p, flat) if off is not None else None for p, off in zip(self._params, self._offsets)]

    def optimizer_slots(self) -> list[Any] | None:
        """``use_orig_params=True`` only; ``False`` (state of the FlatParameter) is not located
        (None: the optimizer signals are refused with that reason)."""
        return super().optimizer_slots() if self.use_orig_params else None

    def local_param_pieces(self) -> Sequence[torch.Tensor | None]:
        """This rank's shard of the (full-precision) parameters, laid out like the gradient
        pieces: the original parameter's sharded 1-D view (use_orig_params=True) or the same
        slice of the FlatParameter's local shard. Read outside forward/backward, when FSDP has
        resharded (both FULL_SHARD and SHARD_GRAD_OP reshard after backward)."""
        if self.use_orig_params:
            return [p.detach().reshape(-1) if off is not None else None
                    for p, off in zip(self._params, self._offsets)]
        return [None if w is None else w[0].detach().reshape(-1).narrow(0, w[1], w[2]) for w in self._slices]

    def local_pieces(self) -> Sequence[torch.Tensor | None]:
        """P 1-D views of this rank's shard of each parameter's reduced gradient (full
        gradients under NO_SHARD), None where the rank holds none of it. dtype: the sharded
        parameter's (fp32 under MixedPrecision unless ``keep_low_precision_grads``)."""
        if self.use_orig_params:
            pieces = [p.grad.reshape(-1) if p.grad is not None else None for p in self._params]
        else:
            pieces = []
            for where in self._slices:
                if where is None:
                    pieces.append(None)
                    continue
                fp, offset, numel = where
                g = fp.grad
                pieces.append(None if g is None else g.reshape(-1).narrow(0, offset, numel))
        self._note_dtype(pieces)
        return pieces
