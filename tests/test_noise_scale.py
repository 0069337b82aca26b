"""The gradient noise scale (distgrad/signals/noise_scale.py) on one process:

* exact: each step's |G_small|^2 and |G_big|^2 against float64 gradients of each micro-batch
  computed on a float64 copy of the model, the per-step estimator against the closed form of
  McCandlish et al. Appendix A.1 on those, the EMAs against their recurrence; the estimate does
  not depend on whether the loop divides the loss by the accumulation steps;
* statistical: a model whose per-sample gradient is its input, drawn with a known mean G and
  covariance C, weights fixed (lr 0): the per-step estimates are unbiased for |G|^2 and tr(C),
  and B_simple (the ratio of the averages) matches tr(C)/|G|^2 within 4 standard errors
  computed from the run itself;
* set-up errors name the key. The multi-rank engines: tests/test_noise_scale_multirank.py.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

import distgrad
from distgrad.config import ConfigError
from distgrad.record import StepRecord
from distgrad.signals.noise_scale import estimate
from tests.closed_forms import Dot, known_covariance, ratio_and_stderr


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _run(divide: bool, steps: int = 4, k: int = 3, b: int = 4, lr: float = 0.05, async_records: str = "off"):
    m = _mlp()
    ref = copy.deepcopy(m).double()
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": async_records},
                             noise_scale={"enabled": True, "micro_batch_size": b, "ema_decay": 0.8})
    recs, refs = [], []
    dg.add_hook(recs.append)
    for step in range(steps):
        ref.load_state_dict({n: v.double() for n, v in m.state_dict().items()})
        per_micro = []
        for micro in range(k):
            g = torch.Generator().manual_seed(100 * step + micro)
            x, y = torch.randn(b, 5, generator=g), torch.randn(b, 3, generator=g)
            loss = (m(x) - y).pow(2).mean()
            (loss / k if divide else loss).backward()
            ref.zero_grad()
            (ref(x.double()) - y.double()).pow(2).mean().backward()
            per_micro.append(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))
        opt.step()
        opt.zero_grad()
        h = torch.stack(per_micro)  # float64 [k, n]: each micro-batch's mean-loss gradient
        scale = 1.0 if divide else float(k)  # the reduced gradient is the sum of the hooked ones without /k
        refs.append((scale ** 2 * h.pow(2).sum(1).mean().item(), scale ** 2 * h.mean(0).pow(2).sum().item()))
    dg.close()
    return recs, refs


@pytest.mark.parametrize("divide,async_records", [(True, "off"), (False, "off"), (True, "on")],
                         ids=["loss-divided-by-k", "loss-not-divided", "async-records"])
def test_per_step_components_and_estimates_against_float64_micro_batch_gradients(divide, async_records):
    recs, refs = _run(divide, async_records=async_records)
    assert [r.step for r in recs] == [0, 1, 2, 3]
    ema_g2 = ema_tr = 0.0
    for t, (rec, (small, big)) in enumerate(zip(recs, refs), start=1):
        ns = rec.noise_scale
        assert (ns.micro_batches, ns.small_batch, ns.big_batch, ns.ema_steps) == (3, 4.0, 12.0, t)
        np.testing.assert_allclose(ns.grad_sq_small, small, rtol=1e-6)
        np.testing.assert_allclose(ns.grad_sq_big, big, rtol=1e-6)
        # closed form of Appendix A.1 with B_small = 4, B_big = 12, from the float64 reference
        g2 = (12 * big - 4 * small) / (12 - 4)
        tr = (small - big) / (1 / 4 - 1 / 12)
        np.testing.assert_allclose(ns.true_grad_sq, g2, rtol=1e-5, atol=1e-6 * small)
        np.testing.assert_allclose(ns.noise_trace, tr, rtol=1e-5, atol=1e-5 * small * 4)
        ema_g2 = 0.8 * ema_g2 + 0.2 * ns.true_grad_sq
        ema_tr = 0.8 * ema_tr + 0.2 * ns.noise_trace
        corr = 1 - 0.8 ** t
        np.testing.assert_allclose([ns.ema_true_grad_sq, ns.ema_noise_trace], [ema_g2 / corr, ema_tr / corr],
                                   rtol=1e-12)
        assert ns.noise_scale == pytest.approx(ema_tr / ema_g2, rel=1e-12)
        assert StepRecord.from_dict(rec.to_dict()).noise_scale == ns  # the JSONL form round-trips


def test_the_noise_scale_does_not_depend_on_the_loss_scaling_of_the_loop():
    a, _ = _run(True, lr=0.0)  # the same weights on every step in both runs
    b, _ = _run(False, lr=0.0)
    for ra, rb in zip(a, b):
        assert ra.noise_scale.noise_scale == pytest.approx(rb.noise_scale.noise_scale, rel=1e-5)
        # the components are on the scale of the reduced gradient: k^2 apart
        assert rb.noise_scale.ema_noise_trace == pytest.approx(9 * ra.noise_scale.ema_noise_trace, rel=1e-5)


def test_closed_form_on_a_problem_with_known_gradient_covariance():
    d, k, b, steps, decay = 10, 4, 6, 400, 0.98
    G, C, truth = known_covariance(d)
    m = Dot(4, d - 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             noise_scale={"enabled": True, "micro_batch_size": b, "ema_decay": decay})
    recs = []
    dg.add_hook(recs.append)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for _ in range(k):
            z = G + torch.randn(b, d, generator=gen) * C.sqrt()
            (m(z) / k).backward()
        opt.step()
        opt.zero_grad()
    dg.close()
    ns = [r.noise_scale for r in recs]
    g2 = np.array([n.true_grad_sq for n in ns])
    tr = np.array([n.noise_trace for n in ns])
    n = len(g2)
    assert n == steps
    # unbiased per-step estimates of |G|^2 and tr(Sigma)
    assert abs(g2.mean() - float(G.pow(2).sum())) < 4 * g2.std() / np.sqrt(n)
    assert abs(tr.mean() - float(C.sum())) < 4 * tr.std() / np.sqrt(n)
    r, se = ratio_and_stderr(tr, g2)
    assert abs(r - truth) < 4 * se, (r, truth, se)
    # the exported B_simple: the ratio of the EMAs (weights decay^(n-1-i)), within its own error
    w = decay ** np.arange(n - 1, -1, -1)
    r_ema, se_ema = ratio_and_stderr(tr, g2, w)
    assert ns[-1].noise_scale == pytest.approx(r_ema, rel=1e-9)
    assert abs(ns[-1].noise_scale - truth) < 4 * se_ema, (ns[-1].noise_scale, truth, se_ema)
    assert se < 0.1 * truth  # the test has power: the error bar is small against the value


def test_estimate_formula_and_one_batch_size_is_refused():
    g2, tr = estimate(5.0, 2.0, 4, 8.0)
    # E|G_B|^2 = |G|^2 + tr/B at B = 8 and 32
    assert 5.0 == pytest.approx(g2 + tr / 8) and 2.0 == pytest.approx(g2 + tr / 32)
    with pytest.raises(ValueError, match="two batch sizes"):
        estimate(1.0, 1.0, 1, 8.0)


def test_one_micro_batch_per_step_exports_nothing_and_warns_once(caplog):
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             noise_scale={"enabled": True, "micro_batch_size": 2})
    recs = []
    dg.add_hook(recs.append)
    with caplog.at_level("WARNING", logger="distgrad"):
        for _ in range(3):
            m(torch.randn(2, 5)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    dg.close()
    assert len(recs) == 3 and all(r.noise_scale is None for r in recs)
    assert sum("needs two batch sizes" in r.getMessage() for r in caplog.records) == 1
    assert dg.counters["internal_errors"] == 0


def test_a_pytorch_engine_without_micro_batch_size_is_refused_naming_the_key():
    m = _mlp()
    with pytest.raises(ConfigError, match="noise_scale.micro_batch_size"):
        distgrad.instrument(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), exporter={"enabled": False},
                            noise_scale={"enabled": True})


def test_unsampled_steps_do_not_leak_into_the_next_sampled_step():
    """interval 2: the micro-batches of the unsampled step are forgotten at its boundary."""
    recs, refs = [], []
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             sampling={"interval": 2}, noise_scale={"enabled": True, "micro_batch_size": 2})
    dg.add_hook(recs.append)
    for step in range(4):
        hs = []
        for micro in range(2):
            x = torch.randn(2, 5)
            m(x).pow(2).mean().div(2).backward()
            hs.append(torch.cat([p.grad.reshape(-1).double().clone() for p in m.parameters()]))
        opt.step()
        opt.zero_grad()
        per = [2 * hs[0], 2 * (hs[1] - hs[0])]  # the micro-batch gradients on the reduced scale
        refs.append(sum(h.pow(2).sum().item() for h in per) / 2)
    dg.close()
    assert [r.step for r in recs] == [0, 2]
    for rec in recs:
        assert rec.noise_scale.micro_batches == 2
        assert rec.noise_scale.grad_sq_small == pytest.approx(refs[rec.step], rel=1e-5)


def test_a_grad_scaler_loss_scale_is_divided_out():
    """torch.amp.GradScaler: the hooked micro-batch gradients carry the loss scale, the reduced
    gradient read in scaler.step does not; the estimate equals the unscaled run's (a power-of-2
    scale is exact in float32)."""
    def run(scaled: bool):
        m = _mlp()
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) if scaled else None
        dg = distgrad.instrument(m, optimizer=opt, scaler=scaler, exporter={"enabled": False},
                                 statistics={"async_records": "off"},
                                 noise_scale={"enabled": True, "micro_batch_size": 4})
        recs = []
        dg.add_hook(recs.append)
        for step in range(3):
            for micro in range(3):
                g = torch.Generator().manual_seed(100 * step + micro)
                loss = m(torch.randn(4, 5, generator=g)).pow(2).mean() / 3
                (scaler.scale(loss) if scaled else loss).backward()
            if scaled:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
        dg.close()
        return recs

    plain, scaled = run(False), run(True)
    assert [r.loss_scale for r in scaled] == [2.0 ** 12] * 3
    for a, b in zip(plain, scaled):
        assert b.noise_scale.grad_sq_small == pytest.approx(a.noise_scale.grad_sq_small, rel=1e-6)
        assert b.noise_scale.grad_sq_big == pytest.approx(a.noise_scale.grad_sq_big, rel=1e-6)
        assert b.noise_scale.noise_scale == pytest.approx(a.noise_scale.noise_scale, rel=1e-6)


def test_the_moving_averages_survive_a_checkpoint():
    """state_dict / load_state_dict (distgrad.core.checkpoint): a resumed run continues the EMAs, so its
    records equal those of the uninterrupted run."""
    import json

    def steps(dg, m, opt, first, n):
        recs = []
        dg.add_hook(recs.append)
        for step in range(first, first + n):
            for micro in range(2):
                g = torch.Generator().manual_seed(100 * step + micro)
                (m(torch.randn(4, 5, generator=g)).pow(2).mean() / 2).backward()
            opt.step()
            opt.zero_grad()
        return recs

    def make():
        m = _mlp()
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        return m, opt, distgrad.instrument(m, optimizer=opt, exporter={"enabled": False},
                                           statistics={"async_records": "off"},
                                           noise_scale={"enabled": True, "micro_batch_size": 4, "ema_decay": 0.7})

    m, opt, dg = make()
    whole = steps(dg, m, opt, 0, 4)
    dg.close()
    m, opt, dg = make()
    steps(dg, m, opt, 0, 2)
    state = json.loads(json.dumps(dg.state_dict()))  # JSON-serialisable
    dg.close()
    m, opt, dg = make()
    dg.load_state_dict(state)
    # the resumed instrument counts steps from 0 again; the EMAs carry on from the checkpoint
    resumed = steps(dg, m, opt, 2, 2)
    dg.close()
    for a, b in zip(whole[2:], resumed):
        assert b.noise_scale.ema_steps == a.noise_scale.ema_steps
        assert b.noise_scale.noise_scale == pytest.approx(a.noise_scale.noise_scale, rel=1e-12)
