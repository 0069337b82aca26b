"""Multi-rank cases of the FP8 scaling health (distgrad/signals/fp8.py), run inside the logit
precursors' launch (tests/dist/logits_cases.py, 2 gloo ranks, CPU): ``fp8_z2`` (DeepSpeed
ZeRO-2) and ``fp8_fsdp2`` (FSDP2, each block a unit, with ``fp8.tp_size: 2``: the two ranks are
taken as one tensor-parallel group, so the amax disagreement across them is exported).

The model is tests/fp8_models.py's (two blocks of two torchao float8 linears, emulated), GAS
micro-batches per rank and step of different magnitudes per rank (each rank its own data). Per
micro-batch each rank records, from the tensors its float8 layers cast (captured by forward /
full-backward hooks), the float64 reference of each cast (tests/fp8_models.py ``reference``);
rank 0 also writes its records (``StepRecord.fp8``) and the boundary's collective / host-sync
counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import distgrad
from tests.dist.common import BoundaryCounter
from tests.dist.engines import adamw, build_deepspeed, build_fsdp2
from tests.fp8_models import capture, cast_references, make

GAS, STEPS, B = 2, 3, 6


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7_000 * step + 70 * micro + rank)
    return torch.randn(B, 16, generator=g) * (1 + 2 * rank + micro), torch.randint(0, 5, (B,), generator=g)


def run(key: str, rank: int, world: int) -> dict:
    cfg = {"exporter": {"enabled": False}, "statistics": {"async_records": "off"},
           "fp8": {"enabled": True, "tp_size": 2 if key == "fp8_fsdp2" else 1}}
    model = make(seed=4)
    if key == "fp8_fsdp2":
        w, opt = build_fsdp2(model, list(model.blocks), optim=adamw(0.05))
        inst = distgrad.instrument(w, cfg, optimizer=opt)

        def fwd_bwd(x, y, micro):
            (F.cross_entropy(w(x), y) / GAS).backward()

        def step():
            opt.step()
            opt.zero_grad()
    else:
        engine, _ = build_deepspeed(model, 2, "fp32", GAS, micro_batch=B, lr=0.05)
        inst = distgrad.instrument(engine, cfg)

        def fwd_bwd(x, y, micro):
            engine.backward(F.cross_entropy(engine(x), y))
            if micro < GAS - 1:
                engine.step()  # not yet the boundary: DeepSpeed accumulates

        def step():
            engine.step()  # the accumulation boundary

    counter = BoundaryCounter(inst)
    refs, records = [], []
    for s in range(STEPS):
        caps, handles = capture(model)
        for micro in range(GAS):
            fwd_bwd(*batch(s, micro, rank), micro)
        counter.around(step)
        refs.append(cast_references(caps, handles))
        records.append(inst.last_record.fp8.to_dict() if inst.last_record and inst.last_record.fp8 else None)
    counter.restore()
    inst.close()
    return {"records": records, "refs": refs, "counts": counter.counts,
            "internal_errors": inst.counters["internal_errors"]}
