"""instrument() on one process with a plain module: the off switch, misuse errors that name the
fix, unwritable paths named by their config key, parameters without gradients, the loss hint."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from prometheus_client import generate_latest

import distgrad
from distgrad.config import ConfigError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)  # never in the forward: no gradient at all

    def forward(self, x):
        return self.used(x)


def _train(model, opt, steps, loss_fn=lambda out: out.pow(2).mean()):
    for _ in range(steps):
        loss = loss_fn(model(torch.randn(5, 4)))
        loss.backward()
        opt.step()
        opt.zero_grad()


def _text(dg):
    return generate_latest(dg.prometheus.registry).decode()


def test_enabled_false_starts_nothing():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dg = distgrad.instrument(m, optimizer=opt, enabled=False, exporter={"port": 0})
    try:
        assert dg.prometheus is None and dg.port is None and dg.sinks == []
        _train(m, opt, 2)
        assert dg.last_record is None and dg.counters["sampled_steps"] == 0
    finally:
        dg.close()


def test_optimizer_passed_by_position_is_explained():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer=opt"):
        distgrad.instrument(m, opt)


def test_double_instrumentation_is_refused_until_close():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"port": 0})
    with pytest.raises(RuntimeError, match="already instrumented"):
        distgrad.instrument(m, optimizer=opt, exporter={"port": 0})
    dg.close()
    distgrad.instrument(m, optimizer=opt, exporter={"port": 0}).close()


def test_deepspeed_config_without_section_and_bad_thresholds_name_the_problem():
    with pytest.raises(ConfigError, match="DeepSpeed config"):
        distgrad.DistgradConfig.from_dict({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}})
    cfg = distgrad.DistgradConfig.from_dict({"train_micro_batch_size_per_gpu": 1, "distgrad": {"sampling": {"interval": 4}}})
    assert cfg.sampling.interval == 4
    with pytest.raises(ConfigError, match="vanish_threshold"):
        distgrad.DistgradConfig(health={"vanish_threshold": 10.0, "explode_threshold": 1.0})


@pytest.mark.parametrize("key", ["sinks.jsonl.path", "flight_recorder.dir"])
def test_unwritable_paths_fail_at_instrument_time_naming_the_key(tmp_path, key):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where a directory is needed
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=key):
        distgrad.instrument(m, optimizer=opt, exporter={"port": 0}, **{key: str(blocker / "sub" / "x")})


def test_parameter_without_gradient_has_no_series_and_is_a_finding(caplog):
    """Issue 13 ("no gradient is a finding"; before it, such parameters were left out of the
    vanishing test): a trainable parameter whose ``.grad`` stays None has no per-parameter
    series (nothing to measure), is counted on every sampled step
    (``distgrad_params_without_grad``, ``rec.health.no_grad``) and is flagged vanishing after
    ``health.patience`` (3) steps like an exactly-zero gradient, logged once."""
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"port": 0})
    seen = []
    dg.add_hook(lambda rec: seen.append((rec.health.n_no_grad, list(rec.health.vanishing))))
    try:
        with caplog.at_level(logging.WARNING, logger="distgrad"):
            _train(m, opt, 5)
        text = _text(dg)
        assert 'distgrad_param_grad_norm{param="used.weight"}' in text
        assert "unused." not in text.split("distgrad_param_grad_norm", 1)[1]
        assert "distgrad_params_without_grad 2.0" in text
        unused = ["unused.weight", "unused.bias"]
        assert seen == [(2, [])] * 2 + [(2, unused)] * 3
        assert dg.last_record.health.no_grad == unused
        assert sum("vanishing [" in r and "without any gradient: ['unused.bias', 'unused.weight']" in r
                   for r in caplog.messages) == 1
        assert "distgrad_samples_total" not in text  # this engine does not count samples
    finally:
        dg.close()


def test_missing_loss_is_pointed_out_once(caplog):
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"port": 0})
    try:
        with caplog.at_level(logging.WARNING, logger="distgrad"):
            _train(m, opt, 12)
        hints = [r for r in caplog.messages if "observe_loss" in r]
        assert len(hints) == 1
        dg.observe_loss(torch.tensor(2.5))
        _train(m, opt, 1)
        assert dg.last_record.loss == 2.5
    finally:
        dg.close()


_WITHOUT_DEEPSPEED = r"""
import json, sys


class Unimportable:  # deepspeed and mpi4py are not installed, as for a PyTorch-only user
    attempts = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("deepspeed", "mpi4py"):
            Unimportable.attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, Unimportable())
import torch
import distgrad

torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False})
loss = m(torch.randn(5, 4)).pow(2).mean()
loss.backward()
dg.observe_loss(loss)
ref = float(torch.cat([p.grad.detach().double().reshape(-1) for p in m.parameters()]).norm())
opt.step()
rec = dg.last_record
dg.close()
print(json.dumps({"grad_norm": rec.grad_norm, "ref": ref, "loss": rec.loss, "ref_loss": float(loss),
                  "attempts": Unimportable.attempts}))
"""


def test_pytorch_use_needs_neither_deepspeed_nor_mpi4py(tmp_path):
    """deepspeed and mpi4py are extras: with both unimportable, ``import distgrad`` and
    instrumenting a plain module work, the recorded grad norm equals the float64 norm of the
    gradients, and distgrad never even tried to import them (the DeepSpeed check is lazy)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _WITHOUT_DEEPSPEED], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["attempts"] == []
    assert res["grad_norm"] == pytest.approx(res["ref"], rel=1e-6)
    assert res["loss"] == pytest.approx(res["ref_loss"], rel=1e-6)
