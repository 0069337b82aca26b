"""Packed layout of the two reduced blocks: column names and :class:`Layout` (positions for P
parameters and W ranks); :func:`pack_blocks` / :func:`split_blocks`, the one place the step's
blocks (core statistics, loss, packed signals, unsampled-step flags) are put together and taken
apart."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

#: columns of the SUM-reduced per-parameter block
SUM_COLS = ("numel", "sum", "sumsq", "nan", "inf", "zeros")
#: columns of the MAX-reduced per-parameter block (min is carried as -min)
MAX_COLS = ("max", "neg_min")
#: per-rank slots in the SUM block: replica fingerprint, non-finite element count (of the rank's
#: shard of the reduced gradient), error flag, culprit flags (the rank's own contribution was
#: non-finite before the reduction: :data:`CULPRIT_LOSS` | :data:`CULPRIT_GRAD`)
RANK_COLS = ("fingerprint", "nonfinite", "error", "culprit")
#: culprit flag: the loss this rank observed since the last boundary was NaN/Inf
CULPRIT_LOSS = 1
#: culprit flag: a gradient this rank computed was NaN/Inf before the cross-rank reduction
CULPRIT_GRAD = 2
#: trailing SUM slots: observed loss sum and count (micro-batches x ranks)
TAIL_COLS = ("loss_sum", "loss_count")


@dataclasses.dataclass
class Layout:
    """Positions in the packed tensors for P parameters and W ranks.

    SUM block, float64 ``[P*6 + W*4 + 2]``: per-parameter ``SUM_COLS`` row-major, then per-rank
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


def pack_blocks(blocks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's two packed tensors from its blocks, in order: ``(SUM, MAX)`` = the
    concatenation of every block's SUM part and of every block's MAX part (float64 1-D
    tensors on one device; a block may have empty parts). :func:`split_blocks` takes them
    apart again after the two all-reduces."""
    import torch  # at run time only here (the layout is imported without torch)

    return torch.cat([s for s, _ in blocks]), torch.cat([m for _, m in blocks])


def split_blocks(host: np.ndarray, sizes: Sequence[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Inverse of :func:`pack_blocks` on the reduced host array ``[SUM parts..., MAX parts...]``
    (float64, as the step's host copy holds them): per block of ``sizes`` (``(SUM elements, MAX
    elements)`` each, in packing order), its reduced ``(SUM part, MAX part)`` (views).

    Raises:
        ValueError: ``len(host)`` is not the sum of the sizes (the blocks were packed otherwise).
    """
    n_sum = sum(s for s, _ in sizes)
    n = n_sum + sum(m for _, m in sizes)
    if len(host) != n:
        raise ValueError(f"reduced array of {len(host)} elements, the blocks {list(sizes)} make {n}")
    out = []
    i, j = 0, n_sum
    for s, m in sizes:
        out.append((host[i:i + s], host[j:j + m]))
        i += s
        j += m
    return out
