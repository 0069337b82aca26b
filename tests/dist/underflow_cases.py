"""Multi-rank driver of the underflow signal (tests/test_underflow_multirank.py) under ``torchrun
--nproc_per_node 2``, gloo, CPU: cases ``ddp`` (DDP, fp16 autocast, no loss scaling, the loop
dividing the loss by GAS: ``underflow.loss_factor``), ``z2`` (DeepSpeed ZeRO-2 fp16: fp16
parameters, dynamic loss scale, DeepSpeed's own division by GAS), ``fsdp2`` (``fully_shard``
on each block and the root, ``MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp32)``, no
loss scaling, the loop dividing by GAS; an odd vocabulary (65 rows) so the embedding and the
output head are sharded unevenly; FSDP2_STEPS steps with ``underflow.interval: 2``, so steps 1
and 3 are sampled steps that do not recompute; rank 1 alone clips before step FSDP2_CLIPPED's
boundary), ``fsdp2_autocast`` (the same sharding with float32 parameters and fp16 autocast in
the loop, STEPS steps, every step recomputed) and ``z3`` (DeepSpeed ZeRO-3 fp16, odd sizes so
every partition is padded, Z3_STEPS steps, ``underflow.interval: 2``).

The model is tests/underflow_models.py's tiny decoder, GAS micro-batches per rank and step (each
rank its own data), STEPS steps, every step recomputed (``underflow.interval: 1``) under ddp and z2. Before each
step's first micro-batch each rank computes its reference another way: a copy of the model
(a fresh decoder holding the weights of that forward) runs the micro-batch through ``.backward()`` in the training
precision (autocast / fp16 weights, the same loss factor and loss scale), and a float64 copy
runs it with autocast off; per layer ``[lost, float64 zeros, elements]``. Under FSDP2 that copy
is a plain decoder built from the parameters' ``full_tensor()`` (taken outside the boundary),
cast to fp16 whole for the training precision (FSDP2's ``param_dtype``); under ZeRO-3 one built
inside ``deepspeed.zero.GatheredParameters``. Rank 0 writes its
records (``StepRecord.underflow``) and the boundary's collective / host-sync counts.
"""

from __future__ import annotations

import collections

import torch

import distgrad
from distgrad.naming.grouping import group_keys
from tests.dist.common import BoundaryCounter, driver_args, optimizer_step, run_cases
from tests.dist.engines import build_ddp, build_deepspeed, init_distributed
from tests.underflow_models import Decoder, clone

GAS, STEPS, B, T = 2, 2, 4, 16
#: the FSDP2 and ZeRO-3 cases: steps and underflow.interval (recomputes on steps 0, 2 and 4, not on
#: 1 and 3); on FSDP2's step FSDP2_CLIPPED rank 1 alone clips its gradients (clip_grad_value_, no
#: collective) before the boundary: it refuses the step, rank 0 does not, and both must still make
#: the recomputation step's all-gather (PackedSignal.exchange) so their collectives stay aligned
FSDP2_STEPS, FSDP2_INTERVAL, FSDP2_CLIPPED, Z3_STEPS = 5, 2, 4, 3


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7_000 * step + 70 * micro + rank)
    return torch.randint(0, 48, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)


def reference(model, ids, labels, factor: float, scale: float, autocast: bool, low_dtype=None) -> dict:
    low = clone(model) if low_dtype is None else clone(model).to(low_dtype)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = low(ids, labels)
    (loss * factor * scale).backward()
    m64 = clone(model).double()
    with torch.autocast("cpu", enabled=False):
        (m64(ids, labels) * factor).backward()
    names = [n for n, _ in m64.named_parameters()]
    rows: dict = collections.defaultdict(lambda: [0, 0, 0])
    for key, p, q in zip(group_keys(names, "layer"), low.parameters(), m64.parameters()):
        r = rows[key]
        r[0] += int(((p.grad == 0) & (q.grad != 0)).sum())
        r[1] += int((q.grad == 0).sum())
        r[2] += p.numel()
    return dict(rows)


def full_decoder(model) -> Decoder:
    """A plain float32 decoder holding an FSDP2 decoder's full parameters (``full_tensor()``: a
    collective, every rank calls it)."""
    plain = Decoder(len(model.embed.weight), model.embed.weight.shape[1], len(model.layers),
                    loss_weight=model.loss_weight)
    plain.load_state_dict({n: p.full_tensor().detach() for n, p in model.named_parameters()})
    return plain


def autocast_backward(module, ids: torch.Tensor, labels: torch.Tensor) -> None:
    """One micro-batch of the loops with fp16 autocast (ddp, fsdp2_autocast): the forward
    ``module(ids, labels)`` (the loss) inside autocast, then ``(loss / GAS).backward()`` outside
    it (the loop's own division by GAS)."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = module(ids, labels)
    (loss / GAS).backward()


def deepspeed_fp16(model, stage: int, cfg: dict):
    """``model`` under DeepSpeed ZeRO-``stage`` fp16 (dynamic loss scale, GAS micro-batches of B,
    lr 0.1), instrumented with ``cfg``. Returns ``(engine, inst, fwd_bwd, step, scale)``:
    ``fwd_bwd(ids, labels, micro)`` runs a micro-batch (``engine.step()`` inside the accumulation),
    ``step()`` the boundary's ``engine.step()``, ``scale()`` DeepSpeed's loss scale (float)."""
    engine, _ = build_deepspeed(model, stage, "fp16", GAS, micro_batch=B, lr=0.1)
    inst = distgrad.instrument(engine, cfg)

    def fwd_bwd(ids, labels, micro):
        engine.backward(engine(ids, labels))
        if micro < GAS - 1:
            engine.step()

    def step():
        engine.step()
    return engine, inst, fwd_bwd, step, lambda: float(inst.source.loss_scale())


def run(key: str, rank: int, world: int) -> dict:
    torch.manual_seed(5)
    steps, low_dtype = STEPS, None
    cfg = {"exporter": {"enabled": False}, "statistics": {"async_records": "off"},
           "underflow": {"enabled": True, "interval": 1, "loss_factor": 1.0 if key in ("z2", "z3") else 1.0 / GAS}}
    if key == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from tests.dist.engines import build_fsdp2

        steps, low_dtype = FSDP2_STEPS, torch.float16
        cfg["underflow"]["interval"] = FSDP2_INTERVAL
        model = Decoder(vocab=65, loss_weight=1e-5)
        full_bytes = 4 * sum(p.numel() for p in model.parameters())  # before sharding: the plain model's
        model, opt = build_fsdp2(model, list(model.layers), optim=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                 mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
        try:  # one byte below the full float32 model: refused at instrument()
            distgrad.instrument(model, {**cfg, "underflow": {**cfg["underflow"], "max_gather_bytes": full_bytes - 1}},
                                optimizer=opt).close()
            refused = None
        except distgrad.ConfigError as e:
            refused = str(e)
        cfg["underflow"]["max_gather_bytes"] = full_bytes  # exactly the full model: accepted
        hsdp = None
        try:  # HSDP (a 2-D (replicate, shard) mesh): placements the gather does not serve, refused
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
            other, other_opt = build_fsdp2(Decoder(), optim=lambda ps: torch.optim.SGD(ps, lr=0.1), mesh=mesh)
            distgrad.instrument(other, cfg, optimizer=other_opt).close()
        except distgrad.ConfigError as e:
            hsdp = str(e)
        inst = distgrad.instrument(model, cfg, optimizer=opt)

        def fwd_bwd(ids, labels, micro):
            (model(ids, labels) / GAS).backward()

        step = optimizer_step(opt)
        inner, factor, autocast = None, 1.0 / GAS, False
        scale = lambda: 1.0  # noqa: E731
    elif key == "fsdp2_autocast":  # float32 parameters (no MixedPrecisionPolicy), fp16 autocast in the loop
        from tests.dist.engines import build_fsdp2

        model = Decoder(vocab=65, loss_weight=1e-5)
        model, opt = build_fsdp2(model, list(model.layers), optim=lambda ps: torch.optim.SGD(ps, lr=0.1))
        inst = distgrad.instrument(model, cfg, optimizer=opt)

        def fwd_bwd(ids, labels, micro):
            autocast_backward(model, ids, labels)

        step = optimizer_step(opt)
        inner, factor, autocast = None, 1.0 / GAS, True
        scale = lambda: 1.0  # noqa: E731
    elif key == "z3":
        import deepspeed

        steps = Z3_STEPS
        cfg["underflow"]["interval"] = FSDP2_INTERVAL
        model = Decoder(vocab=65, d=33, loss_weight=1e-5)  # odd sizes: padded partitions
        engine, inst, fwd_bwd, step, scale = deepspeed_fp16(model, 3, cfg)

        def gathered():  # the fp16 weights of the forward, gathered by DeepSpeed (a collective: every rank)
            plain = Decoder(65, 33, 2, loss_weight=model.loss_weight).half()
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                plain.load_state_dict({n: p.detach().clone() for n, p in engine.module.named_parameters()})
            return plain
        inner, factor, autocast = None, 1.0 / GAS, False
    elif key == "ddp":
        model = Decoder(loss_weight=1e-5)
        w, opt = build_ddp(model, optim=lambda ps: torch.optim.SGD(ps, lr=0.1))
        inst = distgrad.instrument(w, cfg, optimizer=opt)

        def fwd_bwd(ids, labels, micro):
            with w.no_sync() if micro < GAS - 1 else torch.enable_grad():
                autocast_backward(w, ids, labels)

        step = optimizer_step(opt)
        inner, factor, autocast = model, 1.0 / GAS, True
        scale = lambda: 1.0  # noqa: E731
    else:
        model = Decoder(loss_weight=1e-3)
        engine, inst, fwd_bwd, step, scale = deepspeed_fp16(model, 2, cfg)
        inner, factor, autocast = engine.module, 1.0 / GAS, False
    counter = BoundaryCounter(inst)
    records, refs = [], []
    for s in range(steps):
        for micro in range(GAS):
            ids, labels = batch(s, micro, rank)
            if micro == 0:
                base = inner if inner is not None else gathered() if key == "z3" else full_decoder(model)
                refs.append(reference(base, ids, labels, factor, scale(), autocast, low_dtype))
            fwd_bwd(ids, labels, micro)
        if key == "fsdp2" and s == FSDP2_CLIPPED and rank == 1:
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e9)  # changes nothing, but read as clipped
        counter.around(step)
        rec = inst.last_record
        records.append(rec.underflow.to_dict() if rec is not None and rec.underflow is not None else None)
    counter.restore()
    inst.close()
    out = {"records": records, "refs": refs, "counts": counter.counts,
           "internal_errors": inst.counters["internal_errors"]}
    if key == "fsdp2":
        sig = next(x for x in inst.signals.signals if x.name == "underflow")
        out.update(refused=refused, full_bytes=full_bytes, hsdp_refused=hsdp, refused_steps=dict(inst.refused_steps),
                   copy_dropped=sig._full is None)
    return out


def main() -> None:
    args = driver_args(cases="all")
    rank, world = init_distributed(fp16=True)
    run_cases([(k, lambda r, w, k=k: run(k, r, w)) for k in ("ddp", "z2", "fsdp2", "fsdp2_autocast", "z3")],
              args.cases, args.out, rank, world, "underflow")


if __name__ == "__main__":
    main()
