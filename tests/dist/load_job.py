"""A 2-rank DDP training loop (gloo, CPU) instrumented by distgrad with its exporter on
``--port``, for the exporter load test: runs until ``--stop`` exists (rank 0 decides, every
rank follows through a broadcast every 4 steps), then rank 0 writes the wall-clock time of every
optimizer step to ``--out``. ``--ready`` gets ``{"pid", "port"}`` of rank 0 after the first
steps."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distgrad


class Blocks(nn.Module):
    """12 blocks of LayerNorm + Linear(48, 48): 48 parameter tensors, a few hundred series."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(48), nn.Linear(48, 48)) for _ in range(12)])
        self.head = nn.Linear(48, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return self.head(x).pow(2).mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--stop", required=True)
    ap.add_argument("--max-seconds", type=float, default=150)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Blocks())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"port": args.port if rank == 0 else 0})
    g = torch.Generator().manual_seed(rank)
    times: list[float] = []
    t_end = time.monotonic() + args.max_seconds
    flag = torch.zeros(1)
    step = 0
    while True:
        x = torch.randn(64, 48, generator=g)
        loss = model(x)
        inst.observe_loss(loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            times.append(time.time())
            if step == 5:
                Path(args.ready).write_text(json.dumps({"pid": os.getpid(), "port": inst.port}))
        if step % 4 == 0:
            flag.fill_(float(rank == 0 and (os.path.exists(args.stop) or time.monotonic() > t_end)))
            dist.broadcast(flag, 0)
            if flag.item():
                break
    inst.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "steps": step}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
