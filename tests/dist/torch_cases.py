"""Multi-rank driver for the PyTorch-native reference tests (run by tests/test_torch_reference.py
under ``torchrun --nproc_per_node 2``, gloo, CPU; every case in one launch).

Cases: DDP, FSDP1 (use_orig_params True/False x FULL_SHARD/SHARD_GRAD_OP; NO_SHARD in a few
cases), FSDP2, each fp32 and
bf16 (DDP: a bf16 model; FSDP1: ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)``; FSDP2:
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), gradient accumulation 1 and 2
(``no_sync()`` / ``set_requires_gradient_sync(False)`` on the first micro-batch; ``-sync``
variants accumulate with a reduction per micro-batch). Each trains TinyModel for two optimizer
steps with distgrad attached and records on rank 0:
  * distgrad's record of each step;
  * reference A: the full reduced gradient gathered in a step pre-hook registered *after*
    distgrad's (so it sees exactly what distgrad read): DDP ``p.grad``; FSDP1
    use_orig_params=True ``FSDP.summon_full_params(with_grads=True)``; FSDP1
    use_orig_params=False an all-gather of each FlatParameter's gradient shard split by
    ``_numels`` (not ``_shard_param_infos``, which distgrad uses); FSDP2 ``full_tensor()``;
    statistics in float64; on every rank, each gradient piece and each weight piece
    (``local_param_pieces``) must equal the full tensor at ``source.local_offsets()``;
  * the update-to-weight ratio (option ``update_ratio``, on in every case) against full
    weights gathered before and after the step;
  * reference B (step 0): a float64 copy of the model on one process over all ranks'
    micro-batches.
Plus: a DDP run whose rank 1 gradient is corrupted (replica check), GradScaler runs with an
injected overflow (non-fused without and with ``unscale_``, fused AdamW), the errors for a
plain module under 2 ranks, an optimizer built before FSDP wrapping and ``enabled: false`` on one
rank, and a NaN gradient and a NaN loss on steps that are not sampled (interval 2).
Writes JSON to the path given by --out.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardingStrategy

import distgrad
from distgrad import stats

from tests.dist.engines import adamw, blocks_and_frozen, build_ddp, build_fsdp1, build_fsdp2, sgd
from tests.dist.common import (run_cases, driver_args, ATTR_GAS, LA_GAS, LA_SOURCES, TinyLM, TinyModel, batch_for, full_stats, pieces_match,
                    loss_analysis_loop, loss_attribution_loop, reference_b)

ENGINES = ("ddp", "fsdp1-orig-full", "fsdp1-orig-sgo", "fsdp1-flat-full", "fsdp1-flat-sgo", "fsdp2")


def _strip(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _flat_gather(w, get) -> dict[str, torch.Tensor]:
    """Full per-parameter tensors of an FSDP1 use_orig_params=False model: all-gather each
    FlatParameter's local shard (``get(fp)``: its grad or data) and split by ``_numels``."""
    out = {}
    for pname, fp in w.named_parameters():
        if not fp.requires_grad:
            continue
        t = get(fp).detach()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        full = torch.cat(parts).double()[: sum(fp._numels)]
        prefix = _strip(pname[: -len("_flat_param")])
        for fqn, piece in zip(fp._fqns, full.split(list(fp._numels))):
            out[prefix + fqn] = piece.clone()
    return out


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().double().reshape(-1).clone()


def wrap(engine: str, model: TinyModel, dtype: str):
    """Returns (wrapped model, its AdamW (lr 1e-3), full-gradient gather, full-weight gather,
    no_sync factory); the gathers are collectives (every rank calls them) returning
    {name: float64 1-D tensor}."""
    bf16 = dtype == "bf16"
    if engine == "ddp":
        if bf16:
            model = model.to(torch.bfloat16)
        w, opt = build_ddp(model)
        trainable = [(n, p) for n, p in w.module.named_parameters() if p.requires_grad]
        return (w, opt, lambda: {n: _flat(p.grad) for n, p in trainable},
                lambda: {n: _flat(p) for n, p in trainable}, w.no_sync)
    if engine.startswith("fsdp1"):
        orig = "-orig-" in engine
        strategy = {"full": ShardingStrategy.FULL_SHARD, "sgo": ShardingStrategy.SHARD_GRAD_OP,
                    "noshard": ShardingStrategy.NO_SHARD}[engine.rsplit("-", 1)[1]]
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
        w, opt = build_fsdp1(model, wrap=blocks_and_frozen(model), orig_params=orig, sharding_strategy=strategy,
                             mixed_precision=mp)
        if orig:
            def summon(grads: bool):
                with FSDP.summon_full_params(w, with_grads=grads, writeback=False):
                    return {_strip(n): _flat(p.grad if grads else p)
                            for n, p in w.named_parameters() if p.requires_grad}
            return w, opt, lambda: summon(True), lambda: summon(False), w.no_sync
        return (w, opt, lambda: _flat_gather(w, lambda fp: fp.grad), lambda: _flat_gather(w, lambda fp: fp.data),
                w.no_sync)
    if engine == "fsdp2":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        model, opt = build_fsdp2(model, model.blocks, mp_policy=mp)

        @contextlib.contextmanager
        def no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return (model, opt, lambda: {n: _flat(None if p.grad is None else p.grad.full_tensor()) for n, p in trainable},
                lambda: {n: _flat(p.detach().full_tensor()) for n, p in trainable}, no_sync)
    raise ValueError(engine)


def fresh_model(dtype: str) -> tuple[TinyModel, nn.Module]:
    torch.manual_seed(1234)
    model = TinyModel()
    ref = copy.deepcopy(model).double()
    if dtype == "bf16":  # the engine computes with bf16-rounded weights; so does the reference
        ref.load_state_dict({k: v.bfloat16().double() for k, v in model.state_dict().items()})
    return model, ref


def run_case(engine: str, dtype: str, gas: int, sync: bool, rank: int, world: int, steps: int = 2,
             corrupt: bool = False) -> dict:
    model, ref_model = fresh_model(dtype)
    expected = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    w, opt, gather, gather_weights, no_sync = wrap(engine, model, dtype)
    if corrupt:  # registered before distgrad's hook: distgrad reads the corrupted copy on rank 1
        def corrupt_rank1(o, a, k):
            if rank == 1:
                with torch.no_grad():
                    w.module.inp.weight.grad.view(-1)[0] += 1.0
        opt.register_step_pre_hook(corrupt_rank1)
    inst = distgrad.instrument(w, optimizer=opt, exporter={"enabled": False}, statistics={"update_ratio": True})
    refs: list[dict] = []
    offset_mismatches: list[int] = []
    weights_before: list[dict] = []
    src = inst.source

    def capture(o, a, k):
        full, wfull = gather(), gather_weights()
        refs.append(full)
        weights_before.append(wfull)
        # every rank: its gradient and weight pieces are the full tensors at local_offsets()
        offs = src.local_offsets()
        bad = pieces_match(full, src.local_pieces(), offs, src.names)
        bad += pieces_match(wfull, src.local_param_pieces(), offs, src.names)
        t = torch.tensor([bad])
        dist.all_reduce(t)
        offset_mismatches.append(int(t))
    opt.register_step_pre_hook(capture)
    ref_ratio: list[dict] = []
    records = []
    for step in range(steps):
        for micro in range(gas):
            ctx = no_sync() if (micro < gas - 1 and not sync) else contextlib.nullcontext()
            x, y = batch_for(step, micro, rank)
            if engine == "ddp" and dtype == "bf16":
                x = x.bfloat16()
            with ctx:
                loss = w(x, y)
                (loss / gas).backward()
        opt.step()
        after = gather_weights()
        ref_ratio.append({n: ((after[n] - b).norm() / b.norm()).item() for n, b in weights_before[-1].items()})
        opt.zero_grad(set_to_none=True)
        records.append(inst.last_record.to_dict() if inst.last_record else None)
    ref_b, ref_loss = reference_b(ref_model, gas, world)
    out = {
        "records": records,
        "ref_full": [full_stats(r) for r in refs],
        "ref_fp64_step0": ref_b,
        "ref_loss_step0": ref_loss,
        "expected_names": expected,
        "frozen": frozen,
        "counters": dict(inst.counters),
        "engine_name": inst.source.engine_name,
        "grad_dtype": str(inst.source.grad_dtype),
        "compute_dtype": str(inst.source.compute_dtype),
        "replicated": bool(inst.source.replicated),
        "offset_mismatches": offset_mismatches,
        "ref_update_ratio": ref_ratio,
    }
    inst.close()
    return out


def run_scaler_case(mode: str, rank: int, world: int, steps: int = 3, overflow_step: int = 1) -> dict:
    """DDP fp32, GradScaler(init_scale=1024), an Inf injected into every rank's gradient after
    the backward of ``overflow_step``. ``mode``: "plain" (scaler.step unscales), "unscale"
    (the loop calls scaler.unscale_ first), "fused" (AdamW(fused=True): the optimizer unscales)."""
    model, _ = fresh_model("fp32")
    w, opt = build_ddp(model, optim=adamw(1e-3, fused=(mode == "fused")))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    inst = distgrad.instrument(w, optimizer=opt, scaler=scaler, exporter={"enabled": False})

    def grads():
        return {n: p.grad.detach().double().reshape(-1).clone() if p.grad is not None else None
                for n, p in w.module.named_parameters() if p.requires_grad}

    seen: dict[int, dict] = {}
    cur = {"step": 0}

    def after_distgrad(o, a, k):
        gs = getattr(o, "grad_scale", None)
        seen[cur["step"]] = {"stats": full_stats(grads()), "opt_grad_scale": None if gs is None else float(gs)}
    opt.register_step_pre_hook(after_distgrad)
    out_steps = []
    for step in range(steps):
        cur["step"] = step
        x, y = batch_for(step, 0, rank)
        loss = w(x, y)
        scaler.scale(loss).backward()
        if step == overflow_step:
            with torch.no_grad():
                w.module.inp.weight.grad.view(-1)[3] = float("inf")
        raw = full_stats(grads())  # scaled by the loss scale
        scale = float(scaler.get_scale())
        if mode == "unscale":
            scaler.unscale_(opt)
        scaler.step(opt)
        after = full_stats(grads())
        scaler.update()
        opt.zero_grad(set_to_none=True)
        rec = inst.last_record
        out_steps.append({
            "record": rec.to_dict() if rec is not None and rec.step == step else None,
            "raw_before_step": raw, "after_step": after, "scale": scale,
            "prehook": seen.get(step),
        })
    out = {"steps": out_steps, "counters": dict(inst.counters), "overflow_step": overflow_step,
           "expected_names": [n for n, p in TinyModel().named_parameters() if p.requires_grad]}
    inst.close()
    assert scaler.step.__func__ is torch.amp.GradScaler.step, "scaler.step not restored by close()"
    return out


def run_errors(rank: int) -> dict:
    """Messages of instrument() errors that need torch.distributed with 2 ranks."""
    out = {}
    try:
        m = TinyModel()
        distgrad.instrument(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), exporter={"enabled": False})
        out["plain_module_2_ranks"] = None
    except Exception as e:  # noqa: BLE001
        out["plain_module_2_ranks"] = f"{type(e).__name__}: {e}"
    try:
        torch.manual_seed(0)
        m = TinyModel()
        early = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        w, _ = build_fsdp1(m, wrap=lambda x: x is m.frozen, orig_params=False, optim=None)
        distgrad.instrument(w, optimizer=early, exporter={"enabled": False})
        out["optimizer_before_wrap"] = None
    except Exception as e:  # noqa: BLE001
        out["optimizer_before_wrap"] = f"{type(e).__name__}: {e}"
    # enabled: false on rank 1 only: every rank raises (was: a gloo abort), both messages kept
    msg = None
    try:
        m, opt = build_ddp(TinyModel(), optim=sgd(0.1))
        distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, enabled=rank == 0).close()
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
    msgs: list = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, msg)
    out["disabled_on_one_rank"] = msgs
    return out


def run_unsampled_nonfinite(rank: int, world: int) -> dict:
    """DDP fp32, interval 2, steps 0..4: a NaN put into rank 1's local gradient of one element
    on unsampled step 1 (before DDP's all-reduce, so every replica gets it; wiped by a pre-hook
    after distgrad's before SGD applies it) and a NaN loss observed on rank 0 on unsampled step 3.
    Reference: the steps injected. Also counts the collectives made inside ``optimizer.step`` per
    step (2 on sampled steps, 0 on the others)."""
    torch.manual_seed(0)
    w, opt = build_ddp(TinyModel(), optim=sgd(0.01))
    state = {"step": 0, "count": False, "collectives": 0}

    def inject(g):
        if state["step"] == 1 and rank == 1:
            g = g.clone()
            g.view(-1)[4] = float("nan")
        return g

    w.module.inp.weight.register_hook(inject)  # runs before DDP reduces the gradient
    inst = distgrad.instrument(w, optimizer=opt, exporter={"enabled": False}, sampling={"interval": 2})

    def wipe(o, a, k):  # after distgrad's: the NaN never reaches the weights
        for p in w.parameters():
            if p.grad is not None:
                p.grad.nan_to_num_(nan=0.0)

    opt.register_step_pre_hook(wipe)
    originals = {fn: getattr(dist, fn) for fn in ("all_reduce", "all_gather_into_tensor", "broadcast")}

    def counting(fn):
        def call(*a, **kw):
            if state["count"]:
                state["collectives"] += 1
            return originals[fn](*a, **kw)
        return call

    for fn in originals:
        setattr(dist, fn, counting(fn))
    reported, per_step = {}, []
    inst.add_hook(lambda r: reported.__setitem__(r.step, r.unsampled_nonfinite and r.unsampled_nonfinite.to_dict()))
    try:
        for step in range(5):
            state["step"] = step
            x, y = batch_for(step, 0, rank)
            loss = w(x, y)
            loss.backward()
            inst.observe_loss(torch.tensor(float("nan")) if (step == 3 and rank == 0) else loss)
            state["count"], state["collectives"] = True, 0
            opt.step()
            state["count"] = False
            per_step.append(state["collectives"])
            opt.zero_grad()
    finally:
        for fn, f in originals.items():
            setattr(dist, fn, f)
    out = {"reported": {str(k): v for k, v in reported.items()}, "counters": dict(inst.counters),
           "collectives_per_step": per_step}
    inst.close()
    return out


def run_refused(rank: int, world: int) -> dict:
    """DDP fp32, steps 0..4, every step sampled; what each rank does before ``opt.step()``:
    step 0 and 4 backward (exported); step 1 rank 1 alone clips its gradients before distgrad
    reads them ("clipped" on rank 1 only: rank 0 must learn the reason from rank 1's flag);
    step 2 no backward on either rank ("no_backward"); step 3 ``opt.step(closure)`` on both
    ("closure"; on one rank only the closure's DDP all-reduce would come after the other rank's
    distgrad collectives: not a loop that can run). Reference: the script itself."""
    torch.manual_seed(0)
    w, opt = build_ddp(TinyModel(), optim=sgd(0.01))
    inst = distgrad.instrument(w, optimizer=opt, exporter={"enabled": False})
    exported: list[int] = []
    inst.add_hook(lambda r: exported.append(r.step))

    def backward(step: int):
        loss = w(*batch_for(step, 0, rank))
        loss.backward()
        return loss

    for step in range(5):
        if step == 2:
            opt.step()  # the gradients of step 1 again
            continue
        opt.zero_grad()
        if step == 3:
            opt.step(lambda: backward(step))
            continue
        backward(step)
        if (step, rank) == (1, 1):
            torch.nn.utils.clip_grad_norm_(w.parameters(), 1e-3)
        opt.step()
    out = {"exported": exported, "refused_steps": dict(inst.refused_steps),
           "local_refusals": dict(inst.boundary.refusals.counts), "counters": dict(inst.counters)}
    inst.close()
    everything: list = [None] * world
    dist.all_gather_object(everything, out)
    return {"ranks": everything}


def run_loss_attribution(rank: int, tmp: str) -> dict:
    """FSDP2 fp32, 2 micro-batches per step (no gradient sync on the first): per-rank loss
    attribution and the straggler with the data time reported by the loop
    (``observe_data_time``), sample indices passed with ``observe_loss(loss, samples=)``; see
    common.loss_attribution_loop."""
    model, _ = fresh_model("fp32")
    w, opt, _, _, no_sync = wrap("fsdp2", model, "fp32")
    inst = distgrad.instrument(w, optimizer=opt, exporter={"enabled": False}, **{"flight_recorder.dir": tmp, "spikes.ema_warmup": 3,
                                   "spikes.ema_z": 10.0})
    ctx: dict = {}

    def forward(x, y, micro):
        ctx["cm"] = no_sync() if micro < ATTR_GAS - 1 else contextlib.nullcontext()
        ctx["cm"].__enter__()
        return w(x, y)

    def backward(loss, micro):
        (loss / ATTR_GAS).backward()
        ctx["cm"].__exit__(None, None, None)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = loss_attribution_loop(inst, rank, forward, backward, step, report_data=True, explicit_samples=True)
    out["dir"] = tmp
    inst.close()
    return out


def run_loss_analysis(rank: int) -> dict:
    """FSDP2 fp32 TinyLM, 2 micro-batches per step (no gradient sync on the first): loss
    components, per-token losses from ``logits=`` / ``labels=`` with per-sequence sources, and
    the trend. See common.loss_analysis_loop."""
    torch.manual_seed(11)
    model, opt = build_fsdp2(TinyLM(), optim=adamw(1e-2))
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, loss={"sources": LA_SOURCES})

    def forward(tokens, micro):
        model.set_requires_gradient_sync(micro == LA_GAS - 1)
        return model(tokens)

    def backward(loss, micro):
        (loss / LA_GAS).backward()

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = loss_analysis_loop(inst, rank, forward, backward, step, use_logits=True)
    inst.close()
    return out


def all_cases() -> list[tuple[str, str, str, int, bool]]:
    cases = []
    for engine in ENGINES:
        for dtype in ("fp32", "bf16"):
            for gas in (1, 2):
                cases.append((f"{engine}-{dtype}-gas{gas}", engine, dtype, gas, False))
    for engine in ("ddp", "fsdp1-flat-full", "fsdp2"):
        cases.append((f"{engine}-fp32-gas2-sync", engine, "fp32", 2, True))
    # replicated FSDP1. Not bf16 with gas 2: torch 2.13 FSDP1 NO_SHARD + use_orig_params=True +
    # MixedPrecision fails in the forward after a no_sync() backward when a weight is tied
    # (FlatParamHandle._use_sharded_grad_views assigns the bf16 grad of the shared parameter;
    # reproduced without distgrad)
    for engine in ("fsdp1-orig-noshard", "fsdp1-flat-noshard"):
        for dtype, gas in (("fp32", 2), ("bf16", 1)):
            cases.append((f"{engine}-{dtype}-gas{gas}", engine, dtype, gas, False))
    return cases


def main() -> None:
    args = driver_args(cases="all")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    jobs = [(key, functools.partial(run_case, engine, dtype, gas, sync)) for key, engine, dtype, gas, sync in all_cases()]
    jobs.append(("ddp-fp32-gas1-corrupt", functools.partial(run_case, "ddp", "fp32", 1, False, corrupt=True)))
    for mode in ("plain", "unscale", "fused"):
        jobs.append((f"scaler-{mode}", functools.partial(run_scaler_case, mode)))
    tmp = os.path.join(os.path.dirname(args.out), "flightrec")
    jobs += [("errors", lambda r, w: run_errors(r)),
             ("unsampled-nonfinite", run_unsampled_nonfinite),
             ("refused", run_refused),
             ("loss-analysis-fsdp2", lambda r, w: run_loss_analysis(r)),
             ("loss-attribution-fsdp2", lambda r, w: run_loss_attribution(r, tmp))]
    # which statistics kernel computed the pieces (DISTGRAD_STATS_KERNEL forces one)
    run_cases(jobs, args.cases, args.out, rank, world, "torch_cases", gather=False,
              extra=lambda: {"stats_kernel_use": stats.kernel_use()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
