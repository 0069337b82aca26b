"""Multi-rank driver of a float8 run that SATURATES (issue #25 item 6) and its healthy twin,
under ``torchrun --nproc_per_node 2`` (gloo, CPU, torchao float8 emulated): FSDP2 with torchao's
float8 all-gather (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``: each rank casts its
weight shard to float8 before the all-gather, tests/fp8_models.py ``make``), AdamW with a
layer-wise learning rate (block 0: 5e-4, block 1 and the head: 0.05; over the 6 steps block 0's
weights move by about 1% of their amax at most, block 1's amax about doubles).

* ``fp8_stale``: the user calls ``precompute_float8_dynamic_scale_for_fsdp(model)`` ONCE, after
  building the model (as a set-up step), instead of after every optimizer step as torchao's
  docstring says. FSDP2's pre-all-gather then casts every later weight with the scale of the
  initial weight (``WeightWithDynamicFloat8CastTensor._precomputed_scale`` is never refreshed);
  the weights grow under the optimizer and their largest elements are clipped to fp8_max by the
  saturating cast.
* ``fp8_fresh``: the documented placement (after each ``optimizer.step()``; step 0 uses the
  mesh-reduced dynamic scale): nothing saturates, nothing fires.

Per step each rank records, before the forward, its local high-precision weight shard of each
float8 layer (float64, from the sharded parameter's ``WeightWithDynamicFloat8CastTensor``) and the
tensors its layers cast (tests/fp8_models.py ``capture``, inputs and grad_outputs), and returns
the float64 references of the input / grad_output casts; rank 0 also returns its records
(``StepRecord.fp8``), distgrad's JSONL log (for the rule replay of
tests/monitoring/test_precursor_paging.py) and the boundary's collective / host-sync counts. The
test side rebuilds each step's whole weight from both ranks' shards and recomputes its cast with
the scale torchao used (tests/fp8_models.py ``reference`` with ``amax_of_scale``).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distgrad
from tests.dist.common import BoundaryCounter, driver_args, run_cases
from tests.dist.engines import build_fsdp2
from tests.fp8_models import capture, cast_references, make

GAS, STEPS, B = 2, 6, 6
LAYERS = ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5_000 * step + 50 * micro + rank)
    return torch.randn(B, 16, generator=g), torch.randint(0, 5, (B,), generator=g)


def run(key: str, rank: int, world: int) -> dict:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    model = make(seed=11, fsdp_float8_all_gather=True)

    def layerwise(params):
        low = {id(p) for p in model.blocks[0].parameters()}
        return torch.optim.AdamW([{"params": [p for p in params if id(p) in low], "lr": 5e-4},
                                  {"params": [p for p in params if id(p) not in low], "lr": 0.05}])
    w, opt = build_fsdp2(model, list(model.blocks), optim=layerwise)
    jsonl = os.path.join(tempfile.mkdtemp(prefix=f"dg_{key}_"), f"{key}.jsonl")
    inst = distgrad.instrument(w, {"exporter": {"enabled": False}, "statistics": {"async_records": "off"},
                                   "fp8": {"enabled": True}, "sinks": {"jsonl": {"path": jsonl}}}, optimizer=opt)
    mods = dict(model.named_modules())
    if key == "fp8_stale":
        precompute_float8_dynamic_scale_for_fsdp(w)  # once, at set-up: the mistake
    counter = BoundaryCounter(inst)
    refs, shards, records = [], [], []
    for s in range(STEPS):
        shards.append({n: mods[n].weight._local_tensor._tensor.detach().double().tolist() for n in LAYERS})
        caps, handles = capture(model, weights=False)
        for micro in range(GAS):
            x, y = batch(s, micro, rank)
            (F.cross_entropy(w(x), y) / GAS).backward()

        def step():
            opt.step()
            opt.zero_grad()
            if key == "fp8_fresh":
                precompute_float8_dynamic_scale_for_fsdp(w)  # torchao's place: after the optimizer step
        counter.around(step)
        refs.append(cast_references(caps, handles))
        records.append(inst.last_record.fp8.to_dict() if inst.last_record and inst.last_record.fp8 else None)
    counter.restore()
    inst.close()
    out = {"records": records, "refs": refs, "shards": shards, "counts": counter.counts,
           "internal_errors": inst.counters["internal_errors"]}
    if rank == 0:
        with open(jsonl) as f:
            out["jsonl"] = f.read()
    return out


def main() -> None:
    args = driver_args(cases="all")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_cases([(k, lambda r, w, k=k: run(k, r, w)) for k in ("fp8_stale", "fp8_fresh")],
              args.cases, args.out, rank, world, "fp8_fsdp")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
