"""Never silently wrong: a boundary that cannot be reading the step's reduced, pre-clip gradient
refuses the step (nothing exported), says so once at ERROR level with the fix, and the optimizer
wrappers distgrad cannot read through are refused at instrument() with the right advice."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import distgrad
from tests.reference import case


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
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False})
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
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False})
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
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False})
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
    dg = distgrad.instrument(m, optimizer=acc, exporter={"enabled": False})
    assert dg.boundary.optimizer is opt
    dg.close()
    wrapper = DeepSpeedOptimizerWrapper.__new__(DeepSpeedOptimizerWrapper)
    wrapper.optimizer = opt
    with pytest.raises(TypeError, match="pass the engine"):
        distgrad.instrument(m, optimizer=wrapper, exporter={"enabled": False})
    with pytest.raises(TypeError, match="DistgradCallback"):
        distgrad.instrument(m, optimizer=LightningOptimizer(opt), exporter={"enabled": False})
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    with pytest.raises(TypeError, match="DeepSpeedEngine"):
        distgrad.instrument(m, optimizer=DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer), exporter={"enabled": False})


def _served(dg) -> dict:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(dg.prometheus.registry).decode()
    return {(s.name, s.labels.get("reason")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in ("distgrad_refused_steps_total", "distgrad_sampled_steps_total")}


def test_refused_steps_are_served_by_reason(caplog):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"port": 0})
    try:
        want = {("distgrad_refused_steps_total", r): 0.0 for r in ("closure", "clipped", "no_backward")}
        want[("distgrad_sampled_steps_total", None)] = 0.0
        assert _served(dg) == want  # every reason at 0 from the start
        with caplog.at_level(logging.WARNING, logger="distgrad"):
            opt.zero_grad()
            _loss(m, 0).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()  # clipped before the read
            opt.zero_grad()
            _loss(m, 1).backward()
            opt.step()  # a good step: exported, no refusal
            opt.step()  # no backward since the last step
            opt.step()  # again

            def closure():
                opt.zero_grad()
                loss = _loss(m, 2)
                loss.backward()
                return loss
            opt.step(closure)
        want.update({("distgrad_refused_steps_total", "clipped"): 1.0,
                     ("distgrad_refused_steps_total", "no_backward"): 2.0,
                     ("distgrad_refused_steps_total", "closure"): 1.0,
                     ("distgrad_sampled_steps_total", None): 1.0})
        assert _served(dg) == want
        assert dg.refused_steps == dg.boundary.refusals.counts == {"clipped": 1, "no_backward": 2, "closure": 1}
        assert "distgrad_refused_steps_total" in _errors(caplog)[0]
    finally:
        dg.close()


@pytest.mark.multirank
def test_refusal_on_one_rank_drops_the_step_on_every_rank_and_counts_its_reason(torch_results):
    # tests/dist/torch_cases.py run_refused: DDP, steps 1-3 refused (rank 1 alone clips at step 1)
    r0, r1 = case(torch_results, "refused")["ranks"]
    assert r0["exported"] == r1["exported"] == [0, 4]
    assert r0["refused_steps"] == r1["refused_steps"] == {"clipped": 1, "no_backward": 1, "closure": 1}
    # rank 0 did not see the clipping: it learned the reason from rank 1's flag
    assert r0["local_refusals"] == {"no_backward": 1, "closure": 1}
    assert r1["local_refusals"] == {"clipped": 1, "no_backward": 1, "closure": 1}
    for r in (r0, r1):  # a refusal is not an error of distgrad's
        assert (r["counters"]["sampled_steps"], r["counters"]["internal_errors"]) == (2, 0)


def _fp64_norm(m, seed):
    import copy

    ref = copy.deepcopy(m).double()
    g = torch.Generator().manual_seed(seed)
    (ref(torch.randn(6, 4, generator=g).double()).pow(2).mean() * 100.0).backward()
    return float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ref.parameters()])))


@pytest.mark.parametrize("when", ["before_unscale", "after_unscale", "in_scaler_step"])
def test_read_outside_scaler_step_is_unscaled(when):
    # AMP: scaler.scale(loss).backward(); [read]; scaler.unscale_(opt); scaler.step(opt). A read
    # before unscale_ sees the gradients multiplied by the loss scale (1024 here); distgrad
    # divides by it. Reference: the float64 recomputation of the step's gradient.
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    dg = distgrad.instrument(m, optimizer=opt, scaler=scaler, exporter={"enabled": False})
    try:
        for s in range(2):
            ref = _fp64_norm(m, s)
            opt.zero_grad()
            scaler.scale(_loss(m, s)).backward()
            if when == "before_unscale":
                dg.read_gradients_now()
            if when != "in_scaler_step":
                scaler.unscale_(opt)
            if when == "after_unscale":
                dg.read_gradients_now()
            scaler.step(opt)
            scaler.update()
            assert dg.last_record.step == s
            assert dg.last_record.grad_norm == pytest.approx(ref, rel=1e-5)
        assert dg.boundary.refusals.counts == {} and dg.counters["internal_errors"] == 0
    finally:
        dg.close()
