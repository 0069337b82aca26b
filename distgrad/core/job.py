"""Names across the job: when no rank holds every parameter (pipeline stages, experts spread over
ranks), the global parameter list is agreed once at ``instrument()`` and every rank packs its
pieces at the global positions, so one SUM and one MAX over the whole job still give the
statistics of the whole model, each parameter under its name in the user's model.

The rule that keeps this exact: each parameter name is held by exactly one set of ranks (the
ranks its gradient is reduced over: a pipeline stage's data-parallel group, an expert's
expert-data-parallel group), every holder reports that same set, and the holders split its
elements among themselves (sharding, or :class:`~distgrad.engines.base.Ownership` for
replicas). A name held by two different sets (independent models on sub-groups, weights tied
across pipeline stages) is refused: their gradients are separate tensors that distgrad would add.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from distgrad.engines.base import GradSource, Ownership


@dataclasses.dataclass
class JobView:
    """The job-wide parameter list and this rank's place in it.

    Attributes:
        names: G global parameter names, in merged registration order.
        numels: G full element counts.
        slots: per local parameter (length P), its global position.
        own: :class:`Ownership` over the G global parameters, groups in global ranks.
    """

    names: list[str]
    numels: list[int]
    slots: list[int]
    own: Ownership

    def expand(self, pieces: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Length-G list: the local pieces at their global positions, None elsewhere."""
        out: list[torch.Tensor | None] = [None] * len(self.names)
        for slot, piece in zip(self.slots, pieces):
            out[slot] = piece
        return out


def holders(source: GradSource) -> list[tuple[int, ...]]:
    """Per local parameter, the global ranks its gradient is reduced over (the source's
    ``param_holders()`` when it has one, else its process group, else every rank)."""
    fn = getattr(source, "param_holders", None)
    if fn is not None:
        return [tuple(h) for h in fn()]
    ranks = tuple(range(dist.get_world_size())) if source.group is None else tuple(
        dist.get_process_group_ranks(source.group))
    return [ranks] * len(source.names)


def _merge(lists: Sequence[Sequence[str]]) -> list[str]:
    """Merge per-rank name lists keeping each rank's order: a new name goes right before the
    next name of its rank's list already merged, or at the end."""
    out: list[str] = []
    seen: set[str] = set()
    for names in lists:
        for i, n in enumerate(names):
            if n in seen:
                continue
            nxt = next((m for m in names[i + 1:] if m in seen), None)
            out.insert(out.index(nxt) if nxt is not None else len(out), n)
            seen.add(n)
    return out


def job_view(source: GradSource) -> JobView | None:
    """The job view when this source's parameters do not span the job, else None. Every rank
    must call it (one ``all_gather_object`` of names, sizes, holders and replica groups when
    any rank's parameters are partial; one small all-reduce otherwise).

    Raises:
        ValueError: a parameter held by different rank sets, or with different sizes, on
            different ranks (the message names it and what to do).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.get_world_size()
    mine = holders(source)
    partial = torch.tensor([float(any(len(h) != world for h in mine))])
    dist.all_reduce(partial, op=dist.ReduceOp.MAX)
    if not partial.item():
        return None
    g = source.group
    grank, gsize = (dist.get_rank(g), dist.get_world_size(g)) if g is not None else (dist.get_rank(), world)
    local = source.ownership(grank, gsize)
    to_global = (lambda r: r) if g is None else (lambda r: dist.get_global_rank(g, r))
    groups = [[to_global(r) for r in grp] for grp in local.groups]
    every: list = [None] * world
    dist.all_gather_object(every, (list(source.names), list(source.numels), mine, groups))
    names = _merge([e[0] for e in every])
    index = {n: i for i, n in enumerate(names)}
    numels = [0] * len(names)
    held: dict[str, tuple[int, ...]] = {}
    present: dict[str, set[int]] = {}
    for r, (ns, nums, hs, _) in enumerate(every):
        for n, k, h in zip(ns, nums, hs):
            if n in held and (held[n] != h or numels[index[n]] != k):
                raise ValueError(
                    f"parameter {n!r} is held by ranks {list(held[n])} ({numels[index[n]]} elements) and by ranks "
                    f"{list(h)} ({k} elements): two separate tensors under one name (independent models on "
                    "sub-groups of the job, or a weight tied across pipeline stages). distgrad combines the "
                    "whole job; give the parameters distinct names or untie them across stages")
            held[n], numels[index[n]] = h, k
            present.setdefault(n, set()).add(r)
    for n, h in held.items():
        if present[n] != set(h):
            raise ValueError(f"parameter {n!r} is reduced over ranks {list(h)} but held by ranks "
                             f"{sorted(present[n])}; every rank of its group must instrument it")
    slots = [index[n] for n in source.names]
    G = len(names)
    index_, copies, check = [0] * G, [1] * G, [False] * G
    for s, i, c, k in zip(slots, local.index, local.copies, local.check):
        index_[s], copies[s], check[s] = i, c, k
    partition: dict[tuple[int, ...], None] = {}
    for e in every:
        for grp in e[3]:
            partition[tuple(sorted(grp))] = None
    describe = local.describe if g is None else (lambda r: f"global rank {r}")
    own = Ownership(index_, copies, check, sorted(list(p) for p in partition), describe)
    return JobView(names, numels, slots, own)

