"""Shared pieces of the multi-rank test drivers: a small model with awkward shapes, deterministic
per-(step, micro-batch, rank) data, and float64 reference statistics of full gradients."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
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


def pieces_match(full: dict, pieces, offsets, names) -> int:
    """Number of parameters whose local piece is not ``full[name][start:start+numel]``."""
    bad = 0
    for name, piece, off in zip(names, pieces, offsets):
        if off is None:
            bad += int(piece is not None and piece.numel() > 0)
        else:
            s, n = off
            bad += int(piece is None or piece.numel() != n or not torch.equal(full[name][s:s + n], piece.double()))
    return bad


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
    ``.tolist()``, truth and number conversions) in ``self.n`` and lists their names in
    ``self.calls``; used by the tests that assert a path makes no host sync."""

    SYNCING = {"cpu", "item", "tolist", "__bool__", "__float__", "__int__", "__index__"}

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.SYNCING:
            self.n += 1
            self.calls.append(name)
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

    records, losses = [], []
    counter = BoundaryCounter(inst)
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
            counter.around(step)
            records.append(inst.last_record.to_dict() if inst.last_record is not None else None)
    finally:
        counter.restore()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    return {"records": records, "losses": gathered, "counts": counter.counts}


class BoundaryCounter:
    """Counts the collectives (torch.distributed calls) and host syncs (:class:`HostSyncs`) made
    inside the instrument's boundary methods (collect, finish, skip, watch) during each call of
    :meth:`around`; :meth:`restore` undoes the wrapping."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather", "broadcast",
             "reduce_scatter_tensor", "barrier")

    def __init__(self, inst) -> None:
        import torch.distributed as dist

        self.inst, self.dist = inst, dist
        self.counts: list[dict] = []
        self.originals = {fn: getattr(dist, fn) for fn in self.NAMES if hasattr(dist, fn)}
        self.on, self.n = False, 0
        self.syncs = HostSyncs()
        for meth in ("collect", "finish", "skip", "watch"):
            bound = getattr(inst, meth)

            def timed(*a, __m=bound, **kw):
                self.on = True
                try:
                    with self.syncs:
                        return __m(*a, **kw)
                finally:
                    self.on = False
            setattr(inst, meth, timed)
        for fn, orig in self.originals.items():
            setattr(dist, fn, self._counting(orig))

    def _counting(self, orig):
        def call(*a, **kw):
            if self.on:
                self.n += 1
            return orig(*a, **kw)
        return call

    def around(self, fn) -> None:
        self.n, self.syncs.n = 0, 0
        fn()
        self.counts.append({"collectives": self.n, "syncs": self.syncs.n})

    def restore(self) -> None:
        for fn, f in self.originals.items():
            setattr(self.dist, fn, f)
        for meth in ("collect", "finish", "skip", "watch"):
            vars(self.inst).pop(meth, None)


def optimizer_step(opt: torch.optim.Optimizer) -> Callable[[], None]:
    """A torch loop's optimizer step, ``opt.step()`` then ``opt.zero_grad()`` (distgrad's boundary
    runs inside ``opt.step()``), as a function of no arguments for :meth:`BoundaryCounter.around`."""
    def step() -> None:
        opt.step()
        opt.zero_grad()
    return step


def counted_steps(inst, steps: int, backward: Callable[[int], None], step: Callable[[], None]) -> tuple[list, list]:
    """Train ``steps`` steps: ``backward(s)`` (forward and backward of step ``s``), then ``step()``
    (the optimizer step, where distgrad's boundary runs) inside :meth:`BoundaryCounter.around`.
    Returns (each step's record as a dict, None where there is none; each step's
    ``{"collectives", "syncs"}`` counts). The wrapping is undone even when a step raises."""
    counter = BoundaryCounter(inst)
    records = []
    try:
        for s in range(steps):
            backward(s)
            counter.around(step)
            records.append(inst.last_record.to_dict() if inst.last_record else None)
    finally:
        counter.restore()
    return records, counter.counts


class TinyLM(nn.Module):
    """Token model for the loss-analysis runs: embedding -> linear head over 13 classes. Input
    tokens [B, T] (int64); ``forward`` returns logits [B, T, 13]."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        self.head = nn.Linear(8, 13)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))


#: the loss-analysis run: optimizer steps, micro-batches, data sources configured, z-loss weight
LA_STEPS, LA_GAS, LA_SOURCES, LA_ZW = 12, 2, ["web", "code"], 0.01


def lm_batch(step: int, micro: int, rank: int, b: int = 3, t: int = 5):
    """Deterministic tokens [b, t], labels [b, t] (some -100: ignored) and one source label per
    sequence ("web", "code" or "books": an unconfigured source, counted as "other")."""
    g = torch.Generator().manual_seed(7_000 * step + 70 * micro + rank)
    tokens = torch.randint(0, 13, (b, t), generator=g)
    labels = torch.randint(0, 13, (b, t), generator=g)
    labels[torch.rand(b, t, generator=g) < 0.2] = -100
    sources = [("web", "code", "books")[(step + micro + rank + i) % 3] for i in range(b)]
    return tokens, labels, sources


def lm_losses(logits: torch.Tensor, labels: torch.Tensor):
    """(loss, components, per-token losses [B, T], mask): cross-entropy over the counted tokens
    plus LA_ZW x z-loss (mean squared log-partition, as PaLM's auxiliary z-loss)."""
    import torch.nn.functional as F

    v = logits.shape[-1]
    tok = F.cross_entropy(logits.reshape(-1, v).float(), labels.reshape(-1), reduction="none",
                          ignore_index=-100).reshape(labels.shape)
    mask = labels != -100
    ce = tok[mask].mean()
    z = torch.logsumexp(logits.float(), dim=-1)[mask].pow(2).mean()
    return ce + LA_ZW * z, {"lm": ce, "z": z}, tok, mask


def loss_analysis_loop(inst, rank: int, forward, backward, step, use_logits: bool) -> dict:
    """LA_STEPS optimizer steps of LA_GAS micro-batches of TinyLM; each micro-batch's loss is
    observed with its components (weights: z-loss LA_ZW), per-token losses (``logits=`` and
    ``labels=`` when ``use_logits``, else ``token_losses=`` and ``token_mask=``) and per-sequence
    sources. ``forward(tokens, micro) -> logits``, ``backward(loss, micro)``, ``step()``.
    Returns the records (rank 0) and, gathered from every rank, each micro-batch's loss,
    components and float64 per-token losses recomputed from the logits with their sources."""
    import torch.distributed as dist
    import torch.nn.functional as F

    records, seen = [], []
    counter = BoundaryCounter(inst)
    for s in range(LA_STEPS):
        for micro in range(LA_GAS):
            tokens, labels, sources = lm_batch(s, micro, rank)
            logits = forward(tokens, micro)
            loss, comps, tok, mask = lm_losses(logits, labels)
            if use_logits:
                inst.observe_loss(loss, components=comps, weights={"z": LA_ZW}, logits=logits, labels=labels,
                                  sources=sources)
            else:
                inst.observe_loss(loss, components=comps, weights={"z": LA_ZW}, token_losses=tok, token_mask=mask,
                                  sources=sources)
            ref_tok = F.cross_entropy(logits.detach().double().reshape(-1, 13), labels.reshape(-1), reduction="none",
                                      ignore_index=-100).reshape(labels.shape) if use_logits else tok.detach().double()
            seen.append({"step": s, "loss": float(loss.detach().double()),
                         "comps": {k: float(v.detach().double()) for k, v in comps.items()},
                         "tokens": [[float(ref_tok[i, j]) for j in range(labels.shape[1]) if mask[i, j]]
                                    for i in range(labels.shape[0])],
                         "sources": sources})
            backward(loss, micro)
        counter.around(step)
        records.append(inst.last_record.to_dict() if inst.last_record is not None else None)
    counter.restore()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seen)
    return {"records": records, "seen": gathered, "counts": counter.counts}


def driver_args(**options: str) -> argparse.Namespace:
    """A driver's command line, as :func:`tests.helpers.launch` passes it: ``--out PATH`` (required:
    the JSON rank 0 writes) and ``--NAME`` for each keyword, that value its default
    (``cases="all"``: the comma-separated cases to run, or all). Exits (argparse) on a bad line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    for name, default in options.items():
        ap.add_argument(f"--{name}", default=default)
    return ap.parse_args()


def run_cases(jobs: list[tuple[str, Callable[[int, int], Any]]], cases: str, out: str, rank: int, world: int,
              tag: str, gather: bool = True, extra: Callable[[], dict] | None = None) -> None:
    """Run each ``(key, fn)`` of ``jobs`` selected by ``cases`` ("all" or comma-separated keys)
    on every rank as ``fn(rank, world)``, in order; a case that raises reports its error and
    traceback instead (per case, to the pytest side; each rank also prints it on stderr). With
    ``gather`` each case's per-rank results are all-gathered (``{key: {"ranks": [...]}}``), else
    rank 0 keeps its own (``{key: result}``). Rank 0 writes ``{"world_size": W, "cases": ...}``
    and the keys of ``extra()`` to ``out``; then every rank meets at a barrier."""
    want = None if cases == "all" else set(cases.split(","))
    results, t0 = {}, time.time()
    for key, fn in jobs:
        if want is not None and key not in want:
            continue
        t = time.time()
        try:
            res = fn(rank, world)
        except Exception as e:  # noqa: BLE001 - reported per case by the pytest side
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(f"[{tag}] rank {rank} {key}: {res['traceback']}", file=sys.stderr, flush=True)
        if gather:
            per_rank = [None] * world
            dist.all_gather_object(per_rank, res)
            results[key] = {"ranks": per_rank}
        else:
            results[key] = res
        if rank == 0:
            print(f"[{tag}] {key}: {'error' if 'error' in res else 'ok'} ({time.time() - t:.2f}s)", flush=True)
    if rank == 0:
        print(f"[{tag}] total {time.time() - t0:.1f}s", flush=True)
        with open(out, "w") as f:
            json.dump({"world_size": world, "cases": results, **(extra() if extra else {})}, f)
    dist.barrier()
