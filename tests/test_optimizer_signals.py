"""Optimizer-aware signals (distgrad.signals.adam) on one process: every value of
``StepRecord.optimizer_signals`` against a float64 recomputation from the gradient and the
AdamW state the optimizer held before its step (bias correction at steps 1 and 2 included), what
happens on the first step and with other optimizers."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import distgrad
from distgrad.config import ConfigError
from distgrad.naming.grouping import group_keys
from distgrad.signals.adam import AdamSignal


def reference(grads: dict, state: dict, group: dict, theta: float, keys: dict, clip: float | None = None) -> dict:
    """Float64 signals per layer and globally from full pre-clip gradients and the optimizer state
    before the step (``state[name] = (step, exp_avg, exp_avg_sq)``); ``clip``: the global-norm
    clip threshold, whose coefficient scales the update RMS (torch's clip_grad_norm_ formula)."""
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    c = 1.0 if clip is None else min(1.0, clip / (norm + 1e-6))
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    acc: dict[str, np.ndarray] = {}
    for name, g in grads.items():
        t, m, v = state[name]
        vhat = v / (1.0 - beta2 ** t)
        d = np.maximum(vhat, eps * eps)
        row = np.array([g.size, np.sum(g * g / d), np.sum(g * g > theta * d), np.sum(g * m), np.sum(g * g),
                        np.sum(m * m), np.sum(v * v), np.sum(vhat)])
        for k in (keys[name], "__all__"):
            acc[k] = acc.get(k, 0) + row
    out = {}
    for k, (n, r, s, gm, gg, mm, vv, vh) in acc.items():
        out[k] = {"rms": c * math.sqrt(r / n), "spikes": s / n, "cos": gm / math.sqrt(gg * mm), "m": math.sqrt(mm),
                  "v": math.sqrt(vv), "fisher": vh}
    return out


class _Net(nn.Module):
    """Layer labels 0, 1 (two blocks), head, norm: several layers for the per-layer values."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 16), nn.Linear(16, 16)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return self.head(self.norm(x))


def _model():
    torch.manual_seed(0)
    return _Net()


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("async_records,clip", [("off", None), ("on", None), ("off", 0.05)])
def test_adamw_signals_match_float64(async_records, clip, kernel, monkeypatch):
    """Steps 1-4 (step 0 has no moment); with ``clip`` the loop reads the gradients, then clips
    them with clip_grad_norm_ (the optimizer's moments then track clipped gradients).
    ``kernel``: the native CPU kernel (``auto``, checked to be used) or the torch path."""
    from distgrad.signals import adam as adam_mod, adam_native

    monkeypatch.setattr(adam_mod, "KERNEL", kernel)
    adam_native.native()  # built and self-checked (which calls run) before the calls are counted
    native_calls = []
    real_run = adam_native.run
    monkeypatch.setattr(adam_native, "run", lambda *a: native_calls.append(len(a[1])) or real_run(*a))
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    theta = 2.0
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False},
                             statistics={"async_records": async_records}, clip={"max_grad_norm": clip},
                             optimizer_signals={"spike_threshold": theta, "top_layers": 2, "every": 1})
    names = [n for n, _ in m.named_parameters()]
    keys = dict(zip(names, group_keys(names, "layer")))
    expected = {}

    def before(o, args, kwargs):  # the state the step starts from, in float64
        st = {}
        for n, p in m.named_parameters():
            s = o.state.get(p, {})
            st[n] = (float(s["step"]), s["exp_avg"].double().numpy().ravel(),
                     s["exp_avg_sq"].double().numpy().ravel()) if s else None
        expected[len(expected)] = (dict(pre_clip), st)

    opt.register_step_pre_hook(before)
    recs = []
    dg.add_hook(recs.append)
    pre_clip: dict = {}
    for _ in range(5):
        loss = m(torch.randn(8, 6)).pow(2).mean()
        loss.backward()
        pre_clip.update({n: p.grad.double().numpy().ravel().copy() for n, p in m.named_parameters()})
        if clip is not None:
            dg.read_gradients_now()
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        opt.zero_grad()
    dg.close()
    if kernel == "auto":  # every piece of steps 1-4 went through the native kernel
        assert adam_native.native() is not None and native_calls == [len(names)] * 4
    else:
        assert native_calls == []
    by_step = {r.step: r for r in recs}
    assert sorted(by_step) == [0, 1, 2, 3, 4]
    assert by_step[0].optimizer_signals is None  # no moment before the first step
    assert all(s is None for s in expected[0][1].values())
    for step in (1, 2, 3, 4):
        grads, st = expected[step]
        assert {s[0] for s in st.values()} == {float(step)}  # steps 1 and 2: strongest bias correction
        ref = reference(grads, st, opt.param_groups[0], theta, keys, clip)
        o = by_step[step].optimizer_signals
        if clip is not None:  # the clip acts: the update RMS is that of the clipped gradient
            assert o.clip_ratio == pytest.approx(by_step[step].clip.ratio, rel=1e-12) and o.clip_ratio < 0.9
        assert o is not None and o.optimizer == "AdamW" and o.elements == sum(g.size for g in grads.values())
        assert o.elements_without_state == 0
        # the clip scales these steps (c < 0.9): the pre-clip count is kept in JSONL only; the
        # spike fraction proper is NaN (not the applied update's) and not served to Prometheus
        served = AdamSignal.samples(o)["distgrad_adam_spike_fraction"]  # what the Prometheus sink serves
        if clip is not None:
            assert math.isnan(o.spike_fraction) and o.layer_spike_fraction == {} and served is None
        else:
            assert o.spike_fraction == o.spike_fraction_preclip == served
        got_global = {"rms": o.update_rms, "spikes": o.spike_fraction_preclip, "cos": o.grad_momentum_cosine,
                      "m": o.exp_avg_norm, "v": o.exp_avg_sq_norm, "fisher": o.fisher_trace}
        for k, v in ref["__all__"].items():
            assert got_global[k] == pytest.approx(v, rel=1e-5, abs=1e-12), (step, k)
        layers = sorted(set(keys.values()))
        assert sorted(o.layer_update_rms) == layers == ["0", "1", "head", "norm"]
        for layer in layers:
            got = {"rms": o.layer_update_rms[layer], "spikes": o.layer_spike_fraction.get(layer, math.nan),
                   "cos": o.layer_grad_momentum_cosine[layer], "m": o.layer_exp_avg_norm[layer],
                   "v": o.layer_exp_avg_sq_norm[layer], "fisher": o.layer_fisher_trace[layer]}
            for k, v in ref[layer].items():
                if k == "spikes" and clip is not None:
                    continue  # not given per layer on a clipped step (asserted above)
                assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-12), (step, layer, k)
        top = sorted(layers, key=lambda k: -ref[k]["fisher"])[:2]
        assert o.fisher_top_layers == top
        assert 0 < o.spike_fraction_preclip < 1  # theta 2 splits the elements: the comparison is exercised
    # the part survives the JSON round trip
    again = type(recs[-1]).from_dict(recs[-1].to_dict())
    assert json.dumps(again.optimizer_signals.to_dict()) == json.dumps(recs[-1].optimizer_signals.to_dict())


def test_nonfinite_gradient_gives_nan_spike_fraction_not_a_low_count():
    """A NaN in one element of the head's gradient (step 2): the global and head spike
    fractions are NaN like the update RMS (a NaN element is in no count: the fraction was 0 or
    too low); the other layers keep their float64 reference values."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    theta = 2.0
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, optimizer_signals={"spike_threshold": theta, "every": 1})
    names = [n for n, _ in m.named_parameters()]
    keys = dict(zip(names, group_keys(names, "layer")))
    recs, seen = [], {}
    dg.add_hook(recs.append)

    def before(o, args, kwargs):
        seen["grads"] = {n: p.grad.double().numpy().ravel().copy() for n, p in m.named_parameters()}
        seen["state"] = {n: (float(o.state[p]["step"]), o.state[p]["exp_avg"].double().numpy().ravel(),
                             o.state[p]["exp_avg_sq"].double().numpy().ravel()) for n, p in m.named_parameters()
                         if o.state.get(p)}

    opt.register_step_pre_hook(before)
    for step in range(3):
        m(torch.randn(8, 6)).pow(2).mean().backward()
        if step == 2:
            m.head.weight.grad[1, 3] = float("nan")
            m.head.weight.grad[0, 0] = 1e6  # a spike by any threshold, in the same layer
        opt.step()
        if step < 2:
            opt.zero_grad()
    dg.close()
    o = recs[2].optimizer_signals
    assert math.isnan(o.spike_fraction) and math.isnan(o.update_rms)
    assert math.isnan(o.layer_spike_fraction["head"]) and math.isnan(o.layer_update_rms["head"])
    finite = {n: g for n, g in seen["grads"].items() if keys[n] != "head"}
    ref = reference(finite, seen["state"], opt.param_groups[0], theta, keys)
    for layer in ("0", "1", "norm"):
        assert o.layer_spike_fraction[layer] == pytest.approx(ref[layer]["spikes"], rel=1e-12, abs=1e-12), layer
        assert o.layer_update_rms[layer] == pytest.approx(ref[layer]["rms"], rel=1e-5), layer
    assert any(0 < o.layer_spike_fraction[k] for k in ("0", "1", "norm"))  # the counts are exercised


def test_other_optimizers_are_refused_loudly_once(caplog):
    m = _model()
    with caplog.at_level(logging.WARNING, logger="distgrad"):
        dg = distgrad.instrument(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), exporter={"enabled": False})
    assert [r for r in caplog.records if "optimizer-aware signals" in r.getMessage() and "SGD" in r.getMessage()]
    assert not dg.signals.signals or all(s.name != "optimizer_signals" for s in dg.signals.signals)
    dg.close()
    with pytest.raises(ConfigError, match="optimizer_signals.enabled"):
        distgrad.instrument(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), exporter={"enabled": False},
                            optimizer_signals={"enabled": "on"})
    # coupled L2 weight decay: Adam's moments are not those of the gradient
    with pytest.raises(ConfigError, match="coupled L2"):
        distgrad.instrument(m, optimizer=torch.optim.Adam(m.parameters(), weight_decay=0.01),
                            exporter={"enabled": False}, optimizer_signals={"enabled": "on"})
    with pytest.raises(ConfigError, match="amsgrad"):
        distgrad.instrument(m, optimizer=torch.optim.AdamW(m.parameters(), amsgrad=True),
                            exporter={"enabled": False}, optimizer_signals={"enabled": "on"})
    dg = distgrad.instrument(m, optimizer=torch.optim.Adam(m.parameters()), exporter={"enabled": False},
                             optimizer_signals={"enabled": "off"})
    assert all(s.name != "optimizer_signals" for s in dg.signals.signals)
    dg.close()


def test_deepspeed_adam_modes_are_read_from_the_optimizer():
    """DeepSpeed's FusedAdam / DeepSpeedCPUAdam keep Adam vs AdamW on the optimizer
    (``adam_w_mode``), not in the param group: coupled L2 there is refused too."""
    from types import SimpleNamespace

    from distgrad.signals.adam import group_problem

    group = {"weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8}
    for name in ("FusedAdam", "DeepSpeedCPUAdam"):
        assert "coupled L2" in group_problem(name, group, SimpleNamespace(adam_w_mode=0))
        assert group_problem(name, group, SimpleNamespace(adam_w_mode=1)) is None
        assert group_problem(name, {**group, "weight_decay": 0.0}, SimpleNamespace(adam_w_mode=0)) is None
    assert group_problem("AdamW", group) is None
    assert "coupled L2" in group_problem("Adam", group)
    assert group_problem("Adam", {**group, "decoupled_weight_decay": True}) is None


def test_every_kth_sampled_step_computes_same_values_and_serves_last_computed(monkeypatch):
    """``optimizer_signals.every: 3``: the signals are computed on sampled steps 0, 3, 6 (the
    step counter decides) with values bit-identical to an ``every: 1`` run of the same seed (whose
    values test_adamw_signals_match_float64 checks against float64); the sampled steps in between
    read no optimizer state (no native kernel call) and carry None in the record, while the
    Prometheus collector keeps serving the last computing step's values, with
    ``distgrad_optimizer_signals_step`` naming that step."""
    from distgrad.export.prometheus import DistgradCollector
    from distgrad.signals import adam_native

    adam_native.native()
    real_run = adam_native.run

    def run(every):
        calls = []
        monkeypatch.setattr(adam_native, "run", lambda *a: calls.append(len(a[1])) or real_run(*a))
        m = _model()
        opt = torch.optim.AdamW(m.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-6)
        dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False},
                                 optimizer_signals={"spike_threshold": 2.0, "every": every})
        recs = []
        dg.add_hook(recs.append)
        gen = torch.Generator().manual_seed(1)
        for _ in range(8):
            m(torch.randn(8, 6, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        dg.close()
        return {r.step: r for r in recs}, calls

    full, full_calls = run(1)
    sparse, sparse_calls = run(3)
    assert sorted(full) == sorted(sparse) == list(range(8))
    assert len(full_calls) == 7 and len(sparse_calls) == 2  # steps 1-7; steps 3 and 6 (step 0: no moment)
    for step in range(1, 8):
        if step % 3 == 0:
            assert sparse[step].optimizer_signals is not None
            assert json.dumps(sparse[step].optimizer_signals.to_dict()) == \
                json.dumps(full[step].optimizer_signals.to_dict())
        else:
            assert sparse[step].optimizer_signals is None and full[step].optimizer_signals is not None

    col = DistgradCollector({}, 1)

    def served(rec):
        col.update(rec, {})
        fams = {f.name: f for f in col.snapshot_body()[1]}
        return {name: {tuple(s.labels.values()): s.value for s in fams[name].samples} if name in fams else {}
                for name in ("distgrad_update_rms", "distgrad_layer_update_rms", "distgrad_optimizer_signals_step",
                             "distgrad_optimizer_step")}

    # steps 0-2: nothing computed yet (step 0 has no moment), nothing served
    for step in range(3):
        got = served(sparse[step])
        assert got["distgrad_update_rms"] == {} and got["distgrad_optimizer_signals_step"] == {}
    for step in range(3, 8):
        got = served(sparse[step])
        last = step - step % 3  # the last computing step
        ref = sparse[last].optimizer_signals
        assert got["distgrad_optimizer_step"] == {(): float(step)}
        assert got["distgrad_optimizer_signals_step"] == {(): float(last)}
        assert got["distgrad_update_rms"] == {(): ref.update_rms}
        assert got["distgrad_layer_update_rms"] == {(k,): v for k, v in ref.layer_update_rms.items()}
        if step != last:  # a held value, not the (different) value every: 1 computes on this step
            assert got["distgrad_update_rms"] != {(): full[step].optimizer_signals.update_rms}
