"""Healthy-run corpus and realistic failures for the paging evidence (issue 23, item 3):
tests/monitoring/test_paging_corpus.py serves these runs to a real Prometheus + Alertmanager,
launch/paging_eval.py replays their JSONL records through the shipped rules.

Each run is a small training job of its own: a tiny causal language model (GPT-style: learned
positions, LayerNorm, GELU MLP; or LLaMA-style: RoPE, RMSNorm, SwiGLU, no biases) on a fixed
Markov-chain language, or an MLP classifier on a fixed teacher; under a plain module on one
process, DDP, DeepSpeed ZeRO-2 or FSDP2 (2 gloo ranks); AdamW or SGD with momentum; a
learning-rate schedule with or without warm-up (cosine, linear or constant after it); gradient
clipping at a threshold the gradient norm does reach (active), or none. Small batches are
included on purpose: their gradient norm jumps 2-2.5x from step to step in healthy training.
Everything is seeded: the same run gives the same records (up to float reduction order).

Sets (:data:`RUNS`):
  tune:    the runs the detection policy may be tuned on (their JSONL: /work/corpus/tune/ while
           the work is under way; ``python tests/dist/corpus_cases.py --list`` describes them).
  heldout: other shapes, batch sizes, schedules and engine/optimizer pairings, never tuned on.
  faults:  realistic failures (2 ranks, DDP), each at a known step: ``garbage`` (rank 1's
           batch replaced by random tokens: a corrupted shard), ``lr`` (the learning
           rate multiplied by 100: a scheduler bug; the loss does not come back; and a 30x
           one it recovers from, which must not page), ``nan`` (``blocks.1.mlp`` on rank 1 returns
           NaN in its forward for one step: a numerically broken kernel / bad input).

Launch: ``torchrun --nproc_per_node 2 tests/dist/corpus_cases.py --out OUT.json --set tune``
runs the set's 2-rank runs one after the other; ``--nproc_per_node 1`` its one-process (plain
module) runs. Each run writes rank 0's JSONL records to ``--jsonl-dir/<run>.jsonl`` and, with
``--sd-dir``, serves its exporter on a free port registered as a Prometheus file_sd target
(``<sd-dir>/<run>.json``, label ``run=<run>``; removed by ``dg.close()``) after ``--hold``
seconds past its last step, so Prometheus scrapes its final state. OUT.json (rank 0): per run,
its spec, the loop's own per-step losses and learning rates, and the injected fault's step /
rank / module.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distgrad.signals.logits import observe_attention
from tests.dist.engines import build_ddp, build_deepspeed, build_fsdp2


@dataclass(frozen=True)
class Run:
    """One corpus run. ``engine``: plain | ddp | zero2 | fsdp2. ``model``: gpt | llama | mlp.
    ``batch``: sequences (or samples) per rank per step. ``warmup``: linear warm-up steps (0:
    none); ``decay``: cosine | linear | constant after it (to 10% of ``lr`` at the last step).
    ``clip``: global grad-norm threshold or None. ``opt``: adamw | sgdm. ``fault``: None or
    garbage | lr | nan, made at step ``fault_step`` (on rank :data:`FAULT_RANK` when per rank)."""

    name: str
    set: str
    engine: str
    model: str
    layers: int
    width: int
    vocab: int
    seq: int
    batch: int
    steps: int
    lr: float
    warmup: int
    decay: str
    clip: float | None
    opt: str
    seed: int
    fault: str | None = None
    fault_step: int = -1
    heads: int = 2
    #: "markov" (a fixed Markov-chain language, ``vocab`` tokens) or "text" (bytes of the Python
    #: standard library's sources, as launch/train.py's example: burstier gradients; vocab 256)
    data: str = "markov"
    #: the ``lr`` fault's learning-rate multiplier
    lr_mult: float = 100.0
    #: whether the fault must page (False: a recovered instability, which must NOT page)
    pages: bool = True

    @property
    def event_step(self) -> int:
        """The first step whose record can show the fault: the garbage batch's and the NaN's own
        step; for ``lr`` the step after the jump (the step where the learning rate is raised is
        still computed on the weights before its update)."""
        return self.fault_step + 1 if self.fault == "lr" else self.fault_step

    @property
    def world(self) -> int:
        return 1 if self.engine == "plain" else 2


#: ``--opt-in``: the opt-in signal families whose alerts apply to these models (attention logits
#: -> DistgradAttentionLogitHigh, update geometry -> DistgradUpdateRatioHigh; replica weight hashes
#: -> DistgradReplicaWeightsDiverged are added on the layouts with replicated weights), so their
#: false-page rate is measured on the same healthy runs as the default rules'
OPT_IN: dict = {"logits": {"attention": True, "attention_modules": r"blocks\.\d+\.attn$", "output": True,
                           "output_module": "head"},
                "update_geometry": {"enabled": True}}

#: the rank whose batch / forward goes bad in the per-rank faults
FAULT_RANK = 1
#: the module whose forward output the ``nan`` fault makes NaN
NAN_MODULE = "blocks.1.mlp"

RUNS: tuple[Run, ...] = (
    # ---- tune: the policy may look at these
    Run("tune-plain-gpt-text-b4", "tune", "plain", "gpt", 2, 32, 256, 32, 4, 300, 3e-3, 20, "cosine", 1.0, "adamw", 1,
        data="text"),
    Run("tune-plain-mlp-sgdm", "tune", "plain", "mlp", 3, 64, 10, 0, 8, 250, 0.05, 0, "constant", None, "sgdm", 2),
    Run("tune-ddp-llama-b8", "tune", "ddp", "llama", 2, 48, 64, 16, 8, 250, 2e-3, 25, "linear", 0.5, "adamw", 3),
    Run("tune-zero2-gpt-text-b4", "tune", "zero2", "gpt", 3, 32, 256, 32, 4, 250, 1e-3, 0, "cosine", 1.0, "adamw", 4,
        data="text"),
    Run("tune-ddp-llama-text-b2", "tune", "ddp", "llama", 2, 48, 256, 32, 2, 250, 3e-3, 30, "cosine", 1.0, "adamw", 6,
        data="text"),
    Run("tune-fsdp2-llama-b2", "tune", "fsdp2", "llama", 2, 32, 48, 12, 2, 200, 0.1, 10, "constant", None, "sgdm", 5),
    # ---- held out: nobody tunes on these (other shapes, batches, schedules, pairings)
    Run("held-plain-llama-b16", "heldout", "plain", "llama", 3, 40, 40, 16, 16, 200, 1e-3, 0, "constant", None, "adamw", 11),
    Run("held-ddp-mlp-b4", "heldout", "ddp", "mlp", 2, 96, 16, 0, 4, 200, 3e-3, 15, "cosine", 0.25, "adamw", 12),
    Run("held-zero2-llama-sgdm", "heldout", "zero2", "llama", 2, 24, 96, 16, 8, 200, 0.2, 0, "linear", 1.0, "sgdm", 13),
    Run("held-zero2-llama-text-b4", "heldout", "zero2", "llama", 2, 32, 256, 32, 4, 200, 2e-3, 20, "cosine", 1.0,
        "adamw", 16, data="text"),
    Run("held-fsdp2-gpt-text-b4", "heldout", "fsdp2", "gpt", 2, 48, 256, 24, 4, 200, 2e-3, 30, "linear", 1.0, "adamw",
        14, data="text"),
    Run("held-ddp-gpt-b2", "heldout", "ddp", "gpt", 1, 16, 16, 8, 2, 200, 5e-3, 0, "cosine", None, "adamw", 15),
    # ---- realistic failures (DDP, 2 ranks), each at a known step
    Run("fault-garbage", "faults", "ddp", "gpt", 2, 32, 32, 16, 8, 165, 3e-3, 10, "constant", None, "adamw", 21,
        fault="garbage", fault_step=140),
    Run("fault-lr", "faults", "ddp", "gpt", 2, 32, 32, 16, 8, 55, 3e-3, 10, "constant", None, "adamw", 22,
        fault="lr", fault_step=30),
    # the same at 30x (tests/test_causes.py's factor, there with SGD): under AdamW the loss jumps
    # ~1.5x and is back below its pre-fault level within ~10 steps -- a recovered instability,
    # which by issue 23's policy may open a ticket but must not page
    Run("fault-lr30-recovers", "faults", "ddp", "gpt", 2, 32, 32, 16, 8, 55, 3e-3, 10, "constant", None, "adamw", 22,
        fault="lr", fault_step=30, lr_mult=30.0, pages=False),
    Run("fault-nan", "faults", "ddp", "gpt", 2, 32, 32, 16, 8, 50, 3e-3, 10, "constant", None, "adamw", 23,
        fault="nan", fault_step=25),
)
SETS = ("tune", "heldout", "faults")


# -------------------------------------------------------------------------------- models
class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` [B, H, T, Dh] (Dh even), base 10000."""
    t, dh = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, llama: bool) -> None:
        super().__init__()
        self.heads, self.llama = heads, llama
        self.qkv = nn.Linear(d, 3 * d, bias=not llama)
        self.proj = nn.Linear(d, d, bias=not llama)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(h).chunk(3, -1))
        if self.llama:
            q, k = rope(q), rope(k)
        observe_attention(self, q, k, is_causal=True)  # distgrad's hook point (a no-op unless watched)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int, llama: bool) -> None:
        super().__init__()
        self.llama = llama
        hidden = 4 * d if not llama else (8 * d) // 3
        self.fc = nn.Linear(d, hidden, bias=not llama)
        self.gate = nn.Linear(d, hidden, bias=False) if llama else None
        self.out = nn.Linear(hidden, d, bias=not llama)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.llama:
            return self.out(F.silu(self.gate(h)) * self.fc(h))
        return self.out(F.gelu(self.fc(h)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, llama: bool) -> None:
        super().__init__()
        norm = (lambda: RMSNorm(d)) if llama else (lambda: nn.LayerNorm(d))
        self.ln1, self.ln2 = norm(), norm()
        self.attn, self.mlp = Attention(d, heads, llama), MLP(d, llama)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class CausalLM(nn.Module):
    """GPT-style (``llama=False``: learned positions, LayerNorm, GELU) or LLaMA-style (RoPE,
    RMSNorm, SwiGLU, no biases). Input tokens int64 [B, T+1]; returns the mean next-token
    cross-entropy (float32 scalar)."""

    def __init__(self, r: Run) -> None:
        super().__init__()
        llama = r.model == "llama"
        self.tok = nn.Embedding(r.vocab, r.width)
        self.pos = None if llama else nn.Embedding(r.seq, r.width)
        self.blocks = nn.ModuleList([Block(r.width, r.heads, llama) for _ in range(r.layers)])
        self.ln = RMSNorm(r.width) if llama else nn.LayerNorm(r.width)
        self.head = nn.Linear(r.width, r.vocab, bias=False)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        x, y = seq[:, :-1], seq[:, 1:]
        h = self.tok(x)
        if self.pos is not None:
            h = h + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


MLP_IN = 12


class Classifier(nn.Module):
    """``layers`` hidden Linear+GELU layers of ``width``; input float32 [B, 12] and the class
    in the last column (as a float), ``vocab`` classes; returns the mean cross-entropy."""

    def __init__(self, r: Run) -> None:
        super().__init__()
        dims = [MLP_IN] + [r.width] * r.layers
        self.blocks = nn.ModuleList([nn.Linear(a, b) for a, b in itertools.pairwise(dims)])
        self.head = nn.Linear(r.width, r.vocab)

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        h, y = xy[:, :MLP_IN], xy[:, MLP_IN].long()
        for lin in self.blocks:
            h = F.gelu(lin(h))
        return F.cross_entropy(self.head(h), y)


def build_model(r: Run) -> nn.Module:
    torch.manual_seed(r.seed)
    return Classifier(r) if r.model == "mlp" else CausalLM(r)


# -------------------------------------------------------------------------------- data
_TEXT: list = []


def text_bytes(max_bytes: int = 2 << 20) -> torch.Tensor:
    """The first ``max_bytes`` of the standard library's .py sources (sorted paths, tests
    excluded) as uint8 [N] (launch/train.py's default training text), read once per process."""
    if not _TEXT:
        import sysconfig
        from pathlib import Path

        chunks, total = [], 0
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            if "site-packages" in f.parts or "test" in f.parts:
                continue
            try:
                chunks.append(f.read_bytes())
            except OSError:
                continue
            total += len(chunks[-1])
            if total >= max_bytes:
                break
        _TEXT.append(torch.frombuffer(bytearray(b"\n".join(chunks)[:max_bytes]), dtype=torch.uint8))
    return _TEXT[0]


def language(r: Run) -> torch.Tensor:
    """A fixed Markov-chain language ([V, V] row-stochastic, peaked): what the LM learns."""
    g = torch.Generator().manual_seed(1000 + r.seed)
    return torch.softmax(3.0 * torch.randn(r.vocab, r.vocab, generator=g), dim=-1)


def teacher(r: Run) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + r.seed)
    return torch.randn(MLP_IN, r.vocab, generator=g)


def batch(r: Run, world_data: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """The batch of (run, step, rank): int64 [B, T+1] token sequences, or float32 [B, 13]."""
    g = torch.Generator().manual_seed(r.seed * 1_000_003 + step * 1009 + rank)
    if r.model == "mlp":
        x = torch.randn(r.batch, MLP_IN, generator=g)
        y = (x @ world_data).argmax(-1)
        return torch.cat([x, y[:, None].float()], dim=1)
    if r.data == "text":
        ix = torch.randint(len(world_data) - r.seq - 1, (r.batch,), generator=g).tolist()
        return torch.stack([world_data[i:i + r.seq + 1] for i in ix]).long()
    seq = torch.empty(r.batch, r.seq + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, r.vocab, (r.batch,), generator=g)
    for t in range(r.seq):
        seq[:, t + 1] = torch.multinomial(world_data[seq[:, t]], 1, generator=g).squeeze(-1)
    return seq


def corrupt(r: Run, b: torch.Tensor, step: int) -> torch.Tensor:
    """The ``garbage`` fault: the whole batch replaced by uniform random tokens (a corrupted
    shard on one rank; as tests/test_causes.py's garbage batch, the step's global loss about
    doubles)."""
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, r.vocab, b.shape, generator=g)


def lr_factor(r: Run, step: int) -> float:
    """Multiplier of ``r.lr`` at ``step``: linear warm-up over ``r.warmup`` steps, then
    cosine / linear decay to 10% at the last step, or constant."""
    if step < r.warmup:
        return (step + 1) / r.warmup
    frac = (step - r.warmup) / max(1, r.steps - r.warmup)
    if r.decay == "cosine":
        return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))
    if r.decay == "linear":
        return 1.0 - 0.9 * frac
    return 1.0


def make_optimizer(r: Run, params) -> torch.optim.Optimizer:
    if r.opt == "adamw":
        return torch.optim.AdamW(params, lr=r.lr, betas=(0.9, 0.95), weight_decay=0.01)
    return torch.optim.SGD(params, lr=r.lr, momentum=0.9)


# -------------------------------------------------------------------------------- one run
def run_one(r: Run, rank: int, args: argparse.Namespace) -> dict:
    """Train ``r`` on this rank; returns rank 0's facts (the loop's losses, lr, the fault)."""
    import distgrad

    model = build_model(r)
    data = teacher(r) if r.model == "mlp" else text_bytes() if r.data == "text" else language(r)
    overrides: dict = {
        "sinks": {"jsonl": {"path": os.path.join(args.jsonl_dir, f"{r.name}.jsonl") if args.jsonl_dir else None}},
        "exporter": {"enabled": bool(args.sd_dir), "port": 0, "host": "127.0.0.1", "run_name": r.name,
                     "file_sd_path": os.path.join(args.sd_dir, f"{r.name}.json") if args.sd_dir else None},
    }
    if args.opt_in:  # the opt-in families whose alerts apply to these models (paging_eval --opt-in)
        overrides.update(OPT_IN)
        if r.model == "mlp":  # no attention layer: only the output logits
            overrides["logits"] = dict(OPT_IN["logits"], attention=False, attention_modules=None)
        if r.engine == "ddp":  # replicated weights to compare (ZeRO-2 / FSDP2 shard, plain has one copy)
            overrides["replica_weights"] = {"hash_interval": 25}
    if args.jsonl_dir and rank == 0:
        os.makedirs(args.jsonl_dir, exist_ok=True)
        p = os.path.join(args.jsonl_dir, f"{r.name}.jsonl")
        if os.path.exists(p):
            os.remove(p)
    engine = None
    if r.engine == "zero2":
        opt = make_optimizer(r, model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(r, s))
        engine, opt = build_deepspeed(model, 2, micro_batch=r.batch, optimizer=opt, lr_scheduler=sched,
                                      zero_allow_untested_optimizer=True,
                                      **({"gradient_clipping": r.clip} if r.clip else {}))
        sched = engine.lr_scheduler
        inst = distgrad.instrument(engine, **overrides)
        net = engine
    else:
        optim = functools.partial(make_optimizer, r)
        if r.engine == "ddp":
            net, opt = build_ddp(model, optim=optim)
        elif r.engine == "fsdp2":
            net, opt = build_fsdp2(model, model.blocks, optim=optim)
        else:
            net, opt = model, optim(list(model.parameters()))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(r, s))
        if r.clip:
            overrides["clip"] = {"max_grad_norm": r.clip}
        inst = distgrad.instrument(net, optimizer=opt, **overrides)
        if r.clip:  # clipping in a pre-hook registered after instrument(): distgrad reads the pre-clip norm
            def clip(*_):
                torch.nn.utils.clip_grad_norm_(net.parameters(), r.clip)
            opt.register_step_pre_hook(clip)
    nan_hook = None
    state = {"poison": False}
    if r.fault == "nan":
        target = dict(model.named_modules())[NAN_MODULE]

        def poison(mod, args_, out):
            # the forward of blocks.1.mlp makes NaN on FAULT_RANK during fault_step (in the
            # training forward and in distgrad's replay of it at the step's boundary)
            return out * float("nan") if state["poison"] else out
        nan_hook = target.register_forward_hook(poison)
    waits: list[bool] = []
    if args.prom_url and rank == 0:  # the live test: Prometheus scrapes this run before its first step
        waits.append(wait_prometheus(args.prom_url, f'up{{run="{r.name}"}} == 1'))
    losses, lrs = [], []
    t_fault = None
    for step in range(r.steps):
        if r.fault == "lr" and step == r.fault_step:
            for g in opt.param_groups:
                g["lr"] *= r.lr_mult
            sched.base_lrs = [b * r.lr_mult for b in sched.base_lrs]
        b = batch(r, data, step, rank)
        if r.fault == "garbage" and step == r.fault_step and rank == FAULT_RANK:
            b = corrupt(r, b, step)
        state["poison"] = r.fault == "nan" and step == r.fault_step and rank == FAULT_RANK
        if r.fault and step == r.fault_step:
            t_fault = time.time()
        lrs.append(opt.param_groups[0]["lr"])
        if engine is not None:
            loss = engine(b)
            engine.backward(loss)
            engine.step()  # DeepSpeed steps its lr scheduler itself
        else:
            loss = net(b)
            inst.observe_loss(loss)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        state["poison"] = False
        losses.append(float(loss.detach()))
    if nan_hook is not None:
        nan_hook.remove()
    t_end = time.time()
    if args.prom_url and rank == 0:  # ... and its final state before the target goes
        waits.append(wait_prometheus(args.prom_url, f'distgrad_optimizer_step{{run="{r.name}"}} == {r.steps - 1}'))
    hold = args.fault_hold if r.fault and args.fault_hold is not None else args.hold
    if hold > 0:
        time.sleep(hold)  # let Prometheus scrape the final state before the target goes
    last = inst.last_record
    port = inst.port
    inst.close()
    return {"run": asdict(r), "losses": losses, "lrs": lrs, "port": port, "t_fault": t_fault, "t_end": t_end,
            "last_step": last.step if last is not None else None, "scraped": waits,
            "fault_rank": FAULT_RANK if r.fault in ("garbage", "nan") else None,
            "fault_module": NAN_MODULE if r.fault == "nan" else None}


def wait_prometheus(url: str, promql: str, timeout: float = 60.0) -> bool:
    """Poll Prometheus at ``url`` until the instant query ``promql`` returns a sample (the
    scrape of a newly discovered file_sd target comes up to ~5-6 s after the file appears);
    False after ``timeout`` seconds (never raises: the other rank is inside a collective)."""
    import urllib.parse
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}api/v1/query?" + urllib.parse.urlencode({"query": promql}), timeout=5) as f:
                if json.load(f)["data"]["result"]:
                    return True
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def describe(r: Run) -> str:
    data = " on stdlib text" if r.data == "text" else " on a Markov-chain language" if r.model != "mlp" else ""
    shape = (f"MLP {r.layers}x{r.width}, {r.vocab} classes" if r.model == "mlp"
             else f"{r.model.upper()}-style LM, {r.layers} layers, width {r.width}, vocab {r.vocab}, seq {r.seq}{data}")
    sched = (f"warm-up {r.warmup} then {r.decay}" if r.warmup else f"no warm-up, {r.decay}")
    fault = f"; FAULT {r.fault}{f' x{r.lr_mult:g}' if r.fault == 'lr' else ''} at step {r.fault_step}" if r.fault else ""
    return (f"{r.name}: {r.engine} ({r.world} rank{'s' if r.world > 1 else ''}), {shape}, batch {r.batch}/rank, "
            f"{r.steps} steps, {r.opt} lr {r.lr:g} ({sched}), clip {r.clip if r.clip else 'none'}, seed {r.seed}{fault}")


def select(which: str, world: int, only: str | None = None) -> list[Run]:
    sets = SETS if which == "all" else tuple(which.split(","))
    names = set(only.split(",")) if only else None
    return [r for r in RUNS if r.set in sets and r.world == world and (names is None or r.name in names)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON facts of every run (rank 0)")
    ap.add_argument("--set", default="all", help="tune, heldout, faults, comma-separated, or all")
    ap.add_argument("--runs", default=None, help="only these run names (comma-separated)")
    ap.add_argument("--jsonl-dir", default=None)
    ap.add_argument("--sd-dir", default=None, help="serve each run's exporter, registered here (file_sd)")
    ap.add_argument("--prom-url", default=None,
                    help="Prometheus base URL: rank 0 waits until it has scraped the run's target before the "
                         "first step and its last step's state before closing")
    ap.add_argument("--hold", type=float, default=0.0, help="seconds to keep serving after the last step")
    ap.add_argument("--fault-hold", type=float, default=None,
                    help="seconds to keep serving after the last step of a fault run (default: --hold)")
    ap.add_argument("--list", action="store_true", help="describe the runs and exit")
    ap.add_argument("--opt-in", action="store_true", help="also switch on the opt-in families of OPT_IN")
    args = ap.parse_args()
    if args.list:
        for r in RUNS:
            print(describe(r))
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    dist = None
    rank = 0
    if world > 1:
        import deepspeed.ops
        import torch.distributed as dist

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see launch/train.py skip_cpu_shm_op
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    results = {}
    for r in select(args.set, world, args.runs):
        t0 = time.time()
        try:
            res = run_one(r, rank, args)
        except Exception as e:  # noqa: BLE001 (reported to the test, which fails on it)
            res = {"run": asdict(r), "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res["wall_s"] = time.time() - t0
        results[r.name] = res
        if rank == 0:
            print(f"corpus: {r.name} done in {res['wall_s']:.1f} s" + (f" ERROR {res['error']}" if "error" in res else ""),
                  flush=True)
        if dist is not None:
            dist.barrier()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": results}, f)
    if dist is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
