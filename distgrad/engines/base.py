"""The interface between an engine (DeepSpeed, DDP, FSDP) and the statistics core."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch


class GradSource(abc.ABC):
    """Finds, on this rank, the local piece of each parameter's *reduced* gradient.

    Attributes set by subclasses:
        engine_name: bounded label value, e.g. ``"deepspeed"``, ``"ddp"``, ``"fsdp1"``.
        zero_stage: ZeRO stage (0-3) for DeepSpeed, None otherwise.
        names: P trainable parameter names, in registration (forward) order, each once
            (tied weights counted once), wrapper prefixes removed.
        numels: P full (unsharded) element counts.
        replicated: True when every rank holds the same full reduced gradient (DDP, ZeRO-0):
            the core then splits each gradient into W slices and each rank reads only its own
            slice, so nothing is counted twice and the work is divided by W. Layouts with
            several mesh dimensions (HSDP, tensor parallel) describe themselves with
            :meth:`ownership` instead.
        grad_dtype: dtype the gradients are held in (for headroom to its largest finite value).
        group: the process group the gradients are reduced over, whose ranks the
            :class:`~distgrad.core.instrument.Instrument` combines statistics over (None: the
            default group, or one process).
    """

    engine_name: str = "unknown"
    zero_stage: int | None = None
    names: list[str]
    numels: list[int]
    replicated: bool = False
    grad_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    group: Any = None

    def ownership(self, rank: int, world: int) -> Ownership:
        """Which part of each local piece this rank counts, so that every element of every
        gradient is counted by exactly one rank of the job (``rank``/``world`` in the
        instrument's process group). The default follows :attr:`replicated`: every rank holds
        a full copy (``copies = world``, ``index = rank``, all ranks checked against each
        other) or its own shard (``copies = 1``, no replica check). Called once, at
        ``instrument()``."""
        n = len(self.names)
        if self.replicated and world > 1:
            return Ownership([rank] * n, [world] * n, [True] * n, [list(range(world))])
        return Ownership([0] * n, [1] * n, [False] * n, [])

    @abc.abstractmethod
    def local_pieces(self) -> Sequence[torch.Tensor | None]:
        """Length-P list of 1-D views of this rank's reduced gradient piece (None if none).

        Only called at a gradient-accumulation boundary after the reduction has completed.
        For replicated sources the full flattened gradient is returned.
        """

    def local_param_pieces(self) -> Sequence[torch.Tensor | None]:
        """Length-P list of 1-D views of this rank's piece of each parameter's *master* weights
        (fp32 master shards where the engine keeps them), laid out like :meth:`local_pieces`.
        Used for the update-to-weight ratio; engines that cannot provide it raise
        NotImplementedError (the option is then refused at ``instrument()`` time)."""
        raise NotImplementedError(f"{self.engine_name}: master weights are not located")

    def optimizer_slots(self) -> list[Any] | None:
        """Per parameter (length P, laid out like :meth:`local_pieces`), the
        :class:`~distgrad.engines.optimizer_state.OptimizerSlot` of the optimizer entry that holds
        this rank's piece (None where the rank holds none or the optimizer does not step it), or
        None when this engine cannot locate the optimizer state (default). Read at the boundary,
        before the optimizer step: the state is then that of the previous step."""
        return None

    def local_state_pieces(self, key: str) -> list[torch.Tensor | None] | None:
        """Length-P list of 1-D views of this rank's piece of optimizer state ``key`` (e.g.
        ``"exp_avg"``, ``"exp_avg_sq"``), element-aligned with :meth:`local_pieces` (the fp32
        state of a DeepSpeed partition, an FSDP shard, a DDP replica's full state); None per
        parameter without such state yet; None overall when :meth:`optimizer_slots` is None."""
        slots = self.optimizer_slots()
        if slots is None:
            return None
        return [None if s is None else s.piece(key) for s in slots]

    def grad_scale(self) -> float:
        """Factor the gradients currently carry (fp16 loss scale) or 1.0."""
        return 1.0

    def device(self) -> torch.device:
        """Device on which to pack statistics (that of the gradients)."""
        return torch.device("cpu")

    # fp16 / overflow state; engines without a scaler keep these defaults
    def has_loss_scaler(self) -> bool:
        """True when the engine trains fp16 with a dynamic loss scaler (DeepSpeed fp16,
        ``torch.amp.GradScaler``); only then are loss-scale and overflow series exported."""
        return False

    def loss_scale(self) -> float | None:
        """Current loss scale (dimensionless, a power of 2), or None without a scaler."""
        return None

    def min_loss_scale(self) -> float | None:
        """The scaler's configured floor, or None (for ``distgrad_loss_scale_at_minimum``)."""
        return None

    def overflow(self) -> bool | None:
        """After the optimizer step: whether the scaler found Inf/NaN and skipped it (None
        without a scaler)."""
        return None

    def samples(self) -> int | None:
        """Training samples consumed so far, when the engine counts them."""
        return None


def slice_for_rank(flat: torch.Tensor | None, rank: int, world: int) -> torch.Tensor | None:
    """Rank ``rank``'s contiguous 1/W slice of a replicated flat gradient:
    elements ``[rank*c, min(n, (rank+1)*c))`` with ``c = ceil(n/W)``; may be empty."""
    if flat is None:
        return None
    n = flat.numel()
    c = -(-n // world)
    start = min(n, rank * c)
    return flat.narrow(0, start, max(0, min(n, start + c) - start))


@dataclasses.dataclass
class Ownership:
    """Exactly-once ownership of this rank's gradient pieces (engine contract).

    A local piece may be held identically by several ranks (replicated mesh dimensions: DDP,
    ZeRO-0, the replicate dimension of HSDP, tensor-parallel-replicated norms and biases). Of
    such a piece this rank counts the contiguous slice ``index`` of ``copies`` (the split of
    :func:`slice_for_rank`), the other holders the other slices, so the packed SUM / MAX over
    the job count each element once. Sharded dimensions need nothing: their pieces are
    disjoint.

    Attributes:
        index: per parameter (length P), this rank's position among the holders of its piece.
        copies: per parameter, the number of ranks holding an identical copy (1: not replicated).
        check: per parameter, whether the piece enters this rank's replica fingerprint.
        groups: partition of the instrument group's ranks (as group ranks) into sets that must
            hold identical fingerprints; empty: no replica check.
        describe: ``describe(rank)`` -> text naming a group rank for messages (global rank and
            mesh coordinate), or None for ``"rank <r>"``.
    """

    index: list[int]
    copies: list[int]
    check: list[bool]
    groups: list[list[int]]
    describe: Callable[[int], str] | None = None

    def take(self, pieces: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """This rank's share of each piece: the piece itself when ``copies == 1``, else its
        ``index``-th of ``copies`` contiguous slices."""
        return [p if c == 1 else slice_for_rank(p, i, c) for p, i, c in zip(pieces, self.index, self.copies)]

    def name(self, rank: int) -> str:
        return self.describe(rank) if self.describe is not None else f"rank {rank}"
