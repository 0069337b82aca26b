"""The record parts of the data-parallel replica checks: ranks training on the same data
(:mod:`distgrad.signals.duplicate_data`) and replica weight hashes
(:mod:`distgrad.signals.weight_hash`); typed parts of :class:`distgrad.record.StepRecord`
(fields ``duplicate_data`` and ``replica_weights``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from distgrad.record.base import _Part


@dataclass
class DuplicateData(_Part):
    """Data-parallel ranks whose per-rank losses were bit-identical, step after step.

    Attributes:
        streak: ``duplicate_data.steps``, K: consecutive sampled steps (on which the shared loss
            moved) a set of ranks must agree on for it to be flagged.
        groups: the flagged sets of ranks (instrument-group ranks, ascending; each of 2 or more
            data-parallel replicas whose losses were bit-identical on the last K informative
            sampled steps); empty when none.
        ranks: the union of ``groups``, ascending (``distgrad_duplicate_data_ranks`` is its length).
        first_step: the optimizer step at which the current flag was first raised, None when none.
    """

    streak: int
    groups: list[list[int]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    first_step: int | None = None


@dataclass
class ReplicaWeights(_Part):
    """The replica weight-hash comparison of the last hash step (kept on the records in between).

    Attributes:
        interval: ``replica_check.weight_hash_interval`` in optimizer steps.
        hash_step: optimizer step of the last comparison (the weights as they were at that
            step's boundary, before its optimizer step); None before the first.
        checked_ranks: ranks that took part (the replica groups' members).
        mismatch_ranks: ranks whose checksum disagreed with the majority of their replica group
            (ties: the group containing the lowest rank is the reference), ascending; empty when
            the replicas agree.
        mismatch_params: parameter names whose per-parameter checksum differed within a replica
            group, in parameter order (at most 32 listed; ``n_mismatch_params`` counts all).
        n_mismatch_params: number of such parameters.
        mismatch_rank: the first of ``mismatch_ranks``, -1 when none.
    """

    interval: int
    hash_step: int | None = None
    checked_ranks: list[int] = field(default_factory=list)
    mismatch_ranks: list[int] = field(default_factory=list)
    mismatch_params: list[str] = field(default_factory=list)
    n_mismatch_params: int = 0
    mismatch_rank: int = -1
