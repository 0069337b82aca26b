"""Data-parallel ranks that train on the same data.

A loader that does not shard by rank (no ``DistributedSampler``, a sampler seeded alike on every
rank, an ``IterableDataset`` that ignores the rank) or a sampler without ``set_epoch`` hands two
data-parallel replicas the same batches: the run silently trains on a fraction of its data at
the cost of all of it. The tell is already in the sampled step's SUM collective: every rank's own
loss rides there in its own slot (:mod:`distgrad.loss.tracker`; ``StepRecord.ranks``), summed
with zeros, so the reduced values are each rank's float64 loss bit for bit. Two replicas that see
the same samples with the same weights compute bit-identical losses; two that see different
samples essentially never do.

Decision (host side, from the reduced values every rank holds alike; no collective of its own,
no device work): on each sampled step, within each set of data-parallel replicas, ranks whose
``(loss_mean, loss_max)`` pair (the mean and the largest micro-batch loss of their step,
float64) is bit-identical form a class. A rank's streak counts the consecutive sampled steps on
which it shared its class with the same ranks (the running intersection keeps at least two);
a step on which the rank's pair equals its previous step's pair carries no information (a loss
that does not move: a zero-initialised head's ``log V``, a saturated loss) and neither advances
nor resets the streak. Ranks whose streak reaches ``duplicate_data.steps`` (K) are flagged, with
the set they share. One step of equal losses is not enough (K >= 2 is advised; default 3): with
K sampled steps of moving, independently drawn losses the chance of a false flag is that of K
coincidences of 53-bit floats.

Which ranks are data-parallel replicas: the ranks the gradients are reduced over are, for DDP,
DeepSpeed (its data-parallel group, tensor / pipeline peers excluded by DeepSpeed's ``mpu``),
FSDP1 (hybrid too: shard and replicate dimensions both split the data) and FSDP2 on a 1-D mesh.
Tensor- or context-parallel peers legitimately see the same data, so an FSDP2 mesh with several
dimensions is only checked when every dimension is named as data-parallel (``dp``,
``replicate``, ``shard``, ``dp_replicate``, ``dp_shard``, ``hsdp``, ``fsdp``, ``ddp``); pipeline
/ expert layouts (:mod:`distgrad.core.job`) are skipped. A skipped layout logs one line at
``instrument()`` and the record part stays None.

Cost: one float64 (the failure slot of the pack) in the SUM collective; O(W) host work per
sampled step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from distgrad.config.sections import Section
from distgrad.export.metrics import Metric, condition
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal

log = logging.getLogger("distgrad")

#: FSDP2 mesh dimension names taken as data-parallel (lower case)
DP_DIM_NAMES = frozenset({"dp", "replicate", "shard", "dp_replicate", "dp_shard", "hsdp", "fsdp", "ddp",
                          "data", "data_parallel"})


def data_parallel_groups(inst: Any) -> tuple[list[list[int]] | None, str]:
    """The sets of instrument-group ranks that are data-parallel replicas of each other (each
    should see different data), or ``(None, why)`` when distgrad cannot tell (see the module
    docstring). Decided once, from the layout (the same on every rank)."""
    if inst.world_size < 2:
        return None, "one rank"
    if getattr(inst, "job", None) is not None:
        return None, "parameters split over ranks (pipeline stages / experts)"
    mesh = getattr(inst.source, "mesh", None)
    if inst.source.engine_name == "fsdp2" and mesh is not None and mesh.ndim > 1:
        names = tuple(mesh.mesh_dim_names or ())
        if not names or not all(str(n).lower() in DP_DIM_NAMES for n in names):
            return None, (f"an FSDP2 mesh with dimensions {names or mesh.ndim} (a tensor- or context-parallel "
                          "dimension's peers see the same data; name the dimensions, e.g. "
                          "('replicate', 'shard'), if all are data-parallel)")
    return [list(range(inst.world_size))], ""


class SameDataStreaks:
    """The streak bookkeeping of the module docstring, independent of torch (unit-testable).

    Args:
        groups: sets of ranks that are data-parallel replicas of each other.
        world: W, ranks (length of the per-rank arrays).
        k: consecutive informative sampled steps for a flag (>= 1).
    """

    def __init__(self, groups: Sequence[Sequence[int]], world: int, k: int) -> None:
        self.groups = [list(g) for g in groups]
        self.k = int(k)
        self.streak = [0] * world
        self.shared: list[frozenset[int] | None] = [None] * world
        self.prev: list[tuple[float, float] | None] = [None] * world
        self.first_step: int | None = None

    def observe(self, step: int, loss_mean: Sequence[float], loss_max: Sequence[float]) -> list[list[int]]:
        """Take one sampled step's per-rank losses (float64; NaN where a rank observed none);
        returns the flagged sets (each ascending, sorted), empty when none."""
        w = len(self.streak)
        key: list[tuple[float, float] | None] = []
        for r in range(w):
            a, b = float(loss_mean[r]), float(loss_max[r])
            key.append((a, b) if np.isfinite(a) and np.isfinite(b) else None)
        cls: list[frozenset[int] | None] = [None] * w
        for g in self.groups:
            buckets: dict[tuple[float, float], list[int]] = {}
            for r in g:
                k = key[r]
                if k is not None:
                    buckets.setdefault(k, []).append(r)
            for members in buckets.values():
                if len(members) >= 2:
                    for r in members:
                        cls[r] = frozenset(members)
        for r in range(w):
            c = cls[r]
            if c is None:
                self.streak[r], self.shared[r] = 0, None
            elif key[r] != self.prev[r]:  # the shared loss moved: an informative step
                shared = self.shared[r]
                s = shared & c if shared is not None else None
                if s is not None and len(s) >= 2:
                    self.shared[r], self.streak[r] = s, self.streak[r] + 1
                else:
                    self.shared[r], self.streak[r] = c, 1
            self.prev[r] = key[r]
        flagged = {r for r in range(w) if self.streak[r] >= self.k}
        out = sorted({tuple(sorted(self.shared[r] & flagged)) for r in flagged  # type: ignore[operator]
                      if len(self.shared[r] & flagged) >= 2})  # type: ignore[operator]
        if out and self.first_step is None:
            self.first_step = int(step)
        elif not out:
            self.first_step = None
        return [list(g) for g in out]


class DuplicateDataSignal(PackedSignal):
    """Flags data-parallel ranks with bit-identical losses (module docstring). Contributes no
    element of its own to the collectives (only the pack's failure slot); works in
    :meth:`finish` on the reduced per-rank losses (``rec.ranks``)."""

    name = "duplicate_data"

    class Config(Section):
        """Data-parallel ranks that train on the same data (a loader that does not shard by rank, a
        sampler without ``set_epoch``): their per-rank losses, already in the sampled step's SUM
        collective, are bit-identical step after step (see docs/signals.md, "Ranks training on the
        same data"). Decided on the host from the reduced values (no extra collective)."""

        section_key: ClassVar[str] = "duplicate_data"
        steps: int = Field(3, ge=0, description=(
            "Flag a set of data-parallel ranks whose per-rank losses (mean and largest micro-batch "
            "loss of the step) are bit-identical on this many consecutive sampled steps on which the "
            "shared loss changed (a loss that does not move, e.g. a zero-initialised head's log V, "
            "says nothing); 0 turns the check off. Needs the loop's losses (observe_loss or automatic "
            "capture) and a layout whose data-parallel ranks distgrad knows (DDP, DeepSpeed, FSDP1, "
            "FSDP2 on a 1-D mesh or a mesh whose dimensions are all named data-parallel); elsewhere "
            "the check is skipped with one log line."))

    @dataclass
    class Part(_Part):
        """Data-parallel ranks whose per-rank losses were bit-identical, step after step
        (``StepRecord.duplicate_data``).

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

    _when = condition("duplicate_data", "`duplicate_data.steps` > 0 (default) with world size > 1 on a layout whose "
                      "data-parallel ranks distgrad knows (see docs/signals.md), after a sampled step with a loss "
                      "observed",
                      enabled=lambda c: c.duplicate_data.steps > 0)
    METRICS = (
        Metric("distgrad_duplicate_data_ranks", "gauge", (), "ranks", "Data-parallel ranks whose losses were "
               "bit-identical to another replica's on the last duplicate_data.steps informative sampled steps "
               "(0: none).", _when,
               doc="data-parallel ranks training on the same data: ranks whose per-rank loss (mean and largest "
                   "micro-batch loss, float64, bit for bit) equalled another data-parallel replica's on "
                   "`duplicate_data.steps` consecutive sampled steps on which it moved (0 healthy; the record's "
                   "`duplicate_data` names the ranks; distgrad/signals/duplicate_data.py)"),
    )

    @staticmethod
    def samples(part: DuplicateDataSignal.Part) -> dict[str, Any]:
        """``distgrad_duplicate_data_ranks``: the number of flagged ranks."""
        return {"distgrad_duplicate_data_ranks": len(part.ranks)}

    @classmethod
    def build(cls, inst: Any) -> DuplicateDataSignal | None:
        """``duplicate_data.steps`` > 0 on a layout whose data-parallel ranks are known (else None,
        with one log line from rank 0 naming why, except on one rank)."""
        k = inst.config.duplicate_data.steps
        if not k:
            return None
        groups, why = data_parallel_groups(inst)
        if groups is None:
            if inst.world_size > 1 and getattr(inst, "global_rank", 0) == 0:
                log.info("distgrad: duplicate_data: not checked with %s: distgrad cannot tell which ranks are "
                         "data-parallel replicas", why)
            return None
        return cls(groups, inst.world_size, k)

    def __init__(self, groups: list[list[int]], world: int, k: int) -> None:
        self.k = k
        self.streaks = SameDataStreaks(groups, world, k)
        self._logged: set[tuple[tuple[int, ...], ...]] = set()

    @property
    def sum_size(self) -> int:
        return 0

    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.zeros(0, dtype=torch.float64, device=device), None

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray, grad_scale: float) -> None:
        ranks = rec.ranks
        if ranks is None:
            return
        groups = self.streaks.observe(rec.step, ranks.loss_mean, ranks.loss_max)
        flat = sorted({r for g in groups for r in g})
        rec.duplicate_data = DuplicateDataSignal.Part(self.k, groups, flat, self.streaks.first_step)
        key = tuple(tuple(g) for g in groups)
        if groups and key not in self._logged:
            self._logged.add(key)
            if inst.global_rank == 0:
                log.warning(
                    "distgrad: step %d: data-parallel ranks train on the same data: %s had bit-identical losses "
                    "on %d consecutive sampled steps (a data loader that does not shard by rank? a sampler "
                    "without set_epoch?); distgrad_duplicate_data_ranks = %d",
                    rec.step, "; ".join(", ".join(inst.own.name(r) for r in g) for g in groups), self.k, len(flat))

