"""Multi-rank driver for tests/test_causes.py (one torchrun launch, 3 gloo CPU ranks): realistic
failures made with a model and training loop of its own (no injection into distgrad's view),
and whether distgrad names their cause.

Model (:class:`CauseModel`): ``feat_norm`` (an RMS normalisation of the input features without
epsilon, as hand-written normalisations often are) -> ``inp`` -> 2 MLP blocks -> ``head``;
a fixed teacher labels random inputs, so the loss falls smoothly on a healthy run.

Cases (each returns JSON-able records of rank 0 and per-rank facts):
  nan:  DDP; at step 4 rank 1's batch holds an all-zero sample (a zero-padded row): 0/0 in
        ``feat_norm`` makes the loss and every gradient of rank 1 NaN; the all-reduce then
        spreads it to every rank.
  detached: DDP(find_unused_parameters=True) with an adapter added through a stray .detach():
        its parameters' gradients stay None on every rank.
  spike-healthy / spike-garbage / spike-lr: 300 healthy steps; one rank's garbage batch at
        step 150; a 30x learning-rate blow-up at step 20 (see :func:`spike_case`).
  flip: DDP with a comm hook that, after the all-reduce, flips the sign of one element of
        the reduced gradient on rank 2 at step 3 and one low mantissa bit on rank 0 at step 5.
  module-ddp / -fsdp1 / -fsdp2 / -zero3: ``log(softmax(.))`` in ``layers.1.router`` goes
        -inf for one sample of rank 1's second micro-batch at step 3 (see :func:`module_case`).
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import distgrad
from distgrad.report import analyze

from tests.dist.engines import adamw, build_ddp, build_deepspeed, build_fsdp1, build_fsdp2, sgd
from tests.dist.common import driver_args, HostSyncs, run_cases

D_IN, D, CLASSES, BATCH = 8, 16, 5, 16


class RMSNormNoEps(nn.Module):
    """``x / sqrt(mean(x^2))`` with a learned gain and no epsilon: NaN (0/0) for an all-zero row."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x / x.pow(2).mean(-1, keepdim=True).sqrt()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class CauseModel(nn.Module):
    """``detached_adapter``: an extra ``adapter`` (Linear) whose output is added with a stray
    ``.detach()`` -- a classic bug: its parameters never receive a gradient."""

    def __init__(self, detached_adapter: bool = False) -> None:
        super().__init__()
        self.feat_norm = RMSNormNoEps(D_IN)
        self.inp = nn.Linear(D_IN, D)
        self.layers = nn.ModuleList([Block(D) for _ in range(2)])
        self.adapter = nn.Linear(D, D) if detached_adapter else None
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.feat_norm(x))
        for b in self.layers:
            h = b(h)
        if self.adapter is not None:
            h = h + self.adapter(h).detach()
        return F.cross_entropy(self.head(h), y)


_TEACHER = torch.Generator().manual_seed(99)
TEACHER = torch.randn(D_IN, CLASSES, generator=_TEACHER)


def batch(step: int, rank: int, micro: int = 0, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + micro)
    x = torch.randn(size, D_IN, generator=g)
    return x, (x @ TEACHER).argmax(-1)


def _slim(rec) -> dict:
    return {"step": rec.step, "grad_norm": rec.grad_norm, "loss": rec.loss, "counters": dict(rec.counters),
            "culprit_module": rec.culprit_module.to_dict() if rec.culprit_module else None,
            "nonfinite": rec.nonfinite, "nonfinite_ranks": rec.nonfinite_ranks, "culprits": [c.to_dict() for c in rec.culprits],
            "replica_mismatch_ranks": rec.replica_mismatch_ranks, "step_applied": rec.step_applied}


def _ddp(seed: int = 0, detached_adapter: bool = False, **kw) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    return build_ddp(CauseModel(detached_adapter), optim=sgd(0.1), **kw)


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast",
               "reduce_scatter_tensor", "all_gather_object", "all_to_all_single", "reduce")


class Counting:
    """Counts torch.distributed collectives and host syncs made inside the instrument's
    ``collect`` / ``finish`` (the sampled step's work) and host syncs during backward."""

    def __init__(self, inst) -> None:
        self.state = {"in": None, "collectives": 0, "syncs": 0}
        #: the same counts for the culprit-module replay (``inst.replay.boundary``), separately
        self.replay = {"collectives": 0, "syncs": 0}
        self.originals = {fn: getattr(dist, fn) for fn in COLLECTIVES if hasattr(dist, fn)}
        for name in ("collect", "finish"):
            setattr(inst, name, self._window(getattr(inst, name), self.state))
        if inst.replay is not None:
            inst.replay.boundary = self._window(inst.replay.boundary, self.replay)
        for fn in self.originals:
            setattr(dist, fn, self._counting(fn))

    def _counting(self, fn):
        def call(*a, **kw):
            if self.state["in"] is not None:
                self.state["in"]["collectives"] += 1
            return self.originals[fn](*a, **kw)
        return call

    def _window(self, method, into):
        def call(*a, **kw):
            self.state["in"] = into
            with HostSyncs() as m:
                try:
                    return method(*a, **kw)
                finally:
                    self.state["in"] = None
                    into["syncs"] += m.n
        return call

    def take(self) -> dict:
        out = {k: self.state[k] for k in ("collectives", "syncs")}
        self.state["collectives"] = self.state["syncs"] = 0
        return out

    def take_replay(self) -> dict:
        out = dict(self.replay)
        self.replay.update(collectives=0, syncs=0)
        return out

    def restore(self) -> None:
        for fn, f in self.originals.items():
            setattr(dist, fn, f)


def nan_case(rank: int, world: int) -> dict:
    model, opt = _ddp()
    inst = distgrad.instrument(model, optimizer=opt, exporter={"port": 0, "host": "127.0.0.1"})
    count = Counting(inst)
    recs, local_loss, counts, backward_syncs, replay_counts = [], [], [], [], []
    try:
        for step in range(7):
            x, y = batch(step, rank)
            if step == 4 and rank == 1:
                x[0] = 0.0  # a zero-padded sample
            loss = model(x, y)
            local_loss.append(loss.item())
            inst.observe_loss(loss)
            with HostSyncs() as m:
                loss.backward()
            backward_syncs.append(m.n)
            count.take()
            opt.step()
            counts.append(count.take())
            replay_counts.append(count.take_replay())
            opt.zero_grad()
            recs.append(_slim(inst.last_record))
    finally:
        count.restore()
    served = ""
    if inst.prometheus is not None:
        from prometheus_client import generate_latest

        served = "\n".join(ln for ln in generate_latest(inst.prometheus.registry).decode().splitlines()
                           if ln.startswith(("distgrad_nonfinite_culprit", "distgrad_nonfinite_params",
                                             "distgrad_nonfinite_replay")))
    inst.close()
    return {"records": recs, "local_loss": local_loss, "counts": counts, "backward_syncs": backward_syncs,
            "served": served, "replay_counts": replay_counts}


def flip_case(rank: int, world: int) -> dict:
    model, opt = _ddp()
    state = {"step": 0}
    changed = []

    def hook(st, bucket):
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()

        def then(f):
            t = f.value()[0]
            if rank == 2 and st["step"] == 3:
                t[3] = -t[3]
                changed.append((st["step"], "sign"))
            if rank == 0 and st["step"] == 5:
                t.view(torch.int32)[7] ^= 1  # lowest mantissa bit
                changed.append((st["step"], "bit"))
            return t
        return fut.then(then)

    model.register_comm_hook(state, hook)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False})
    recs, old_fp = [], []
    for step in range(7):
        state["step"] = step
        x, y = batch(step, rank)
        loss = model(x, y)
        loss.backward()
        # the previous fingerprint (sum of squares of the whole copy), for the record
        grads = [p.grad.reshape(-1) for p in model.parameters()]
        ss = torch.tensor([sum(float(torch.dot(g.double(), g.double())) for g in grads)], dtype=torch.float64)
        all_ss = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(all_ss, ss)
        old_fp.append([float(t) for t in all_ss])
        opt.step()
        opt.zero_grad()
        recs.append(_slim(inst.last_record))
    inst.close()
    return {"records": recs, "old_fingerprints": old_fp, "changed": changed}


def detached_case(rank: int, world: int) -> dict:
    """DDP(find_unused_parameters=True) over a model whose adapter output is detached."""
    model, opt = _ddp(detached_adapter=True, find_unused_parameters=True)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False})
    recs, none_grads = [], []
    for step in range(5):
        x, y = batch(step, rank)
        model(x, y).backward()
        none_grads.append(sorted(n for n, p in model.module.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
        h = inst.last_record.health
        recs.append({"step": inst.last_record.step, "n_no_grad": h.n_no_grad, "no_grad": h.no_grad,
                     "vanishing": h.vanishing, "names": list(inst.last_record.params.names)})
    inst.close()
    return {"records": recs, "none_grads": none_grads}


# ---------------------------------------------------------------------------- every engine
#: engine runs of :func:`engine_case`: DeepSpeed ZeRO 0-3; FSDP1 in both parameter modes with
#: the adapter in its own unit ("own") or in the root unit with other parameters ("shared"); FSDP2
ENGINE_KINDS = ("ds-z0", "ds-z1", "ds-z2", "ds-z3", "fsdp1-orig-own", "fsdp1-orig-shared",
                "fsdp1-flat-own", "fsdp1-flat-shared", "fsdp2")
ENGINE_STEPS, PAD_STEP, PAD_RANK = 6, 4, 1


class PaddedNormModel(CauseModel):
    """:class:`CauseModel` with a detached adapter, a per-sample mask (the loader pads a short
    last batch by repeating samples and masks them out, as ``DistributedSampler``-style loaders
    do) and a small feature-norm penalty on the hidden states, written by hand as
    ``sqrt(sum(h^2))`` over masked rows. A masked row is an all-zero vector: its norm is 0
    (finite), but the backward of ``sqrt`` at 0 is ``0 / (2 * 0)`` = NaN, which flows into every
    parameter below the head. The loss stays finite: a NaN made only in the backward pass."""

    def __init__(self) -> None:
        super().__init__(detached_adapter=True)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.feat_norm(x))
        for b in self.layers:
            h = b(h)
        h = h + self.adapter(h).detach()  # the stray .detach(): the adapter never gets a gradient
        ce = F.cross_entropy(self.head(h), y, reduction="none")
        norm = (h * mask[:, None]).pow(2).sum(-1).sqrt()
        return ((ce + 1e-3 * norm) * mask).sum() / mask.sum()


def _padded_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = batch(step, rank)
    mask = torch.ones(BATCH)
    if step == PAD_STEP and rank == PAD_RANK:  # a short last batch: the last row repeats the first
        x[-1], y[-1], mask[-1] = x[0], y[0], 0.0
    return x, y, mask


def _clean(name: str) -> str:
    for junk in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(junk, "")
    return name


def _wrap_engine(kind: str, model: PaddedNormModel):
    """Returns (forward-backward-step callable, instrument, full weights callable)."""
    if kind.startswith("ds-"):
        import deepspeed

        engine, _ = build_deepspeed(model, int(kind[-1]), micro_batch=BATCH, lr=1e-2)
        inst = distgrad.instrument(engine, exporter={"enabled": False})

        from deepspeed.utils import safe_get_full_grad

        def train(x, y, mask):
            loss = engine(x, y, mask)
            engine.backward(loss)
            # the engine's own view of the adapter's reduced gradient, before the step clears it
            seen = [_maxabs(safe_get_full_grad(p)) for p in engine.module.adapter.parameters()]
            engine.step()
            return loss, seen

        def full():
            params = list(engine.module.parameters())
            ctx = deepspeed.zero.GatheredParameters(params) if kind == "ds-z3" else contextlib.nullcontext()
            with ctx:
                return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        return train, inst, full
    if kind.startswith("fsdp1"):
        own = kind.endswith("-own")
        wrapped, opt = build_fsdp1(model, wrap=lambda m: isinstance(m, Block) or (own and m is model.adapter),
                                   orig_params="-orig-" in kind, optim=adamw(1e-2))

        def full():
            return {_clean(n): t.detach().clone() for n, t in wrapped.state_dict().items()}
    else:
        wrapped, opt = build_fsdp2(model, (*model.layers, model.adapter), optim=adamw(1e-2))

        def full():
            return {n: t.full_tensor().detach().clone() for n, t in wrapped.state_dict().items()}
    inst = distgrad.instrument(wrapped, optimizer=opt, exporter={"enabled": False})
    if kind == "fsdp1-flat-own":  # the adapter's own unit's FlatParameter
        holders = [lambda: model.adapter._flat_param.grad]
    elif kind == "fsdp1-flat-shared":  # this rank's part of the adapter's segment of the root's FlatParameter
        holders = [functools.partial(_flat_segment, fp, f) for fp in wrapped.parameters()
                   for f in fp._fqns if f.startswith("adapter.")]
    else:
        holders = [lambda p=p: p.grad for p in model.adapter.parameters()]

    def train(x, y, mask):
        opt.zero_grad()
        loss = wrapped(x, y, mask)
        loss.backward()
        seen = [_maxabs(h()) for h in holders]  # this rank's part of the engine's reduced gradient
        opt.step()
        return loss, seen
    return train, inst, full


def _flat_segment(fp, fqn: str) -> "torch.Tensor | None":
    """This rank's part of parameter ``fqn``'s segment of a FlatParameter's gradient shard
    (use_orig_params=False: the parameters lie one after another in ``_fqns`` order, ``_numels``
    elements each, and rank r holds elements ``[r * shard, (r + 1) * shard)``); None when the
    FlatParameter has no gradient, an empty tensor when this rank holds none of the segment."""
    g = fp.grad
    if g is None:
        return None
    i = list(fp._fqns).index(fqn)
    start = sum(int(n) for n in list(fp._numels)[:i])
    end = start + int(fp._numels[i])
    lo = dist.get_rank() * g.numel()
    a, b = max(start, lo), min(end, lo + g.numel())
    return g.reshape(-1)[a - lo:b - lo] if a < b else g.reshape(-1)[:0]


def _maxabs(g: "torch.Tensor | None") -> "float | None":
    if g is None:
        return None
    g = g.to_local() if hasattr(g, "to_local") else g
    return float(g.detach().abs().max()) if g.numel() else 0.0


def _own_grad_nonfinite(weights: dict, x, y, mask) -> bool:
    """The reference, computed another way: this rank's own gradient of its batch, from a plain
    float64 copy of the model loaded with the full weights (no engine, no hooks)."""
    ref = PaddedNormModel().double()
    ref.load_state_dict({k: v.double() for k, v in weights.items()})
    ref(x.double(), y, mask.double()).backward()
    return not all(bool(torch.isfinite(p.grad).all()) for p in ref.parameters() if p.grad is not None)


def engine_case(kind: str, rank: int, world: int) -> dict:
    """:class:`PaddedNormModel` under one engine for :data:`ENGINE_STEPS` steps: rank
    :data:`PAD_RANK`'s batch at step :data:`PAD_STEP` is padded (a NaN made only in its
    backward pass); the adapter never gets a gradient. Per step: the local loss, the reference
    of whether this rank's own gradient was non-finite (steps before the optimizer applied the
    NaN), the engine's own view of the adapter's gradient on this rank (None, or its largest
    magnitude: DeepSpeed's ``safe_get_full_grad``; FSDP1/2 ``.grad`` of the adapter's parameters
    or of the FlatParameter holding them), and distgrad's record (culprits, no-grad and vanishing parameters, the adapter's
    statistics)."""
    torch.manual_seed(0)
    train, inst, full = _wrap_engine(kind, PaddedNormModel())
    recs, local_loss, own_bad, engine_adapter = [], [], [], []
    for step in range(ENGINE_STEPS):
        x, y, mask = _padded_batch(step, rank)
        if step <= PAD_STEP:
            own_bad.append(_own_grad_nonfinite(full(), x, y, mask))
        loss, seen = train(x, y, mask)
        local_loss.append(float(loss.detach()))
        engine_adapter.append(seen)
        rec = inst.last_record
        names = list(rec.params.names)
        adapter = {n: {"numel": float(rec.params.numel[i]), "norm": float(rec.params.norm[i]),
                       "zeros": float(rec.params.zeros[i])} for i, n in enumerate(names) if n.startswith("adapter.")}
        recs.append({"step": rec.step, "nonfinite": rec.nonfinite, "culprits": [c.to_dict() for c in rec.culprits],
                     "nonfinite_ranks": rec.nonfinite_ranks, "names": names, "adapter": adapter,
                     "n_no_grad": rec.health.n_no_grad, "no_grad": rec.health.no_grad,
                     "vanishing": rec.health.vanishing, "internal_errors": rec.counters.get("internal_errors", 0),
                     "step_applied": rec.step_applied})
    inst.close()
    return {"records": recs, "local_loss": local_loss, "own_bad": own_bad, "engine_adapter": engine_adapter}


def spike_case(mode: str, rank: int, world: int) -> dict:
    """DDP, 64 samples per rank, SGD lr 0.05. ``healthy``: 300 steps. ``garbage``: at step 150
    rank 1's batch has 16 of its 64 labels wrong (a corrupted shard: the global loss about
    doubles). ``lr``: at step 20 the learning rate is multiplied by 30 (a scheduler bug)."""
    model, opt = _ddp()
    for g in opt.param_groups:
        g["lr"] = 0.05
    log = Path(tempfile.mkdtemp(prefix=f"spike-{mode}-")) / "run.jsonl"
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, sinks={"jsonl": {"path": str(log)}})
    steps = {"healthy": 300, "garbage": 156, "lr": 30}[mode]
    out = []
    for step in range(steps):
        if mode == "lr" and step == 20:
            for g in opt.param_groups:
                g["lr"] *= 30
        x, y = batch(step, rank, size=64)
        if mode == "garbage" and step == 150 and rank == 1:
            y[:16] = (y[:16] + 2) % CLASSES
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rec = inst.last_record
        out.append({"step": rec.step, "loss": rec.loss, "grad_norm": rec.grad_norm, "fired": rec.spikes.fired,
                    "loss_max_rank": rec.ranks.loss_max_rank if rec.ranks is not None else None,
                    "rank_loss": list(rec.ranks.loss_mean) if rec.ranks is not None else None,
                    "incidents": rec.incidents.to_dict()})
    totals = {s: dict(m.spikes) for s, m in inst.diagnostics.monitors.items()}
    replays = inst.replay.replays
    inst.close()
    verdict = None
    if rank == 0:  # the offline verdict (distgrad summary) of the run's JSONL log
        a = analyze(log)
        verdict = {"healthy": a.healthy, "problems": [[p.kind, p.step, p.ranks, p.detail] for p in a.problems]}
    shutil.rmtree(log.parent, ignore_errors=True)
    return {"records": out, "totals": totals, "replays": replays, "verdict": verdict}


class Router(nn.Module):
    """Routing log-probabilities written as ``log(softmax(.))`` instead of ``log_softmax``: a
    sample whose logits are far apart gets exact-0 probabilities, and log(0) = -inf."""

    def __init__(self, d: int, experts: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(d, experts)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.proj(h), -1))


class RoutedBlock(nn.Module):
    def __init__(self, d: int, experts: int = 4) -> None:
        super().__init__()
        self.router = Router(d, experts)
        self.mix = nn.Linear(experts, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mix(self.router(h))


class ModuleCaseModel(nn.Module):
    """inp -> dropout -> MLP block -> routed block (``layers.1.router``) -> BatchNorm -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.drop = nn.Dropout(0.2)
        self.layers = nn.ModuleList([Block(D), RoutedBlock(D)])
        self.bn = nn.BatchNorm1d(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.inp(x))
        for b in self.layers:
            h = b(h)
        return F.cross_entropy(self.head(self.bn(h)), y)


#: the module case: optimizer steps, micro-batches per step, and the (step, rank, micro-batch)
#: whose first sample is scaled by 1e4 (a unit mix-up in the data): the router's logits then lie
#: ~1e3 apart, softmax underflows to exact zeros and log(0) = -inf
MOD_STEPS, MOD_GAS, MOD_BAD = 6, 2, (3, 1, 1)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """What the replay must leave alone: the CPU RNG state, the module buffers (BatchNorm running
    statistics) and the optimizer state (cloned, DTensors as their local shards)."""
    state = [(k, _local(v).detach().clone()) for st in opt.state.values() for k, v in sorted(st.items())
             if isinstance(v, torch.Tensor)]
    return {"rng": torch.get_rng_state().clone(), "buffers": [b.detach().clone() for b in model.buffers()],
            "opt": state}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


def _same_snapshot(x: dict, y: dict) -> bool:
    return (_same(x["rng"], y["rng"]) and len(x["buffers"]) == len(y["buffers"])
            and all(_same(a, b) for a, b in zip(x["buffers"], y["buffers"]))
            and [k for k, _ in x["opt"]] == [k for k, _ in y["opt"]]
            and all(_same(a, b) for (_, a), (_, b) in zip(x["opt"], y["opt"])))


def module_case(engine: str, rank: int, world: int) -> dict:
    """A NaN made in the forward pass of ``layers.1.router`` by one micro-batch of one rank
    (:data:`MOD_BAD`), under ``engine`` ("ddp": DDP with ``no_sync`` accumulation; "fsdp1":
    FullyShardedDataParallel per block and at the root, ``use_orig_params``; "fsdp2":
    ``fully_shard`` per block and at the root; "zero3": DeepSpeed ZeRO-3), 2 micro-batches per
    step, trained twice: with the culprit-module replay (the default) and with ``tracer.replays:
    0``. Returns the first run's per-step facts (:func:`_module_run`) and ``same_training``:
    every micro-batch loss (NaN equal to NaN) and every final parameter shard equal in both runs,
    i.e. training after the replay is bit for bit the training without it."""
    on = _module_run(engine, rank, 4)
    off = _module_run(engine, rank, 0)
    same = (len(on["losses"]) == len(off["losses"])
            and all(a == b or (a != a and b != b) for a, b in zip(on["losses"], off["losses"]))
            and len(on["params"]) == len(off["params"]) and all(_same(a, b) for a, b in zip(on["params"], off["params"])))
    return {"records": on["records"], "same_training": same, "losses": on["losses"]}


def _module_run(engine: str, rank: int, replays: int) -> dict:
    """One training run of :func:`module_case`. Records per step: the record's culprit module,
    the replays made, the replay's collectives, whether the RNG state / buffers / optimizer state
    seen by an optimizer step pre-hook registered before ``instrument()`` equal those seen by one
    registered after it (distgrad's pre-hook, where the replay runs, sits between them), and, as
    the reference, the first module whose output went non-finite in the training forward itself
    (plain forward hooks of the driver's own). A last pre-hook replaces the NaN gradients by 0
    after distgrad has read them (the user's own guard), so training goes on finite."""
    import contextlib

    torch.manual_seed(0)
    user = ModuleCaseModel()
    names = {m: n for n, m in user.named_modules() if n}
    first_bad: dict = {}
    cur = {"key": None}

    def hook(m, args, out):
        if torch.is_grad_enabled() and cur["key"] not in first_bad and not bool(torch.isfinite(out).all()):
            first_bad[cur["key"]] = names[m]
    for m in names:
        m.register_forward_hook(hook)
    if engine == "zero3":
        return _module_case_zero3(user, hook_state=(first_bad, cur), rank=rank, replays=replays)
    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    if engine == "ddp":
        model, opt = build_ddp(user, optim=adam)
    elif engine == "fsdp1":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model, opt = build_fsdp1(user, auto_wrap_policy=ModuleWrapPolicy({Block, RoutedBlock}), optim=adam)
    else:
        model, opt = build_fsdp2(user, user.layers, optim=adam)
    snaps: dict = {}
    opt.register_step_pre_hook(lambda o, a, k: snaps.__setitem__("before", _snapshot(user, o)))
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, tracer={"replays": replays})
    opt.register_step_pre_hook(lambda o, a, k: snaps.__setitem__("after", _snapshot(user, o)))

    def sanitize(o, a, k):
        for p in model.parameters():
            if p.grad is not None:
                _local(p.grad).nan_to_num_(0.0, 0.0, 0.0)
    opt.register_step_pre_hook(sanitize)
    count = Counting(inst)
    out, losses = [], []
    try:
        for step in range(MOD_STEPS):
            for micro in range(MOD_GAS):
                x, y = batch(step, rank, micro)
                if (step, rank, micro) == MOD_BAD:
                    x[0] *= 1e4
                cur["key"] = (step, micro)
                sync = model.no_sync() if engine == "ddp" and micro < MOD_GAS - 1 else contextlib.nullcontext()
                with sync:
                    loss = model(x, y)
                    (loss / MOD_GAS).backward()
                losses.append(loss.item())
            count.take()
            opt.step()
            opt.zero_grad()
            rec = inst.last_record
            out.append({"step": rec.step, "nonfinite": rec.nonfinite,
                        "culprits": [c.rank for c in rec.culprits],
                        "culprit_module": rec.culprit_module.to_dict() if rec.culprit_module else None,
                        "replays": inst.replay.replays, "replay_counts": count.take_replay(),
                        "untouched": _same_snapshot(snaps["before"], snaps["after"]),
                        "reference": [first_bad.get((step, m)) for m in range(MOD_GAS)]})
    finally:
        count.restore()
    inst.close()
    return {"records": out, "losses": losses, "params": [_local(p).detach().clone() for p in model.parameters()]}


def _module_case_zero3(user: nn.Module, hook_state: tuple, rank: int, replays: int) -> dict:
    """:func:`module_case` under DeepSpeed ZeRO-3 (parameters partitioned: the replayed forward
    gathers them on every rank), AdamW, 2 micro-batches per step (DeepSpeed's own accumulation).
    ``untouched``: the CPU RNG state and the BatchNorm buffers are the same before and after
    ``engine.step()``, inside which the replay runs (DeepSpeed's optimizer touches neither)."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see launch/train.py skip_cpu_shm_op
    first_bad, cur = hook_state
    engine, _ = build_deepspeed(user, 3, gas=MOD_GAS, micro_batch=BATCH)
    inst = distgrad.instrument(engine, exporter={"enabled": False}, tracer={"replays": replays})
    count = Counting(inst)
    out, losses = [], []
    try:
        for step in range(MOD_STEPS):
            untouched = True
            for micro in range(MOD_GAS):
                x, y = batch(step, rank, micro)
                if (step, rank, micro) == MOD_BAD:
                    x[0] *= 1e4
                cur["key"] = (step, micro)
                loss = engine(x, y)
                losses.append(loss.item())
                engine.backward(loss)
                before = (torch.get_rng_state().clone(), [b.detach().clone() for b in user.buffers()])
                count.take()
                engine.step()  # the boundary is inside, on the last micro-batch
                after = (torch.get_rng_state(), list(user.buffers()))
                untouched &= _same(before[0], after[0]) and all(_same(a, b) for a, b in zip(before[1], after[1]))
            rec = inst.last_record
            out.append({"step": rec.step, "nonfinite": rec.nonfinite,
                        "culprits": [c.rank for c in rec.culprits],
                        "culprit_module": rec.culprit_module.to_dict() if rec.culprit_module else None,
                        "replays": inst.replay.replays, "replay_counts": count.take_replay(),
                        "untouched": untouched, "step_applied": rec.step_applied,
                        "reference": [first_bad.get((step, m)) for m in range(MOD_GAS)]})
    finally:
        count.restore()
    inst.close()
    from deepspeed.utils import safe_get_local_fp32_param

    params = []
    for p in user.parameters():  # this rank's fp32 partition without the last ranks' padding
        w = safe_get_local_fp32_param(p).detach().reshape(-1)
        params.append(w[:max(0, min(w.numel(), int(p.ds_numel) - rank * w.numel()))].clone())
    return {"records": out, "losses": losses, "params": params}


def main() -> None:
    args = driver_args(cases="all")
    dist.init_process_group("gloo")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see launch/train.py skip_cpu_shm_op
    rank, world = dist.get_rank(), dist.get_world_size()
    jobs = [("nan", nan_case), ("flip", flip_case), ("detached", detached_case)]
    jobs += [(f"spike-{m}", functools.partial(spike_case, m)) for m in ("healthy", "garbage", "lr")]
    jobs += [(f"engine-{k}", functools.partial(engine_case, k)) for k in ENGINE_KINDS]
    jobs += [(f"module-{e}", functools.partial(module_case, e)) for e in ("ddp", "fsdp1", "fsdp2", "zero3")]
    run_cases(jobs, args.cases, args.out, rank, world, "cause_cases")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
