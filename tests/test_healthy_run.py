"""A healthy 300-step run raises no alarm (issue 13, "Done when": 0 alarms on a 300-step
healthy run): a tiny causal transformer language model trained as such models are (AdamW,
linear warm-up then cosine decay, gradient clipping), one process, every detector and check on.

Checked on every record: no spike from any detector (the paging robust and window detectors
and the EMA one), no non-finite gradient or loss, no culprit rank (the loss and the
pre-reduction gradient check are on), no parameter without a gradient, none vanishing or
exploding, no replica mismatch, no internal error; the loss falls (checked against the loop's
own losses); and ``distgrad summary --fail-on-problem`` judges the JSONL log HEALTHY.
"""

from __future__ import annotations

import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import distgrad
from distgrad.cli import main

V, T, D, B, STEPS, WARMUP = 24, 16, 32, 16, 300, 20


class Block(nn.Module):
    """Pre-norm causal self-attention (one head) and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        h = h + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class TinyCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def _corpus(gen: torch.Generator) -> torch.Tensor:
    """A fixed bigram language ([V, V] row-stochastic, peaked): what the model has to learn."""
    return torch.softmax(3.0 * torch.randn(V, V, generator=gen), dim=-1)


def _batch(trans: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    seq = torch.empty(B, T + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, V, (B,), generator=gen)
    for t in range(T):
        seq[:, t + 1] = torch.multinomial(trans[seq[:, t]], 1, generator=gen).squeeze(-1)
    return seq


def _lr(step: int) -> float:
    """Linear warm-up over WARMUP steps, then cosine decay to 10% at the last step."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def test_healthy_300_step_lm_run_raises_no_alarm(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend for the CI machine's 2 cores
    try:
        _run_and_check(tmp_path, capsys)
    finally:
        torch.set_num_threads(threads)


def _run_and_check(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    trans = _corpus(gen)
    model = TinyCausalLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr)
    path = tmp_path / "run.jsonl"
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, clip={"max_grad_norm": 1.0},
                               sinks={"jsonl": {"path": str(path)}}, statistics={"update_ratio": True})
    assert inst.local_grad_check is not None  # the pre-reduction gradient check is on
    losses, recs = [], []
    for _ in range(STEPS):
        seq = _batch(trans, gen)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), seq[:, 1:].reshape(-1))
        inst.observe_loss(loss)
        loss.backward()
        inst.read_gradients_now()  # distgrad reads the reduced gradient before the loop clips it
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        recs.append(inst.last_record)
    inst.close()

    assert [r.step for r in recs] == list(range(STEPS))
    # a real training run: the loss falls from about ln(V) towards the bigram entropy
    assert abs(losses[0] - math.log(V)) < 0.3 and sum(losses[-20:]) / 20 < losses[0] - 1.0
    for r in recs:
        assert abs(r.loss - losses[r.step]) < 1e-5  # distgrad's loss is the loop's
        assert r.spikes.flagged == [] and r.spikes.fired == {}, (r.step, r.spikes)
        assert not r.nonfinite and r.culprits == [] and r.nonfinite_ranks == []
        assert r.health.n_no_grad == 0 and r.health.n_vanishing == 0 and r.health.n_exploding == 0
        assert r.replica_mismatch_ranks == []
        assert r.incidents.opened == [] and r.incidents.active == []  # the detection policy: no page
    last = recs[-1]
    assert last.incidents.total == {"divergence": 0, "bad_batch": 0, "spike_burst": 0}
    assert all(v == 0 for s in last.spikes.total.values() for v in s.values()), last.spikes.total
    assert set(last.spikes.total["loss"]) >= {"robust", "window", "ema"}  # every detector ran
    c = last.counters
    assert c["nonfinite_steps"] == 0 and c["internal_errors"] == 0 and c["replica_mismatch"] == 0
    assert c["sampled_steps"] == STEPS
    # the JSONL log carries the same: no spike fired in any line
    lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    assert len([ln for ln in lines if "step" in ln]) >= STEPS
    assert main(["summary", str(path), "--fail-on-problem"]) == 0
    out = capsys.readouterr().out
    assert "verdict: HEALTHY" in out
    # the default-on optimizer signals (one sampled step in optimizer_signals.every) give no finding
    # either (distgrad/report/signals.py)
    assert any(ln.get("optimizer_signals") for ln in lines) and "FINDINGS: none" in out, out
