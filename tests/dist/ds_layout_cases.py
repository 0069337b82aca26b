"""Multi-rank driver for DeepSpeed layouts beyond data parallelism (tests/test_deepspeed_layouts.py)
under ``torchrun --nproc_per_node 4``, gloo, CPU.

``moe-z2``: :class:`MoEModel` (4 experts of ``deepspeed.moe.layer.MoE`` with ``ep_size`` 2, so
each rank holds 2 experts and each expert lives on the 2 ranks of its expert-data-parallel
group) under ZeRO-2, two optimizer steps; records on rank 0:
  * distgrad's record of each step;
  * reference A: every rank's full reduced gradient of each of its parameters
    (``safe_get_full_grad``, right before distgrad's boundary), the experts keyed by their global
    index ``expert-parallel rank * num_local_experts + local index`` (DeepSpeed's dispatch order),
    gathered from all ranks; float64 statistics;
  * the collectives and host syncs inside distgrad's ``collect`` / ``finish``.
  * with ``router.enabled``: every rank's gate forwards recomputed in float64 by the test's own
    hook (top-1 counts, softmax entropy, tokens, ``l_aux``), gathered from all ranks.
``moe-z2-nan``: the same (router off), with a NaN put into global rank 3's ZeRO-2 fragment of one expert
parameter on step 1. ``pipe-z0`` / ``pipe-z1``: a ``PipelineEngine`` (2 stages x 2-way data
parallel) under ZeRO-0 / ZeRO-1, reference A gathered from both stages; ``pipe-z0-double``: the
mutation counting both data-parallel replicas of a stage. ``refusals``:
``instrument()`` on a MoE model under ZeRO-0 and on a ``PipelineEngine`` with tied layers.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed
import deepspeed.comm
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import groups, safe_get_full_grad

import distgrad
from distgrad import stats

from tests.dist.engines import build_deepspeed, init_distributed
from tests.dist.common import driver_args, run_cases, full_stats
from tests.dist.layout_cases import _count


class MoEModel(nn.Module):
    """inp -> MoE (4 experts, top-1, no token dropping, no random token selection) -> head;
    x float [6, 7], y [6] in [0, 13)."""

    def __init__(self, ep_size: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 6)
        expert = nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 6))
        self.moe = MoE(hidden_size=6, expert=expert, num_experts=4, ep_size=ep_size, k=1, drop_tokens=False,
                       use_rts=False)
        self.head = nn.Linear(6, 13)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _, _ = self.moe(self.inp(x).unsqueeze(0))
        return F.cross_entropy(self.head(h.squeeze(0)), y)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(40_000 * step + rank)
    return torch.randn(6, 7, generator=g) * 2.0, torch.randint(0, 13, (6,), generator=g)


def make_engine(stage: int):
    torch.manual_seed(1234)
    model = MoEModel()
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "params"})
    opt = torch.optim.AdamW(params, lr=1e-2)
    return build_deepspeed(model, stage, micro_batch=6, optimizer=opt)[0]


def global_name(engine, name: str) -> str:
    """The test's own mapping of a local expert name to its global index (see module doc)."""
    if ".deepspeed_experts." not in name:
        return name
    head, rest = name.split(".deepspeed_experts.", 1)
    local, tail = rest.split(".", 1)
    ep_rank = groups._get_expert_parallel_rank("ep_size_2")
    return f"{head}.deepspeed_experts.{int(local) + 2 * ep_rank}.{tail}"


def router_reference(gate, log: list) -> None:
    """The test's own hook on the gate: per forward, float64 top-1 counts of softmax(x W^T), the
    summed softmax entropy, the tokens and DeepSpeed's l_aux (reference for ``router``)."""
    def hook(mod, args, out):
        x = args[0].detach().double()
        p = torch.softmax(x @ mod.wg.weight.detach().double().T, -1)
        counts = torch.bincount(p.argmax(-1), minlength=p.shape[-1]).double()
        log.append({"counts": counts.tolist(), "entropy": float(-(p * torch.log(p)).sum()), "tokens": x.shape[0],
                    "l_aux": float(out[0])})
    return gate.register_forward_hook(hook)


def run_moe(key: str, rank: int) -> dict:
    engine = make_engine(2)
    router = {"enabled": True} if key == "moe-z2" else {}
    inst = distgrad.instrument(engine, exporter={"enabled": False}, router=router)
    forwards: list = []
    handle = router_reference(engine.module.moe.deepspeed_moe.gate, forwards)
    router_ref: list = []
    counts, refs, records = _count(inst), [], []
    inner = engine._take_model_step
    state = {"step": 0}
    injected: list = [None]

    def before(*a, **kw):  # wraps distgrad's wrapper: runs first
        full = {}
        for n, p in engine.module.named_parameters():
            g = safe_get_full_grad(p)
            full[global_name(engine, n)] = g.detach().double().reshape(-1).clone()
        every: list = [None] * deepspeed.comm.get_world_size()
        torch.distributed.all_gather_object(every, full)
        refs.append(full_stats({n: g for e in every for n, g in e.items()}))
        if key.endswith("-nan") and state["step"] == 1 and rank == 3:
            for n, p in engine.module.named_parameters():
                m = getattr(p, "_hp_mapping", None)
                if ".deepspeed_experts." in n and m is not None:
                    frag = m.get_lp_grad_fragment(p._index_in_param_group)
                    frag.view(-1)[0] = float("nan")
                    injected[0] = global_name(engine, n)
                    break
        counts.start()
        try:
            return inner(*a, **kw)
        finally:
            counts.stop()

    engine._take_model_step = before
    try:
        for step in range(2):
            state["step"] = step
            x, y = batch(step, rank)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            records.append(inst.last_record.to_dict() if inst.last_record else None)
            every_rank: list = [None] * deepspeed.comm.get_world_size()
            torch.distributed.all_gather_object(every_rank, forwards[:])
            router_ref.append(every_rank)
            forwards.clear()
    finally:
        counts.restore()
        handle.remove()
    names: list = [None] * deepspeed.comm.get_world_size()
    torch.distributed.all_gather_object(names, [n for n, _ in engine.module.named_parameters()])
    hit: list = [None] * deepspeed.comm.get_world_size()
    torch.distributed.all_gather_object(hit, injected[0])
    out = {"records": records, "ref_full": refs, "counts": counts.per_step, "counters": dict(inst.counters),
           "local_names": names, "injected": hit, "names": list(inst.names), "router_ref": router_ref}
    inst.close()
    return out


def pipe_engine(stage: int, tied: bool = False):
    """A ``PipelineEngine``: 5 layers (3 with parameters) in 2 stages x 2-way data parallel,
    gradient accumulation 2 (micro-batches of 3); ``tied``: the first and last layer share a
    weight (``TiedLayerSpec``)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    torch.manual_seed(1234)
    if tied:
        layers = [TiedLayerSpec("w", nn.Linear, 7, 7), LayerSpec(nn.GELU), TiedLayerSpec("w", nn.Linear, 7, 7),
                  LayerSpec(nn.Linear, 7, 13)]
    else:
        layers = [LayerSpec(nn.Linear, 7, 5), LayerSpec(nn.GELU), LayerSpec(nn.Linear, 5, 9), LayerSpec(nn.GELU),
                  LayerSpec(nn.Linear, 9, 13)]
    module = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.CrossEntropyLoss(), partition_method="uniform")
    return build_deepspeed(module, stage, gas=2, lr=1e-2)[0]


def run_pipe(key: str, rank: int) -> dict:
    """``PipelineEngine`` with ZeRO-0 or ZeRO-1, two ``train_batch()`` calls; reference A:
    ``safe_get_full_grad`` of every rank's stage parameters right before distgrad's boundary,
    gathered from all ranks."""
    engine = pipe_engine(int(key.split("-z")[1][0]))
    inst = distgrad.instrument(engine, exporter={"enabled": False})
    if key.endswith("-double"):  # the mutation: both replicas of a stage count their whole copy
        from distgrad.engines.base import Ownership

        o = inst.own
        inst.own = Ownership([0] * len(o.index), [1] * len(o.copies), o.check, o.groups, o.describe)
    counts, refs, records = _count(inst), [], []
    inner = engine._take_model_step

    def before(*a, **kw):
        full = {n: safe_get_full_grad(p).detach().double().reshape(-1).clone()
                for n, p in engine.module.named_parameters()}
        every: list = [None] * deepspeed.comm.get_world_size()
        torch.distributed.all_gather_object(every, full)
        refs.append(full_stats({n: g for e in every for n, g in e.items()}))
        counts.start()
        try:
            return inner(*a, **kw)
        finally:
            counts.stop()

    engine._take_model_step = before
    dp = engine.mpu.get_data_parallel_rank()
    try:
        for step in range(2):
            it = iter([batch(10 * step + micro, dp) for micro in range(2)])
            engine.train_batch(data_iter=((x[:3], y[:3]) for x, y in it))
            records.append(inst.last_record.to_dict() if inst.last_record else None)
    finally:
        counts.restore()
    out = {"records": records, "ref_full": refs, "counts": counts.per_step, "counters": dict(inst.counters),
           "names": list(inst.names), "local_names": list(inst.source.names), "copies": inst.own.copies,
           "groups": inst.own.groups}
    inst.close()
    return out


def run_refusals(rank: int) -> dict:
    """instrument() on MoE with expert parallelism under ZeRO-0 (not located by distgrad) and on
    a ``PipelineEngine`` with tied layers: both refused."""
    out = {}
    for key, make in (("moe-z0", lambda: make_engine(0)), ("pipeline-tied", lambda: pipe_engine(1, tied=True))):
        try:
            distgrad.instrument(make(), exporter={"enabled": False}).close()
            out[key] = None
        except Exception as e:  # noqa: BLE001
            out[key] = f"{type(e).__name__}: {e}"
    return out


def main() -> None:
    args = driver_args(group="moe")
    rank, world = init_distributed()
    stats.stats_table([torch.ones(3)], torch.device("cpu"))  # one-time kernel set-up, not counted

    def job(key: str):
        if key == "refusals":
            return lambda r, w: run_refusals(r)
        run = run_pipe if key.startswith("pipe-") else run_moe
        return lambda r, w: run(key, r)
    # MoE before any PipelineEngine (it sets groups.mpu)
    keys = ("moe-z2", "moe-z2-nan", "refusals", "pipe-z0", "pipe-z1", "pipe-z0-double")
    run_cases([(k, job(k)) for k in keys], "all", args.out, rank, world, "ds_layout_cases", gather=False)


if __name__ == "__main__":
    main()
