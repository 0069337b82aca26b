"""A tiny causal language model trained with and without distgrad's adaptive clipping
(distgrad/diagnostics/adaptive_clip.py), shared by tests/test_adaptive_clip.py (a short run) and
launch/adaptive_clip_eval.py (the measured table in docs/action.md). Not a test module.

The data: token sequences from a fixed random first-order Markov chain (vocabulary 64, each
token's successor drawn from 4 likely tokens), so the loss falls from log 64 towards the chain's
entropy. The model: embedding, 2 pre-norm transformer layers (width 64, 4 heads, causal mask),
tied output head. AdamW (betas 0.9 / 0.95, weight decay 0.1). The learning rate: a 20-step
linear warm-up to ``lr``; ``unstable`` multiplies it by ``mult`` for ``SPIKE_LEN`` steps
every ``SPIKE_EVERY`` steps from step ``SPIKE_START`` on (a schedule error / restart of the warm-up: the loss spikes).
The garbage case (``train(..., garbage=garbage_steps(steps))``): the batches of ``GARBAGE_LEN``
consecutive steps every ``GARBAGE_EVERY`` from ``GARBAGE_START`` are replaced by corrupted ones
(every sequence one token repeated: a burst of padding / a null-filled shard); their gradient is
~20x the clean one (global norm ~11 vs ~0.6 at step 120, SGD), and applied unclipped it damages
the weights, so the loss of the FOLLOWING clean batches spikes. Spikes are then counted on the
clean steps only (:meth:`Run.clean_losses`).

Loss spikes are counted by one detector for every run: distgrad's paging detector
(:class:`~distgrad.diagnostics.robust_spike.RobustJumpDetector`, default settings) fed the loss
series offline; a spike episode is a run of consecutive flagged steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, WIDTH, LAYERS, HEADS, BATCH = 64, 32, 64, 2, 4, 16
WARMUP = 20
SPIKE_START, SPIKE_EVERY, SPIKE_LEN, SPIKE_MULT = 120, 60, 3, 30.0
GARBAGE_START, GARBAGE_EVERY, GARBAGE_LEN = 100, 40, 3


class TinyLM(nn.Module):
    """Embedding + ``LAYERS`` pre-norm causal transformer layers + tied head (fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        h = self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.norm(h) @ self.emb.weight.T


def markov_batches(seed: int, steps: int) -> list[torch.Tensor]:
    """``steps`` batches (BATCH, SEQ + 1) of token ids from the fixed chain (chain seed 0, sample
    seed ``seed``)."""
    g = torch.Generator().manual_seed(0)
    succ = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, VOCAB, (BATCH,), generator=g)
        seq = [tok]
        for _ in range(SEQ):
            pick = torch.multinomial(probs.expand(BATCH, 4), 1, generator=g).squeeze(1)
            tok = succ[tok, pick]
            seq.append(tok)
        out.append(torch.stack(seq, 1))
    return out


def garbage_steps(steps: int, start: int = GARBAGE_START, every: int = GARBAGE_EVERY,
                  length: int = GARBAGE_LEN) -> list[int]:
    """The steps whose batch is replaced by a garbage batch (:func:`garbage_batch`): ``length``
    consecutive steps every ``every`` steps from ``start`` on, below ``steps``."""
    return [s for s in range(start, steps) if (s - start) % every < length]


def garbage_batch(seed: int, step: int) -> torch.Tensor:
    """A corrupted batch (BATCH, SEQ + 1): every sequence one token repeated (a run of padding /
    a null-filled shard), the token drawn from (``seed``, ``step``)."""
    g = torch.Generator().manual_seed(7919 * seed + step)
    return torch.full((BATCH, SEQ + 1), int(torch.randint(0, VOCAB, (1,), generator=g)), dtype=torch.long)


def lr_at(step: int, lr: float, unstable: bool, mult: float = SPIKE_MULT) -> float:
    """The schedule (module docstring)."""
    base = lr * min(1.0, (step + 1) / WARMUP)
    if unstable and step >= SPIKE_START and (step - SPIKE_START) % SPIKE_EVERY < SPIKE_LEN:
        return base * mult
    return base


@dataclass
class Run:
    """One training run: per-step losses, the adaptive clipping records' counts."""

    mode: str
    seed: int
    unstable: bool
    losses: list[float] = field(default_factory=list)
    clipped_steps: int = 0
    min_factor: float = 1.0
    garbage: list[int] = field(default_factory=list)

    def clean_losses(self) -> list[float]:
        """The losses of the steps that trained on a clean batch (the garbage steps' own losses
        left out: they measure the batch, not damage to the model)."""
        bad = set(self.garbage)
        return [v for s, v in enumerate(self.losses) if s not in bad]

    def final_loss(self, last: int = 20) -> float:
        """Mean loss of the last ``last`` steps (nats/token)."""
        tail = self.losses[-last:]
        return sum(tail) / len(tail)


def train(mode: str, seed: int, steps: int, unstable: bool, lr: float = 3e-3, optim: str = "adamw",
          mult: float = SPIKE_MULT, garbage: list[int] | None = None, **clip: object) -> Run:
    """Train TinyLM for ``steps`` optimizer steps instrumented by distgrad (exporter off),
    ``adaptive_clip.mode`` = ``mode`` (``off``, ``zclip``, ``adagc``; other ``adaptive_clip`` keys
    in ``clip``); the batches of the steps in ``garbage`` replaced by :func:`garbage_batch`. Same
    initial weights and batches for every mode of a seed."""
    import distgrad

    torch.set_num_threads(1)  # tiny tensors: one thread (several spin-wait on a loaded machine)
    torch.manual_seed(seed)
    model = TinyLM()
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1) if optim == "adamw"
        else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False},
                               adaptive_clip={"mode": mode, **clip}, optimizer_signals={"enabled": False})
    run = Run(mode, seed, unstable, garbage=sorted(garbage or []))
    bad = set(run.garbage)
    try:
        for step, batch in enumerate(markov_batches(seed, steps)):
            if step in bad:
                batch = garbage_batch(seed, step)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, lr, unstable, mult)
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            inst.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            v = float(loss.detach())
            run.losses.append(v if math.isfinite(v) else float("inf"))
            part = getattr(inst.last_record, "adaptive_clip", None)
            if part is not None and part.clipped:
                run.clipped_steps += 1
                run.min_factor = min(run.min_factor, part.factor)
    finally:
        inst.close()
    return run


def spikes(losses: list[float]) -> tuple[int, int]:
    """``(episodes, flagged steps)``: steps flagged by distgrad's RobustJumpDetector (default
    settings, the paging detector) fed the loss series (a non-finite loss counts as flagged), and
    the runs of consecutive flagged steps among them."""
    from distgrad.diagnostics.robust_spike import RobustJumpDetector

    det = RobustJumpDetector()
    episodes, flagged_steps, prev = 0, 0, False
    for v in losses:
        flagged = not math.isfinite(v) or det.update(v).is_spike
        episodes += flagged and not prev
        flagged_steps += flagged
        prev = flagged
    return episodes, flagged_steps


def spike_episodes(losses: list[float]) -> int:
    """Loss spike episodes (:func:`spikes`)."""
    return spikes(losses)[0]
