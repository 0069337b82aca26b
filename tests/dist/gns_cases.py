"""Multi-rank driver of the gradient noise scale and curvature tests
(tests/test_noise_scale_multirank.py) under ``torchrun --nproc_per_node 2``, gloo, CPU.

Noise-scale cases (``ddp``, ``z2``, ``z3``, ``fsdp1``, ``fsdp2``; and ``z0-fp16``, ``z2-fp16``,
``z3-fp16``: FP16_STEPS steps under DeepSpeed fp16, loss scale 2**8, components only): the model
``Dot`` whose per-sample gradient is its input (loss_i = w . z_i), z_i drawn with a known mean G and covariance diag(C), weights fixed
(learning rate 0), GAS micro-batches of B samples per rank and step, STEPS steps. Per step the
driver records distgrad's :class:`~distgrad.signals.noise_scale.GradientNoiseScale.Part` and the float64 reference of
its two components from the data of every rank (each rank regenerates every rank's batches):
``|G_small|^2 = mean over (rank, micro-batch) of |mean z|^2``, ``|G_big|^2 = |mean of all z|^2``.

Curvature cases (``curv-z2``, ``curv-z3``, ``curv-fsdp2``): the least-squares model ``LSQ`` of
tests/test_curvature.py (a quadratic loss, each rank its own fixed data, AdamW), CURV_STEPS
steps; per step distgrad's :class:`~distgrad.signals.curvature.Curvature.Part` and the exact float64
``dtheta^T H dtheta / |dtheta|^2`` per layer from the full weights gathered before and after
each update (ZeRO-3: ``GatheredParameters``; FSDP2: ``full_tensor()``).

Rank 0 writes the JSON.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch
import torch.distributed as dist

import distgrad
from distgrad import stats

from tests.dist.engines import adamw, build_ddp, build_deepspeed, build_fsdp1, build_fsdp2, init_distributed, sgd
from tests.dist.common import driver_args, BoundaryCounter
from tests.closed_forms import LSQ, Dot, known_covariance, lsq_curvature, lsq_data

D, GAS, B, STEPS, D1 = 10, 2, 4, 80, 4
DECAY = 0.95
CURV_STEPS = 4
FP16_STEPS = 4


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    G, C, _ = known_covariance(D)
    g = torch.Generator().manual_seed(1_000_000 + 1000 * step + 10 * micro + rank)
    return G + torch.randn(B, D, generator=g) * C.sqrt()


def reference(step: int, world: int, fp16: bool = False) -> tuple[float, float]:
    """float64 (|G_small|^2, |G_big|^2) of the step over every rank's micro-batches (``fp16``:
    of the fp16-rounded inputs the engine sees)."""
    zs = [(batch(step, m, r).half() if fp16 else batch(step, m, r)).double() for r in range(world) for m in range(GAS)]
    small = sum(z.mean(0).pow(2).sum().item() for z in zs) / len(zs)
    big = torch.cat(zs).mean(0).pow(2).sum().item()
    return small, big


def run_noise(key: str, rank: int, world: int) -> dict:
    cfg = {"exporter": {"enabled": False}, "statistics": {"async_records": "off"},
           "noise_scale": {"enabled": True, "ema_decay": DECAY}}
    torch.manual_seed(5)
    model = Dot(D1, D - D1)
    if key in ("ddp", "fsdp1", "fsdp2"):
        if key == "ddp":
            w, opt = build_ddp(model, optim=sgd(0.0))
        elif key == "fsdp2":
            w, opt = build_fsdp2(model, [model.a], optim=sgd(0.0))
        else:
            w, opt = build_fsdp1(model, wrap=lambda m: m is model.a, orig_params=False, optim=sgd(0.0))
        inst = distgrad.instrument(w, cfg, optimizer=opt, noise_scale={"enabled": True, "micro_batch_size": B,
                                                                       "ema_decay": DECAY})

        def train(step):
            for m in range(GAS):
                (w(batch(step, m, rank)) / GAS).backward()
            opt.step()
            opt.zero_grad()
    else:
        fp16 = key.endswith("-fp16")  # loss scale 2**8: the hooked gradients carry it (and the ZeRO 1-3 pieces too)
        engine, _ = build_deepspeed(model, int(key[1]), "fp16" if fp16 else "fp32", GAS, micro_batch=B, lr=0.0)
        inst = distgrad.instrument(engine, cfg)

        def train(step):
            for m in range(GAS):
                z = batch(step, m, rank)
                engine.backward(engine(z.half() if fp16 else z))
                engine.step()
    steps = FP16_STEPS if key.endswith("-fp16") else STEPS
    recs = []
    inst.add_hook(recs.append)
    counter = BoundaryCounter(inst)
    for step in range(steps):
        if step < 3:  # the collectives and host syncs of the boundary (noise-scale on)
            counter.around(lambda: train(step))
        else:
            train(step)
    counter.restore()
    inst.close()
    out = {"records": [None if r.noise_scale is None else r.noise_scale.to_dict() for r in recs],
           "steps": [r.step for r in recs],
           "reference": [reference(s, world, key.endswith("-fp16")) for s in range(steps)],
           "internal_errors": inst.counters["internal_errors"], "counts": counter.counts,
           "loss_scale": [r.loss_scale for r in recs]}
    return out


def run_curvature(key: str, rank: int, world: int) -> dict:
    cfg = {"exporter": {"enabled": False}, "statistics": {"async_records": "off"}, "curvature": {"enabled": True}}
    torch.manual_seed(9)
    model = LSQ()
    data = lsq_data(rank)
    if key == "curv-fsdp2":
        model, opt = build_fsdp2(model, model.layers, optim=adamw(0.05))
        inst = distgrad.instrument(model, cfg, optimizer=opt)

        def train():
            model(*data).backward()
            opt.step()
            opt.zero_grad()

        def full():
            return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    else:
        import deepspeed

        stage = int(key[-1])
        engine, _ = build_deepspeed(model, stage, micro_batch=8, lr=0.05)
        inst = distgrad.instrument(engine, cfg)

        def train():
            engine.backward(engine(*data))
            engine.step()

        def full():
            params = list(engine.module.named_parameters())
            if stage == 3:
                with deepspeed.zero.GatheredParameters([p for _, p in params]):
                    return {n: p.detach().clone() for n, p in params}
            return {n: p.detach().clone() for n, p in params}
    recs = []
    inst.add_hook(recs.append)
    weights = [full()]
    counter = BoundaryCounter(inst)
    for _ in range(CURV_STEPS):
        counter.around(train)
        weights.append(full())
    counter.restore()
    inst.close()
    every = [lsq_data(r) for r in range(world)]
    refs = [None] + [lsq_curvature(weights[t - 1], weights[t], every) for t in range(1, CURV_STEPS)]
    return {"records": [None if r.curvature is None else r.curvature.to_dict() for r in recs],
            "steps": [r.step for r in recs], "reference": refs, "internal_errors": inst.counters["internal_errors"],
            "counts": counter.counts}


def main() -> None:
    args = driver_args()
    rank, world = init_distributed(fp16=True)
    stats.stats_table([torch.ones(3)], torch.device("cpu"))  # one-time kernel set-up
    results = {}
    for key in ("ddp", "z2", "z3", "fsdp1", "fsdp2", "z0-fp16", "z2-fp16", "z3-fp16",
                "curv-z2", "curv-z3", "curv-fsdp2"):
        t = time.time()
        try:
            results[key] = (run_curvature if key.startswith("curv-") else run_noise)(key, rank, world)
        except Exception as e:  # noqa: BLE001 - reported per case by the pytest side
            results[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(f"[gns_cases] rank {rank} {key}: {results[key]['traceback']}", file=sys.stderr, flush=True)
        if rank == 0:
            print(f"[gns_cases] {key}: {'error' if 'error' in results[key] else 'ok'} ({time.time() - t:.2f}s)",
                  flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "cases": results}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
