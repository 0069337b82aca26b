"""Replica weight hashes: catch weights that silently diverge across data-parallel replicas.

A bit flip in a *weight* on one data-parallel replica (a memory error, a bad kernel) leaves the
gradients identical after the all-reduce, so the gradient fingerprint
(``statistics.replica_check``) cannot see it; the replicas then train different models for the
rest of the run. Megatron-LM compares weight hashes across data-parallel replicas on an interval
(``--check-weight-hash-across-dp-replicas-interval``); this is distgrad's version, in the
existing two collectives.

What is hashed: on a *hash step* (the first sampled step of each window of
``replica_weights.hash_interval`` optimizer steps: a pure function of the step counter, so every
rank agrees), each rank reads its local pieces of the (master) weights
(``GradSource.local_param_pieces``, aligned with the gradient pieces) at the boundary, before
that step's optimizer step, and for every parameter whose piece is replicated
(``Ownership.check``: DDP and ZeRO-0 every parameter, HSDP its shard along the replicate
dimension, FSDP2 + TP the TP-replicated norms and biases) computes the exact order-free integer
checksum of :mod:`distgrad.stats.checksum` (bit patterns, a flipped bit changes it except with
probability ~2**-40; healthy replicas always agree exactly). Replicas are the sets of
``Ownership.groups`` (ranks that hold identical copies of the same pieces), so under HSDP the
replicas *of the same shard* are compared, never two different shards.

Where it rides:

* SUM part ``[W]``: each rank's total, ``(sum_p c_p) mod 2**52`` over its checked parameters
  (NaN when a piece holds NaN/Inf), in its own slot (the others add 0): attribution by majority
  within each replica group (:func:`distgrad.stats.replica_outliers`, exact; with two replicas
  the tie goes against the higher rank, as for the gradient fingerprint).
* MAX part ``[G, P, 2]``: for its group g, ``c_p`` and ``-c_p`` per parameter (-1 standing for a
  non-finite piece; the other groups' slots -inf): a parameter whose max differs from its min
  within a group differs between replicas, which names the parameter without a per-rank,
  per-parameter slot.

On other sampled steps the part is the identities (zeros, -inf) and nothing is read.

Pure sharding (FSDP / FSDP2 on a 1-D mesh, ZeRO-3, ZeRO-1/2's fp32 master partitions): every
shard has one owner, there is no replica to compare, and a configured interval is refused at
``instrument()`` with a clear error (ZeRO-1/2's replicated low-precision module weights are not
read: ``local_param_pieces`` is the master partition there).

Result (every rank alike): :class:`WeightHash.Part` (``StepRecord.replica_weights``) on every sampled
record (the last comparison), the gauges ``distgrad_replica_weights_mismatch_rank`` /
``..._mismatch_params`` / ``..._hash_step``, one WARNING line from global rank 0 per new
mismatch naming the ranks and parameters, and a flight-recorder report
(``flightrec-step{step}-replica_weights.json``, with ``flight_recorder.dir``).

Cost on a hash step: one pass over the rank's replicated weights (about a dozen int64 operations
per element, chunks of 2**22 elements: 32 MiB of temporaries), no host sync; on every sampled
step W + 2 G P float64 more in the collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from distgrad.config.errors import ConfigError
from distgrad.config.sections import Section
from distgrad.export.metrics import Metric, condition
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal
from distgrad.stats.checksum import replica_checksum
from distgrad.stats.core import replica_outliers

log = logging.getLogger("distgrad")

_HALF = 1 << 26
_MOD = 1 << 52
#: parameter names listed in the record at most
MAX_LISTED = 32


def is_hash_step(step: int, hash_interval: int, sampling_interval: int) -> bool:
    """Whether sampled optimizer step ``step`` is the first sampled step of its window of
    ``hash_interval`` steps (steps are sampled when ``step % sampling_interval == 0``)."""
    return step // hash_interval != (step - sampling_interval) // hash_interval


class WeightHash(PackedSignal):
    """Per-parameter weight checksums of the replicas (module docstring).

    Args:
        interval: ``replica_weights.hash_interval`` (>= 1).
        sampling_interval: ``sampling.interval``.
        groups: ``Ownership.groups`` (non-empty), ranks holding identical replicated pieces.
        check: ``Ownership.check``, per parameter whether its piece is replicated.
        names: parameter names (length P).
        world: W; rank: this rank in the instrument group.
    """

    name = "replica_weights"

    class Config(Section):
        """Replica weight hashes: an exact integer checksum of each data-parallel replica's weights
        compared across the replicas of the same shard on an interval, riding in the sampled step's
        existing collectives (see docs/signals.md, "Replica weight hashes"). As Megatron-LM's
        ``--check-weight-hash-across-dp-replicas-interval`` (a section of its own: the flat key
        ``replica_check`` is the gradient fingerprint's ``statistics.replica_check``)."""

        section_key: ClassVar[str] = "replica_weights"
        hash_interval: int = Field(0, ge=0, description=(
            "Every this many optimizer steps (at the first sampled step of each window of this many "
            "steps), hash each rank's replicated weights (its full copy under DDP / ZeRO-0, its shard "
            "under HSDP's replicate dimension) per parameter with the exact checksum of the replica "
            "fingerprint and compare the replicas: a mismatch names the rank (majority of its replica "
            "group) and the parameters, pages (DistgradReplicaWeightsDiverged) and writes a "
            "flight-recorder report. Costs one pass over the local weights (about a dozen integer "
            "operations per element) on hash steps, and 2 x groups x P + W float64 in every sampled "
            "step's collectives. 0: off. Layouts without replicated weights (pure sharding: FSDP, "
            "ZeRO-3) have nothing to compare and are refused with a clear error."))

    @dataclass
    class Part(_Part):
        """The replica weight-hash comparison of the last hash step, kept on the records in between
        (``StepRecord.replica_weights``).

        Attributes:
            interval: ``replica_weights.hash_interval`` in optimizer steps.
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

    _when = condition("replica_weights", "`replica_weights.hash_interval` > 0 with replicated weights (DDP, ZeRO-0, "
                      "HSDP), world size > 1, after the first sampled step",
                      enabled=lambda c: c.replica_weights.hash_interval > 0)
    METRICS = (
        Metric("distgrad_replica_weights_mismatch_rank", "gauge", (), "rank", "Rank whose weight hash disagreed with "
               "its replica group's majority at the last hash step, -1 if none.", _when),
        Metric("distgrad_replica_weights_mismatch_params", "gauge", (), "params", "Parameters whose weight hash "
               "differed across data-parallel replicas at the last hash step (0: replicas agree).", _when,
               doc="parameters whose exact weight checksum differed within a replica group at the last hash step "
                   "(`replica_weights.hash_interval`; 0 when the replicas agree; the record's `replica_weights` "
                   "names them; distgrad/signals/weight_hash.py)"),
        Metric("distgrad_replica_weights_hash_step", "gauge", (), "steps", "Optimizer step of the last replica "
               "weight-hash comparison.", _when),
    )

    @staticmethod
    def samples(part: WeightHash.Part) -> dict[str, Any]:
        """The three gauges of the last comparison."""
        return {"distgrad_replica_weights_mismatch_rank": part.mismatch_rank,
                "distgrad_replica_weights_mismatch_params": part.n_mismatch_params,
                "distgrad_replica_weights_hash_step": part.hash_step}

    @classmethod
    def build(cls, inst: Any) -> WeightHash | None:
        """``replica_weights.hash_interval`` > 0: the signal (None on one rank or with the
        interval 0).

        Raises:
            ConfigError: a layout without replicated weights (the key named)."""
        n = inst.config.replica_weights.hash_interval
        if not n or inst.world_size < 2:
            return None
        own = inst.own
        if not own.groups or not any(own.check):
            raise ConfigError(
                "distgrad config: 'replica_weights.hash_interval' needs replicated weights, and this layout "
                f"(engine {inst.source.engine_name!r}, ZeRO stage {inst.source.zero_stage}) shards every parameter "
                "with one owner per shard, so there is no replica to compare; set replica_weights.hash_interval: 0 "
                "(HSDP / DDP / ZeRO-0 have replicas)")
        sig = cls(n, inst.config.sampling.interval, own.groups, own.check, inst.names, inst.world_size, inst.rank)
        inst.add_hook(lambda rec: sig.report(inst, rec))
        return sig

    def __init__(self, interval: int, sampling_interval: int, groups: list[list[int]], check: list[bool],
                 names: list[str], world: int, rank: int) -> None:
        self.interval, self.sampling = int(interval), int(sampling_interval)
        self.groups = [list(g) for g in groups]
        self.check = list(check)
        self.names = list(names)
        self.world, self.rank = world, rank
        self.my_group = next((i for i, g in enumerate(self.groups) if rank in g), None)
        self.last: WeightHash.Part | None = None
        self._reported: set[tuple[int, ...]] = set()
        self._step: int | None = None

    @property
    def sum_size(self) -> int:
        return self.world

    @property
    def max_size(self) -> int:
        return 2 * len(self.groups) * len(self.names)

    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = torch.zeros(self.world, dtype=torch.float64, device=device)
        m = torch.full((len(self.groups), len(self.names), 2), -float("inf"), dtype=torch.float64, device=device)
        step = getattr(inst, "sampled_step", None)
        if step is None or not is_hash_step(step, self.interval, self.sampling) or self.my_group is None:
            return s, m.reshape(-1)
        weights = inst.pieces(inst.source.local_param_pieces())
        idx = [i for i, c in enumerate(self.check) if c and weights[i] is not None]
        if idx:
            c = torch.stack([replica_checksum([weights[i].reshape(-1)], device) for i in idx])
            bad = torch.isnan(c)
            c = torch.where(bad, torch.full_like(c, -1.0), c)
            ints = torch.where(bad, torch.zeros_like(c), c).to(torch.int64)
            # (sum c_p) mod 2**52 exactly: high and low 26-bit halves summed apart (no overflow)
            hi, lo = (ints >> 26).sum() % _HALF, (ints & (_HALF - 1)).sum()
            total = ((hi * _HALF + lo) % _MOD).to(torch.float64)
            s[self.rank] = torch.where(bad.any(), torch.full_like(total, float("nan")), total)
            at = torch.tensor(idx, dtype=torch.int64, device=device)
            m[self.my_group, at, 0] = c
            m[self.my_group, at, 1] = -c
        return s, m.reshape(-1)

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray, grad_scale: float) -> None:
        if not is_hash_step(rec.step, self.interval, self.sampling):
            if self.last is not None:
                rec.replica_weights = WeightHash.Part.from_dict(self.last.to_dict())
            return
        m = max_part.reshape(len(self.groups), len(self.names), 2)
        ranks: list[int] = []
        params = np.zeros(len(self.names), dtype=bool)
        for g, members in enumerate(self.groups):
            ranks += [members[j] for j in replica_outliers(sum_part[members], 0.0)]
            hi, lo = m[g, :, 0], -m[g, :, 1]
            with np.errstate(invalid="ignore"):
                params |= np.isfinite(hi) & np.isfinite(lo) & (hi != lo)
        ranks.sort()
        bad = [self.names[i] for i in np.flatnonzero(params)]
        rw = WeightHash.Part(self.interval, int(rec.step), sorted(r for g in self.groups for r in g), ranks,
                            bad[:MAX_LISTED], len(bad), ranks[0] if ranks else -1)
        self.last = rec.replica_weights = rw
        if (ranks or bad) and inst.global_rank == 0:
            log.warning("distgrad: step %d: weights differ across data-parallel replicas (replica weight hash): "
                        "%s disagree%s on %d parameter(s): %s%s", rec.step,
                        ", ".join(inst.own.name(r) for r in ranks) or "no rank by majority (two replicas tie)",
                        "s" if len(ranks) == 1 else "", len(bad), ", ".join(bad[:8]),
                        " ..." if len(bad) > 8 else "")

    def report(self, inst: Any, rec: Any) -> None:
        """Hook after the diagnostics (the record is in the flight recorder's buffer): on global
        rank 0, the first hash step with a given set of mismatched ranks writes a flight-recorder
        report (``flight_recorder.dir``) and names it in ``rec.flight_recorder_report``."""
        rw = rec.replica_weights
        if rw is None or rw.hash_step != rec.step or not (rw.mismatch_ranks or rw.n_mismatch_params):
            return
        key = tuple(rw.mismatch_ranks) or (-1,)
        if key in self._reported or inst.global_rank != 0:
            return
        self._reported.add(key)
        path = inst.dump_flight_recorder("replica_weights", rec.step, "the replica weight mismatch")
        if path is not None:
            rec.flight_recorder_report = path
            log.warning("distgrad: flight-recorder report written to %s", path)

    def state_dict(self) -> dict | None:
        return {"last": self.last.to_dict()} if self.last is not None else None

    def load_state_dict(self, state: dict) -> None:
        if state.get("last") is not None:
            self.last = WeightHash.Part.from_dict(state["last"])

