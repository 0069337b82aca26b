"""Multi-rank cases of the MoE router health (distgrad/signals/router.py) under FSDP2, run inside
the logit precursors' launch (tests/dist/logits_cases.py, 2 gloo ranks, CPU): ``router_fsdp2``
(below) and ``router_dead_fsdp2`` (:func:`run_dead`: dead experts judged on both ranks' tokens).

The model is tests/test_router.py's tiny Hugging Face Mixtral (2 decoder layers, 4 experts,
top-2, hidden 16), each decoder layer an FSDP2 unit of its own (tests/dist/engines.py
``build_fsdp2``), GAS micro-batches per rank and step (each rank its own data). Per micro-batch
each rank recomputes, from the router input its own forward pre-hook captures and the router
weight as the forward sees it (FSDP2 has unsharded it), per layer in float64: the tokens per
expert of the top-k of softmax(x W^T) (``bincount``), the summed softmax entropy and the tokens;
and keeps the model's own ``aux_loss`` of that forward. Rank 0 writes its records
(``StepRecord.router``) and the boundary's collective / host-sync counts.
"""

from __future__ import annotations

import torch

import distgrad
from tests.dist.common import BoundaryCounter, optimizer_step
from tests.dist.engines import adamw, build_fsdp2

GAS, STEPS, B, T, V = 2, 3, 3, 7, 37


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5_000 * step + 50 * micro + rank)
    return torch.randint(0, V, (B, T), generator=g)


def _close(inst, counter: BoundaryCounter, hooks: list, records: list, refs: list) -> dict:
    """End of a router case: undo the counter's wrapping, remove the router pre-hooks, close the
    instrument; the case's result ``{"records", "refs", "counts", "internal_errors"}``."""
    counter.restore()
    for h in hooks:
        h.remove()
    inst.close()
    return {"records": records, "refs": refs, "counts": counter.counts,
            "internal_errors": inst.counters["internal_errors"]}


def run(key: str, rank: int, world: int) -> dict:
    from tests.test_router import _mixtral

    model = _mixtral()
    gates = [layer.mlp.gate for layer in model.model.layers]
    w, opt = build_fsdp2(model, list(model.model.layers), optim=adamw(0.05))
    inst = distgrad.instrument(w, {"exporter": {"enabled": False}, "statistics": {"async_records": "off"},
                                   "router": {"enabled": True}}, optimizer=opt)
    cap: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
    hooks = [g.register_forward_pre_hook(lambda m, a, i=i: cap.__setitem__(
        i, (a[0].detach().double(), m.weight.detach().double().clone(), m.top_k))) for i, g in enumerate(gates)]
    counter = BoundaryCounter(inst)
    refs, records = [], []
    for s in range(STEPS):
        micro_refs = []
        for micro in range(GAS):
            ids = batch(s, micro, rank)
            cap.clear()
            out = w(input_ids=ids, labels=ids)
            (out.loss / GAS).backward()
            layers = {}
            for i, (x, weight, top_k) in cap.items():
                x = x.reshape(-1, x.shape[-1])
                p = torch.softmax(x @ weight.T, -1)
                idx = torch.topk(p, top_k, dim=-1).indices
                counts = torch.bincount(idx.reshape(-1), minlength=p.shape[-1])
                layers[str(i)] = {"counts": counts.tolist(), "entropy": float(-(p * torch.log(p)).sum()),
                                  "tokens": x.shape[0]}
            micro_refs.append({"layers": layers, "aux_loss": float(out.aux_loss.detach())})
        counter.around(optimizer_step(opt))
        refs.append(micro_refs)
        records.append(inst.last_record.router.to_dict() if inst.last_record and inst.last_record.router else None)
    return _close(inst, counter, hooks, records, refs)


#: ``router_dead_fsdp2``: router.dead_after and the steps run (dead from the second step on)
DEAD_AFTER, DEAD_STEPS = 2, 3
#: per rank ``{layer: {expert: balancing bias}}``: both ranks starve expert 1 of layer 0 (a restored
#: bias, as tests/test_router.py's starved case); in layer 1 each rank starves another expert (the
#: bias updated from each rank's own load, a bug that lets the replicas' biases diverge): rank 0
#: expert 3, rank 1 expert 2, so each rank alone sees an expert without tokens that the job feeds
RANK_BIAS = {0: {0: {1: -0.5}, 1: {3: -0.5}}, 1: {0: {1: -0.5}, 1: {2: -0.5}}}


def run_dead(key: str, rank: int, world: int) -> dict:
    """``router_dead_fsdp2``: tests/test_router.py's tiny DeepSeek-V3 (2 MoE layers, 4 experts,
    top-1), each decoder layer an FSDP2 unit, 2 ranks with their own data and the balancing
    biases of :data:`RANK_BIAS`, ``router.dead_after`` :data:`DEAD_AFTER`. Per step each rank
    recomputes from its router inputs (its own pre-hook), the unsharded router weight and its
    bias, in float64, the tokens per expert of the top-1 of ``sigmoid(x W^T) + bias``
    (``bincount``). Rank 0 writes its records (``StepRecord.router``) and the boundary's
    collective / host-sync counts."""
    from tests.test_router import _deepseek_v3

    model = _deepseek_v3()
    gates = [layer.mlp.gate for layer in model.model.layers]
    with torch.no_grad():
        for i, experts in RANK_BIAS[rank % 2].items():
            for e, b in experts.items():
                gates[i].e_score_correction_bias[e] = b
    w, opt = build_fsdp2(model, list(model.model.layers), optim=adamw(0.01))
    inst = distgrad.instrument(w, {"exporter": {"enabled": False}, "statistics": {"async_records": "off"},
                                   "router": {"enabled": True, "dead_after": DEAD_AFTER}}, optimizer=opt)
    cap: dict[int, tuple] = {}
    hooks = [g.register_forward_pre_hook(lambda m, a, i=i: cap.__setitem__(
        i, (a[0].detach().double(), m.weight.detach().double().clone(),
            m.e_score_correction_bias.detach().double().clone(), m.top_k))) for i, g in enumerate(gates)]
    counter = BoundaryCounter(inst)
    refs, records = [], []
    for s in range(DEAD_STEPS):
        ids = batch(s, 0, rank)
        cap.clear()
        w(input_ids=ids, labels=ids).loss.backward()
        layers = {}
        for i, (x, weight, bias, top_k) in cap.items():
            x = x.reshape(-1, x.shape[-1])
            idx = torch.topk(torch.sigmoid(x @ weight.T) + bias, top_k, dim=-1).indices  # n_group 1: no masking
            layers[str(i)] = torch.bincount(idx.reshape(-1), minlength=weight.shape[0]).tolist()
        refs.append(layers)
        counter.around(optimizer_step(opt))
        records.append(inst.last_record.router.to_dict() if inst.last_record and inst.last_record.router else None)
    return _close(inst, counter, hooks, records, refs)
