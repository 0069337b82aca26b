"""Packed layout of the two reduced blocks: column names and :class:`Layout` (positions for P
parameters and W ranks); the step's blocks (:class:`StepBlock`: the core statistics, the loss
block, the packed signals, the unsampled-step flags) and :class:`StepBlocks`, the one place
they are put together (:func:`pack_blocks`) and taken apart (:func:`split_blocks`), for the
record and for the opt-in action alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

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

    #: its name among the step's blocks (:class:`StepBlocks`)
    name = "core"

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


class StepBlock(Protocol):
    """One block of a sampled step's two packed tensors: whatever enters a step declares its
    ``name`` and its sizes, fixed at ``instrument()`` and the same on every rank.

    The blocks (in packing order, :meth:`distgrad.core.instrument.Instrument.blocks`): the core
    statistics (:class:`Layout`, ``"core"``), the loss block
    (:class:`~distgrad.loss.tracker.LossTracker`, ``"loss"``), the packed signals
    (:class:`~distgrad.signals.SignalPack`, ``"signals"``; each signal is one
    :class:`~distgrad.signals.PackedSignal` inside it) and the unsampled steps' non-finite flags
    (:class:`~distgrad.core.watch.UnsampledWatch`, ``"unsampled"``, MAX only).
    """

    @property
    def name(self) -> str:
        """The block's key in :meth:`StepBlocks.pack`'s parts and :meth:`StepBlocks.split`'s result."""
        ...

    @property
    def sum_size(self) -> int:
        """float64 elements of its SUM part."""
        ...

    @property
    def max_size(self) -> int:
        """float64 elements of its MAX part."""
        ...


class StepBlocks:
    """The step's blocks in packing order: :meth:`pack` builds the two packed tensors from each
    block's local parts, :meth:`split` takes the reduced host array apart into each block's
    reduced parts (the record's :meth:`~distgrad.core.instrument.Instrument.split_reduced` and
    the opt-in action's decision use the same split).

    Raises:
        ValueError: two blocks with one name.
    """

    def __init__(self, blocks: Sequence[StepBlock]) -> None:
        names = [b.name for b in blocks]
        if len(set(names)) != len(names):
            raise ValueError(f"step blocks with the same name: {names}")
        self.blocks = list(blocks)

    def sizes(self) -> list[tuple[int, int]]:
        """``(SUM elements, MAX elements)`` of each block, in packing order."""
        return [(b.sum_size, b.max_size) for b in self.blocks]

    def pack(self, parts: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``(SUM, MAX)`` packed tensors (:func:`pack_blocks`) from ``{block name:
        (sum part, max part)}`` (float64 1-D tensors on one device), in the blocks' order; a block
        absent from ``parts`` contributes nothing (one whose sizes are 0: the flags with
        ``interval`` 1)."""
        return pack_blocks([parts[b.name] for b in self.blocks if b.name in parts])

    def split(self, host: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{block name: (reduced SUM part, reduced MAX part)}`` (views of ``host``,
        :func:`split_blocks`).

        Raises:
            ValueError: ``host`` is not as long as the blocks (they were packed otherwise).
        """
        return dict(zip((b.name for b in self.blocks), split_blocks(host, self.sizes())))
