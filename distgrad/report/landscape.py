"""Loss-landscape slices along filter-normalised random directions (Li, Xu, Taylor, Studer and
Goldstein 2018, "Visualizing the Loss Landscape of Neural Nets", NeurIPS; arXiv 1712.09913).

``L(alpha) = loss(theta + alpha d)`` (:func:`slice_1d`) and ``L(alpha, beta) = loss(theta +
alpha d1 + beta d2)`` (:func:`slice_2d`) on a grid, the loss averaged over the given batches of
every rank. Works on a plain ``nn.Module`` on one process and on the same engines as the
instrument: DDP and DeepSpeed ZeRO 0-2 (replicated parameters), FSDP2 / ``DTensor`` parameters
and DeepSpeed ZeRO-3 (sharded: each rank perturbs its own shard only).

Directions (:func:`raw_direction`): for each parameter ``name`` (the name without the wrapper
components DDP / DeepSpeed / FSDP add, :func:`distgrad.naming.canonical.clean_name`) and direction
``k`` a standard normal float64 tensor of the FULL parameter shape from a CPU generator seeded
with the first 8 bytes of ``sha256(f"{seed}/{k}/{name}")``; a rank holding a shard takes the
matching slice, so the direction is the same on any number of ranks and any layout.

Filter normalisation (Li et al. Section 4, their ``normalize_directions_for_weights``): for a
parameter of 2 or more dimensions each filter ``j`` (an output channel / a row of a weight
matrix: index ``j`` of dim 0) is rescaled to ``d_j * |theta_j| / (|d_j| + 1e-10)``. Parameters of
1 dimension (biases, norm weights) are ``one_d="zero"`` (default, not moved: the paper's
``--xignore biasbn``) or ``one_d="weights"`` (``d = theta``, what their code does when
not ignoring them). Weight filter norms of sharded parameters: per-row partial sums of squares of
the local shards, summed with ONE all-reduce at set-up.

Cost: forward passes = grid points x local batches (no backward); collectives: at most one
all-reduce at set-up (sharded parameters) and one all-reduce of 2 float64 per grid point, plus
whatever the engine's forward does (FSDP2 / ZeRO-3 all-gathers). Memory: one copy of the local
parameter shard (restored bit-identically at the end, also after an exception) plus one
direction copy per parameter shard and direction, in the parameter's dtype; transiently the
full float64 direction of the parameter being set up (one parameter at a time).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from distgrad.naming.canonical import clean_name

__all__ = ["SliceResult", "Landscape", "raw_direction", "slice_1d", "slice_2d", "grid"]

ONE_D = ("zero", "weights")
EPS = 1e-10  # Li et al.'s net_plotter.normalize_direction


def raw_direction(name: str, shape: Sequence[int], seed: int, k: int = 0) -> torch.Tensor:
    """The unnormalised direction ``k`` of parameter ``name``: float64 standard normal of the
    full ``shape`` on the CPU, from a generator seeded by ``sha256(f"{seed}/{k}/{name}")``."""
    h = int.from_bytes(hashlib.sha256(f"{seed}/{k}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(h), dtype=torch.float64)


def grid(steps: int, span: float) -> np.ndarray:
    """``steps`` evenly spaced coefficients over ``[-span, span]`` (float64 [steps])."""
    if steps < 1 or not math.isfinite(span) or span <= 0:
        raise ValueError(f"steps must be >= 1 and span > 0, got steps={steps} span={span}")
    return np.linspace(-span, span, steps) if steps > 1 else np.zeros(1)


@dataclass
class SliceResult:
    """A slice: ``alphas`` float64 [n]; ``betas`` float64 [m] (2-D) or None; ``loss`` float64 [n]
    or [n, m] (``loss[i, j]`` at ``alphas[i], betas[j]``), the mean over every rank's batches;
    ``center`` the loss at the unperturbed weights (always evaluated); ``meta`` what produced it."""

    alphas: np.ndarray
    betas: np.ndarray | None
    loss: np.ndarray
    center: float
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready dict (non-finite losses become None)."""
        def f(a: Any) -> list[float | None]:
            return [None if not math.isfinite(v) else float(v) for v in np.asarray(a).reshape(-1)]
        loss = np.asarray(self.loss)
        out = {"alphas": f(self.alphas), "betas": None if self.betas is None else f(self.betas),
               "loss": f(loss) if loss.ndim == 1 else [f(r) for r in loss],
               "center": self.center if math.isfinite(self.center) else None}
        out.update(self.meta)
        return out


@dataclass
class _Param:
    name: str
    shape: tuple[int, ...]
    owned: torch.Tensor | None  # this rank's exactly-once piece (filter norms), flat view
    rows: Callable[[], torch.Tensor] | None  # dim-0 index of each element of ``owned``
    targets: list[tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]  # live tensor, full -> piece


#: a parameter's piece: the full tensor -> this rank's part of it (flat), and the dim-0 row of
#: each element of that part
_Piece = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], torch.Tensor]]


def _flat_range(start: int, n: int, shape: tuple[int, ...]) -> _Piece:
    row = max(1, math.prod(shape[1:])) if len(shape) else 1
    return (lambda full: full.reshape(-1)[start:start + n],
            lambda: torch.div(torch.arange(start, start + n), row, rounding_mode="floor"))


def _block(offset: Sequence[int], lshape: Sequence[int]) -> _Piece:
    def take(full: torch.Tensor) -> torch.Tensor:
        for d, (o, n) in enumerate(zip(offset, lshape)):
            full = full.narrow(d, o, n)
        return full.reshape(-1)

    def rows() -> torch.Tensor:
        if not lshape:
            return torch.zeros(1, dtype=torch.long)
        return torch.arange(offset[0], offset[0] + lshape[0]).repeat_interleave(max(1, math.prod(lshape[1:])))
    return take, rows


class Landscape:
    """Perturbs a model's weights along ``n_dirs`` filter-normalised directions and evaluates the
    mean loss; the weights are restored bit-identically by :meth:`restore` (also called by
    :meth:`evaluate` on exit, normal or not).

    Args:
        model: ``nn.Module``, ``DistributedDataParallel``, FSDP2 module (``DTensor`` parameters,
            also under tensor parallelism with ``Shard`` placements) or ``DeepSpeedEngine``
            (ZeRO 0-3). FSDP1 ``FullyShardedDataParallel`` is refused (flat parameters).
        seed, n_dirs: the directions ``k = 0 .. n_dirs-1`` of :func:`raw_direction`.
        one_d: ``"zero"`` or ``"weights"`` (see the module doc).
        include_frozen: also perturb parameters with ``requires_grad=False``.
        distributed: average the loss over the ranks of ``group`` (default: when
            torch.distributed is initialised with more than one rank). Every rank must then call.
        group: process group (default the world).

    Raises:
        TypeError: FSDP1, ``_StridedShard`` placements or ZeRO-3 parameters on NVMe.
        ValueError: bad ``one_d`` / ``n_dirs``; sharded parameters without ``distributed``.
    """

    def __init__(self, model: Any, *, seed: int = 0, n_dirs: int = 1, one_d: str = "zero",
                 include_frozen: bool = False, distributed: bool | None = None, group: Any = None) -> None:
        if one_d not in ONE_D:
            raise ValueError(f"one_d must be one of {ONE_D}, got {one_d!r}")
        if n_dirs < 1:
            raise ValueError(f"n_dirs must be >= 1, got {n_dirs}")
        import torch.distributed as dist

        self.model, self.seed, self.one_d, self.group = model, int(seed), one_d, group
        init = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if init else 1
        self.distributed = (init and self.world > 1) if distributed is None else bool(distributed)
        if self.distributed and not init:
            raise ValueError("distributed=True needs an initialised torch.distributed process group")
        self._ds_engine = None
        self._fsdp2: list[Any] = []
        module, zero3 = self._unwrap(model)
        self._release()
        self.params, self.sharded = self._layout(module, zero3, include_frozen)
        if self.sharded and not self.distributed:
            raise ValueError("the model has sharded parameters (FSDP2 / ZeRO-3): the landscape needs every rank "
                             "(distributed=None or True)")
        self.saved = [[t.detach().clone() for t, _ in p.targets] for p in self.params]
        sq = self._weight_row_sq()
        self.dirs = [self._directions(k, sq) for k in range(n_dirs)]

    # ---------------------------------------------------------------- layouts
    def _unwrap(self, model: Any) -> tuple[Any, bool]:
        """The user's module and whether it is under ZeRO-3; finds DeepSpeed / FSDP2 wrappers."""
        from torch.nn.parallel import DistributedDataParallel

        from distgrad.engines.deepspeed import is_deepspeed_engine

        zero3 = False
        if is_deepspeed_engine(model):
            self._ds_engine = model
            zero3 = int(model.zero_optimization_stage()) == 3
            module = model.module
        elif isinstance(model, DistributedDataParallel):
            module = model.module
        else:
            module = model
        if any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()):
            raise TypeError("FSDP1 (FullyShardedDataParallel) is not supported by distgrad.report.landscape: use FSDP2 "
                            "(fully_shard) or evaluate a consolidated copy of the model on one process")
        try:
            from torch.distributed.fsdp import FSDPModule

            self._fsdp2 = [m for m in module.modules() if isinstance(m, FSDPModule)]
        except ImportError:  # pragma: no cover - torch without FSDP2
            self._fsdp2 = []
        return module, zero3

    def _layout(self, module: Any, zero3: bool, include_frozen: bool) -> tuple[list[_Param], bool]:
        """Per parameter its full shape, owned piece and live tensors (after :meth:`_release`:
        FSDP2 registers the unsharded parameters on the module between unshard and reshard)."""
        import torch.distributed as dist

        rank = dist.get_rank(self.group) if self.world > 1 else 0
        out, sharded = [], zero3
        for raw, p in module.named_parameters():
            if not (p.requires_grad or include_frozen):
                continue
            name = clean_name(raw)
            if zero3 and hasattr(p, "ds_tensor"):
                out.append(self._zero3(name, p, rank))
            elif hasattr(p, "to_local") and hasattr(p, "placements"):
                sharded = True
                out.append(self._dtensor(name, p))
            else:
                shape = tuple(p.shape)
                take, rows = _flat_range(0, p.numel(), shape)
                out.append(_Param(name, shape, p.data.reshape(-1), rows, [(p.data, take)]))
        return out, sharded

    @staticmethod
    def _zero3(name: str, p: Any, rank: int) -> _Param:
        loc = getattr(p.ds_tensor, "final_location", None)
        if loc is not None and "nvme" in str(loc).lower():
            raise TypeError(f"{name}: ZeRO-3 parameters offloaded to NVMe are not supported by "
                            "distgrad.report.landscape")
        part = p.ds_tensor.data.reshape(-1)
        n = int(p.ds_numel)
        keep = max(0, min(part.numel(), n - rank * part.numel()))
        shape = tuple(p.ds_shape)
        take, rows = _flat_range(rank * part.numel(), keep, shape)
        live = part[:keep]
        return _Param(name, shape, live, rows, [(live, take)])

    @staticmethod
    def _dtensor(name: str, p: Any) -> _Param:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        for pl in p.placements:
            if not (type(pl) is Shard or isinstance(pl, Replicate)):
                raise TypeError(f"{name}: placement {pl} is not supported by distgrad.report.landscape "
                                "(Shard / Replicate only)")
        shape = tuple(p.shape)
        lshape, offset = compute_local_shape_and_global_offset(shape, p.device_mesh, p.placements)
        local = p.detach().to_local()
        take, rows = _block(offset, lshape)
        coord = p.device_mesh.get_coordinate() or []
        first = all(c == 0 for c, pl in zip(coord, p.placements) if isinstance(pl, Replicate))
        # a replicated block is counted by its copy at coordinate 0 of the replicated dims only
        owned = local.reshape(-1) if first else None
        return _Param(name, shape, owned, rows if first else None, [(local, take)])

    # ---------------------------------------------------------------- directions
    def _directions(self, k: int, sq: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per parameter, per live target: the normalised direction's matching piece (``sq``:
        :meth:`_weight_row_sq`)."""
        out = []
        for p, s in zip(self.params, sq):
            if len(p.shape) <= 1:
                if self.one_d == "zero":
                    out.append([torch.zeros_like(t) for t, _ in p.targets])
                else:  # d = theta (saved copy of the same pieces)
                    out.append([t.detach().clone() for t, _ in p.targets])
                continue
            d = raw_direction(p.name, p.shape, self.seed, k)
            dn = torch.linalg.vector_norm(d.reshape(p.shape[0], -1), dim=1)
            scale = s.sqrt() / (dn + EPS)
            d.mul_(scale.reshape((-1,) + (1,) * (len(p.shape) - 1)))
            out.append([take(d).to(dtype=t.dtype, device=t.device).reshape(t.shape) for t, take in p.targets])
            del d
        return out

    def _weight_row_sq(self) -> list[torch.Tensor]:
        """Per parameter, float64 [shape[0]] sums of squares of each filter of the weights over
        the whole job (one all-reduce when sharded; [0] for parameters of < 2 dimensions)."""
        sq = []
        for p in self.params:
            n0 = p.shape[0] if len(p.shape) >= 2 else 0
            s = torch.zeros(n0, dtype=torch.float64)
            if n0 and p.owned is not None and p.rows is not None and p.owned.numel():
                s.index_add_(0, p.rows(), p.owned.detach().double().cpu().pow(2))
            sq.append(s)
        if self.sharded and sq:
            import torch.distributed as dist

            flat = torch.cat(sq) if sq else torch.zeros(0, dtype=torch.float64)
            flat = flat.to(self._device())
            dist.all_reduce(flat, group=self.group)
            sq = list(flat.cpu().split([s.numel() for s in sq]))
        return sq

    def _device(self) -> torch.device:
        import torch.distributed as dist

        if self.distributed and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        for p in self.params:
            for t, _ in p.targets:
                return t.device
        return torch.device("cpu")

    # ---------------------------------------------------------------- evaluation
    def _release(self) -> None:
        """Drop gathered full parameters so that the next forward re-reads the shards (ZeRO-3
        persistent / reused parameters, FSDP2 modules left unsharded)."""
        if self._ds_engine is not None and int(self._ds_engine.zero_optimization_stage()) == 3:
            self._ds_engine.empty_partition_cache()
        for m in self._fsdp2:
            m.reshard()

    @torch.no_grad()
    def set(self, coeffs: Sequence[float]) -> None:
        """Weights := saved + sum_k coeffs[k] * direction k (in the parameter's dtype)."""
        for p, saved, *dirs in zip(self.params, self.saved, *self.dirs):
            for i, (t, _) in enumerate(p.targets):
                t.copy_(saved[i])
                for c, d in zip(coeffs, dirs):
                    if c != 0:
                        t.add_(d[i], alpha=float(c))
        self._release()

    @torch.no_grad()
    def restore(self) -> None:
        """Weights := the saved copy (bit-identical)."""
        for p, saved in zip(self.params, self.saved):
            for (t, _), s in zip(p.targets, saved):
                t.copy_(s)
        self._release()

    @torch.no_grad()
    def loss(self, loss_fn: Callable[[Any, Any], Any], batches: Sequence[Any]) -> float:
        """Mean of ``loss_fn(model, batch)`` (a scalar) over every rank's ``batches`` (one
        all-reduce of [sum, count] when distributed).

        Raises:
            ValueError: no batch on any rank."""
        dev = self._device()
        acc = torch.zeros(2, dtype=torch.float64, device=dev)
        for b in batches:
            v = loss_fn(self.model, b)
            v = v.detach().double().reshape(()) if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64)
            acc[0] += v.to(dev)
            acc[1] += 1
        self._release()
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(acc, group=self.group)
        s, n = acc.tolist()
        if n == 0:
            raise ValueError("no batches: give loss batches to evaluate (the landscape averages the loss over them)")
        return s / n

    def evaluate(self, loss_fn: Callable[[Any, Any], Any], batches: Iterable[Any],
                 points: Sequence[Sequence[float]]) -> np.ndarray:
        """Loss at each point (float64 [len(points)]) then :meth:`restore` (also on error)."""
        batches = list(batches)
        out = np.empty(len(points), dtype=np.float64)
        try:
            for i, c in enumerate(points):
                self.set(c)
                out[i] = self.loss(loss_fn, batches)
        finally:
            self.restore()
        return out

    def meta(self) -> dict:
        return {"method": "Li et al. 2018 filter-normalised random directions", "seed": self.seed,
                "one_d": self.one_d, "n_params": len(self.params), "world": self.world if self.distributed else 1,
                "numel": int(sum(math.prod(p.shape) for p in self.params))}


def slice_1d(model: Any, loss_fn: Callable[[Any, Any], Any], batches: Iterable[Any], *, steps: int = 21,
             span: float = 1.0, seed: int = 0, one_d: str = "zero", include_frozen: bool = False,
             distributed: bool | None = None, group: Any = None) -> SliceResult:
    """1-D slice ``loss(theta + alpha d)`` for ``alpha`` in :func:`grid` ``(steps, span)``.

    ``loss_fn(model, batch)`` returns the scalar loss of one batch (called under
    ``torch.no_grad()``; put the model in eval mode first if it has dropout). Every rank of a
    distributed job calls this with its own batches. Returns :class:`SliceResult` (loss float64
    [steps]); the weights are restored bit-identically. Raises as :class:`Landscape`."""
    alphas = grid(steps, span)
    ls = Landscape(model, seed=seed, n_dirs=1, one_d=one_d, include_frozen=include_frozen,
                   distributed=distributed, group=group)
    vals = ls.evaluate(loss_fn, batches, [(0.0,)] + [(float(a),) for a in alphas])
    meta = ls.meta() | {"span": float(span), "steps": int(steps), "dims": 1}
    return SliceResult(alphas, None, vals[1:], float(vals[0]), meta)


def slice_2d(model: Any, loss_fn: Callable[[Any, Any], Any], batches: Iterable[Any], *,
             steps: int | tuple[int, int] = 21, span: float | tuple[float, float] = 1.0, seed: int = 0,
             one_d: str = "zero", include_frozen: bool = False, distributed: bool | None = None,
             group: Any = None) -> SliceResult:
    """2-D slice ``loss(theta + alpha d1 + beta d2)`` on the grid ``alphas x betas`` (``steps`` /
    ``span`` one value for both axes or a pair). Returns :class:`SliceResult` with loss float64
    [len(alphas), len(betas)]; otherwise as :func:`slice_1d`."""
    nx, ny = (steps, steps) if isinstance(steps, int) else steps
    sx, sy = (span, span) if isinstance(span, (int, float)) else span
    alphas, betas = grid(nx, sx), grid(ny, sy)
    ls = Landscape(model, seed=seed, n_dirs=2, one_d=one_d, include_frozen=include_frozen,
                   distributed=distributed, group=group)
    pts = [(0.0, 0.0)] + [(float(a), float(b)) for a in alphas for b in betas]
    vals = ls.evaluate(loss_fn, batches, pts)
    meta = ls.meta() | {"span": [float(sx), float(sy)], "steps": [int(nx), int(ny)], "dims": 2}
    return SliceResult(alphas, betas, vals[1:].reshape(nx, ny), float(vals[0]), meta)


def plot(result: SliceResult, path: str) -> None:
    """Write a PNG of ``result`` (a line for 1-D, filled contours for 2-D) to ``path``
    (matplotlib, the ``report`` extra)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    loss = np.asarray(result.loss, dtype=np.float64)
    if result.betas is None:
        ax.plot(result.alphas, loss, marker=".")
        ax.axvline(0.0, color="grey", linewidth=0.6)
        ax.set_xlabel("alpha (filter-normalised direction)")
        ax.set_ylabel("loss")
    else:
        z = np.ma.masked_invalid(loss.T)
        cs = ax.contourf(result.alphas, result.betas, z, levels=30, cmap="viridis")
        ax.contour(result.alphas, result.betas, z, levels=10, colors="white", linewidths=0.4)
        fig.colorbar(cs, ax=ax, label="loss")
        ax.plot([0.0], [0.0], marker="+", color="red")
        ax.set_xlabel("alpha (direction 1)")
        ax.set_ylabel("beta (direction 2)")
    ax.set_title(f"loss landscape (seed {result.meta.get('seed')}, centre {result.center:.4g})")
    fig.savefig(path, dpi=100)
