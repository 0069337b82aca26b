"""Never silently wrong: a boundary that cannot be reading the step's reduced, pre-clip gradient
refuses the step (nothing exported), says so once at ERROR level with the fix, and the optimizer
wrappers distgrad cannot read through are refused at instrument() with the right advice."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import distgrad


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _loss(m, seed):
    g = torch.Generator().manual_seed(seed)
    return m(torch.randn(6, 4, generator=g)).pow(2).mean() * 100.0


def _errors(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "NOT exported" in r.getMessage()]


def test_step_with_closure_is_refused_once(caplog):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    dg = distgrad.instrument(m, optimizer=opt, prometheus=False)
    with caplog.at_level(logging.WARNING, logger="distgrad"):
        for s in range(3):
            def closure(s=s):
                opt.zero_grad()
                loss = _loss(m, s)
                loss.backward()
                return loss
            opt.step(closure)
    assert dg.last_record is None and dg.counters["sampled_steps"] == 0
    assert dg.boundary.refusals.counts == {"closure": 3}
    msgs = _errors(caplog)
    assert len(msgs) == 1 and "optimizer.step(closure)" in msgs[0] and "DistgradCallback" in msgs[0]
    dg.close()


def test_clipping_before_the_read_is_refused_and_read_gradients_now_fixes_it(caplog):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    dg = distgrad.instrument(m, optimizer=opt, prometheus=False)
    with caplog.at_level(logging.WARNING, logger="distgrad"):
        for s in range(2):
            opt.zero_grad()
            _loss(m, s).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
    assert dg.last_record is None and dg.boundary.refusals.counts == {"clipped": 2}
    msgs = _errors(caplog)
    assert len(msgs) == 1 and "clipped" in msgs[0] and "read_gradients_now" in msgs[0]
    # the fix: read first, then clip; the served norm is the pre-clip norm clip_grad_norm_ returns
    opt.zero_grad()
    _loss(m, 7).backward()
    dg.read_gradients_now()
    total = float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
    opt.step()
    assert total > 0.5
    assert dg.last_record is not None and dg.last_record.grad_norm == pytest.approx(total, rel=1e-6)
    # clipping after distgrad's read in the same step is fine (not refused)
    assert dg.boundary.refusals.counts == {"clipped": 2}
    dg.close()


def test_step_without_backward_is_refused(caplog):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    dg = distgrad.instrument(m, optimizer=opt, prometheus=False)
    with caplog.at_level(logging.WARNING, logger="distgrad"):
        _loss(m, 0).backward()
        opt.step()
        first = dg.last_record
        opt.step()  # the same gradients again: no backward since the last step
        opt.zero_grad()  # set_to_none: no gradient at all
        opt.step()
    assert first is not None and first.step == 0
    assert dg.last_record is first  # nothing exported for steps 1 and 2
    assert dg.boundary.refusals.counts == {"no_backward": 2}
    assert len(_errors(caplog)) == 1 and "no backward" in _errors(caplog)[0]
    # accumulation into the existing gradient (in-place: new version) is a real step
    opt.zero_grad(set_to_none=False)
    _loss(m, 1).backward()
    opt.step()
    assert dg.last_record.step == 3 and dg.boundary.refusals.counts == {"no_backward": 2}
    dg.close()


def test_optimizer_wrappers():
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from distgrad.api import unwrap_optimizer

    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    acc = AcceleratedOptimizer.__new__(AcceleratedOptimizer)  # what accelerator.prepare returns
    acc.optimizer = opt
    assert unwrap_optimizer(acc) is opt
    dg = distgrad.instrument(m, optimizer=acc, prometheus=False)
    assert dg.boundary.optimizer is opt
    dg.close()
    wrapper = DeepSpeedOptimizerWrapper.__new__(DeepSpeedOptimizerWrapper)
    wrapper.optimizer = opt
    with pytest.raises(TypeError, match="pass the engine"):
        distgrad.instrument(m, optimizer=wrapper, prometheus=False)
    with pytest.raises(TypeError, match="DistgradCallback"):
        distgrad.instrument(m, optimizer=LightningOptimizer(opt), prometheus=False)
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    with pytest.raises(TypeError, match="DeepSpeedEngine"):
        distgrad.instrument(m, optimizer=DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer), prometheus=False)
