import dataclasses
import json
import math

import numpy as np
import pytest

from distgrad.diagnostics.flight_recorder import FlightRecorder, load_dump, provenance_from
from distgrad.record import STAT_FIELDS, ParamStats, Spikes, StepRecord

NAMES = ["embed.weight", "layers.0.attn.q.weight", "layers.1.mlp.up.weight", "head.weight"]


def make_record(step, nan=None, inf=None, loss_scale=None, overflow=None, world=2):
    rng = np.random.default_rng(step)
    P = len(NAMES)
    nan = np.zeros(P) if nan is None else np.asarray(nan, dtype=float)
    inf = np.zeros(P) if inf is None else np.asarray(inf, dtype=float)
    numel = np.array([100.0, 64.0, 64.0, 100.0])
    g = rng.standard_normal(P)
    sumsq = np.abs(g) + 0.1
    bad = (nan + inf) > 0
    sumsq = np.where(nan > 0, np.nan, np.where(inf > 0, np.inf, sumsq))
    ps = ParamStats(
        names=list(NAMES),
        numel=numel,
        sum=np.where(bad, np.nan, g),
        sumsq=sumsq,
        nan=nan,
        inf=inf,
        zeros=np.zeros(P),
        min=np.where(nan > 0, np.nan, -np.abs(g)),
        max=np.where(nan > 0, np.nan, np.where(inf > 0, np.inf, np.abs(g))),
    )
    return StepRecord(
        step=step,
        micro_step=4 * step,
        timestamp=1.7e9 + step,
        world_size=world,
        params=ps,
        grad_norm=float(np.sqrt(ps.sumsq.sum())),
        loss=2.0 + 0.01 * step,
        loss_scale=loss_scale,
        overflow=overflow,
        counters={"sampled_steps": step + 1},
        nonfinite_ranks=[1] if bad.any() else [],
        spikes=Spikes(zscore={"grad_norm": {"ema": float("nan"), "window": 0.5}},
                      total={"grad_norm": {"ema": np.int64(3), "window": 0}}),
    )


def assert_records_equal(a: StepRecord, b: StepRecord):
    for f in dataclasses.fields(StepRecord):
        if f.name in ("params", "spikes", "grad_norm"):
            continue
        assert getattr(a, f.name) == getattr(b, f.name), f.name
    assert (a.grad_norm == b.grad_norm) or (math.isnan(a.grad_norm) and math.isnan(b.grad_norm))
    assert a.params.names == b.params.names
    for f in STAT_FIELDS:
        np.testing.assert_array_equal(getattr(a.params, f), getattr(b.params, f))


def test_provenance_from_hand_computed():
    nan = np.array([[0, 3, 0, 0], [0, 5, 0, 0], [0, 0, 0, 0]])
    inf = np.array([[0, 0, 0, 0], [2, 0, 0, 0], [0, 1, 0, 0]])
    prov = provenance_from(NAMES, nan, inf)
    assert prov == {
        "params": [
            {"name": "embed.weight", "nan": 0, "inf": 2, "ranks": [1]},
            {"name": "layers.0.attn.q.weight", "nan": 8, "inf": 1, "ranks": [0, 1, 2]},
        ],
        "first_param": "layers.0.attn.q.weight",
    }
    # explicit execution order: q runs before embed here (contrived) -> origin is embed
    order = {"layers.0.attn.q.weight": 0, "embed.weight": 1}
    p2 = provenance_from(NAMES, nan, inf, order_key=order)
    assert p2["first_param"] == "embed.weight"
    assert [r["name"] for r in p2["params"]] == ["layers.0.attn.q.weight", "embed.weight"]
    p3 = provenance_from(NAMES, nan, inf, order_key=lambda n: -NAMES.index(n))
    assert p3["first_param"] == "embed.weight"
    # world size 1 as 1-D, no non-finite
    assert provenance_from(NAMES, np.zeros(4), np.zeros(4)) == {"params": [], "first_param": None}
    with pytest.raises(ValueError):
        provenance_from(NAMES, np.zeros((2, 3)), np.zeros((2, 3)))
    with pytest.raises(ValueError):
        provenance_from(NAMES, np.zeros((2, 4)), np.zeros((1, 4)))


def test_ring_buffer_and_dump_once_on_first_nonfinite(tmp_path):
    fr = FlightRecorder(capacity=5, out_dir=tmp_path / "fr", config={"zero_stage": 2, "lr": 3e-4})
    recs = [make_record(s, loss_scale=2.0**16) for s in range(10)]
    for r in recs[:8]:
        assert fr.maybe_dump_on_nonfinite(r) is None
    assert len(fr) == 5 and [r.step for r in fr.records] == [3, 4, 5, 6, 7]
    bad = make_record(8, nan=[0, 0, 7, 0], inf=[0, 2, 0, 0], loss_scale=2.0**15)
    per_rank_nan = np.array([[0, 0, 0, 0], [0, 0, 7, 0]])
    per_rank_inf = np.array([[0, 2, 0, 0], [0, 0, 0, 0]])
    prov = provenance_from(NAMES, per_rank_nan, per_rank_inf)
    path = fr.maybe_dump_on_nonfinite(bad, provenance=prov)
    assert path == tmp_path / "fr" / "flightrec-step8-nonfinite.json"
    assert path.exists() and path.with_suffix(".txt").exists()
    # a second non-finite step does not dump again
    bad2 = make_record(9, nan=[1, 0, 0, 0])
    assert fr.maybe_dump_on_nonfinite(bad2) is None
    assert fr.records[-1] is bad2 and len(list((tmp_path / "fr").iterdir())) == 2

    d = load_dump(path)
    assert d["reason"] == "nonfinite" and d["step"] == 8
    assert d["config"] == {"zero_stage": 2, "lr": 3e-4}
    assert d["provenance"] == prov
    assert d["first_nonfinite_step"] == 8
    assert d["loss_scale_history"] == [[s, 2.0**16] for s in range(4, 8)] + [[8, 2.0**15]]
    expected = recs[4:8] + [bad]
    assert len(d["records"]) == 5
    for a, b in zip(d["records"], expected):
        assert_records_equal(a, b)
        assert isinstance(a, StepRecord)
    assert math.isnan(d["records"][0].spikes.zscore["grad_norm"]["ema"])
    assert d["records"][0].spikes.total["grad_norm"] == {"ema": 3, "window": 0}

    text = path.with_suffix(".txt").read_text()
    assert "first non-finite step: 8" in text
    assert "layers.1.mlp.up.weight" in text and "layers.0.attn.q.weight" in text
    # the backward-order view, named for what it is (no replay here: the origin of a backward NaN)
    origin = [ln for ln in text.splitlines() if ln.startswith("non-finite parameter last in forward order")]
    assert origin and "layers.1.mlp.up.weight" in origin[0] and "made in the backward pass" in origin[0]
    row = [ln for ln in text.splitlines() if ln.strip().startswith("layers.1.mlp.up.weight")][0]
    assert row.split()[-3:] == ["7", "0", "1"]  # nan, inf, ranks
    assert "ranks with non-finite shards: 0, 1" in text
    assert "global gradient norm" in text

    fr.rearm()
    p2 = fr.maybe_dump_on_nonfinite(make_record(10, inf=[0, 0, 0, 1]))
    assert p2 is not None and p2.name == "flightrec-step10-nonfinite.json"


def test_json_is_plain_json_with_nan_literals(tmp_path):
    fr = FlightRecorder(capacity=3, out_dir=tmp_path)
    fr.record(make_record(0, nan=[1, 0, 0, 0]))
    p = fr.dump("manual")
    raw = p.read_text()
    assert "NaN" in raw
    d = json.loads(raw)
    assert d["format"] == "distgrad-flightrec"
    assert d["records"][0]["params"]["names"] == NAMES


def test_dump_without_provenance_derives_from_record(tmp_path):
    fr = FlightRecorder(capacity=4, out_dir=tmp_path)
    fr.record(make_record(0))
    fr.record(make_record(1, inf=[0, 0, 0, 5]))
    fr.record(make_record(2))
    p = fr.dump("spike detected!")  # sanitised
    assert p.name == "flightrec-step2-spike_detected.json"
    d = load_dump(p)
    assert d["provenance_derived_from_record"] is True
    assert d["provenance"]["first_param"] == "head.weight"
    assert d["provenance"]["params"] == [{"name": "head.weight", "nan": 0, "inf": 5, "ranks": [1]}]
    assert "first non-finite step: 1" in p.with_suffix(".txt").read_text()
    # same name again: not overwritten
    p2 = fr.dump("spike detected!")
    assert p2.name == "flightrec-step2-spike_detected-2.json" and p.exists()


def test_empty_and_healthy_dump(tmp_path):
    fr = FlightRecorder(capacity=2, out_dir=tmp_path, config={"path": tmp_path})
    p = fr.dump("manual")
    assert p.name == "flightrec-step-1-manual.json"
    assert "no records buffered" in p.with_suffix(".txt").read_text()
    fr.record(make_record(3, loss_scale=None))
    d = load_dump(fr.dump("manual", loss_scale_history={1: 4.0, 2: 2.0}))
    assert d["provenance"] is None and d["first_nonfinite_step"] is None
    assert d["loss_scale_history"] == [[1, 4.0], [2, 2.0]]
    assert d["config"] == {"path": str(tmp_path)}


def test_overflow_steps_can_be_ignored(tmp_path):
    fr = FlightRecorder(capacity=4, out_dir=tmp_path, dump_on_overflow=False)
    assert fr.maybe_dump_on_nonfinite(make_record(0, inf=[1, 0, 0, 0], overflow=True)) is None
    p = fr.maybe_dump_on_nonfinite(make_record(1, nan=[1, 0, 0, 0], overflow=False))
    assert p is not None and p.name == "flightrec-step1-nonfinite.json"
    with pytest.raises(ValueError):
        FlightRecorder(capacity=0)
    with pytest.raises(ValueError):
        (tmp_path / "x.json").write_text("{}")
        load_dump(tmp_path / "x.json")
