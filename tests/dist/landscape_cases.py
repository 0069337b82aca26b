"""Multi-rank driver for tests/test_landscape_multirank.py (``torchrun --nproc_per_node 2``, gloo,
CPU, one launch): distgrad.report.landscape under DDP, FSDP2 and DeepSpeed ZeRO-3 (default persistence
threshold: every TinyModel parameter persistent, and threshold 0: gathered per module).

Each case trains TinyModel one optimizer step, then on every rank takes a 1-D and a 2-D slice over
its own two batches, and a reference: the same slices on one process (``distributed=False``) of a
plain TinyModel holding the gathered full weights, over the batches of every rank. Records the
bytes of every local weight shard before and after (must be identical), the loss of a forward
pass before and after, and the ``all_reduce`` calls made during the slices. Rank 0 writes JSON.
"""

from __future__ import annotations

import functools
import json
import traceback

import torch
import torch.distributed as dist

import deepspeed

from distgrad.report import landscape as ls

from tests.dist.engines import build_ddp, build_deepspeed, build_fsdp2, init_distributed
from tests.dist.common import driver_args, TinyModel, batch_for

STEPS1, STEPS2, SPAN, SEED, NB = 5, 3, 0.5, 3, 2


def loss_fn(model, batch):
    return model(*batch)


def local_bytes(kind: str, model) -> list[bytes]:
    if kind == "fsdp2":
        return [p.detach().to_local().numpy().tobytes() for p in model.parameters()]
    if kind.startswith("zero3"):
        return [p.ds_tensor.detach().numpy().tobytes() for p in model.module.parameters()]
    return [p.detach().numpy().tobytes() for p in model.parameters()]


def full_state(kind: str, model) -> dict:
    if kind == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if kind.startswith("zero3"):
        params = list(model.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()}


#: the optimizer of the torch engines' single training step
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


def build(kind: str, rank: int):
    torch.manual_seed(1234)
    model = TinyModel()
    if kind == "ddp":
        m, opt = build_ddp(model, optim=ADAM)
        x, y = batch_for(0, 0, rank)
        m(x, y).backward()
        opt.step()
        return m
    if kind == "fsdp2":
        model, opt = build_fsdp2(model, model.blocks, optim=ADAM)
        x, y = batch_for(0, 0, rank)
        model(x, y).backward()
        opt.step()
        return model
    zero = {"stage": 3}
    if kind == "zero3-gathered":
        zero["stage3_param_persistence_threshold"] = 0
    engine, _ = build_deepspeed(model, 3, lr=1e-2, zero_optimization=zero)
    x, y = batch_for(0, 0, rank)
    engine.backward(engine(x, y))
    engine.step()
    return engine


def run_case(kind: str, rank: int, world: int) -> dict:
    model = build(kind, rank)
    batches = [batch_for(500 + i, 0, rank) for i in range(NB)]
    every = [batch_for(500 + i, 0, r) for r in range(world) for i in range(NB)]
    ref = TinyModel()
    ref.load_state_dict(full_state(kind, model), strict=False)  # the tied head is emb.weight
    assert torch.equal(ref.head.weight, ref.emb.weight)
    before = local_bytes(kind, model)
    with torch.no_grad():
        loss_before = [float(loss_fn(model, b)) for b in batches]
    calls = []
    orig = dist.all_reduce

    def counting(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)
    dist.all_reduce = counting
    try:
        r1 = ls.slice_1d(model, loss_fn, batches, steps=STEPS1, span=SPAN, seed=SEED)
        r2 = ls.slice_2d(model, loss_fn, batches, steps=STEPS2, span=SPAN, seed=SEED)
    finally:
        dist.all_reduce = orig
    after = local_bytes(kind, model)
    with torch.no_grad():
        loss_after = [float(loss_fn(model, b)) for b in batches]
    f1 = ls.slice_1d(ref, loss_fn, every, steps=STEPS1, span=SPAN, seed=SEED, distributed=False)
    f2 = ls.slice_2d(ref, loss_fn, every, steps=STEPS2, span=SPAN, seed=SEED, distributed=False)
    return {"r1": r1.to_dict(), "r2": r2.to_dict(), "f1": f1.to_dict(), "f2": f2.to_dict(),
            "identical": before == after and len(before) > 0, "loss_before": loss_before, "loss_after": loss_after,
            "all_reduce": len(calls), "points": (STEPS1 + 1) + (STEPS2 * STEPS2 + 1),
            "n_params": r1.meta["n_params"]}


def main() -> None:
    args = driver_args()
    rank, world = init_distributed()
    out = {}
    for kind in ("ddp", "fsdp2", "zero3", "zero3-gathered"):
        try:
            out[kind] = run_case(kind, rank, world)
        except Exception:  # noqa: BLE001 - reported to the test
            out[kind] = {"error": traceback.format_exc()}
        dist.barrier()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
