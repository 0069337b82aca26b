"""Optimizer-aware signals under sharding, on 2 gloo CPU ranks (tests/dist/adam_cases.py, one
launch): DeepSpeed ZeRO-2, ZeRO-3, FSDP2, FSDP1 (use_orig_params=True) and DDP
(each rank counting its share of the replicated state) with AdamW. Each rank reads its own shard of the
gradient and of ``exp_avg`` / ``exp_avg_sq``; the record must equal (rtol 1e-5) a float64
computation from the full unsharded gradient and the full optimizer state gathered by the
frameworks' own functions, with the optimizer's step count taken from the step index (an
independent source), and the sampled step must still make 2 collectives and 1 host copy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers import launch
from distgrad.naming.grouping import group_keys
from distgrad.record import StepRecord

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="session")
def adam_results(tmp_path_factory):
    return launch("adam_cases.py", tmp_path_factory.mktemp("adam") / "adam.json")


def reference(ref: dict, betas, eps: float, theta: float, clip: float | None) -> dict:
    """Float64 signals per layer label and globally (``"__all__"``) of one step; ``clip``: the
    engine's global-norm clip threshold, whose coefficient (DeepSpeed's formula, from the full
    gradient's norm) scales the update RMS."""
    names = list(ref["grad"])
    norm = math.sqrt(sum(float(np.sum(np.asarray(g) ** 2)) for g in ref["grad"].values()))
    c = 1.0 if clip is None else min(1.0, clip / (norm + 1e-6))
    keys = dict(zip(names, group_keys(names, "layer")))
    t = ref["step"]  # updates applied before this step (every step is applied here)
    acc: dict[str, np.ndarray] = {}
    for n in names:
        g = np.asarray(ref["grad"][n])
        m, v = np.asarray(ref["exp_avg"][n]), np.asarray(ref["exp_avg_sq"][n])
        vhat = v / (1.0 - betas[1] ** t)
        d = np.maximum(vhat, eps * eps)
        row = np.array([g.size, np.sum(g * g / d), np.sum(g * g > theta * d), np.sum(g * m), np.sum(g * g),
                        np.sum(m * m), np.sum(v * v), np.sum(vhat)])
        for k in (keys[n], "__all__"):
            acc[k] = acc.get(k, 0) + row
    return {k: {"rms": c * math.sqrt(r / n), "spikes": s / n, "cos": gm / math.sqrt(gg * mm), "m": math.sqrt(mm),
                "v": math.sqrt(vv), "fisher": vh}
            for k, (n, r, s, gm, gg, mm, vv, vh) in acc.items()}


def moments_from_history(refs: list[dict], betas) -> None:
    """Fill ``exp_avg`` / ``exp_avg_sq`` of each step's reference from the full gradients of the
    steps before it (AdamW without clipping: ``m = sum (1-b1) b1^(k-1-i) g_i``, same for ``v`` with
    ``g_i^2`` and b2): an independent rebuild of the optimizer's full state."""
    for k, ref in enumerate(refs):
        if k == 0:
            continue
        for n in ref["grad"]:
            gs = [np.asarray(refs[i]["grad"][n]) for i in range(k)]
            ref["exp_avg"][n] = sum((1 - betas[0]) * betas[0] ** (k - 1 - i) * g for i, g in enumerate(gs)).tolist()
            ref["exp_avg_sq"][n] = sum((1 - betas[1]) * betas[1] ** (k - 1 - i) * g * g
                                       for i, g in enumerate(gs)).tolist()


@pytest.mark.parametrize("case", ["zero2", "zero3", "fsdp2", "fsdp1", "ddp"])
def test_sharded_signals_equal_the_full_state_computation(adam_results, case):
    c = adam_results["cases"][case]
    assert adam_results["world"] == 2 and c["optimizer"] == "AdamW"
    if case == "fsdp1":  # the FlatParameter's state (use_orig_params=False) is refused, loudly
        assert "optimizer_signals.enabled" in c["flat_refused"] and "fsdp1" in c["flat_refused"]
        moments_from_history(c["refs"], adam_results["betas"])
    assert c["counters"]["internal_errors"] == 0
    recs = [StepRecord.from_dict(r) for r in c["records"]]
    assert [r.step for r in recs] == list(range(len(recs)))
    assert recs[0].optimizer_signals is None  # no moment before the first step
    ratios = [r.optimizer_signals.clip_ratio for r in recs[1:]]
    if c.get("clip"):  # DeepSpeed clips at 1.0 by default: one step's norm (3.0) exceeds it
        assert min(ratios) < 0.5 and max(ratios) == 1.0
    else:
        assert ratios == [1.0] * len(ratios)
    for rec, ref in zip(recs[1:], c["refs"][1:]):
        o = rec.optimizer_signals
        assert o is not None and o.elements_without_state == 0
        assert o.elements == sum(len(g) for g in ref["grad"].values())
        exp = reference(ref, adam_results["betas"], adam_results["eps"], o.spike_threshold, c.get("clip"))
        clipped = o.clip_ratio < 0.99  # then the spike fraction is NaN (pre-clip count kept, asserted)
        assert (math.isnan(o.spike_fraction) and o.layer_spike_fraction == {}) if clipped else \
            o.spike_fraction == o.spike_fraction_preclip
        got = {"rms": o.update_rms, "spikes": o.spike_fraction_preclip, "cos": o.grad_momentum_cosine,
               "m": o.exp_avg_norm, "v": o.exp_avg_sq_norm, "fisher": o.fisher_trace}
        for k, v in exp["__all__"].items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-12), (case, rec.step, k)
        assert sorted(o.layer_update_rms) == sorted(k for k in exp if k != "__all__")
        for layer in o.layer_update_rms:
            got = {"rms": o.layer_update_rms[layer], "spikes": o.layer_spike_fraction.get(layer, math.nan),
                   "cos": o.layer_grad_momentum_cosine[layer], "m": o.layer_exp_avg_norm[layer],
                   "v": o.layer_exp_avg_sq_norm[layer], "fisher": o.layer_fisher_trace[layer]}
            for k, v in exp[layer].items():
                if not (k == "spikes" and clipped):
                    assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-12), (case, rec.step, layer, k)
    # on these CPU ranks the native kernel computed the sums (at least one piece per step)
    assert c["native_pieces"] >= len(recs) - 1
    # 2 collectives and 1 host copy per sampled step with the signal on (the launch's first
    # sampled step also runs the native statistics kernel's one-time self-check, on the host)
    assert c["counts"][1:] == [{"collectives": 2, "syncs": 1}] * (len(recs) - 1)
    if case != "zero2":
        assert c["counts"][0] == {"collectives": 2, "syncs": 1}
