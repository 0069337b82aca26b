"""Multi-rank driver for tests/test_action.py (one torchrun launch, 2 gloo CPU ranks): the opt-in
action (config ``action``) on realistic causes, with the model of tests/dist/cause_cases.py.

Cases (each returns, per rank, the per-step facts and the rank's sample-indices file):
  ddp-skip:   DDP + AdamW, ``on_nonfinite: skip``; at step 4 rank 1's batch holds an all-zero
              sample (0/0 in ``feat_norm``: rank 1's loss and every gradient NaN, spread to both
              ranks by the all-reduce).
  ddp-off:    the same run with the defaults (no action).
  ddp-stop:   the same run with ``on_nonfinite: stop``; the loop leaves on ``inst.should_stop``;
              the ``on_stop`` callback makes a collective and fingerprints the state.
  fsdp2-skip: FSDP2 (``fully_shard``) + AdamW, ``on_nonfinite: skip``, the same zero sample.
  ds-spike:   DeepSpeed ZeRO-2 fp32 + AdamW, ``on_spike: skip``; at step 14 rank 1's batch is
              garbage (every label wrong): the paging detector fires on the step.
  ds3-bf16-spike: the same under ZeRO-3 bf16 (bf16 training weights re-written from unchanged fp32
              master partitions).

Per step each rank records a SHA-256 of its parameters and optimizer state (DeepSpeed: the
inner optimizer's fp32 master partitions and moments too) just before and just after the
optimizer step, so "the update was skipped" is checked bit for bit on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import torch
import torch.distributed as dist

import distgrad

from tests.dist.cause_cases import CLASSES, CauseModel, batch
from tests.dist.engines import adamw, build_ddp, build_deepspeed, build_fsdp2, init_distributed
from tests.dist.common import driver_args, run_cases

BAD_NAN, BAD_SPIKE = 4, 14


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(_local(t).detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def torch_state(model, opt) -> str:
    ts = [p for p in model.parameters()]
    for p in ts:
        ts_state = opt.state.get(p, {})
        ts = ts + [v for _, v in sorted(ts_state.items()) if isinstance(v, torch.Tensor)]
    return digest(ts)


def ds_state(engine) -> str:
    from distgrad.engines.deepspeed import inner_optimizer

    inner = inner_optimizer(engine)
    ts = [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in engine.module.parameters()]  # ZeRO-3: own partition
    ts += [p for g in inner.param_groups for p in g["params"]]  # fp32 master partitions (ZeRO 1/2)
    ts += list(getattr(engine.optimizer, "fp32_partitioned_groups_flat", []))  # ZeRO-3's, outside its step
    for st in inner.state.values():  # moments and step counts, whichever tensors they are keyed by
        ts += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return digest(ts)


def indices(step: int, rank: int, n: int) -> list[int]:
    return [100_000 * rank + 1000 * step + i for i in range(n)]


def served(inst) -> str:
    if inst.prometheus is None:
        return ""
    from prometheus_client import generate_latest

    return "\n".join(ln for ln in generate_latest(inst.prometheus.registry).decode().splitlines()
                     if ln.startswith(("distgrad_action", "distgrad_skipped_steps")))


def read_file(d: str, rank: int) -> list[dict]:
    path = os.path.join(d, f"action-rank{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def torch_case(kind: str, mode: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = CauseModel()
    optim = adamw(1e-2, weight_decay=0.01)
    model, opt = build_fsdp2(model, optim=optim) if kind == "fsdp2" else build_ddp(model, optim=optim)
    tmp = tempfile.mkdtemp(prefix=f"action-{kind}-{mode}-") if rank == 0 else None
    box = [tmp]
    dist.broadcast_object_list(box)
    tmp = box[0]
    action = {} if mode == "off" else {"action": {"on_nonfinite": mode, "samples_dir": tmp}}
    inst = distgrad.instrument(model, optimizer=opt, exporter={"port": 0, "host": "127.0.0.1"}, **action)
    stops = []

    def on_stop(d) -> None:
        t = torch.ones(1)
        dist.all_reduce(t)  # a collective: every rank is here
        stops.append({"step": d.step, "cause": d.cause, "ranks_here": int(t.item()),
                      "state": torch_state(model, opt)})

    inst.on_stop(on_stop)
    steps = []
    for step in range(8):
        x, y = batch(step, rank)
        if step == BAD_NAN and rank == 1:
            x[0] = 0.0  # a zero-padded sample
        loss = model(x, y)
        inst.observe_loss(loss, samples=indices(step, rank, len(x)))
        loss.backward()
        before = torch_state(model, opt)
        opt.step()
        after = torch_state(model, opt)
        opt.zero_grad()
        rec = inst.last_record
        steps.append({"step": step, "changed": before != after, "before": before, "applied": rec.step_applied,
                      "action": rec.action.to_dict() if rec.action else None, "counters": dict(rec.counters),
                      "finite": all(bool(torch.isfinite(_local(p)).all()) for p in model.parameters())})
        if inst.should_stop:
            break
    out = {"steps": steps, "stops": stops, "should_stop": inst.should_stop, "served": served(inst),
           "file": read_file(tmp, rank) if tmp else []}
    inst.close()
    return out


def ds_case(rank: int, world: int, stage: int = 2, dtype: str = "fp32") -> dict:

    torch.manual_seed(0)
    model = CauseModel()
    warmup = {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2, "total_num_steps": 1000}
    engine, _ = build_deepspeed(model, stage, dtype, micro_batch=16, lr=1e-2,
                                scheduler={"type": "WarmupDecayLR", "params": warmup})
    tmp = tempfile.mkdtemp(prefix="action-ds-") if rank == 0 else None
    box = [tmp]
    dist.broadcast_object_list(box)
    tmp = box[0]
    inst = distgrad.instrument(engine, exporter={"port": 0, "host": "127.0.0.1"},
                               action={"on_spike": "skip", "samples_dir": tmp},
                               spikes={"robust_window": 24, "robust_warmup": 8, "robust_k": 6.0, "robust_loss_ratio": 1.5})
    steps = []
    for step in range(17):
        x, y = batch(step, rank)
        if dtype == "bf16":
            x = x.bfloat16()
        if step == BAD_SPIKE and rank == 1:
            y = (y + 2) % CLASSES  # a garbage batch
        loss = engine(x, y)
        inst.observe_samples(indices(step, rank, len(x)))
        engine.backward(loss)
        before, lr = ds_state(engine), engine.lr_scheduler.get_last_lr()[0]
        engine.step()
        after = ds_state(engine)
        rec = inst.last_record
        from distgrad.engines.deepspeed import inner_optimizer

        steps.append({"step": step, "changed": before != after, "applied": rec.step_applied,
                      "engine_applied": bool(engine.was_step_applied()),
                      "moments": sum(isinstance(v, torch.Tensor) for st in inner_optimizer(engine).state.values()
                                     for v in st.values()),
                      "lr_stepped": engine.lr_scheduler.get_last_lr()[0] != lr,
                      "action": rec.action.to_dict() if rec.action else None, "counters": dict(rec.counters),
                      "fired": rec.spikes.fired if rec.spikes else {}, "loss": rec.loss, "grad_norm": rec.grad_norm,
                      "z": rec.spikes.zscore if rec.spikes else None})
    out = {"steps": steps, "served": served(inst), "file": read_file(tmp, rank)}
    inst.close()
    return out


def main() -> None:
    args = driver_args(cases="all")
    rank, world = init_distributed()
    jobs = [("ddp-skip", lambda r, w: torch_case("ddp", "skip", r, w)),
            ("ddp-off", lambda r, w: torch_case("ddp", "off", r, w)),
            ("ddp-stop", lambda r, w: torch_case("ddp", "stop", r, w)),
            ("fsdp2-skip", lambda r, w: torch_case("fsdp2", "skip", r, w)),
            ("ds-spike", ds_case),
            ("ds3-bf16-spike", lambda r, w: ds_case(r, w, stage=3, dtype="bf16"))]
    run_cases(jobs, args.cases, args.out, rank, world, "action_cases")


if __name__ == "__main__":
    main()
