"""Multi-rank driver for the DeepSpeed reference tests (run by tests/test_deepspeed_reference.py
under ``torchrun --nproc_per_node 2``; every case in one launch because start-up is slow).

For each case (ZeRO stage x dtype x gradient accumulation) it trains a small model for two
optimizer steps with distgrad attached and records, on rank 0:
  * distgrad's record of each step (what /metrics would serve);
  * reference A: the full reduced gradient gathered with ``deepspeed.utils.safe_get_full_grad``
    (test-only: a collective per parameter) right before distgrad's boundary hook, with its
    statistics computed in float64 on one process: checks the sharded statistics;
  * reference B (step 0 only): gradients of a float64 copy of the model on one process, averaged
    over every rank's micro-batches: checks that what is read is the post-reduction gradient
    the optimizer applies (averaged over ranks and micro-batches, not a per-rank partial).
Writes JSON to the path given by --out.
"""

from __future__ import annotations

import copy
import json
import os

import torch
import torch.distributed as dist

from deepspeed.utils import safe_get_full_grad

import distgrad

from tests.dist.engines import build_deepspeed, ds_config, init_distributed
from tests.dist.common import (driver_args, ATTR_GAS, HostSyncs, LA_GAS, LA_SOURCES, TinyLM, TinyModel, batch_for, full_stats,
                    loss_analysis_loop, loss_attribution_loop, reference_b)


def run_case(stage: int, dtype: str, gas: int, steps: int, rank: int, world: int) -> dict:
    torch.manual_seed(1234)
    model = TinyModel()
    ref_model = copy.deepcopy(model).double()
    if dtype == "bf16":  # the engine trains on bf16-rounded weights; so does the reference
        ref_model.load_state_dict({k: v.bfloat16().double() for k, v in model.state_dict().items()})
    if dtype == "fp16":
        ref_model.load_state_dict({k: v.half().double() for k, v in model.state_dict().items()})
    engine, _ = build_deepspeed(model, stage, dtype, gas)
    inst = distgrad.instrument(engine, exporter={"enabled": False})
    refs: list[dict] = []
    inner = engine._take_model_step

    def capture(*a, **kw):
        full = {}
        for n, p in engine.module.named_parameters():
            if p.requires_grad:
                g = safe_get_full_grad(p)
                full[n] = g.detach().double().cpu().reshape(-1) if g is not None else None
        # safe_get_full_grad returns the loss-scaled fp16 gradient under ZeRO 1-3 (the optimizer
        # unscales inside step()); reference B (float64 model) checks the unscaled values
        # independently of this division
        scale = float(engine.optimizer.cur_scale) if dtype == "fp16" and stage > 0 else 1.0
        refs.append({k: (v / scale if v is not None else None) for k, v in full.items()})
        return inner(*a, **kw)

    engine._take_model_step = capture
    records, losses = [], []
    for step in range(steps):
        for micro in range(gas):
            x, y = batch_for(step, micro, rank)
            dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
            loss = engine(x.to(dt), y)
            engine.backward(loss)
            engine.step()
        records.append(inst.last_record.to_dict() if inst.last_record else None)
    # reference B: float64 single process, step 0, all ranks' micro-batches
    ref_b, ref_loss = reference_b(ref_model, gas, world)
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    out = {
        "records": records,
        "ref_full": [full_stats(r) for r in refs],
        "ref_fp64_step0": ref_b,
        "frozen": frozen,
        "ref_loss_step0": ref_loss,
        "counters": dict(inst.counters),
        "skipped_steps_engine": int(engine.skipped_steps),
    }
    inst.close()
    engine.destroy() if hasattr(engine, "destroy") else None
    return out


def update_ratio_case(stage: int, dtype: str, rank: int) -> dict:
    """distgrad's update-to-weight ratios vs ||w1 - w0|| / ||w0|| of the full fp32 master
    weights gathered with safe_get_full_fp32_param (test only) around the step, in float64."""
    from deepspeed.utils import safe_get_full_fp32_param

    torch.manual_seed(99)
    model = TinyModel()
    engine, _ = build_deepspeed(model, stage, dtype, 1)
    inst = distgrad.instrument(engine, exporter={"enabled": False}, statistics={"update_ratio": True})
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    inner = engine._take_model_step
    snaps: list[dict] = []

    def full():
        # stage 0 fp32 has no separate master copy: the parameters are the optimizer's weights
        return {n: (safe_get_full_fp32_param(p) if stage else p).detach().double().reshape(-1).clone()
                for n, p in named}

    def around(*a, **kw):
        before = full()
        out = inner(*a, **kw)
        after = full()
        snaps.append({n: ((after[n] - before[n]).norm() / before[n].norm()).item() for n in before})
        return out
    engine._take_model_step = around
    got = []
    for step in range(2):
        x, y = batch_for(step, 0, rank)
        dt = {"bf16": torch.bfloat16}.get(dtype, torch.float32)
        engine.backward(engine(x.to(dt), y))
        engine.step()
        got.append(inst.last_record.update_ratio)
    inst.close()
    return {"got": got, "ref": snaps}


def loss_attribution_case(rank: int, tmp: str) -> dict:
    """ZeRO-2 fp32, 2 micro-batches per step: per-rank loss attribution and the straggler (data
    time measured by distgrad: rank 1 sleeps before its forward), sample indices given with
    ``observe_samples`` (DeepSpeed's ``engine.backward`` observes the loss itself); see
    common.loss_attribution_loop."""
    torch.manual_seed(5)
    model = TinyModel()
    engine, _ = build_deepspeed(model, 2, "fp32", ATTR_GAS)
    inst = distgrad.instrument(engine, exporter={"enabled": False}, **{"flight_recorder.dir": tmp, "spikes.ema_warmup": 3,
                                   "spikes.ema_z": 10.0})
    def backward(loss, micro):
        engine.backward(loss)
        if micro < ATTR_GAS - 1:
            engine.step()  # DeepSpeed counts micro-batches in step(); the last one is the loop's step()

    out = loss_attribution_loop(inst, rank, lambda x, y, micro: engine(x, y), backward, engine.step,
                                report_data=False, explicit_samples=False)
    out["dir"] = tmp
    inst.close()
    return out


def loss_analysis_case(rank: int) -> dict:
    """ZeRO-1 fp32, 2 micro-batches per step, TinyLM: loss components, per-token losses given as
    ``token_losses`` / ``token_mask`` with per-sequence sources, and the trend; the explicit
    ``observe_loss`` turns DeepSpeed's own capture in ``engine.backward`` off (never counted
    twice). See common.loss_analysis_loop."""
    torch.manual_seed(11)
    model = TinyLM()
    engine, _ = build_deepspeed(model, 1, "fp32", LA_GAS)
    inst = distgrad.instrument(engine, exporter={"enabled": False}, loss={"sources": LA_SOURCES})

    def backward(loss, micro):
        engine.backward(loss)
        if micro < LA_GAS - 1:
            engine.step()

    out = loss_analysis_loop(inst, rank, lambda tokens, micro: engine(tokens), backward, engine.step,
                             use_logits=False)
    inst.close()
    return out


def special_cases(rank: int, world: int, tmp: str) -> dict:
    """Fault tolerance, set-up errors, and per-step collective / host-sync counts."""
    import socket

    import torch.distributed as tdist

    out: dict = {}
    # 1. a local failure on rank 1 at step 1: both ranks go on, the error is counted on rank 0
    torch.manual_seed(0)
    model = TinyModel()
    engine, _ = build_deepspeed(model, 2, "fp32", 1)
    inst = distgrad.instrument(engine, exporter={"enabled": False})
    orig = inst.source.local_pieces
    state = {"step": 0}

    def flaky():
        if rank == 1 and state["step"] == 1:
            raise RuntimeError("injected failure inside distgrad on rank 1")
        return orig()
    inst.source.local_pieces = flaky
    steps_seen = []
    for step in range(3):
        state["step"] = step
        x, y = batch_for(step, 0, rank)
        engine.backward(engine(x, y))
        engine.step()
        steps_seen.append(inst.last_record.step if inst.last_record else None)
    out["fault"] = {"steps_seen": steps_seen, "internal_errors": inst.counters["internal_errors"],
                    "global_steps": int(engine.global_steps)}
    inst.close()

    # 2. collectives and host syncs per step, interval 2, including a non-finite step
    torch.manual_seed(0)
    model = TinyModel()
    engine, _ = build_deepspeed(model, 3, "fp32", 1)
    inst = distgrad.instrument(engine, exporter={"enabled": False}, sampling={"interval": 2})
    counts = {"all_reduce": 0, "all_gather": 0, "other": 0}
    active = {"on": False}
    originals = {}
    gathers = ("all_gather_into_tensor", "all_gather_single", "all_gather")
    for fn in ("all_reduce", *gathers, "broadcast", "reduce_scatter_tensor", "reduce_scatter_single",
               "barrier", "reduce", "gather", "scatter", "all_to_all_single"):
        if not hasattr(tdist, fn):
            continue
        originals[fn] = getattr(tdist, fn)

        def wrapper(*a, __fn=fn, **kw):
            if active["on"]:
                key = "all_gather" if __fn in gathers else __fn if __fn in counts else "other"
                counts[key] += 1
            return originals[__fn](*a, **kw)
        setattr(tdist, fn, wrapper)
    per_step = []
    sync = HostSyncs()
    for name in ("collect", "finish", "skip", "watch"):
        meth = getattr(inst, name)

        def timed(*a, __m=meth, **kw):
            active["on"] = True
            try:
                with sync:
                    return __m(*a, **kw)
            finally:
                active["on"] = False
        setattr(inst, name, timed)
    for step in range(4):
        for k in counts:
            counts[k] = 0
        sync.calls.clear()
        x, y = batch_for(step, 0, rank)
        if step == 2:  # a NaN in the input -> non-finite gradients everywhere (extra provenance gather)
            x = x.clone()
            x[0, 0] = float("nan")
        engine.backward(engine(x, y))
        engine.step()
        per_step.append({"step": step, **counts, "syncs": list(sync.calls)})
    for fn, f in originals.items():
        setattr(tdist, fn, f)
    out["counts"] = per_step
    out["counts_nonfinite_steps"] = inst.counters["nonfinite_steps"]
    inst.close()

    # 2b. ZeRO-2 (sharded gradients), interval 2: a NaN input on rank 1 at unsampled step 1 makes
    # its loss and, after the reduction, every gradient partition NaN; DeepSpeed's ZeRO-2 optimizer
    # skips that step (fp32 too), so the sampled step 2 is finite. Step 2's record names step 1 for
    # gradient and loss.
    torch.manual_seed(0)
    model = TinyModel()
    engine, _ = build_deepspeed(model, 2, "fp32", 1)
    inst = distgrad.instrument(engine, exporter={"enabled": False}, sampling={"interval": 2})
    for step in range(3):
        x, y = batch_for(step, 0, rank)
        if step == 1 and rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        engine.backward(engine(x, y))
        engine.step()
    out["unsampled_nan"] = {"step": inst.last_record.step,
                            "reported": (inst.last_record.unsampled_nonfinite
                                         and inst.last_record.unsampled_nonfinite.to_dict()),
                            "counters": dict(inst.counters)}
    inst.close()

    # 3. a port taken on rank 0 raises at instrument() time on every rank, with the fix
    holder = socket.socket()
    port = 0
    if rank == 0:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
    t = torch.tensor([port])
    tdist.broadcast(t, 0)
    msg = None
    try:
        distgrad.instrument(engine, exporter={"port": int(t.item())})
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
    holder.close()
    out["port_taken"] = msg

    # 3b. a failure while attaching to DeepSpeed, after rank 0's exporter started: instrument()
    # closes the instrument, so the port is free again and the engine is left as it was
    import distgrad.engines.deepspeed as ds_adapter

    from launch.dist_env import free_port

    port = free_port() if rank == 0 else 0  # below the ephemeral range: gloo's pairs cannot take it
    t = torch.tensor([port])
    tdist.broadcast(t, 0)
    port = int(t.item())
    take_before = engine._take_model_step
    real_attach = ds_adapter.attach_deepspeed

    def failing_attach(*a, **kw):
        real_attach(*a, **kw)  # wraps the engine, then fails
        raise RuntimeError("injected failure while attaching")
    ds_adapter.attach_deepspeed = failing_attach
    err = None
    try:
        distgrad.instrument(engine, exporter={"port": port})
    except RuntimeError as e:
        err = str(e)
    finally:
        ds_adapter.attach_deepspeed = real_attach
    rebound = None
    if rank == 0:
        again = socket.socket()
        try:
            again.bind(("127.0.0.1", port))
            rebound = True
        except OSError as e:
            rebound = f"{type(e).__name__}: {e}"
        finally:
            again.close()
    restored = engine._take_model_step == take_before
    unmarked = getattr(engine, "_distgrad_instrument", None) is None
    inst = distgrad.instrument(engine, exporter={"port": port})  # distgrad itself can serve there again
    out["attach_failure"] = {"error": err, "rebound": rebound, "port": port, "served": inst.port,
                             "restored": restored, "unmarked": unmarked}
    inst.close()

    # 4. a "distgrad" section inside the DeepSpeed config is picked up by instrument(engine)
    torch.manual_seed(0)
    model = TinyModel()
    cfg = ds_config(1, "fp32", 1)
    cfg["distgrad"] = {"sampling": {"interval": 3}, "exporter": {"enabled": False}, "spikes": {"window": 16}}
    engine, _ = build_deepspeed(model, config=cfg)
    inst = distgrad.instrument(engine)
    out["ds_section"] = {"interval": inst.config.sampling.interval, "spike_window": inst.config.spikes.window,
                         "prometheus": inst.config.exporter.enabled}
    inst.close()

    # 5. ranks configured differently (interval) would deadlock later: refused on every rank now
    try:
        distgrad.instrument(engine, exporter={"enabled": False}, sampling={"interval": 1 + rank}).close()
        out["disagree"] = None
    except RuntimeError as e:
        out["disagree"] = str(e)
    # 5b. enabled: false on rank 1 only: every rank raises (was: rank 0 hung in the agreement)
    msg = None
    try:
        distgrad.instrument(engine, exporter={"enabled": False}, enabled=rank == 0).close()
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
    msgs: list = [None] * world
    tdist.all_gather_object(msgs, msg)
    out["disabled_on_one_rank"] = msgs
    out["loss_attribution"] = loss_attribution_case(rank, tmp)
    out["loss_analysis"] = loss_analysis_case(rank)
    out["update_ratio"] = {f"z{st}-{dt}": update_ratio_case(st, dt, rank)
                           for st, dt in ((0, "fp32"), (1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16"))}
    return out


def main() -> None:
    args = driver_args(cases="all")
    rank, world = init_distributed(fp16=True)
    cases = []
    for stage in (0, 1, 2, 3):
        for dtype in ("fp32", "bf16", "fp16"):
            for gas in (1, 2):
                if dtype == "fp16" and gas == 2:
                    continue
                cases.append((stage, dtype, gas))
    if args.cases != "all":
        want = set(args.cases.split(","))
        cases = [c for c in cases if f"z{c[0]}-{c[1]}-gas{c[2]}" in want]
    results = {}
    for stage, dtype, gas in cases:
        key = f"z{stage}-{dtype}-gas{gas}"
        try:
            results[key] = run_case(stage, dtype, gas, steps=2, rank=rank, world=world)
        except Exception as e:  # noqa: BLE001 - reported per case by the pytest side
            import traceback

            results[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        if rank == 0:
            print(f"[ds_cases] {key}: {'error' if 'error' in results[key] else 'ok'}", flush=True)
    special = None
    if args.cases == "all":
        special = special_cases(rank, world, os.path.join(os.path.dirname(args.out), "flightrec"))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "cases": results, "special": special}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
