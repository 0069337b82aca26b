"""Multi-rank driver of the logit precursors (tests/test_logits_multirank.py) under ``torchrun
--nproc_per_node 2``, gloo, CPU: cases ``z2`` (DeepSpeed ZeRO-2) and ``fsdp2`` (FSDP2 with each
block a unit of its own); also the FP8 scaling-health cases ``fp8_z2`` / ``fp8_fsdp2``
(tests/dist/fp8_cases.py) and the MoE router health cases ``router_fsdp2`` and
``router_dead_fsdp2`` (tests/dist/router_cases.py), in the same launch.

The model is tests/test_logits.py's plain SDPA model (two attention blocks that report through
``observe_attention``, an output head), GAS micro-batches per rank and step (each rank its own
data), STEPS steps. Per micro-batch each rank keeps float64 references computed from the
forward's own tensors another way: per block and head the max of ``q k^T / sqrt(d)`` rebuilt
from the block's ``qk`` projection output (a forward hook), causal mask applied; and the output
z = logsumexp statistics of the returned logits in float64. They are gathered to every rank;
rank 0 writes its records (``StepRecord.logits``) and the boundary's collective / host-sync
counts of the first steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import distgrad
from tests.dist.common import BoundaryCounter, driver_args, run_cases
from tests.dist.engines import adamw, build_deepspeed, build_fsdp2, init_distributed
from tests.logits_models import SDPAModel

GAS, STEPS, B, T, V = 2, 3, 3, 7, 23


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(9_000 * step + 90 * micro + rank)
    return torch.randint(0, V, (B, T), generator=g)


def run(key: str, rank: int, world: int) -> dict:
    cfg = {"exporter": {"enabled": False}, "statistics": {"async_records": "off"},
           "logits": {"attention": True, "attention_modules": r"^blocks\.\d+$", "output": True, "output_module": "head"}}
    torch.manual_seed(3)
    model = SDPAModel(vocab=V)
    caps: dict[int, torch.Tensor] = {}
    for i, blk in enumerate(model.blocks):
        blk.qk.register_forward_hook(lambda m, x, y, i=i: caps.__setitem__(i, y.detach().double()))
    if key == "fsdp2":
        w, opt = build_fsdp2(model, list(model.blocks), optim=adamw(0.05))
        inst = distgrad.instrument(w, cfg, optimizer=opt)

        def fwd_bwd(ids, micro):
            logits = w(ids)
            (F.cross_entropy(logits.flatten(0, 1), ids.flatten()) / GAS).backward()
            return logits

        def step():
            opt.step()
            opt.zero_grad()
    else:
        engine, _ = build_deepspeed(model, 2, "fp32", GAS, micro_batch=B, lr=0.05)
        inst = distgrad.instrument(engine, cfg)

        def fwd_bwd(ids, micro):
            logits = engine(ids)
            engine.backward(F.cross_entropy(logits.flatten(0, 1), ids.flatten()))
            if micro < GAS - 1:
                engine.step()  # not yet the boundary: DeepSpeed accumulates
            return logits

        def step():
            engine.step()  # the accumulation boundary

    refs = []
    counter = BoundaryCounter(inst)
    records = []
    for s in range(STEPS):
        heads, z = {}, []
        for micro in range(GAS):
            ids = batch(s, micro, rank)
            logits = fwd_bwd(ids, micro)
            for i, blk in enumerate(model.blocks):
                q, k = caps[i].view(B, T, 2, blk.num_heads, -1).permute(2, 0, 3, 1, 4)
                sc = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
                sc = sc.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
                hm = sc.transpose(0, 1).reshape(blk.num_heads, -1).amax(1).tolist()
                heads[str(i)] = [max(a, b) for a, b in zip(heads.get(str(i), hm), hm)]
            z += torch.logsumexp(logits.detach().double(), -1).reshape(-1).tolist()
            amax = logits.detach().double().abs().max().item()
            heads["abs_max"] = max(heads.get("abs_max", amax), amax)
        counter.around(step)
        refs.append({"heads": heads, "z": z})
        records.append(inst.last_record.logits.to_dict() if inst.last_record and inst.last_record.logits else None)
    counter.restore()
    inst.close()
    return {"records": records, "refs": refs, "counts": counter.counts,
            "internal_errors": inst.counters["internal_errors"]}


def main() -> None:
    args = driver_args(cases="all")
    rank, world = init_distributed()
    from tests.dist import fp8_cases, router_cases  # FP8 and router health share this launch

    run_cases([(k, lambda r, w, k=k: run(k, r, w)) for k in ("z2", "fsdp2")]
              + [(k, lambda r, w, k=k: fp8_cases.run(k, r, w)) for k in ("fp8_z2", "fp8_fsdp2")]
              + [("router_fsdp2", lambda r, w: router_cases.run("router_fsdp2", r, w)),
                 ("router_dead_fsdp2", lambda r, w: router_cases.run_dead("router_dead_fsdp2", r, w))],
              args.cases, args.out, rank, world, "logits")


if __name__ == "__main__":
    main()
