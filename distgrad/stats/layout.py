"""Packed layout of the two reduced blocks: column names and :class:`Layout` (positions for P
parameters and W ranks)."""

from __future__ import annotations

import dataclasses

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
