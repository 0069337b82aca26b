"""Multi-rank driver for tests/test_grad_histogram_multirank.py (one torchrun launch, 2 gloo CPU
ranks): the gradient value distribution (``histogram.enabled``) under DeepSpeed ZeRO-2 (bf16,
underflow counted against fp16 with ``histogram.dtype: fp16`` so that it is not empty), ZeRO-3
(fp32, ``auto``) and FSDP2 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
``auto`` -> bf16), in sequence.

Each case trains :class:`common.TinyModel` for three optimizer steps on batches whose first
feature is 0 (so ``inp.weight`` has exact-zero gradient columns) and records on rank 0: the
record's ``grad_histogram``, the full reduced gradient of each step gathered right before
distgrad reads it (DeepSpeed ``safe_get_full_grad`` in ``_take_model_step``; FSDP2
``full_tensor()`` in an optimizer step pre-hook registered after distgrad's), in float64, and
the collectives and host syncs made inside distgrad's boundary methods per step (common.BoundaryCounter).
Writes JSON to the path given by --out.
"""

from __future__ import annotations

import json
import traceback

import torch
import torch.distributed as dist

from deepspeed.utils import safe_get_full_grad
from torch.distributed.fsdp import MixedPrecisionPolicy

import distgrad

from tests.dist.engines import build_deepspeed, build_fsdp2, init_distributed
from tests.dist.common import driver_args, TinyModel, batch_for, counted_steps

STEPS = 3


def _batch(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch_for(step, 0, rank)
    x[:, 0] = 0.0  # exact zeros in inp.weight's gradient
    x[:, 1] *= 1e-6  # small gradient values in its second column
    return x.to(dtype), y


def _full(named) -> dict[str, list[float]]:
    return {n: g.detach().double().reshape(-1).tolist() for n, g in named}


def ds_case(stage: int, dtype: str, hist_dtype: str, rank: int) -> dict:
    torch.manual_seed(1234)
    model = TinyModel()
    engine, _ = build_deepspeed(model, stage, dtype)
    inst = distgrad.instrument(engine, exporter={"enabled": False}, histogram={"enabled": True, "dtype": hist_dtype})
    refs: list[dict] = []
    inner = engine._take_model_step

    def capture(*a, **kw):
        full = [(n, safe_get_full_grad(p)) for n, p in engine.module.named_parameters() if p.requires_grad]
        refs.append(_full(full))
        return inner(*a, **kw)

    engine._take_model_step = capture
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    records, counts = counted_steps(inst, STEPS, lambda s: engine.backward(engine(*_batch(s, rank, dt))), engine.step)
    out = {"records": records, "full": refs, "counts": counts, "counters": dict(inst.counters),
           "compute_dtype": str(inst.source.compute_dtype)}
    inst.close()
    return out


def fsdp2_case(rank: int) -> dict:
    torch.manual_seed(1234)
    model = TinyModel()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, opt = build_fsdp2(model, model.blocks, mp_policy=mp)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, histogram={"enabled": True})
    refs: list[dict] = []
    opt.register_step_pre_hook(lambda o, a, k: refs.append(_full(
        (n, p.grad.full_tensor()) for n, p in trainable if p.grad is not None)))

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    records, counts = counted_steps(inst, STEPS, lambda s: model(*_batch(s, rank, torch.float32)).backward(), step)
    out = {"records": records, "full": refs, "counts": counts, "counters": dict(inst.counters),
           "compute_dtype": str(inst.source.compute_dtype)}
    inst.close()
    return out


def main() -> None:
    args = driver_args()
    rank, _ = init_distributed()
    cases = {"z2-bf16": lambda: ds_case(2, "bf16", "fp16", rank), "z3-fp32": lambda: ds_case(3, "fp32", "auto", rank),
             "fsdp2-bf16": lambda: fsdp2_case(rank)}
    results = {}
    for key, run in cases.items():
        try:
            results[key] = run()
        except Exception as e:  # noqa: BLE001 - reported per case by the pytest side
            results[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        if rank == 0:
            print(f"[hist_cases] {key}: {'error' if 'error' in results[key] else 'ok'}", flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "cases": results}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
