"""Statistics core: per-parameter sufficient statistics of local gradient pieces, packed into
two float64 tensors and combined across ranks with exactly two collectives (one SUM, one MAX),
then copied to the host once.

Knows nothing about engines: an engine adapter (``distgrad.engines``) hands it, per trainable
parameter, the 1-D piece of the reduced gradient that this rank holds (or None).

Accuracy (measured on this project's CPU build, see ``shared/notes/engines.md``): fp32
``torch._foreach_norm`` / ``vector_norm`` reach ~1e-3 relative error on 13M elements, so they
are not used for statistics. Here the sum uses torch's cascade ``sum`` in fp32 (~1e-8 relative
to sum |g|), and the sum of squares is computed as fp32 dot products over chunks of 2**16
elements accumulated in float64 (~4e-8 relative). Extrema and counts are exact. All partial
results are float64 from the packing on, and integer counts are exact below 2**53.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from distgrad.record import ParamStats

#: columns of the SUM-reduced per-parameter block
SUM_COLS = ("numel", "sum", "sumsq", "nan", "inf", "zeros")
#: columns of the MAX-reduced per-parameter block (min is carried as -min)
MAX_COLS = ("max", "neg_min")
#: per-rank slots in the SUM block: replica fingerprint, non-finite element count, error flag
RANK_COLS = ("fingerprint", "nonfinite", "error")
#: trailing SUM slots: observed loss sum and count (micro-batches x ranks)
TAIL_COLS = ("loss_sum", "loss_count")

_CHUNK = 1 << 16


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """``sum(x**2)`` of a 1-D floating tensor as a 0-d float64 tensor, accurate to ~1e-7 relative.

    Args:
        x: 1-D tensor, float32 (other float dtypes are upcast to float32 first).

    Chunked fp32 dot products (2**16 elements each; worst-case relative error ~2**16 * 2**-24
    per chunk, typically ~1e-8) are summed in float64. On CUDA the chunks are one batched
    ``linalg.vecdot`` over a 2-D view, so the kernel count does not grow with the size.
    """
    if x.dtype != torch.float32:
        x = x.float()
    n = x.numel()
    if n <= _CHUNK:
        return torch.dot(x, x).double()
    if x.device.type == "cpu":
        return torch.stack([torch.dot(c, c) for c in x.split(_CHUNK)]).double().sum()
    m = n // _CHUNK * _CHUNK
    head = x[:m].view(-1, _CHUNK)
    tail = x[m:]
    return torch.linalg.vecdot(head, head).double().sum() + torch.dot(tail, tail).double()


def piece_stats(x: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Local sufficient statistics of one gradient piece.

    Args:
        x: 1-D gradient piece of any floating dtype (fp32, bf16, fp16, fp64), or None / empty
            when this rank holds no element of the parameter.
        device: where to create the result for an empty piece.

    Returns:
        ``(sums, maxes)``: float64 tensors of shape ``[6]`` (numel, sum, sumsq, nan count,
        inf count, zero count) and ``[2]`` (max, -min). An empty piece gives zeros and
        ``-inf`` (the identities of SUM and MAX). A piece containing NaN has NaN max/-min
        here; :func:`pack_local` replaces them with -inf before the MAX collective (NCCL and
        gloo do not define how NaN propagates through MAX) and :func:`unpack` restores NaN
        from the NaN count, matching ``torch.amax`` on the full tensor.
    """
    if x is None or x.numel() == 0:
        d = x.device if x is not None else device
        return (torch.zeros(6, dtype=torch.float64, device=d),
                torch.full((2,), -float("inf"), dtype=torch.float64, device=d))
    xf = x if x.dtype == torch.float32 else x.float()
    n = xf.numel()
    mn, mx = torch.aminmax(xf)
    nz = torch.count_nonzero(xf)
    nan = torch.count_nonzero(torch.isnan(xf))
    inf = torch.count_nonzero(torch.isinf(xf))
    sums = torch.stack([
        torch.tensor(float(n), dtype=torch.float64, device=xf.device),
        xf.sum().double(),
        sum_of_squares(xf),
        nan.double(),
        inf.double(),
        (n - nz).double(),
    ])
    maxes = torch.stack([mx.double(), -mn.double()])
    return sums, maxes


@dataclasses.dataclass
class Layout:
    """Positions in the packed tensors for P parameters and W ranks.

    SUM block, float64 ``[P*6 + W*3 + 2]``: per-parameter ``SUM_COLS`` row-major, then per-rank
    ``RANK_COLS`` (each rank writes only its own slot, others stay 0, so SUM gathers them),
    then ``TAIL_COLS``. MAX block, float64 ``[P*2]``: per-parameter ``MAX_COLS``.
    """

    n_params: int
    world_size: int

    @property
    def sum_size(self) -> int:
        return self.n_params * len(SUM_COLS) + self.world_size * len(RANK_COLS) + len(TAIL_COLS)

    @property
    def max_size(self) -> int:
        return self.n_params * len(MAX_COLS)

    @property
    def rank_offset(self) -> int:
        return self.n_params * len(SUM_COLS)

    @property
    def tail_offset(self) -> int:
        return self.rank_offset + self.world_size * len(RANK_COLS)


def pack_local(pieces: Sequence[torch.Tensor | None], layout: Layout, rank: int, device: torch.device,
               fingerprint: torch.Tensor | None = None, loss_sum: torch.Tensor | None = None,
               loss_count: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute and pack this rank's contribution.

    Args:
        pieces: length P; the 1-D local gradient piece of each parameter or None.
        layout: sizes; ``layout.n_params == len(pieces)``.
        rank: this rank's index in the process group (its slot in the per-rank block).
        device: device of the packed tensors (the gradients' device; CUDA under NCCL).
        fingerprint: 0-d tensor, sum of squares of the rank's full replicated gradient (DDP,
            ZeRO-0) or None.
        loss_sum: 0-d tensor, sum of losses observed on this rank since the last boundary.
        loss_count: number of losses in ``loss_sum``.

    Returns:
        ``(sum_block, max_block)``, float64 tensors of ``layout.sum_size`` and
        ``layout.max_size`` elements on ``device``. No host synchronisation happens here.
    """
    if len(pieces) != layout.n_params:
        raise ValueError(f"expected {layout.n_params} gradient pieces, got {len(pieces)}")
    stats = [piece_stats(p, device) for p in pieces]
    if stats:
        per_sum = torch.stack([s for s, _ in stats]).to(device)
        per_max = torch.stack([m for _, m in stats]).to(device)
    else:
        per_sum = torch.zeros((0, len(SUM_COLS)), dtype=torch.float64, device=device)
        per_max = torch.zeros((0, len(MAX_COLS)), dtype=torch.float64, device=device)
    per_max = torch.nan_to_num(per_max, nan=-float("inf"))
    ranks = torch.zeros((layout.world_size, len(RANK_COLS)), dtype=torch.float64, device=device)
    if fingerprint is not None:
        ranks[rank, 0] = fingerprint.to(device=device, dtype=torch.float64)
    ranks[rank, 1] = per_sum[:, 3].sum() + per_sum[:, 4].sum()
    tail = torch.zeros(len(TAIL_COLS), dtype=torch.float64, device=device)
    if loss_sum is not None and loss_count:
        tail[0] = loss_sum.detach().to(device=device, dtype=torch.float64)
        tail[1] = float(loss_count)
    sum_block = torch.cat([per_sum.reshape(-1), ranks.reshape(-1), tail])
    return sum_block, per_max.reshape(-1)


def error_blocks(layout: Layout, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks a rank contributes when its local computation failed: identities of SUM/MAX with
    its error flag set, so every rank still makes the same collectives and learns of the error."""
    sum_block = torch.zeros(layout.sum_size, dtype=torch.float64, device=device)
    sum_block[layout.rank_offset + rank * len(RANK_COLS) + 2] = 1.0
    max_block = torch.full((layout.max_size,), -float("inf"), dtype=torch.float64, device=device)
    return sum_block, max_block


def reduce_blocks(sum_block: torch.Tensor, max_block: torch.Tensor,
                  group: "dist.ProcessGroup | None" = None) -> np.ndarray:
    """Combine the packed blocks over all ranks and bring them to the host.

    Exactly two collectives (``all_reduce`` SUM, ``all_reduce`` MAX; none when the default
    group is not initialised or has one rank) and one device-to-host copy.

    Returns:
        float64 numpy array ``[sum_size + max_size]``: the reduced SUM block then MAX block.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sum_block, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(max_block, op=dist.ReduceOp.MAX, group=group)
    return torch.cat([sum_block, max_block]).cpu().numpy()


@dataclasses.dataclass
class Reduced:
    """Host-side result of one sampled step, unpacked."""

    params: ParamStats
    fingerprints: np.ndarray  # [W]
    rank_nonfinite: np.ndarray  # [W]
    rank_error: np.ndarray  # [W]
    loss_sum: float
    loss_count: float


def unpack(host: np.ndarray, layout: Layout, names: Sequence[str], scale: float = 1.0) -> Reduced:
    """Turn the reduced host array into statistics.

    Args:
        host: output of :func:`reduce_blocks`.
        layout: the layout used to pack.
        names: P parameter names.
        scale: the gradients were multiplied by this (fp16 loss scale); sum, min, max are
            divided by it and the sum of squares by its square, which is exact for the power-of-2
            scales dynamic loss scaling uses.
    """
    P = layout.n_params
    s = host[: layout.sum_size]
    m = host[layout.sum_size:]
    per = s[: layout.rank_offset].reshape(P, len(SUM_COLS))
    ranks = s[layout.rank_offset: layout.tail_offset].reshape(layout.world_size, len(RANK_COLS))
    tail = s[layout.tail_offset:]
    mx = m.reshape(P, len(MAX_COLS))
    nan = per[:, 3]
    with np.errstate(invalid="ignore"):
        vmax = np.where(nan > 0, np.nan, mx[:, 0]) / scale
        vmin = np.where(nan > 0, np.nan, -mx[:, 1]) / scale
    stats = ParamStats(
        names=list(names), numel=per[:, 0], sum=per[:, 1] / scale, sumsq=per[:, 2] / (scale * scale),
        nan=nan, inf=per[:, 4], zeros=per[:, 5], min=vmin, max=vmax)
    return Reduced(stats, ranks[:, 0].copy(), ranks[:, 1].copy(), ranks[:, 2].copy(),
                   float(tail[0]), float(tail[1]))


def global_norm(stats: ParamStats) -> float:
    """Global L2 norm over all parameters, ``sqrt(sum_p sumsq_p)`` (NaN/Inf propagate)."""
    return float(np.sqrt(np.sum(stats.sumsq)))


def replica_outliers(fingerprints: np.ndarray, rtol: float) -> list[int]:
    """Ranks whose replicated-gradient fingerprint disagrees with the reference value.

    The reference is the value shared (within ``rtol``) by the most ranks; ties go to the
    group containing the lowest rank, so with two ranks a mismatch is attributed to rank 1
    (with two copies there is no majority: document this when alerting). Non-finite
    fingerprints compare equal only to identical non-finite values.
    """
    fp = np.asarray(fingerprints, dtype=np.float64)
    w = len(fp)
    if w < 2:
        return []

    def same(a: float, b: float) -> bool:
        if not (np.isfinite(a) and np.isfinite(b)):
            return (np.isnan(a) and np.isnan(b)) or a == b
        return abs(a - b) <= rtol * max(abs(a), abs(b))

    best = max(range(w), key=lambda i: (sum(same(fp[i], fp[j]) for j in range(w)), -i))
    return [j for j in range(w) if not same(fp[best], fp[j])]
