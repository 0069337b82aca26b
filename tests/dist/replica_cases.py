"""Driver for tests/test_replica_checks.py: the data-parallel replica checks under DDP on gloo.

* ``dup-unsharded`` / ``dup-sharded`` (2 ranks): TinyModel under DDP, one optimizer step of two
  micro-batches per step; the unsharded loader hands every rank rank 0's batch (a loader that
  does not shard by rank), the sharded one each rank its own. Each rank returns its records'
  ``duplicate_data`` parts, its own float64 losses (the reference: which ranks' losses were
  equal, recomputed from the losses each rank saw) and the collectives / host syncs per step.
* ``flip`` (3 ranks): TinyModel under DDP, ``replica_weights.hash_interval`` HASH_EVERY; after
  the optimizer step of FLIP_AFTER, rank FLIP_RANK flips bit FLIP_BIT of element FLIP_INDEX of
  FLIP_PARAM. Each rank returns its records' ``replica_weights`` parts and, at every step's
  boundary, the parameters whose weights differ across ranks (the reference: the weights
  all-gathered and compared element for element), and the flight-recorder files rank 0 wrote.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import distgrad
from tests.dist.common import (
    BoundaryCounter,
    TinyModel,
    batch_for,
    driver_args,
    run_cases,
)
from tests.dist.engines import adamw, build_ddp

DUP_STEPS, DUP_K, GAS = 6, 3, 2
HASH_EVERY, FLIP_AFTER, FLIP_RANK, FLIP_PARAM, FLIP_INDEX, FLIP_BIT = 3, 4, 2, "blocks.1.1.weight", 3, 20
FLIP_STEPS = 9
FLIP_RANK_HSDP = 3


def _config(**extra) -> dict:
    return {"exporter": {"enabled": False}, "statistics": {"async_records": "off"}, **extra}


def _train_step(model, inst, opt, s: int, data_rank: int, step: Callable[[], Any]) -> list[float]:
    """Optimizer step ``s``: GAS micro-batches of ``data_rank``'s data (each loss observed and
    backpropagated), then ``step()`` (the optimizer's step, counted or not) and ``zero_grad``.
    Returns the micro-batch losses (float64 host values)."""
    losses = []
    for micro in range(GAS):
        x, y = batch_for(s, micro, data_rank)
        loss = model(x, y)
        inst.observe_loss(loss)
        losses.append(float(loss.detach().double()))
        loss.backward()
    step()
    opt.zero_grad()
    return losses


def run_dup(sharded: bool, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model, opt = build_ddp(TinyModel(), optim=adamw(1e-2))
    inst = distgrad.instrument(model, _config(duplicate_data={"steps": DUP_K}), optimizer=opt)
    counter = BoundaryCounter(inst)
    parts, losses = [], []
    try:
        for s in range(DUP_STEPS):
            mine = _train_step(model, inst, opt, s, rank if sharded else 0, lambda: counter.around(opt.step))
            losses.append([sum(mine) / len(mine), max(mine)])
            rec = inst.last_record
            parts.append(None if rec is None or rec.duplicate_data is None else rec.duplicate_data.to_dict())
    finally:
        counter.restore()
        inst.close()
    return {"parts": parts, "losses": losses, "counts": counter.counts, "names": list(inst.names),
            "internal_errors": inst.counters["internal_errors"]}


def run_flip(rank: int, world: int, out_dir: str) -> dict:
    torch.manual_seed(0)
    model, opt = build_ddp(TinyModel(), optim=adamw(1e-2))
    inst = distgrad.instrument(model, _config(replica_weights={"hash_interval": HASH_EVERY},
                                              flight_recorder={"dir": out_dir}), optimizer=opt)
    names = list(inst.names)
    params = dict(model.module.named_parameters())
    counter = BoundaryCounter(inst)
    parts, differ, mismatch, reports = [], [], [], []
    try:
        for s in range(FLIP_STEPS):
            # the reference: which parameters differ across ranks at this step's boundary
            here = []
            for n in names:
                w = params[n].detach().reshape(-1).clone()
                every = [torch.empty_like(w) for _ in range(world)]
                dist.all_gather(every, w)
                if any(not torch.equal(every[0].view(torch.int32), e.view(torch.int32)) for e in every[1:]):
                    here.append(n)
            differ.append(here)
            _train_step(model, inst, opt, s, rank, lambda: counter.around(opt.step))
            if s == FLIP_AFTER and rank == FLIP_RANK:
                with torch.no_grad():
                    params[FLIP_PARAM].data.view(-1).view(torch.int32)[FLIP_INDEX] ^= 1 << FLIP_BIT
            rec = inst.last_record
            parts.append(None if rec is None or rec.replica_weights is None else rec.replica_weights.to_dict())
            mismatch.append(None if rec is None else list(rec.replica_mismatch_ranks))
            reports.append(None if rec is None else rec.flight_recorder_report)
    finally:
        counter.restore()
        inst.close()
    files = sorted(os.listdir(out_dir)) if rank == 0 and os.path.isdir(out_dir) else []
    return {"parts": parts, "differ": differ, "grad_mismatch": mismatch, "reports": reports, "files": files,
            "counts": counter.counts, "internal_errors": inst.counters["internal_errors"]}


def run_hsdp(rank: int, world: int) -> dict:
    """HSDP (FSDP2 on a ("replicate", "shard") 2 x 2 mesh): each rank holds one shard of each
    parameter; the replicas of a shard are the ranks with the same "shard" coordinate. Rank
    FLIP_RANK_HSDP flips a bit in its local shard of FLIP_PARAM after the optimizer step of
    FLIP_AFTER. Returns the records' parts, the replica groups and, per step, which parameters'
    local shards differ from those of the rank's replica (the reference: the local shards
    all-gathered and compared within each replica group), the loader unsharded along "replicate"
    (every rank its own data: the duplicate-data check must stay silent)."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.dist.engines import build_fsdp2

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = TinyModel()
    model, opt = build_fsdp2(model, model.blocks, optim=adamw(1e-2), mesh=mesh)
    inst = distgrad.instrument(model, _config(replica_weights={"hash_interval": HASH_EVERY}), optimizer=opt)
    names = list(inst.names)
    params = {n: p for n, p in model.named_parameters()}
    by_clean = {n: params[k] for n in names for k in params if k.endswith(n)}
    parts, differ = [], []
    try:
        for s in range(FLIP_STEPS):
            here = []
            for n in names:
                w = by_clean[n].to_local().detach().reshape(-1).clone()
                every = [None] * world
                dist.all_gather_object(every, w.view(torch.int32).tolist())
                groups = inst.own.groups
                if any(every[a] != every[b] for g in groups for a in g for b in g):
                    here.append(n)
            differ.append(here)
            _train_step(model, inst, opt, s, rank, opt.step)
            if s == FLIP_AFTER and rank == FLIP_RANK_HSDP:
                with torch.no_grad():
                    local = by_clean[FLIP_PARAM].to_local()
                    local.view(-1).view(torch.int32)[0] ^= 1 << FLIP_BIT
            rec = inst.last_record
            parts.append(None if rec is None else {
                "replica_weights": None if rec.replica_weights is None else rec.replica_weights.to_dict(),
                "duplicate_data": None if rec.duplicate_data is None else rec.duplicate_data.to_dict()})
    finally:
        inst.close()
    return {"parts": parts, "differ": differ, "groups": inst.own.groups, "internal_errors": inst.counters["internal_errors"]}


def main() -> None:
    args = driver_args(cases="all", frdir="")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from distgrad import stats

    stats.stats_table([torch.ones(3)], torch.device("cpu"))  # one-time kernel set-up
    jobs = [("dup-unsharded", lambda r, w: run_dup(False, r, w)), ("dup-sharded", lambda r, w: run_dup(True, r, w)),
            ("flip", lambda r, w: run_flip(r, w, args.frdir)), ("hsdp", run_hsdp)]
    run_cases(jobs, args.cases, args.out, rank, world, "replica_cases")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
