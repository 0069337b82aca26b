"""PyTorch-native adapters: where ``DistributedDataParallel``, FSDP1
(``FullyShardedDataParallel``), FSDP2 (``fully_shard``) and a plain ``nn.Module`` keep the reduced
gradient when ``optimizer.step()`` starts, and the optimizer-step boundary that reads it.

Facts relied on (measured on torch 2.13.0+cpu with 2 gloo ranks, ``shared/notes/engines.md``,
and pinned by ``tests/test_torch_reference.py``):

- ``torch.optim.Optimizer.register_step_pre_hook`` fires once per ``optimizer.step()``, after
  DDP's all-reduce, FSDP1's and FSDP2's reduce-scatter have completed and gradients of all
  micro-batches are accumulated (``no_sync()`` / ``set_requires_gradient_sync(False)``
  micro-batches included). Per-micro-batch hooks (DDP comm hooks, FSDP2
  ``set_all_reduce_hook``) fire before accumulation and are not used.
- DDP: ``p.grad`` is the full gradient averaged over ranks, identical on every rank
  (``replicated``: the core reads a 1/W slice per rank and compares per-rank fingerprints).
- FSDP1 ``use_orig_params=True``: ``p.grad`` of each original parameter is this rank's 1-D
  slice of its flattened gradient, or None when the rank holds none of it
  (``FlatParamHandle._use_sharded_grad_views``, torch/distributed/fsdp/_flat_param.py).
- FSDP1 ``use_orig_params=False``: only the ``FlatParameter`` of each unit is a parameter; its
  ``.grad`` is this rank's padded 1-D shard. Original parameter ``i`` of the unit is
  ``grad[offset_in_shard : offset_in_shard + numel_in_shard]`` when
  ``_shard_param_infos[i].in_shard``; the last ``_shard_numel_padded`` elements are padding
  (private API: ``_fqns``, ``_numels``, ``_param_infos``, ``_shard_param_infos``,
  ``_shard_numel_padded``; checked at ``instrument()`` time, see :func:`_check_flat_layout`).
- FSDP2: ``p.grad`` is a ``DTensor`` with placements ``(Shard(0),)`` on a 1-D mesh;
  ``to_local()`` is this rank's unpadded chunk (never ``full_tensor()``: a collective).
- ``torch.amp.GradScaler.step`` (torch/amp/grad_scaler.py) unscales the gradients in place
  (``unscale_``, unless the user already called it) *before* calling ``optimizer.step()``,
  and does not call ``optimizer.step()`` at all when it found Inf/NaN. Optimizers with
  ``_step_supports_amp_scaling`` (``fused=True``) are called on every step with the gradients
  still scaled and ``optimizer.grad_scale`` / ``optimizer.found_inf`` set for the duration of
  the call. The boundary therefore wraps ``scaler.step`` when a scaler is given.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from distgrad.engines.base import _WRAPPER_COMPONENTS, GradSource

log = logging.getLogger("distgrad")

SUPPORTED = ("torch.nn.parallel.DistributedDataParallel, "
             "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1, use_orig_params True or False, "
             "FULL_SHARD / SHARD_GRAD_OP / NO_SHARD), a module sharded with "
             "torch.distributed.fsdp.fully_shard (FSDP2, 1-D mesh), a plain torch.nn.Module on one "
             "process (optionally torch.compile'd)")


def strip_wrappers(name: str) -> str:
    """Remove wrapper components (``_fsdp_wrapped_module.``, ``_orig_mod.``,
    ``_checkpoint_wrapped_module.``) from a name relative to the user's module.

    Unlike :func:`distgrad.engines.base.clean_name` it leaves a leading ``module.`` alone:
    the adapters here start from the user's own module, where ``module`` is a real name."""
    prev = None
    while prev != name:
        prev = name
        name = _WRAPPER_COMPONENTS.sub(r"\1", name)
    return name


def _unwrap_compiled(model: Any) -> Any:
    """The module inside ``torch.compile(model)`` (``OptimizedModule._orig_mod``), else model."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner
    return model


def _fsdp2_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
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
            :class:`~distgrad.instrument.Instrument` combines statistics over this group.
        scaler: the ``torch.amp.GradScaler`` given to ``instrument()``, or None.
    """

    group: Any = None
    scaler: Any = None
    _device: torch.device = torch.device("cpu")

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

    def _exclude_unmanaged(self, unmanaged: list[str], why: str) -> None:
        if unmanaged:
            log.warning("distgrad: %d trainable parameter(s) are not managed by %s and are not "
                        "reported (their gradients are %s): %s", len(unmanaged), self.engine_name,
                        why, unmanaged[:10])


# ----------------------------------------------------------------------------------------------
class DDPSource(TorchSource):
    """``torch.nn.parallel.DistributedDataParallel``: full gradients averaged over the DDP
    process group, identical on every rank (``replicated``).

    Names come from ``ddp.module.named_parameters()`` (so no ``module.`` prefix), trainable
    only, tied weights once (``named_parameters`` removes duplicates), registration order.
    Parameters DDP ignores (``_ddp_params_and_buffers_to_ignore``) are excluded with a warning.

    Raises:
        TypeError: ``model`` is not a DistributedDataParallel.
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
            self.names.append(strip_wrappers(name))
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


# ----------------------------------------------------------------------------------------------
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

    Raises:
        TypeError: no FSDP unit in ``model``.
        ValueError: hybrid sharding (``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: the shards are
            replicated across groups and would be counted several times), or units mixing
            ``NO_SHARD`` with sharded strategies.
        RuntimeError: the private FlatParameter layout is not the expected one.
    """

    engine_name = "fsdp1"

    def __init__(self, model: Any) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

        root = _unwrap_compiled(model)
        units = [m for m in root.modules() if isinstance(m, FSDP)]
        if not units:
            raise TypeError(f"no FullyShardedDataParallel unit in {type(model).__name__}")
        strategies = {u.sharding_strategy for u in units}
        hybrid = {s for s in strategies if "HYBRID" in s.name}
        if hybrid:
            raise ValueError(f"FSDP1 {sorted(s.name for s in hybrid)} is not supported: shards are "
                             "replicated across replica groups; use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")
        if ShardingStrategy.NO_SHARD in strategies and len(strategies) > 1:
            raise ValueError("FSDP1 units mix NO_SHARD with sharded strategies "
                             f"({sorted(s.name for s in strategies)}); use one strategy for all units")
        self.replicated = strategies == {ShardingStrategy.NO_SHARD}
        self.group = units[0].process_group
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
        self._device = _comm_device(self.group, units[0].compute_device)

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
                skipped.append(strip_wrappers(name))
                continue
            self._params.append(p)
            self.names.append(strip_wrappers(name))
            self.numels.append(full[id(p)])
            self._offsets.append(where[id(p)])
        self._exclude_unmanaged(skipped, "not reduced by FSDP (ignored_modules?)")

    def _init_flat(self, root: nn.Module) -> None:
        order = {id(m): i for i, m in enumerate(root.modules())}
        rows, skipped = [], []
        for pname, fp in root.named_parameters():
            if not fp.requires_grad:
                continue
            if not getattr(fp, "_is_flat_param", False):
                skipped.append(strip_wrappers(pname))
                continue
            prefix = pname[: -len("_flat_param")] if pname.endswith("_flat_param") else ""
            _check_flat_layout(fp, prefix.rstrip("."))
            for i, (fqn, numel, info, pinfo) in enumerate(
                    zip(fp._fqns, fp._numels, fp._shard_param_infos, fp._param_infos)):
                where = (fp, int(info.offset_in_shard), int(info.numel_in_shard)) if info.in_shard else None
                key = (order.get(id(pinfo.module), len(order)), i)
                rows.append((key, strip_wrappers(prefix + fqn), int(numel), where,
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


# ----------------------------------------------------------------------------------------------
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
                skipped.append(strip_wrappers(name))
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
            self.names.append(strip_wrappers(name))
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


# ----------------------------------------------------------------------------------------------
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
                self.names.append(strip_wrappers(name))
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


def torch_source(model: Any) -> TorchSource:
    """The adapter for ``model``: DDP, then FSDP2, then FSDP1, then a plain module.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (the message lists supported types).
        ValueError / RuntimeError: from the adapters (unsupported configurations).
    """
    if is_ddp(model):
        return DDPSource(model)
    if is_fsdp2(model):
        return FSDP2Source(model)
    if is_fsdp1(model):
        return FSDP1Source(model)
    if is_torch_module(model):
        return LocalSource(model)
    raise TypeError(f"not a torch.nn.Module: {type(model).__name__}; supported: {SUPPORTED}")


# ----------------------------------------------------------------------------------------------
class OptimizerBoundary:
    """The optimizer-step boundary for PyTorch-native engines.

    Installs on ``optimizer``: a step pre-hook that reads the reduced gradients of sampled
    steps (``Instrument.collect``: local statistics + 2 collectives + 1 host copy) and a step
    post-hook that publishes (``Instrument.finish``) or accounts (``Instrument.skip``) the step;
    on ``model``: a forward hook counting micro-batches (forward passes with grad enabled) and
    capturing the loss when the forward returns one (a 0-d floating tensor, or an object /
    dict with a 0-d ``loss``, as Hugging Face models return). The first explicit
    ``inst.observe_loss(...)`` call switches the automatic capture off. With a
    ``GradScaler``, ``scaler.step`` is wrapped on the instance (see the module docstring):

    - non-fused optimizers: gradients are unscaled when the pre-hook runs (``scaler.step``
      calls ``unscale_`` first, or the user did); an overflow step never reaches
      ``optimizer.step``, so its statistics are read after ``scaler.step`` returns (Inf/NaN
      gradients, already unscaled) and the step is recorded with ``overflow=True``,
      ``step_applied=False``.
    - ``_step_supports_amp_scaling`` optimizers (``fused=True``): the pre-hook sees gradients
      still multiplied by ``optimizer.grad_scale`` (None when the user already unscaled); the
      statistics are divided by it (exact for power-of-two scales), and ``optimizer.found_inf``
      gives the overflow.

    ``step`` counts optimizer steps since ``instrument()``, skipped ones included: every
    ``optimizer.step()`` outside ``scaler.step`` plus every ``scaler.step(optimizer)``. It is
    the same on all ranks because every rank calls them, and it decides sampling, so all ranks
    make the same collectives. ``loss_scale`` is ``scaler.get_scale()`` just before
    ``scaler.step``: the scale this step's backward used (read on sampled steps only).

    Not seen: steps a GradScaler skips when ``scaler=`` was not passed (``optimizer.step`` is
    never called, so neither hook fires and the step is not counted).
    """

    def __init__(self, inst: Any, source: TorchSource, optimizer: torch.optim.Optimizer,
                 model: nn.Module, scaler: Any = None) -> None:
        self.inst, self.source, self.optimizer, self.scaler = inst, source, optimizer, scaler
        self.step = 0
        self.micro = 0
        self._pending: tuple | None = None  # (step, sampled, host, grad_scale, fused_overflow)
        self._in_scaler = False
        self._fired = False
        self._auto_loss = True
        self._handles = [optimizer.register_step_pre_hook(self._pre),
                         optimizer.register_step_post_hook(self._post),
                         model.register_forward_hook(self._forward)]
        observe = inst.observe_loss

        def observe_loss(loss: Any) -> None:  # explicit losses replace the automatic capture
            if self._auto_loss:
                self._auto_loss = False
                inst._loss_sum, inst._loss_count = None, 0
            observe(loss)

        observe_loss.__doc__ = observe.__doc__
        self._observe = observe
        inst.observe_loss = observe_loss
        self._scaler_step: Callable | None = None
        self._scaler_own_step = scaler is not None and "step" in vars(scaler)
        if scaler is not None:
            self._scaler_step = scaler.step
            scaler.step = self._wrapped_scaler_step  # on this instance only
        inst._restore.append(self.remove)

    def remove(self) -> None:
        """Remove the hooks and restore ``scaler.step`` (called by ``Instrument.close``)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._scaler_step is not None:
            if self._scaler_own_step:
                self.scaler.step = self._scaler_step
            else:
                vars(self.scaler).pop("step", None)
            self._scaler_step = None
        self.inst.__dict__.pop("observe_loss", None)

    # -- hooks ------------------------------------------------------------------------------
    def _forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self.micro += 1
        if self._auto_loss:
            loss = output
            if isinstance(output, dict):
                loss = output.get("loss")
            elif not isinstance(output, torch.Tensor):
                loss = getattr(output, "loss", None)
            if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
                self._observe(loss)
        self.inst.after_micro_batch()  # writes the forward tracer's report once it has run

    def _begin(self) -> None:
        """Read the gradients of a sampled step (all ranks reach this at the same step)."""
        self.inst.after_micro_batch()  # the tracer report of the last micro-batch, if it ran
        if self._pending is not None:  # the previous optimizer.step raised after its pre-hook
            log.warning("distgrad: optimizer.step() at step %d did not complete; recorded as not applied",
                        self._pending[0])
            self._end(None, False, None)
        step = self.step
        sampled = self.inst.is_sampled(step)
        gscale, fused_overflow = 1.0, None
        if self._in_scaler:
            try:
                found = getattr(self.optimizer, "found_inf", None)
                if found is not None:  # fused path: grads still scaled by optimizer.grad_scale
                    fused_overflow = bool(float(found) > 0)
                    gs = getattr(self.optimizer, "grad_scale", None)
                    gscale = float(gs) if gs is not None else 1.0
            except Exception:  # noqa: BLE001
                self.inst._internal_error("reading the GradScaler state")
        host = self.inst.collect(step) if sampled else None
        self._pending = (step, sampled, host, gscale, fused_overflow)

    def _end(self, overflow: bool | None, applied: bool, loss_scale: float | None) -> None:
        step, sampled, host, gscale, _ = self._pending
        self._pending = None
        self.step += 1
        if sampled:
            self.inst.finish(step, self.micro, host, gscale, loss_scale, overflow, applied, None)
        else:
            self.inst.skip(overflow, applied, None)

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._fired = True
        self._begin()

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._in_scaler and self._pending is not None:
            self._end(None, True, None)

    def _wrapped_scaler_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        step_fn = self._scaler_step
        if optimizer is not self.optimizer or not self.scaler.is_enabled() or self._in_scaler:
            return step_fn(optimizer, *args, **kwargs)
        loss_scale = None
        if self.inst.is_sampled(self.step):  # get_scale() syncs with the device: sampled steps only
            try:
                loss_scale = float(self.scaler.get_scale())
            except Exception:  # noqa: BLE001
                self.inst._internal_error("reading the loss scale")
        self._in_scaler, self._fired = True, False
        try:
            out = step_fn(optimizer, *args, **kwargs)
        finally:
            self._in_scaler = False
        if self._fired:
            fused_overflow = self._pending[4] if self._pending is not None else None
            overflow = bool(fused_overflow)
        else:  # GradScaler found Inf/NaN and skipped optimizer.step(): read the unscaled grads now
            overflow = True
            self._begin()
        self._end(overflow, not overflow, loss_scale)
        return out


def check_boundary_args(model: Any, optimizer: Any, scaler: Any) -> None:
    """Validate ``optimizer=`` / ``scaler=`` before anything is installed.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` or ``scaler`` has no
            ``step``/``get_scale``/``is_enabled`` (not a ``torch.amp.GradScaler``).
        ValueError: the optimizer holds none of the model's trainable parameters (typically:
            created before wrapping with FSDP ``use_orig_params=False`` or ``fully_shard``).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if scaler is not None and not all(hasattr(scaler, a) for a in ("step", "get_scale", "is_enabled")):
        raise TypeError(f"scaler= must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    mine = [p for p in _unwrap_compiled(model).parameters() if p.requires_grad]
    if mine and not any(id(p) in held for p in mine):
        raise ValueError("the optimizer holds none of the model's trainable parameters: create the "
                         "optimizer from the wrapped model's parameters (after DDP / FSDP wrapping) and "
                         "pass that optimizer")


def attach_torch(inst: Any, source: TorchSource, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: Any = None) -> OptimizerBoundary:
    """Install the :class:`OptimizerBoundary` (``Instrument.close`` removes it). Arguments are
    checked by :func:`check_boundary_args` first."""
    source.scaler = scaler
    return OptimizerBoundary(inst, source, optimizer, model, scaler)
