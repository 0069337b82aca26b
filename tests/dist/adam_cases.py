"""Multi-rank driver of the optimizer-aware signals (run by tests/test_optimizer_signals_multirank.py
under ``torchrun --nproc_per_node 2``, one launch): DeepSpeed ZeRO-2, ZeRO-3, FSDP2, FSDP1
(``use_orig_params=True``; ``False`` must be refused) and DDP, each with
AdamW, train 4 optimizer steps of TinyModel with distgrad attached (default configuration: the
signals are on for AdamW). Before distgrad reads each step, every rank gathers (test only,
collectives outside distgrad's boundary) the full reduced gradient and the full optimizer state
``exp_avg`` / ``exp_avg_sq`` (DeepSpeed ``safe_get_full_grad`` / ``safe_get_full_optimizer_state``,
FSDP2 ``full_tensor()``, FSDP1 ``summon_full_params``, its moments rebuilt from the gradient history); rank 0 writes them with distgrad's records, the collectives and host
syncs distgrad made per step, and the optimizer's hyperparameters, as JSON to --out."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

import distgrad
from distgrad.naming.canonical import clean_name

from tests.dist.engines import (adamw, blocks_and_frozen, build_ddp, build_deepspeed, build_fsdp1, build_fsdp2,
                                init_distributed)
from tests.dist.common import driver_args, TinyModel, batch_for, counted_steps

STEPS = 4
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.01
ADAMW = adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD)


def _full(t) -> list | None:
    return None if t is None else t.detach().double().cpu().reshape(-1).tolist()


def _torch_steps(inst, model, opt) -> tuple[list, list]:
    """STEPS steps of ``model`` (batch_for(step, 0, rank)) and ``opt``: see common.counted_steps."""
    def step():
        opt.step()
        opt.zero_grad()
    return counted_steps(inst, STEPS, lambda s: model(*batch_for(s, 0, dist.get_rank())).backward(), step)


def deepspeed_case(stage: int) -> dict:
    from deepspeed.utils import safe_get_full_grad, safe_get_full_optimizer_state

    torch.manual_seed(1234)
    model = TinyModel()
    engine, _ = build_deepspeed(model, stage, lr=LR,
                                adamw_params={"betas": list(BETAS), "eps": EPS, "weight_decay": WD})
    inst = distgrad.instrument(engine, exporter={"enabled": False}, optimizer_signals={"every": 1})
    named = [(clean_name(n), p) for n, p in engine.module.named_parameters() if p.requires_grad]
    assert [n for n, _ in named] == inst.names
    refs: list[dict] = []
    inner = engine._take_model_step

    def capture(*a, **kw):
        ref = {"step": int(engine.global_steps), "grad": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for n, p in named:
            ref["grad"][n] = _full(safe_get_full_grad(p))
            if engine.global_steps > 0:  # no state before the first step
                ref["exp_avg"][n] = _full(safe_get_full_optimizer_state(p, "exp_avg"))
                ref["exp_avg_sq"][n] = _full(safe_get_full_optimizer_state(p, "exp_avg_sq"))
        refs.append(ref)
        return inner(*a, **kw)

    engine._take_model_step = capture
    records, counts = counted_steps(inst, STEPS, lambda s: engine.backward(engine(*batch_for(s, 0, dist.get_rank()))),
                                    engine.step)
    out = {"records": records, "refs": refs, "counts": counts, "counters": dict(inst.counters),
           "optimizer": type(engine.optimizer.optimizer).__name__,
           "clip": float(engine.gradient_clipping() or 0.0) or None}  # DeepSpeed's default is 1.0
    inst.close()
    return out


def fsdp2_case() -> dict:
    torch.manual_seed(1234)
    model = TinyModel()
    model, opt = build_fsdp2(model, model.blocks, optim=ADAMW)
    named = [(clean_name(n, strip_module=False), p) for n, p in model.named_parameters() if p.requires_grad]
    refs: list[dict] = []
    state = {"step": 0}

    def capture(o, args, kwargs):  # registered before distgrad's pre-hook: runs first
        ref = {"step": state["step"], "grad": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for n, p in named:
            ref["grad"][n] = _full(p.grad.full_tensor() if p.grad is not None else None)
            s = o.state.get(p, {})
            if s:
                ref["exp_avg"][n] = _full(s["exp_avg"].full_tensor())
                ref["exp_avg_sq"][n] = _full(s["exp_avg_sq"].full_tensor())
        refs.append(ref)
        state["step"] += 1

    opt.register_step_pre_hook(capture)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, optimizer_signals={"every": 1})
    assert [n for n, _ in named] == inst.names
    records, counts = _torch_steps(inst, model, opt)
    out = {"records": records, "refs": refs, "counts": counts, "counters": dict(inst.counters),
           "optimizer": type(opt).__name__}
    inst.close()
    return out


def fsdp1_case() -> dict:
    """FSDP1, use_orig_params=True, FULL_SHARD, one unit per block: reference gradient from
    ``summon_full_params(with_grads=True)``; the full moments are rebuilt by the test from the
    gradient history (AdamW, no clipping): ``FSDP.optim_state_dict``'s ``exp_avg`` was measured
    not to be the optimizer's (its ``exp_avg_sq`` was) on torch 2.13 CPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(1234)
    model = TinyModel()
    w, opt = build_fsdp1(model, wrap=blocks_and_frozen(model), optim=ADAMW)
    refs: list[dict] = []
    state = {"step": 0}

    def capture(o, args, kwargs):  # before distgrad's pre-hook (registered first)
        ref = {"step": state["step"], "grad": {}, "exp_avg": {}, "exp_avg_sq": {}}
        with FSDP.summon_full_params(w, with_grads=True, writeback=False):
            for n, p in w.named_parameters():
                if p.requires_grad:
                    ref["grad"][clean_name(n, strip_module=False)] = _full(p.grad)
        refs.append(ref)
        state["step"] += 1

    opt.register_step_pre_hook(capture)
    inst = distgrad.instrument(w, optimizer=opt, exporter={"enabled": False}, optimizer_signals={"every": 1})
    records, counts = _torch_steps(inst, w, opt)
    out = {"records": records, "refs": refs, "counts": counts, "counters": dict(inst.counters),
           "optimizer": type(opt).__name__, "names": list(inst.names)}
    inst.close()
    # use_orig_params=False: the FlatParameter's state is not located: refused at instrument()
    torch.manual_seed(1234)
    m2 = TinyModel()
    flat, flat_opt = build_fsdp1(m2, wrap=lambda m: m is m2.frozen, orig_params=False, optim=adamw())
    try:
        distgrad.instrument(flat, optimizer=flat_opt, exporter={"enabled": False}, optimizer_signals={"enabled": "on"}).close()
        out["flat_refused"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["flat_refused"] = f"{type(e).__name__}: {e}"
    return out


def ddp_case() -> dict:
    """DDP: every rank holds the full state; each counts its 1/W share (``inst.own``)."""
    torch.manual_seed(1234)
    w, opt = build_ddp(TinyModel(), optim=ADAMW)
    named = [(clean_name(n, strip_module=False), p) for n, p in w.module.named_parameters() if p.requires_grad]
    refs: list[dict] = []
    state = {"step": 0}

    def capture(o, args, kwargs):
        ref = {"step": state["step"], "grad": {n: _full(p.grad) for n, p in named}, "exp_avg": {}, "exp_avg_sq": {}}
        for n, p in named:
            if o.state.get(p):
                ref["exp_avg"][n] = _full(o.state[p]["exp_avg"])
                ref["exp_avg_sq"][n] = _full(o.state[p]["exp_avg_sq"])
        refs.append(ref)
        state["step"] += 1

    opt.register_step_pre_hook(capture)
    inst = distgrad.instrument(w, optimizer=opt, exporter={"enabled": False}, optimizer_signals={"every": 1})
    records, counts = _torch_steps(inst, w, opt)
    out = {"records": records, "refs": refs, "counts": counts, "counters": dict(inst.counters),
           "optimizer": type(opt).__name__}
    inst.close()
    return out


def main() -> None:
    args = driver_args()
    init_distributed()
    from distgrad.signals import adam_native

    assert adam_native.native() is not None  # built and self-checked before counting its pieces
    native_pieces: list[int] = []
    real_run = adam_native.run
    adam_native.run = lambda fn, pieces, prm: native_pieces.append(len(pieces)) or real_run(fn, pieces, prm)
    cases = {}
    for name, case in (("zero2", lambda: deepspeed_case(2)), ("zero3", lambda: deepspeed_case(3)),
                       ("fsdp2", fsdp2_case), ("fsdp1", fsdp1_case), ("ddp", ddp_case)):
        native_pieces.clear()
        cases[name] = case()
        cases[name]["native_pieces"] = sum(native_pieces)  # pieces the native CPU kernel computed
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"cases": cases, "betas": BETAS, "eps": EPS, "world": dist.get_world_size()}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
