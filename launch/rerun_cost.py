"""What the rerun attribution (``rerun.enabled``, distgrad/diagnostics/rerun.py) costs: on healthy
steps (nothing but the replay's kept references) and on the one step it reruns.

Run on 2 CPU ranks (gloo)::

    torchrun --nproc_per_node 2 launch/rerun_cost.py [--width 1024 --layers 8 --batch 16 --gas 4 --steps 30]

A DDP MLP (``--layers`` Linear(width, width) + GELU, a cross-entropy head; the forward returns
the loss), ``--gas`` micro-batches per optimizer step, every step sampled, ``action.on_nonfinite:
skip``. Two runs from the same seed: rerun off, then on; in each, rank 1's last micro-batch of
step ``--steps // 2`` holds an infinite sample (a garbage batch: verdict ``data``). Rank 0 prints
the median optimizer-step wall time of the healthy steps of each run, the wall time of the
non-finite step in each, the rerun's own time on both ranks and the bytes of inputs broadcast.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import distgrad


class MLP(nn.Module):
    def __init__(self, width: int, layers: int, classes: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = F.gelu(lin(x))
        return F.cross_entropy(self.head(x), y)


def run(args: argparse.Namespace, rerun: bool) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(MLP(args.width, args.layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, rerun={"enabled": rerun},
                               action={"on_nonfinite": "skip"})
    bad = args.steps // 2
    times, part = [], None
    for step in range(args.steps):
        batches = []
        for micro in range(args.gas):
            g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
            x = torch.randn(args.batch, args.width, generator=g)
            if step == bad and rank == 1 and micro == args.gas - 1:
                x[0] = float("inf")
            batches.append((x, torch.randint(0, 16, (args.batch,), generator=g)))
        dist.barrier()
        t = time.perf_counter()
        for micro, (x, y) in enumerate(batches):
            if micro < args.gas - 1:
                with model.no_sync():
                    model(x, y).backward()
            else:
                model(x, y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        rec = inst.last_record
        if rerun and rec is not None and getattr(rec, "rerun", None) is not None and rec.rerun.step == step:
            part = rec.rerun
    inst.close()
    healthy = [t for i, t in enumerate(times) if i >= 3 and i != bad]
    out = {"healthy_ms": 1e3 * statistics.median(healthy), "bad_ms": 1e3 * times[bad]}
    if part is not None:
        out.update(verdict=part.verdict, rerun_ms=1e3 * part.seconds)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--gas", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    off = run(args, False)
    on = run(args, True)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, on.get("rerun_ms"))
    if dist.get_rank() == 0:
        params = args.layers * (args.width + 1) * args.width + (args.width + 1) * 16
        inputs = args.gas * args.batch * (args.width * 4 + 8)
        print(f"MLP {args.layers} x {args.width} ({params / 1e6:.2f}M parameters), {args.gas} micro-batches of "
              f"{args.batch}, 2 gloo ranks, 1 thread each")
        print(f"healthy step, median: rerun off {off['healthy_ms']:.1f} ms, on {on['healthy_ms']:.1f} ms")
        print(f"non-finite step: rerun off {off['bad_ms']:.1f} ms, on {on['bad_ms']:.1f} ms "
              f"(verdict {on.get('verdict')}); the rerun itself: " +
              ", ".join(f"rank {r} {ms:.1f} ms" for r, ms in enumerate(per_rank) if ms is not None) +
              f"; inputs broadcast: {inputs / 1e3:.0f} kB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
