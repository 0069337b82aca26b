"""Multi-rank driver for the parallelism-layout tests (tests/test_layouts.py) under
``torchrun --nproc_per_node 4``, gloo, CPU: a 2 x 2 device mesh. ``--group`` picks the cases of
one launch:

* ``hsdp``: TinyModel under FSDP1 ``HYBRID_SHARD`` (use_orig_params True and False) and
  ``_HYBRID_SHARD_ZERO2``, and FSDP2 ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh;
* ``tp``: :class:`TPModel` under FSDP2 + tensor parallelism on a ``(dp, tp)`` mesh
  (``ColwiseParallel`` / ``RowwiseParallel`` MLP, ``SequenceParallel`` LayerNorm; the input and
  head layers are not tensor-parallel, so they are implicit replicas over ``tp``).

Every case trains two optimizer steps with distgrad attached and records (rank 0 writes JSON):
  * distgrad's record of each step;
  * reference A: the full reduced gradient gathered in a step pre-hook registered *after*
    distgrad's (FSDP2 ``full_tensor()``; FSDP1 use_orig_params=True
    ``summon_full_params(with_grads=True)``; FSDP1 use_orig_params=False an all-gather of each
    FlatParameter's gradient shard over the shard group, split by ``_numels``), float64
    statistics;
  * reference B (step 0): a float64 copy of the model on one process over the batches of every
    data-parallel rank;
  * the collectives (``torch.distributed`` calls) and host syncs made inside distgrad's
    ``Instrument.collect`` / ``finish`` on each step;
  * for HSDP layouts: whether each rank's gradient piece is the full gradient at
    ``source.local_offsets()``.
Variants: ``-corrupt`` (one rank changes one element of a replicated piece before distgrad
reads it: the replica check must name it), ``-double`` (the mutation: ``inst.own`` patched to
count every replica, which the reference comparison must reject), ``-nan`` (a NaN put into one
rank's tensor-parallel shard: the provenance must name the parameter and the global rank).
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

import distgrad
from distgrad import stats
from distgrad.engines.base import Ownership

from tests.dist.engines import adamw, blocks_and_frozen, build_ddp, build_fsdp1, build_fsdp2, sgd
from tests.dist.common import driver_args, run_cases, HostSyncs, TinyModel, batch_for, full_stats, pieces_match, reference_b

CPU = torch.device("cpu")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast",
               "reduce_scatter_tensor", "all_gather_object", "all_to_all_single", "reduce")


class TPModel(nn.Module):
    """inp -> LayerNorm (sequence parallel) -> up (column parallel) -> GELU -> down (row
    parallel) -> residual -> head; cross-entropy over every position. Input x float [B, S=4, 5],
    target y [B, 4] in [0, 3). Odd sizes (7 hidden, 10 inner) give uneven shards. Under tensor
    parallelism (``tp_mesh`` set) the LayerNorm gets the replicated activation as a
    ``Replicate`` DTensor, which ``SequenceParallel`` redistributes to ``Shard(1)`` (backward:
    the all-gather that makes the gradient of ``inp`` whole on every TP rank); the math is the
    plain model's."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.up = nn.Linear(7, 10)
        self.down = nn.Linear(10, 7)
        self.head = nn.Linear(7, 3, bias=False)
        self.tp_mesh = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.tp_mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate

            z = self.norm(DTensor.from_local(h, self.tp_mesh, [Replicate()], run_check=False))
        else:
            z = self.norm(h)
        z = self.down(F.gelu(self.up(z)))
        logits = self.head(h + z)
        return F.cross_entropy(logits.float().reshape(-1, 3), y.reshape(-1))


def tp_batch(step: int, micro: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20_000 * step + 100 * micro + dp_rank)
    return torch.randn(2, 4, 5, generator=g) * 2.0, torch.randint(0, 3, (2, 4), generator=g)


class PPModel(nn.Module):
    """inp -> blocks.0 -> blocks.1 -> head (residual MLP blocks with a LayerNorm), logits over 13
    classes; input x float [B, 7]. Split into 2 pipeline stages torchtitan's way: a copy of the
    whole model with the modules of the other stage set to None, so each stage keeps the user's
    parameter names (stage 0: inp, blocks.0; stage 1: blocks.1, head)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.blocks = nn.ModuleDict({str(i): nn.Sequential(nn.LayerNorm(5), nn.Linear(5, 9), nn.GELU(),
                                                            nn.Linear(9, 5)) for i in range(2)})
        self.head = nn.Linear(5, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for b in self.blocks.values():
            x = x + b(x)
        return self.head(x) if self.head is not None else x

    def stage(self, index: int) -> "PPModel":
        m = copy.deepcopy(self)
        if index == 0:
            m.head = None
            del m.blocks["1"]
        else:
            m.inp = None
            del m.blocks["0"]
        return m


def pp_batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(30_000 * step + dp_rank)
    return torch.randn(4, 7, generator=g) * 2.0, torch.randint(0, 13, (4,), generator=g)


def run_pp_case(layout: str, rank: int) -> dict:
    """2 pipeline stages (``torch.distributed.pipelining``, ``ScheduleGPipe``, 2 micro-batches)
    x 2-way data parallelism (DDP or FSDP2) inside each stage, on a ``(pp, dp)`` mesh; each rank
    instruments its own stage module with its optimizer."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(1234)
    full = PPModel()
    ref_model = copy.deepcopy(full).double()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    mod = full.stage(stage_index)
    if "-ddp" in layout:
        wrapped, opt = build_ddp(mod, optim=adamw(1e-2), process_group=mesh["dp"].get_group())
        trainable = [(n, p) for n, p in mod.named_parameters()]
        gather = lambda: {n: _flat(p.grad) for n, p in trainable}  # noqa: E731
    else:
        wrapped, opt = build_fsdp2(mod, optim=adamw(1e-2), mesh=mesh["dp"])
        trainable = [(n, p) for n, p in mod.named_parameters()]
        gather = lambda: {n: _flat(p.grad.full_tensor()) for n, p in trainable}  # noqa: E731
    stage = PipelineStage(wrapped, stage_index, 2, CPU, group=mesh["pp"].get_group())
    # DDP: one micro-batch (torch 2.13's DDP reducer fails on two forwards before a backward:
    # "rebuilt parameter indices size is not same"; with static_graph=True the last stage's
    # replicas then differ, which distgrad's replica check reports)
    n_micro = 1 if "-ddp" in layout else 2
    schedule = ScheduleGPipe(stage, n_microbatches=n_micro, loss_fn=lambda out, y: F.cross_entropy(out, y))
    state = {"step": 0}
    if layout.endswith("-nan"):  # before distgrad's hook: a NaN in rank 3's (stage 1) blocks.1.1.weight, step 1

        def nan(o, a, k):
            if rank == 3 and state["step"] == 1:
                g = mod.blocks["1"][1].weight.grad
                with torch.no_grad():
                    (g.to_local() if hasattr(g, "to_local") else g).view(-1)[2] = float("nan")
        opt.register_step_pre_hook(nan)
    log = _Log()
    logging.getLogger("distgrad").addHandler(log)
    inst = distgrad.instrument(wrapped, optimizer=opt, exporter={"enabled": False})
    if layout.endswith("-double"):
        o = inst.own
        inst.own = Ownership([0] * len(o.index), [1] * len(o.copies), o.check, o.groups, o.describe)
    counts, refs, records = _count(inst), [], []

    def capture(o, a, k):
        mine = gather()
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        refs.append(full_stats({n: g for e in every for n, g in e.items()}))
    opt.register_step_pre_hook(capture)
    try:
        for step in range(2):
            state["step"] = step
            x, y = pp_batch(step, dp_rank)
            if stage_index == 0:
                schedule.step(x)
            else:
                losses: list = []
                schedule.step(target=y, losses=losses)
                inst.observe_loss(torch.stack(losses).mean())
            counts.start()
            opt.step()
            counts.stop()
            opt.zero_grad(set_to_none=True)
            records.append(inst.last_record.to_dict() if inst.last_record else None)
    finally:
        counts.restore()
        logging.getLogger("distgrad").removeHandler(log)
    ref_model.zero_grad()
    loss0 = 0.0
    for r in range(2):
        x, y = pp_batch(0, r)
        loss = F.cross_entropy(ref_model(x.double()), y) / 2
        loss.backward()
        loss0 += loss.item()
    out = {"records": records, "ref_full": refs, "counts": counts.per_step, "counters": dict(inst.counters),
           "ref_fp64_step0": full_stats({n: p.grad for n, p in ref_model.named_parameters()}),
           "ref_loss_step0": loss0, "warnings": log.messages, "groups": inst.own.groups,
           "copies": inst.own.copies, "names": list(inst.names), "local_names": list(inst.source.names)}
    inst.close()
    return out


class _count:
    """Collectives (``torch.distributed`` calls) and host syncs inside distgrad's ``collect`` /
    ``finish`` between ``start()`` and ``stop()``, per step in ``per_step``."""

    def __init__(self, inst) -> None:
        self.on, self.collectives, self.syncs, self.per_step = False, 0, 0, []
        self.originals = {fn: getattr(dist, fn) for fn in COLLECTIVES if hasattr(dist, fn)}
        for fn in self.originals:
            setattr(dist, fn, self._counting(fn))
        for name in ("collect", "finish"):
            setattr(inst, name, self._window(getattr(inst, name)))

    def _counting(self, fn):
        def call(*a, **kw):
            if self.inside:
                self.collectives += 1
            return self.originals[fn](*a, **kw)
        return call

    inside = False

    def _window(self, method):
        def call(*a, **kw):
            self.inside = self.on
            with HostSyncs() as m:
                try:
                    return method(*a, **kw)
                finally:
                    self.inside = False
                    self.syncs += m.n if self.on else 0
        return call

    def start(self) -> None:
        self.on, self.collectives, self.syncs = True, 0, 0

    def stop(self) -> None:
        self.on = False
        self.per_step.append({"collectives": self.collectives, "syncs": self.syncs})

    def restore(self) -> None:
        for fn, f in self.originals.items():
            setattr(dist, fn, f)


def _flat(t):
    return None if t is None else t.detach().double().reshape(-1).clone()


def _strip(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def wrap(layout: str, rank: int):
    """(model, its AdamW (lr 1e-2), full-gradient gather, data-parallel rank, data-parallel size,
    reference model)."""
    torch.manual_seed(1234)
    if layout.startswith("fsdp2-tp"):
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                       parallelize_module)
        from torch.distributed.tensor import Replicate, Shard

        model = TPModel()
        ref = copy.deepcopy(model).double()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model.tp_mesh = mesh["tp"]
        parallelize_module(model, mesh["tp"], {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Replicate())})
        model, opt = build_fsdp2(model, optim=adamw(1e-2), mesh=mesh["dp"])
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return (model, opt, lambda: {n: _flat(p.grad.full_tensor()) for n, p in trainable},
                mesh["dp"].get_local_rank(), 2, ref)
    model = TinyModel()
    ref = copy.deepcopy(model).double()
    if layout.startswith("fsdp2-hsdp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model, opt = build_fsdp2(model, model.blocks, optim=adamw(1e-2), mesh=mesh)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return model, opt, lambda: {n: _flat(p.grad.full_tensor()) for n, p in trainable}, rank, 4, ref
    # FSDP1 hybrid: shard group = mesh dim 1, replica group = mesh dim 0
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    strategy = ShardingStrategy._HYBRID_SHARD_ZERO2 if "zero2" in layout else ShardingStrategy.HYBRID_SHARD
    orig = "-flat" not in layout
    w, opt = build_fsdp1(model, wrap=blocks_and_frozen(model), orig_params=orig, optim=adamw(1e-2),
                         sharding_strategy=strategy, device_mesh=mesh)
    if orig:
        def summon():
            with FSDP.summon_full_params(w, with_grads=True, writeback=False):
                return {_strip(n): _flat(p.grad) for n, p in w.named_parameters() if p.requires_grad}
        return w, opt, summon, rank, 4, ref
    shard_group = mesh.get_group("shard")

    def flat_gather():
        out = {}
        for pname, fp in w.named_parameters():
            if not fp.requires_grad:
                continue
            t = fp.grad.detach()
            parts = [torch.empty_like(t) for _ in range(shard_group.size())]
            dist.all_gather(parts, t.contiguous(), group=shard_group)
            full = torch.cat(parts).double()[: sum(fp._numels)]
            prefix = _strip(pname[: -len("_flat_param")])
            for fqn, piece in zip(fp._fqns, full.split(list(fp._numels))):
                out[prefix + fqn] = piece.clone()
        return out
    return w, opt, flat_gather, rank, 4, ref


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_case(layout: str, rank: int) -> dict:
    base = layout.split("-corrupt")[0].split("-double")[0].split("-nan")[0]
    model, opt, gather, dp_rank, dp_size, ref_model = wrap(base, rank)
    tp = base.startswith("fsdp2-tp")
    if layout.endswith("-corrupt"):  # before distgrad's hook: rank 3 changes a replicated piece
        target = "norm.weight" if tp else "blocks.1.3.bias"

        def corrupt(o, a, k):
            if rank == 3:
                for n, p in model.named_parameters():
                    if _strip(n) == target:
                        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        with torch.no_grad():
                            g.view(-1)[0] += 1.0
        opt.register_step_pre_hook(corrupt)
    if layout.endswith("-nan"):  # before distgrad's hook: a NaN in rank 3's shard of up.weight, step 1

        def nan(o, a, k):
            if rank == 3 and state["step"] == 1:
                with torch.no_grad():
                    model.up.weight.grad.to_local().view(-1)[1] = float("nan")
        opt.register_step_pre_hook(nan)
    log = _Log()
    logging.getLogger("distgrad").addHandler(log)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False})
    if layout.endswith("-double"):  # the mutation: every replica counts its whole copy
        o = inst.own
        inst.own = Ownership([0] * len(o.index), [1] * len(o.copies), o.check, o.groups, o.describe)
    src = inst.source
    state = {"step": 0, "in": False, "collectives": 0, "syncs": 0}
    originals = {fn: getattr(dist, fn) for fn in COLLECTIVES if hasattr(dist, fn)}

    def counting(fn):
        def call(*a, **kw):
            if state["in"]:
                state["collectives"] += 1
            return originals[fn](*a, **kw)
        return call

    def window(method):
        def call(*a, **kw):
            state["in"] = True
            with HostSyncs() as m:
                try:
                    return method(*a, **kw)
                finally:
                    state["in"] = False
                    state["syncs"] += m.n
        return call

    for name in ("collect", "finish"):
        setattr(inst, name, window(getattr(inst, name)))
    refs, offset_mismatches = [], []

    def capture(o, a, k):
        full = gather()
        refs.append(full_stats(full))
        if not tp:
            t = torch.tensor([pieces_match(full, src.local_pieces(), src.local_offsets(), src.names)])
            dist.all_reduce(t)
            offset_mismatches.append(int(t))
    opt.register_step_pre_hook(capture)
    records, counts = [], []
    for fn in originals:
        setattr(dist, fn, counting(fn))
    try:
        for step in range(2):
            state["step"] = step
            x, y = tp_batch(step, 0, dp_rank) if tp else batch_for(step, 0, rank)
            model(x, y).backward()
            state["collectives"], state["syncs"] = 0, 0
            opt.step()
            counts.append({"collectives": state["collectives"], "syncs": state["syncs"]})
            opt.zero_grad(set_to_none=True)
            records.append(inst.last_record.to_dict() if inst.last_record else None)
    finally:
        for fn, f in originals.items():
            setattr(dist, fn, f)
        logging.getLogger("distgrad").removeHandler(log)
    if tp:
        ref_model.zero_grad()
        for r in range(dp_size):
            x, y = tp_batch(0, 0, r)
            ref_model(x.double(), y).backward()
        ref_b = full_stats({n: p.grad / dp_size for n, p in ref_model.named_parameters()})
    else:
        ref_b, _ = reference_b(ref_model, 1, dp_size)
    out = {"records": records, "ref_full": refs, "ref_fp64_step0": ref_b, "counts": counts,
           "offset_mismatches": offset_mismatches, "counters": dict(inst.counters),
           "warnings": log.messages, "groups": inst.own.groups, "copies": inst.own.copies,
           "names": list(src.names), "engine_name": src.engine_name}
    inst.close()
    return out


def run_refusals(rank: int) -> dict:
    """instrument() on models reduced over half of the job (the layout of 2 pipeline stages x
    2-way data parallelism, each rank instrumenting its own stage): DDP on a 2-rank group and
    FSDP2 on the 1-D ``dp`` sub-mesh. Both must raise, not report one stage as the model."""
    out = {}
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    for key, make in (("ddp-subgroup", lambda m: build_ddp(m, optim=sgd(0.1), process_group=groups[rank // 2])),
                      ("fsdp2-submesh", lambda m: build_fsdp2(m, optim=sgd(0.1), mesh=mesh["dp"]))):
        try:
            m, opt = make(TinyModel())
            distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}).close()
            out[key] = None
        except Exception as e:  # noqa: BLE001
            out[key] = f"{type(e).__name__}: {e}"
    return out


GROUPS = {
    "hsdp": ["fsdp1-hybrid-orig", "fsdp1-hybrid-zero2-orig", "fsdp1-hybrid-flat", "fsdp2-hsdp",
             "fsdp2-hsdp-double", "fsdp2-hsdp-corrupt", "fsdp1-hybrid-orig-corrupt", "refusals"],
    "tp": ["fsdp2-tp", "fsdp2-tp-double", "fsdp2-tp-corrupt", "fsdp2-tp-nan"],
    "pp": ["pp-ddp", "pp-fsdp2", "pp-ddp-double", "pp-fsdp2-nan"],
}


def main() -> None:
    args = driver_args(group="all")  # --group: hsdp, tp, pp or all (one launch for every case)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stats.stats_table([torch.ones(3)], CPU)  # one-time kernel set-up (native self-check), not counted
    keys = [k for g in GROUPS.values() for k in g] if args.group == "all" else GROUPS[args.group]

    def job(key: str):
        if key == "refusals":
            return lambda r, w: run_refusals(r)
        run = run_pp_case if key.startswith("pp-") else run_case
        return lambda r, w: run(key, r)
    run_cases([(k, job(k)) for k in keys], "all", args.out, rank, world, "layout_cases", gather=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
