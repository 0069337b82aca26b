"""FP8 scaling health (distgrad/signals/fp8.py) on one process, torchao float8 emulated on the
CPU, against float64 recomputations made another way (tests/fp8_models.py: the tensors each
float8 layer casts captured by forward / full-backward hooks, torchao's dynamic scale written
out from its definition, the scaled values cast by torch and compared): per layer and tensor the
amax and scale extremes over the step's micro-batches, the underflow and saturation counts.
Also: the realistic cases (an input that becomes all zeros: amax 0 in that layer only; an input
that jumps 1000x: its scale collapses 1000x and its small elements underflow) name the right
layer in the served metrics, a healthy run meets no alert condition, saturation counted exactly
with a stale scale, off by default, clear errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchao")

import distgrad  # noqa: E402
from distgrad.config import ConfigError  # noqa: E402
from distgrad.signals.fp8 import ROLES, Fp8Signal, cast_stats, fp8_thresholds  # noqa: E402
from tests.fp8_models import DTYPES, capture, make, reference  # noqa: E402

GAS, B = 2, 6
LAYERS = ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]


def _run(steps, batch, interval=1, jsonl=None, **fp8):
    """``steps`` optimizer steps of GAS micro-batches ``batch(step, micro) -> (x, y)``; returns
    the records, the captured casts per step, the served samples of the last record. ``jsonl``:
    a path for distgrad's JSONL sink (tests/monitoring/test_precursor_paging.py replays it)."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             sampling={"interval": interval}, fp8={"enabled": True, **fp8},
                             sinks={"jsonl": {"path": jsonl}})
    recs = []
    dg.add_hook(recs.append)
    caps_per_step = []
    for s in range(steps):
        caps, handles = capture(model)
        for micro in range(GAS):
            x, y = batch(s, micro)
            (F.cross_entropy(model(x), y) / GAS).backward()
        opt.step()
        opt.zero_grad()
        for h in handles:
            h.remove()
        caps_per_step.append(caps)
    errors = dg.counters["internal_errors"]
    dg.close()
    assert errors == 0
    return recs, caps_per_step


def _batch(scale_of=lambda s, micro: 1.0):
    def batch(s, micro):
        g = torch.Generator().manual_seed(100 * s + micro)
        x = torch.randn(B, 16, generator=g) * scale_of(s, micro)
        return x, torch.randint(0, 5, (B,), generator=g)
    return batch


def _check(part, caps):
    assert set(part.stats) == set(LAYERS)
    for name in LAYERS:
        for role in ROLES:
            ref = reference(caps[(name, role)], DTYPES[role])
            st = part.stats[name][role]
            assert st["observed"] == GAS
            for k in ("elements", "underflow", "saturated"):
                assert st[k] == ref[k], (name, role, k)
            for k in ("amax_min", "amax_max", "scale_min", "scale_max"):
                assert st[k] == pytest.approx(ref[k], rel=1e-6), (name, role, k)


def test_fp8_layers_equal_float64_recomputation_and_healthy_run_is_silent():
    # micro-batches of different magnitudes: the min and max over them differ
    recs, caps = _run(3, _batch(lambda s, micro: 1.0 + 3 * micro))
    assert len(recs) == 3
    for rec, cap in zip(recs, caps):
        _check(rec.fp8, cap)
        assert rec.fp8.layers == {"blocks.0.up": "0", "blocks.0.down": "0", "blocks.1.up": "1",
                                  "blocks.1.down": "1"}
    # the record survives JSON
    back = Fp8Signal.Part.from_dict(recs[-1].fp8.to_dict())
    assert back == recs[-1].fp8
    # served per (layer, tensor); a healthy run meets none of the alert conditions
    s = Fp8Signal.samples(recs[-1].fp8)
    assert set(s["distgrad_fp8_amax_min"]) == {(lay, r) for lay in ("0", "1") for r in ROLES}
    ref = min(reference(caps[-1][(n, "input")], DTYPES["input"])["amax_min"] for n in LAYERS[:2])
    assert s["distgrad_fp8_amax_min"][("0", "input")] == pytest.approx(ref, rel=1e-6)
    refs = [reference(caps[-1][(n, "grad_output")], DTYPES["grad_output"]) for n in LAYERS]
    assert s["distgrad_fp8_amax_max"]["grad_output"] == pytest.approx(max(r["amax_max"] for r in refs), rel=1e-6)
    assert s["distgrad_fp8_underflow_ratio"]["grad_output"] == (sum(r["underflow"] for r in refs)
                                                                / sum(r["elements"] for r in refs))
    _assert_alerts(s, set())
    assert s["distgrad_fp8_amax_disagreement"] == {}  # no tensor parallelism
    assert _collapsed(recs) == set()


def _collapsed(recs):
    """The tensors whose served smallest scale fell below DistgradFp8ScaleCollapse's ratio of its
    maximum over the run so far (the rule's max_over_time, every record one scrape)."""
    from grafana import config

    ratio = config.ALERTS["DistgradFp8ScaleCollapse"]["ratio"]
    seen, out = {}, set()
    for r in recs:
        for role, v in Fp8Signal.samples(r.fp8)["distgrad_fp8_scale_min"].items():
            seen[role] = max(seen.get(role, v), v)
            if v < ratio * seen[role]:
                out.add(role)
    return out


def _assert_alerts(s, expected):
    """The (alert, layer, tensor) whose condition holds in the served samples, with the
    thresholds of grafana/config.py."""
    from grafana import config

    a = config.ALERTS
    got = set()
    for key, v in s["distgrad_fp8_amax_min"].items():
        if v == 0:
            got.add(("DistgradFp8AmaxZero",) + key)
    for key, v in s["distgrad_fp8_scale_min"].items():
        if math.isnan(v) or v == 0 or s["distgrad_fp8_scale_max"][key] == math.inf:
            got.add(("DistgradFp8ScaleInvalid", key))
    for key, v in s["distgrad_fp8_layer_saturation_ratio"].items():
        if v > a["DistgradFp8Saturation"]["threshold"]:
            got.add(("DistgradFp8Saturation", key))
    assert got == expected


def test_input_that_becomes_all_zeros_names_its_layer():
    # the model's input becomes exactly zero at step 2 (an empty / masked-out batch)
    def batch(s, micro):
        x, y = _batch()(s, micro)
        return (torch.zeros_like(x) if s == 2 else x), y

    recs, caps = _run(3, batch)
    _check(recs[2].fp8, caps[2])
    s = Fp8Signal.samples(recs[2].fp8)
    assert s["distgrad_fp8_amax_min"][("0", "input")] == 0.0
    # the scale torchao computes for amax 0: fp8_max / 1e-12, finite
    assert recs[2].fp8.stats["blocks.0.up"]["input"]["scale_max"] == pytest.approx(448 / 1e-12, rel=1e-6)
    # the all-zero input reaches only the first linear; later ones see the biases' output
    zero = {k for k, v in s["distgrad_fp8_amax_min"].items() if v == 0}
    assert ("0", "input") in zero
    assert all(recs[i].fp8.stats["blocks.0.up"]["input"]["amax_min"] > 0 for i in (0, 1))
    _assert_alerts(s, {("DistgradFp8AmaxZero",) + k for k in zero})
    # the offline report's FP8 series: the smallest amax over layers (0 at step 2, block 0 named)
    # and the underflow fraction, against the float64 references of the captured casts
    from distgrad.report.signals import SignalsAccumulator

    acc = SignalsAccumulator(max_points=16)
    for r in recs:
        acc.add(r)
    series = {x.metric: x for x in acc.result().series if x.signal == "fp8"}
    refs = [{(n, role): reference(c[(n, role)], DTYPES[role]) for n in LAYERS for role in ROLES} for c in caps]
    amin = series["amax_min"]
    np.testing.assert_allclose(amin.glob.last[:, 0], [min(r["amax_min"] for r in ref.values()) for ref in refs],
                               rtol=1e-6)
    assert amin.glob.last[2, 0] == 0 and amin.per_layer.last[2, amin.layers.index("0")] == 0
    under = series["underflow_ratio"].glob.last[:, 0]
    np.testing.assert_allclose(under, [sum(r["underflow"] for r in ref.values()) / sum(r["elements"] for r in
                                                                                        ref.values()) for ref in refs])


def test_input_that_jumps_1000x_collapses_its_scale():
    recs, caps = _run(3, _batch(lambda s, micro: 1000.0 if s == 2 else 1.0))
    for rec, cap in zip(recs, caps):
        _check(rec.fp8, cap)
    before = recs[1].fp8.stats["blocks.0.up"]["input"]
    after = recs[2].fp8.stats["blocks.0.up"]["input"]
    assert after["scale_min"] < before["scale_min"] / 300
    assert after["saturated"] == 0  # dynamic scaling follows the jump: no clipping
    assert _collapsed(recs) == {"input"}  # DistgradFp8ScaleCollapse's condition, for the input only


def test_saturation_counted_exactly_with_a_stale_scale():
    """A delayed (stale) scale: the scale of an earlier, 1000x smaller tensor applied to this one
    clips the large elements; cast_stats counts them exactly against torch's cast."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 48, generator=g)
    x[0, :5] = torch.tensor([2e-6, -1e-7, 3e-12, 0.0, 5e-13])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax, _, _ = fp8_thresholds(dtype)
        stale = torch.tensor(fmax / (x.abs().max().item() / 30), dtype=torch.float32)
        sums, maxes = cast_stats(x, dtype, scale=stale)
        y = x.float() * stale
        c = y.clamp(-fmax, fmax).to(dtype).double()
        top = 2.0 ** math.floor(math.log2(fmax)) * torch.finfo(dtype).eps
        sat = int(((y.double().abs() - c.abs()) > top / 2).sum())
        under = int(((x != 0) & (c == 0)).sum())
        assert sat > 10 and under >= 1
        assert sums.tolist() == [1.0, x.numel(), under, sat, 0.0]
        assert maxes.tolist() == [stale.item(), -stale.item(), x.abs().max().item(), -x.abs().max().item()]


def test_only_sampled_steps_and_off_by_default():
    recs, caps = _run(4, _batch(), interval=2)
    assert [r.step for r in recs] == [0, 2]
    for r, s in zip(recs, (0, 2)):
        _check(r.fp8, caps[s])
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"})
    x, y = _batch()(0, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert dg.last_record.fp8 is None
    dg.close()


def test_clear_errors():
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="fp8.enabled.*no torchao float8 layer"):
        distgrad.instrument(plain, optimizer=opt, exporter={"enabled": False}, fp8={"enabled": True})
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="fp8.modules"):
        distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, fp8={"enabled": True, "modules": "("})


def test_distgrad_reexecutions_are_not_observed():
    """A forward + backward under distgrad's replay flag (the rerun attribution's and the underflow
    recomputation's: signals.underflow.in_replay) inside a sampled step is not counted: the
    step's part equals the float64 reference of the training micro-batch alone."""
    from distgrad.signals import underflow

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             fp8={"enabled": True})
    caps, handles = capture(model)
    x, y = _batch()(0, 0)
    F.cross_entropy(model(x), y).backward()
    for h in handles:
        h.remove()
    underflow._DEPTH[0] += 1
    try:
        x2, y2 = _batch(lambda s, micro: 50.0)(0, 1)
        torch.autograd.grad(F.cross_entropy(model(x2), y2), list(model.parameters()))
    finally:
        underflow._DEPTH[0] -= 1
    opt.step()
    part = dg.last_record.fp8
    dg.close()
    for name in LAYERS:
        for role in ROLES:
            ref = reference(caps[(name, role)], DTYPES[role])
            st = part.stats[name][role]
            assert st["observed"] == 1 and st["elements"] == ref["elements"]
            assert st["amax_max"] == pytest.approx(ref["amax_max"], rel=1e-6)


@pytest.mark.parametrize("key", ["fp8_stale", "fp8_fresh"])
def test_fsdp2_float8_all_gather_stale_precomputed_scale_saturates_exactly(key, tmp_path):
    """FSDP2 with torchao's float8 all-gather on 2 gloo ranks (tests/dist/fp8_fsdp_cases.py, one
    launch shared with tests/monitoring/test_precursor_paging.py). ``fp8_stale``:
    ``precompute_float8_dynamic_scale_for_fsdp`` called once at set-up, so every weight cast uses
    the scale of the initial weight; ``fp8_fresh``: called after each optimizer step (torchao's
    docstring). Per step and float8 layer, the weight's counts equal the float64 recomputation of
    the cast of the whole weight (both ranks' shards, captured before the forward) with the scale
    torchao used (from the initial weight's amax / the current one's), for each of the GAS
    micro-batches; amax = the whole weight's, on both extremes; the input and grad_output as
    in the other multi-rank cases. The stale run saturates in block 1 (learning rate 0.05) from
    step 1 on, beyond DistgradFp8Saturation's threshold, and never in block 0 (5e-4); the fresh
    run never saturates. 2 collectives per sampled step, 1 host copy after the first. The offline
    report's saturation series (per layer and global) equals the references' fractions."""
    from grafana import config
    from tests.dist.fp8_fsdp_cases import GAS, STEPS
    from tests.dist.fp8_fsdp_cases import LAYERS as FL
    from tests.fp8_models import fsdp_cases

    res = fsdp_cases()
    assert res["world_size"] == 2
    ranks = res["cases"][key]["ranks"]
    for r in ranks:
        assert "error" not in r, r.get("traceback")
        assert r["internal_errors"] == 0
        assert [c["collectives"] for c in r["counts"]] == [2] * STEPS
        assert [c["syncs"] for c in r["counts"][1:]] == [1] * (STEPS - 1)
    thr = config.ALERTS["DistgradFp8Saturation"]["threshold"]
    first = {n: torch.tensor(sum((r["shards"][0][n] for r in ranks), []), dtype=torch.float64) for n in FL}
    report = []  # per step, per layer: the reference's [saturated, elements] over its modules and tensors
    for s, rec in enumerate(ranks[0]["records"]):
        assert rec is not None and set(rec["stats"]) == set(FL)
        report.append({"0": [0, 0], "1": [0, 0]})
        for name in FL:
            whole = torch.tensor(sum((r["shards"][s][name] for r in ranks), []), dtype=torch.float64)
            assert whole.shape == first[name].shape  # both ranks' shards: the whole weight
            stale = first[name].abs().max().item() if key == "fp8_stale" else None
            ref = reference([whole], DTYPES["weight"], amax_of_scale=stale)
            st = rec["stats"][name]["weight"]
            assert st["observed"] == 2 * GAS
            for c in ("elements", "underflow", "saturated"):
                assert st[c] == GAS * ref[c], (s, name, c)
            assert st["amax_min"] == st["amax_max"] == pytest.approx(ref["amax_max"], rel=1e-6)
            assert st["scale_min"] == st["scale_max"] == pytest.approx(ref["scale_max"], rel=1e-6)
            lay = report[-1][name.split(".")[1]]
            lay[0], lay[1] = lay[0] + GAS * ref["saturated"], lay[1] + GAS * ref["elements"]
            ratio = st["saturated"] / st["elements"]
            if key == "fp8_stale" and s >= 1 and name.startswith("blocks.1."):
                assert ratio > thr, (s, name, ratio)
            else:
                assert ratio == 0, (s, name, ratio)
            for role in ("input", "grad_output"):
                refs = [m for r in ranks for m in r["refs"][s][f"{name}|{role}"]]
                st = rec["stats"][name][role]
                assert st["observed"] == len(refs) == 2 * GAS
                for c in ("elements", "underflow", "saturated"):
                    assert st[c] == sum(m[c] for m in refs), (s, name, role, c)
                assert st["amax_min"] == pytest.approx(min(m["amax_min"] for m in refs), rel=1e-6)
                assert st["amax_max"] == pytest.approx(max(m["amax_max"] for m in refs), rel=1e-6)
                assert st["scale_min"] == pytest.approx(min(m["scale_min"] for m in refs), rel=1e-6)
                lay[0] += sum(m["saturated"] for m in refs)
                lay[1] += sum(m["elements"] for m in refs)
        if key == "fp8_stale" and s >= 1:
            # the served per-layer metric names layer 1 only
            srv = Fp8Signal.samples(Fp8Signal.Part.from_dict(rec))["distgrad_fp8_layer_saturation_ratio"]
            assert {k for k, v in srv.items() if v > thr} == {"1"}, srv
    # the offline report's FP8 saturation series, from rank 0's JSONL log: per layer the clipped
    # fraction over its modules and tensors, equal to the references'
    from distgrad.export.jsonl import read_jsonl
    from distgrad.report.signals import SignalsAccumulator

    log = tmp_path / f"{key}.jsonl"
    log.write_text(ranks[0]["jsonl"])
    acc = SignalsAccumulator(max_points=16)
    for r in read_jsonl(log):
        acc.add(r)
    sat = next(x for x in acc.result().series if x.signal == "fp8" and x.metric == "saturation_ratio")
    for lay in ("0", "1"):
        col = sat.per_layer.last[:, sat.layers.index(lay)]
        np.testing.assert_allclose(col, [r[lay][0] / r[lay][1] for r in report], rtol=1e-12)
    np.testing.assert_allclose(sat.glob.last[:, 0], [sum(v[0] for v in r.values()) / sum(v[1] for v in r.values())
                                                     for r in report], rtol=1e-12)
