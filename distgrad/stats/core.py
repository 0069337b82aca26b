"""Packing this rank's statistics, the two collectives, unpacking on the host, and what is
derived from the reduced values (global norm, replica outliers)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from distgrad.record import ParamStats
from distgrad.stats.host_copy import HostCopy
from distgrad.stats.kernels import stats_table
from distgrad.stats.layout import MAX_COLS, RANK_COLS, SUM_COLS, TAIL_COLS, Layout


def pack_local(pieces: Sequence[torch.Tensor | None], layout: Layout, rank: int, device: torch.device,
               fingerprint: torch.Tensor | None = None, loss_sum: torch.Tensor | None = None,
               loss_count: float = 0.0, culprit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute and pack this rank's contribution.

    Args:
        pieces: length P; the 1-D local gradient piece of each parameter or None.
        layout: sizes; ``layout.n_params == len(pieces)``.
        rank: this rank's index in the process group (its slot in the per-rank block).
        device: device of the packed tensors (the gradients' device; CUDA under NCCL).
        fingerprint: 0-d tensor, :func:`~distgrad.stats.checksum.replica_checksum` of the rank's
            full replicated gradient (DDP, ZeRO-0) or None.
        loss_sum: 0-d tensor, sum of losses observed on this rank since the last boundary.
        loss_count: number of losses in ``loss_sum``.
        culprit: 0-d tensor of culprit flags (:data:`~distgrad.stats.layout.CULPRIT_LOSS` |
            :data:`~distgrad.stats.layout.CULPRIT_GRAD`) of this rank's own contribution, or None.

    Returns:
        ``(sum_block, max_block)``, float64 tensors of ``layout.sum_size`` and
        ``layout.max_size`` elements on ``device``. No host synchronisation happens here.
    """
    if len(pieces) != layout.n_params:
        raise ValueError(f"expected {layout.n_params} gradient pieces, got {len(pieces)}")
    table = stats_table(pieces, device)
    per_sum = table[:, : len(SUM_COLS)]
    per_max = torch.nan_to_num(table[:, len(SUM_COLS):], nan=-float("inf"), posinf=float("inf"),
                               neginf=-float("inf"))  # keep +-Inf: only NaN is mapped
    ranks = torch.zeros((layout.world_size, len(RANK_COLS)), dtype=torch.float64, device=device)
    if fingerprint is not None:
        ranks[rank, 0] = fingerprint.to(device=device, dtype=torch.float64)
    ranks[rank, 1] = per_sum[:, 3].sum() + per_sum[:, 4].sum()
    if culprit is not None:
        ranks[rank, 3] = culprit.to(device=device, dtype=torch.float64)
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
                  group: dist.ProcessGroup | None = None) -> np.ndarray:
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


def reduce_blocks_async(sum_block: torch.Tensor, max_block: torch.Tensor,
                        group: dist.ProcessGroup | None = None) -> HostCopy:
    """:func:`reduce_blocks` without waiting for the device: the same two collectives, then a
    non-blocking copy to pinned host memory and a CUDA event (:class:`HostCopy`); read the
    array with ``HostCopy.wait()`` later. On CPU tensors the copy is the data itself."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sum_block, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(max_block, op=dist.ReduceOp.MAX, group=group)
    return HostCopy(torch.cat([sum_block, max_block]))


@dataclasses.dataclass
class Reduced:
    """Host-side result of one sampled step, unpacked."""

    params: ParamStats
    fingerprints: np.ndarray  # [W]
    rank_nonfinite: np.ndarray  # [W]
    rank_error: np.ndarray  # [W]
    rank_culprit: np.ndarray  # [W] culprit flags (CULPRIT_LOSS | CULPRIT_GRAD)
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
    return Reduced(stats, ranks[:, 0].copy(), ranks[:, 1].copy(), ranks[:, 2].copy(), ranks[:, 3].copy(),
                   float(tail[0]), float(tail[1]))


def global_norm(stats: ParamStats) -> float:
    """Global L2 norm over all parameters, ``sqrt(sum_p sumsq_p)`` (NaN/Inf propagate)."""
    return float(np.sqrt(np.sum(stats.sumsq)))


def replica_outliers(fingerprints: np.ndarray, rtol: float) -> list[int]:
    """Ranks whose replicated-gradient fingerprint disagrees with the reference value.

    The reference is the value shared (within ``rtol``) by the most ranks; ties go to the
    group containing the lowest rank, so with two ranks a mismatch is attributed to rank 1
    (with two copies there is no majority: document this when alerting); with three or more
    the ranks outside the majority are named. Non-finite fingerprints compare equal only to
    identical non-finite values. The instrument passes ``rtol=0``: its fingerprints are exact
    integer checksums (:mod:`distgrad.stats.checksum`).
    """
    fp = np.asarray(fingerprints, dtype=np.float64)
    w = len(fp)
    if w < 2:
        return []

    def same(a: float, b: float) -> bool:
        if not (np.isfinite(a) and np.isfinite(b)):
            return (np.isnan(a) and np.isnan(b)) or a == b
        return abs(a - b) <= rtol * max(abs(a), abs(b))

    vals: list[float] = fp.tolist()
    best = max(range(w), key=lambda i: (sum(same(vals[i], vals[j]) for j in range(w)), -i))
    return [j for j in range(w) if not same(vals[best], vals[j])]
