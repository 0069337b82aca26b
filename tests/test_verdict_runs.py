"""The offline verdict (``distgrad summary``) on JSONL logs of real small runs: each run made
with a realistic cause (the instrument on a tiny model in this process, a JsonlSink), and the
verdict must name the problem, its step and what to do; a healthy run must be HEALTHY.

Causes: a learning-rate blow-up (divergence), a layer whose output is detached (no gradient:
never updated), LoRA adapters that cannot learn (A frozen at zero and B zero: exactly-zero
gradients; or the adapter branch detached: no gradients), ReLU units killed mid-run (vanishing),
a learning rate of 0 (no progress), and a run that hangs between two steps (stall)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn

import distgrad
from distgrad.cli import main
from distgrad.report import analyze
from distgrad.report.verdict import _ADVICE

RUNBOOK = Path(__file__).resolve().parents[1] / "docs" / "runbook.md"


class LoRALinear(nn.Module):
    """A frozen base ``Linear`` plus a rank-``r`` adapter ``lora_B @ lora_A``."""

    def __init__(self, n_in: int, n_out: int, r: int = 2, a_init_zero: bool = False, detach: bool = False) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.zeros(r, n_in) if a_init_zero else torch.randn(r, n_in) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(n_out, r))
        self.detach = detach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = x @ self.lora_A.t() @ self.lora_B.t()
        return self.base(x) + (delta.detach() if self.detach else delta)


class Net(nn.Module):
    def __init__(self, lora: dict | None = None, detach_mid: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = LoRALinear(16, 16, **lora) if lora is not None else nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)
        self.detach_mid = detach_mid

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        m = self.mid(h)
        h = h + (m.detach() if self.detach_mid else torch.relu(m))
        return ((self.out(h).squeeze(-1) - y) ** 2).mean()


def run(tmp_path: Path, steps: int = 120, lr: float = 0.02, net: Net | None = None, on_step=None,
        trainable=None) -> Path:
    """Train ``net`` on a fixed linear teacher with noise; ``on_step(step, net, opt)`` injects the cause."""
    torch.manual_seed(0)
    net = net or Net()
    if trainable is not None:  # e.g. LoRA fine-tuning: only the adapters train
        for n, p in net.named_parameters():
            p.requires_grad_(trainable(n))
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=lr)
    path = tmp_path / "run.jsonl"
    inst = distgrad.instrument(net, optimizer=opt, exporter={"enabled": False},
                               sinks={"jsonl": {"path": str(path)}}, statistics={"update_ratio": True})
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(8, generator=g)
    for step in range(steps):
        if on_step is not None:
            on_step(step, net, opt)
        x = torch.randn(64, 8, generator=g)
        y = x @ teacher + 0.05 * torch.randn(64, generator=g)
        loss = net(x, y)  # the model returns the loss: distgrad picks it up
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    inst.close()
    return path


def kinds(a) -> dict:
    return {p.kind: p for p in a.problems}


def test_healthy_run_is_healthy(tmp_path, capsys):
    path = run(tmp_path, steps=300)
    a = analyze(path)
    assert a.healthy, a.verdict()
    assert main(["summary", str(path), "--fail-on-problem"]) == 0
    assert "verdict: HEALTHY" in capsys.readouterr().out


def test_lr_blow_up_is_divergence(tmp_path, capsys):
    def blow_up(step, net, opt):
        if step == 60:
            for g in opt.param_groups:
                g["lr"] = 0.3
    path = run(tmp_path, steps=120, on_step=blow_up)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in recs}
    a = analyze(path)
    assert a.first_problem.step > 60, a.verdict()  # nothing before the blow-up
    p = kinds(a)["divergence"]
    assert 60 < p.step < 120
    best = int(re.search(r"\(step (\d+)\)", p.detail).group(1))
    assert best < 62 and losses[p.step] > 2 * losses[best]  # the log itself shows the rise
    assert "lower the learning rate" in p.detail and "runbook.md#verdict-divergence" in p.detail
    assert main(["summary", str(path), "--fail-on-problem"]) == 3
    out = capsys.readouterr().out
    assert f"divergence at step {p.step}" in out or f"PROBLEM at step {p.step}: the loss diverged" in out


def test_detached_layer_is_never_updated(tmp_path):
    path = run(tmp_path, net=Net(detach_mid=True))
    a = analyze(path)
    p = kinds(a)["never_updated"]
    assert p.step == 0 and "2 trainable parameter(s)" in p.detail
    assert "mid.weight (no gradient)" in p.detail and "mid.bias (no gradient)" in p.detail
    assert "inp." not in p.detail and "out." not in p.detail
    assert a.verdict().startswith("PROBLEM at step 0: 2 trainable parameter(s) never updated")


def test_dead_lora_adapters_zero_a_frozen(tmp_path):
    """A initialised to zero (like B) and frozen by mistake: B's gradient is exactly zero forever."""
    net = Net(lora={"a_init_zero": True})
    path = run(tmp_path, net=net, trainable=lambda n: n == "mid.lora_B")
    a = analyze(path)
    p = kinds(a)["dead_adapter"]
    assert "mid.lora_B (zero gradient)" in p.detail and "1 adapter parameter(s)" in p.detail
    assert "what to do" in p.detail and "runbook.md#verdict-dead-adapter" in p.detail


def test_dead_lora_adapters_detached(tmp_path):
    # the adapters and the head train (the head keeps the loss differentiable)
    path = run(tmp_path, net=Net(lora={"detach": True}), trainable=lambda n: "lora_" in n or n.startswith("out."))
    a = analyze(path)
    p = kinds(a)["dead_adapter"]
    assert "mid.lora_A (no gradient)" in p.detail and "mid.lora_B (no gradient)" in p.detail
    assert "never_updated" not in kinds(a)  # the frozen base is not trainable: not listed


def test_killed_relu_layer_is_vanishing(tmp_path):
    def kill(step, net, opt):
        if step == 40:
            with torch.no_grad():
                net.inp.bias.fill_(-1e3)  # every ReLU of the first layer dead from here on
    path = run(tmp_path, on_step=kill)
    a = analyze(path)
    p = kinds(a)["vanishing"]
    assert p.step == 40 and "inp.weight" in p.detail
    assert "mid.weight" in p.detail  # its input is all zeros too


def test_zero_learning_rate_is_no_progress(tmp_path):
    path = run(tmp_path, steps=100, lr=0.0)
    a = analyze(path)
    p = kinds(a)["no_progress"]
    assert p.step == 99 and "runbook.md#verdict-no-progress" in p.detail
    # the update-to-weight ratio is 0 on every step: nothing was updated
    assert "never_updated" in kinds(a) and "no update" in kinds(a)["never_updated"].detail


def test_hang_between_steps_is_a_stall(tmp_path):
    path = run(tmp_path, steps=40)
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    for r in lines:  # the job hung for 10 minutes after step 25 (the records' own times, shifted)
        if r["step"] > 25:
            r["timestamp"] += 600.0
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    p = kinds(analyze(path))["stall"]
    assert p.step == 25 and "after step 25" in p.detail and "next: step 26" in p.detail


def test_every_finding_has_a_runbook_section():
    text = RUNBOOK.read_text()
    for kind in _ADVICE:
        assert f"### verdict-{kind.replace('_', '-')}" in text, kind
