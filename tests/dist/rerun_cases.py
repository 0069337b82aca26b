"""Multi-rank driver for tests/test_rerun.py (one torchrun launch, 2 gloo CPU ranks): the rerun
attribution's verdict (distgrad/diagnostics/rerun.py) on three injected faults, each on a DDP
model of its own with ``rerun.enabled`` and ``action.on_nonfinite: skip`` (the bad update is not
applied, so the steps after it are healthy again unless the fault persists).

Model: an RMS normalisation of the input without epsilon (NaN, 0/0, for an all-zero sample) ->
Linear -> GELU -> Linear -> cross-entropy (the forward returns the loss), 2 micro-batches per
step (``no_sync`` on the first), 6 steps; the fault at step 3 on rank 1.

Cases:
  data:      rank 1's second micro-batch at step 3 holds an all-zero sample (a garbage batch).
  transient: a forward hook on rank 1's ``inp`` Linear sets one output element to NaN once, at
             step 3's second micro-batch, and never again.
  device:    from step 3 on, rank 1's arithmetic is wrong: a forward hook on every Linear sets
             the exponent bits of the first output element (stuck at one: every matmul's output
             perturbed, on rank 1 only, every call).
  weights:   replica weight hashes every step; after step 2's update rank 1 flips the top
             mantissa bit of one weight (a memory fault): the replicas differ from step 3 on.
  zero2 / zero3: the device fault under DeepSpeed ZeRO-2 (the rerun runs through
             ``engine.module``), and under ZeRO-3, where the forward gathers every rank's
             shards: no rerun (reason ``sharded``), no collective of its own, training goes on.

Per case and rank: each step's record (``rerun`` part, culprits, finiteness), the float64
reference of the culprit's step-3 micro-batches (loss and squared gradient norm from a copy of
the weights before step 3, by ``.backward()`` on a plain copy of the model, no hook: another
way than the rerun's ``autograd.grad``), and rank 0's served rerun metrics.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import distgrad

from tests.dist.common import driver_args, run_cases
from tests.dist.engines import build_ddp, sgd

D_IN, D, CLASSES, BATCH, GAS, STEPS, BAD = 8, 16, 5, 8, 2, 6, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(D_IN))
        self.inp = nn.Linear(D_IN, D)
        self.out = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.gain * x / x.pow(2).mean(-1, keepdim=True).sqrt()  # no epsilon: 0/0 on a zero row
        return F.cross_entropy(self.out(F.gelu(self.inp(x))), y)


TEACHER = torch.randn(D_IN, CLASSES, generator=torch.Generator().manual_seed(7))


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_007 * step + 101 * rank + micro)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, (x @ TEACHER).argmax(-1)


def _stuck_exponent(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    out = out.clone()
    bits = out.view(-1)[:1].view(torch.int32)
    bits |= 0x7F800000  # the first element's exponent bits stuck at one: Inf or NaN
    return out


def case(kind: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model, opt = build_ddp(Net(), optim=sgd(0.05))
    extra: dict = {"replica_weights": {"hash_interval": 1}} if kind == "weights" else {}
    if kind == "data":  # the output logits' statistics must not see the reruns' (NaN) forwards
        extra["logits"] = {"output": True, "output_module": "out"}
    inst = distgrad.instrument(model, optimizer=opt, rerun={"enabled": True}, action={"on_nonfinite": "skip"},
                               exporter={"port": 0, "host": "127.0.0.1"} if kind == "device" else {"enabled": False},
                               **extra)
    inner = model.module
    calls = _record_collectives(inst)
    fired = {"n": 0}
    handles = []
    recs, reference = [], {}
    for step in range(STEPS):
        if step == BAD and rank == 1:
            if kind == "transient":
                def once(m, a, out):
                    fired["n"] += 1
                    if fired["n"] == GAS:  # the second micro-batch of this step, and never again
                        out = out.clone()
                        out[0, 0] = float("nan")
                    return out
                handles.append(inner.inp.register_forward_hook(once))
            elif kind == "device":
                handles += [m.register_forward_hook(_stuck_exponent)
                            for m in inner.modules() if isinstance(m, nn.Linear)]
        if step == BAD and kind == "weights" and rank == 1:
            with torch.no_grad():
                w = inner.inp.weight.view(-1)[:1].view(torch.int32)
                w ^= 1 << 22  # the top mantissa bit of one weight, on this replica only
        # the reference: rank 1's micro-batches on a plain copy of this rank's weights before the step
        reference[step] = _reference(inner, kind, step)
        for micro in range(GAS):
            x, y = batch(step, rank, micro)
            if kind == "data" and step == BAD and rank == 1 and micro == 1:
                x[0] = 0.0
            ctx = model.no_sync() if micro < GAS - 1 else _null()
            with ctx:
                model(x, y).backward()
        opt.step()
        opt.zero_grad()
        rec = inst.last_record
        recs.append({"step": rec.step, "nonfinite": rec.nonfinite, "applied": rec.step_applied,
                     "culprits": [c.rank for c in rec.culprits],
                     "rerun": rec.rerun.to_dict() if rec.rerun is not None else None,
                     "logit_max": rec.logits.output_abs_max if rec.logits is not None else None,
                     "boundary_collectives": list(calls)})
        calls.clear()
    served = ""
    if inst.prometheus is not None:
        from prometheus_client import generate_latest

        served = "\n".join(ln for ln in generate_latest(inst.prometheus.registry).decode().splitlines()
                           if ln.startswith("distgrad_rerun"))
    for h in handles:
        h.remove()
    _restore_collectives()
    errors = inst.counters["internal_errors"]
    inst.close()
    return {"records": recs, "reference": reference, "served": served, "internal_errors": errors}


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast",
                "broadcast_object_list", "all_gather_object", "reduce_scatter_tensor", "barrier")
_ORIGINAL: dict = {}


def _record_collectives(inst) -> list[str]:
    """The torch.distributed calls made inside the boundary's replay + rerun
    (``inst.replay.boundary``), by name, in order (nested calls of broadcast_object_list too)."""
    calls: list[str] = []
    inside = [False]
    for fn in _COLLECTIVES:
        if hasattr(dist, fn):
            orig = _ORIGINAL.setdefault(fn, getattr(dist, fn))

            def counted(*a, _fn=fn, _orig=orig, **kw):
                if inside[0]:
                    calls.append(_fn)
                return _orig(*a, **kw)
            setattr(dist, fn, counted)
    boundary = inst.replay.boundary

    def wrapped(*a, **kw):
        inside[0] = True
        try:
            return boundary(*a, **kw)
        finally:
            inside[0] = False
    inst.replay.boundary = wrapped
    return calls


def _restore_collectives() -> None:
    for fn, f in _ORIGINAL.items():
        setattr(dist, fn, f)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _reference(inner: nn.Module, kind: str, step: int) -> dict:
    """Rank 1's micro-batches of ``step`` (as the fault-free arithmetic computes them) on a copy of the
    current weights: per micro-batch loss and squared gradient norm in float64 (float32 model,
    ``.backward()`` into ``.grad``), and whether any is non-finite."""
    net = Net()
    net.load_state_dict(copy.deepcopy(inner.state_dict()))
    loss_sum = g2_sum = 0.0
    nonfinite = 0
    for micro in range(GAS):
        x, y = batch(step, 1, micro)
        if kind == "data" and step == BAD and micro == 1:
            x[0] = 0.0
        net.zero_grad()
        loss = net(x, y)
        loss.backward()
        g2 = sum(float(p.grad.double().pow(2).sum()) for p in net.parameters())
        if not (torch.isfinite(loss) and g2 == g2 and g2 != float("inf")):
            nonfinite += 1
        loss_sum += float(loss.detach().double())
        g2_sum += g2
    return {"loss": loss_sum, "grad_sq": g2_sum, "nonfinite": nonfinite}


def ds_case(stage: int, rank: int, world: int) -> dict:
    from tests.dist.engines import build_deepspeed

    torch.manual_seed(0)
    engine, _ = build_deepspeed(Net(), stage=stage, gas=GAS, micro_batch=BATCH)
    inst = distgrad.instrument(engine, rerun={"enabled": True}, exporter={"enabled": False})
    calls = _record_collectives(inst)
    recs = []
    for step in range(BAD + 2):
        if step == BAD and rank == 1:
            for m in (engine.module.inp, engine.module.out):
                m.register_forward_hook(_stuck_exponent)
        for micro in range(GAS):
            x, y = batch(step, rank, micro)
            engine.backward(engine(x, y))
            engine.step()
        rec = inst.last_record
        recs.append({"step": rec.step, "nonfinite": rec.nonfinite, "culprits": [c.rank for c in rec.culprits],
                     "rerun": rec.rerun.to_dict(), "boundary_collectives": list(calls)})
        calls.clear()
    _restore_collectives()
    errors = inst.counters["internal_errors"]
    inst.close()
    return {"records": recs, "internal_errors": errors}


def main() -> None:
    args = driver_args(cases="all")
    dist.init_process_group("gloo")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see launch/train.py skip_cpu_shm_op
    rank, world = dist.get_rank(), dist.get_world_size()
    jobs = [(k, functools.partial(case, k)) for k in ("data", "transient", "device", "weights")]
    jobs += [(f"zero{s}", functools.partial(ds_case, s)) for s in (2, 3)]
    run_cases(jobs, args.cases, args.out, rank, world, "rerun_cases")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
