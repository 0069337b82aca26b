"""Shared pieces of the multi-rank test drivers: a small model with awkward shapes, deterministic
per-(step, micro-batch, rank) data, and float64 reference statistics of full gradients."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyModel(nn.Module):
    """Embedding -> 2 blocks -> tied head. Shapes chosen so that several parameters have an
    element count not divisible by 2 (35, 7, 5, 13*7, ...), one parameter is frozen
    (``frozen.weight``, must never appear), and the head is tied to the embedding (counted once).
    Input: float features [B, 7]; target: class indices [B] in [0, 13)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)  # weight 35, bias 5: odd
        self.frozen = nn.Linear(5, 5, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(5), nn.Linear(5, 9), nn.GELU(), nn.Linear(9, 5))
                                     for _ in range(2)])
        self.emb = nn.Embedding(13, 5)
        self.head = nn.Linear(5, 13, bias=False)
        self.head.weight = self.emb.weight  # tied: 65 elements, odd

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.inp(x))
        h = h + self.emb(y % 13)
        for b in self.blocks:
            h = h + b(h)
        logits = self.head(h)
        return F.cross_entropy(logits.float(), y)


def batch_for(step: int, micro: int, rank: int, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic batch for (step, micro-batch, rank): x float32 [batch, 7], y int64 [batch]."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(batch, 7, generator=g) * 2.0
    y = torch.randint(0, 13, (batch,), generator=g)
    return x, y


def full_stats(grads: dict[str, torch.Tensor | None]) -> dict[str, dict[str, float]]:
    """Reference statistics of full gradients, each computed directly in float64 with torch
    (a different code path from distgrad's packed sufficient statistics)."""
    out = {}
    for name, g in grads.items():
        if g is None:
            out[name] = None
            continue
        g = g.double().reshape(-1)
        fin = torch.isfinite(g)
        out[name] = {
            "numel": g.numel(),
            "norm": torch.linalg.vector_norm(g).item(),
            "mean": g.mean().item(),
            "std": g.std(correction=0).item(),
            "min": g.min().item(),
            "max": g.max().item(),
            "abs_max": g.abs().max().item(),
            "nan": int(torch.isnan(g).sum()),
            "inf": int(torch.isinf(g).sum()),
            "zeros": int((g == 0).sum()),
            "rms": (g[fin].pow(2).mean().sqrt().item() if fin.any() else 0.0),
        }
    return out


def reference_b(ref_model: nn.Module, gas: int, world: int) -> tuple[dict, float]:
    """float64 gradients of step 0 averaged over every rank's micro-batches, and the mean loss."""
    ref_model.zero_grad()
    n, loss_sum = 0, 0.0
    for r in range(world):
        for micro in range(gas):
            x, y = batch_for(0, micro, r)
            loss = ref_model(x.double(), y)
            loss.backward()
            loss_sum += loss.item()
            n += 1
    grads = {name: (p.grad / n).reshape(-1) for name, p in ref_model.named_parameters() if p.requires_grad}
    return full_stats(grads), loss_sum / n


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts calls of the tensor methods that wait for the device (``.cpu()``, ``.item()``,
    ``.tolist()``, truth and number conversions) in ``self.n``; used by the tests that assert a
    path makes no host sync."""

    SYNCING = {"cpu", "item", "tolist", "__bool__", "__float__", "__int__", "__index__"}

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SYNCING:
            self.n += 1
        return func(*args, **(kwargs or {}))


#: the per-rank attribution run (loss_attribution_loop): optimizer steps, micro-batches per step,
#: the (step, rank, micro-batch) whose input is scaled into a loss spike, the steps on which rank 1
#: sleeps before its first forward (a slow data loader), and how long
ATTR_STEPS, ATTR_GAS, ATTR_SPIKE, ATTR_SLOW_STEPS, ATTR_SLEEP = 8, 2, (6, 1, 1), (2, 5), 0.25


def sample_ids(step: int, micro: int, rank: int, n: int) -> list[int]:
    """Made-up dataset indices of the samples of (step, micro-batch, rank)."""
    return [100_000 * step + 1000 * micro + 10 * rank + i for i in range(n)]


def loss_attribution_loop(inst, rank: int, forward, backward, step, report_data: bool, explicit_samples: bool,
                          dtype=torch.float32) -> dict:
    """Train ATTR_STEPS optimizer steps of ATTR_GAS micro-batches with a loss spike in rank 1's
    batch and a slow rank 1 on some steps; pass sample indices (``observe_loss(samples=)`` when
    ``explicit_samples``, else ``observe_samples``) and, with ``report_data``, the data time.
    ``forward(x, y, micro) -> loss``, ``backward(loss, micro)``, ``step()``. Returns the records,
    every micro-batch loss as each rank saw it (float64 of the loss value, all ranks) and the
    collectives and host syncs distgrad made (inside the instrument's boundary methods) per step."""
    import time

    import torch.distributed as dist

    records, losses, counts = [], [], []
    names = [fn for fn in ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather", "broadcast",
                           "reduce_scatter_tensor", "barrier") if hasattr(dist, fn)]
    originals = {fn: getattr(dist, fn) for fn in names}
    state = {"on": False, "collectives": 0}
    syncs = HostSyncs()

    def counting(fn):
        def call(*a, **kw):
            if state["on"]:
                state["collectives"] += 1
            return originals[fn](*a, **kw)
        return call

    for meth in ("collect", "finish", "skip", "watch"):
        bound = getattr(inst, meth)

        def timed(*a, __m=bound, **kw):
            state["on"] = True
            try:
                with syncs:
                    return __m(*a, **kw)
            finally:
                state["on"] = False
        setattr(inst, meth, timed)
    for fn in names:
        setattr(dist, fn, counting(fn))
    try:
        for s in range(ATTR_STEPS):
            for micro in range(ATTR_GAS):
                t0 = time.perf_counter()
                if rank == 1 and s in ATTR_SLOW_STEPS and micro == 0:
                    time.sleep(ATTR_SLEEP)
                x, y = batch_for(s, micro, rank)
                if (s, rank, micro) == ATTR_SPIKE:
                    x = x * 60.0
                if report_data:
                    inst.observe_data_time(time.perf_counter() - t0)
                ids = sample_ids(s, micro, rank, len(y))
                if not explicit_samples:
                    inst.observe_samples(ids)
                loss = forward(x.to(dtype), y, micro)
                losses.append([s, micro, float(loss.detach().double())])
                if explicit_samples:
                    inst.observe_loss(loss, samples=ids)
                backward(loss, micro)
            state["collectives"], syncs.n = 0, 0
            step()
            counts.append({"collectives": state["collectives"], "syncs": syncs.n})
            records.append(inst.last_record.to_dict() if inst.last_record is not None else None)
    finally:
        for fn, f in originals.items():
            setattr(dist, fn, f)
        for meth in ("collect", "finish", "skip", "watch"):
            vars(inst).pop(meth, None)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    return {"records": records, "losses": gathered, "counts": counts}
