"""Multi-rank driver for tests/test_adaptive_clip.py (one torchrun launch, 2 gloo CPU ranks):
adaptive clipping (config ``adaptive_clip``) under DDP and FSDP2, float64 model, SGD.

Cases ``ddp-zclip``, ``ddp-adagc`` and ``fsdp2-adagc`` (each rank scales its own rows of every
parameter by the factor of the whole parameter): 10 steps, each rank its own batch; at step 8 (zclip) /
steps 2 and 8 (adagc) rank 1's loss is multiplied by 40 (a gradient spike that reaches both ranks
through DDP's all-reduce). Per rank: the per-parameter factors applied each step (derived from the
gradient before and after distgrad's pre-hook), the clipped-step count, and the largest relative
error of the gradient the optimizer consumed against ``factor * the reduced gradient`` with the
factor from the record (float64).
"""

from __future__ import annotations

import torch
import torch.nn as nn

import distgrad
from tests.dist.common import driver_args, run_cases
from tests.dist.engines import build_ddp, build_fsdp2, init_distributed, sgd


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def case(engine: str, mode: str, spikes: tuple[int, ...], rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()
    if engine == "ddp":
        ddp, opt = build_ddp(model, optim=sgd(0.05))
    else:  # FSDP2: each rank holds dim-0 rows of every parameter; scales its shard
        ddp, opt = build_fsdp2(model, optim=sgd(0.05))
    clip = {"mode": mode, "zclip_warmup_steps": 5, "adagc_warmup_steps": 3}
    inst = distgrad.instrument(ddp, optimizer=opt, exporter={"enabled": False}, adaptive_clip=clip)
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([_local(p.grad).detach().clone() for p in ddp.parameters()]))
    g = torch.Generator().manual_seed(100 + rank)
    factors, decided, err, last = [], [], 0.0, None
    try:
        for step in range(10):
            x = torch.randn(8, 6, generator=g, dtype=torch.float64)
            y = torch.randn(8, 3, generator=g, dtype=torch.float64)
            loss = ((ddp(x) - y) ** 2).mean() * (40.0 if step in spikes and rank == 1 else 1.0)
            loss.backward()
            pre = [_local(p.grad).detach().clone() for p in ddp.parameters()]
            opt.step()
            opt.zero_grad()
            last = inst.last_record.adaptive_clip
            decided.append(last.factor)
            fs = []
            for a, b in zip(seen[-1], pre):
                if b.numel() == 0 or not bool((b != 0).any()):
                    fs.append(None)  # an empty shard (FSDP2): nothing to scale here
                    continue
                f = float((a * b).sum() / (b * b).sum())  # the factor applied to this tensor
                fs.append(f)
                err = max(err, float((a - f * b).abs().max() / b.abs().max()))
            factors.append(fs)
            known = [f for f in fs if f is not None]
            if last.clipped:  # the record's smallest factor is the smallest applied (of this rank's tensors)
                err = max(err, max(0.0, (last.factor - min(known)) / last.factor))
            else:
                err = max(err, max(abs(f - 1.0) for f in known))
    finally:
        inst.close()
    return {"factors": factors, "decided": decided, "clipped_steps": last.clipped_steps, "max_rel_err": err}


def main() -> None:
    args = driver_args(cases="all")
    rank, world = init_distributed()
    jobs = [("ddp-zclip", lambda r, w: case("ddp", "zclip", (8,), r, w)),
            ("ddp-adagc", lambda r, w: case("ddp", "adagc", (2, 8), r, w)),
            ("fsdp2-adagc", lambda r, w: case("fsdp2", "adagc", (2, 8), r, w))]
    run_cases(jobs, args.cases, args.out, rank, world, "clip_cases")


if __name__ == "__main__":
    main()
