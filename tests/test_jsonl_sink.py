"""JsonlSink / read_jsonl: exact round trip, NaN, rotation, torn last line."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from distgrad.record import STAT_FIELDS, Health, StepRecord
from distgrad.export.jsonl import SCHEMA_VERSION, JsonlSink, read_jsonl, rotated_files
from tests.synthetic import NAN_STEP, assert_same, make_record, param_names

NAN_PARAM = "model.layers.1.mlp.up_proj.weight"


def write_run(path, n: int, **kw) -> list[StepRecord]:
    rng = np.random.default_rng(123)
    names = param_names()
    recs = [make_record(t, names, rng, NAN_PARAM if t == NAN_STEP else None) for t in range(n)]
    with JsonlSink(path, **kw) as sink:
        for r in recs:
            sink.write(r)
    return recs


def test_round_trip_exact_with_nan(tmp_path):
    path = tmp_path / "run.jsonl"
    recs = write_run(path, 20)
    back = list(read_jsonl(path))
    assert len(back) == 20
    for a, b in zip(recs, back):
        assert_same(a, b)
    bad = back[NAN_STEP]
    j = bad.params.index(NAN_PARAM)
    assert bad.nonfinite and bad.params.nan[j] == 5 and math.isnan(bad.params.sumsq[j])
    assert math.isnan(bad.grad_norm)
    assert bad.nonfinite_ranks == [1]
    assert not any(r.nonfinite for i, r in enumerate(back) if i != NAN_STEP)
    assert back[0].loss is None
    # numpy scalars in the typed parts were converted
    assert back[3].grad_scale == 1.5 and back[3].health.n_vanishing == 3 and type(back[3].health.n_vanishing) is int
    assert back[3].health == Health(3, 0, ["a", "b", "c"], [])
    assert back[3].update_ratio == recs[3].update_ratio


def test_line_format(tmp_path):
    path = tmp_path / "run.jsonl"
    write_run(path, 10)
    lines = path.read_text().splitlines()
    assert len(lines) == 10
    d = json.loads(lines[NAN_STEP])
    assert d["schema"] == SCHEMA_VERSION == 2
    assert d["step"] == NAN_STEP
    assert "NaN" in lines[NAN_STEP]  # Python JSON non-finite literal
    assert set(d["params"]) == {"names", *STAT_FIELDS}


def test_flushed_after_every_line(tmp_path):
    path = tmp_path / "run.jsonl"
    rng = np.random.default_rng(0)
    names = param_names()
    sink = JsonlSink(path)
    try:
        for t in range(5):
            sink.write(make_record(t, names, rng))
            # readable by another reader right away, without close()
            assert [r.step for r in read_jsonl(path)] == list(range(t + 1))
    finally:
        sink.close()
    sink.close()  # idempotent
    with pytest.raises(ValueError):
        sink.write(make_record(9, names, rng))


def test_rotation(tmp_path):
    path = tmp_path / "run.jsonl"
    one = tmp_path / "one.jsonl"
    write_run(one, 1)
    size1 = one.stat().st_size
    max_bytes = int(size1 * 3.5)  # three lines per file
    recs = write_run(path, 40, max_bytes=max_bytes, backups=4)
    files = rotated_files(path)
    assert [f.name for f in files] == ["run.jsonl.4", "run.jsonl.3", "run.jsonl.2", "run.jsonl.1", "run.jsonl"]
    for f in files:
        assert f.stat().st_size <= max_bytes
    back = list(read_jsonl(path))
    # the newest records survive, contiguous and in order; the oldest files were deleted
    steps = [r.step for r in back]
    assert steps == list(range(40 - len(steps), 40))
    assert 13 <= len(steps) <= 15
    for r in back:
        assert_same(recs[r.step], r)
    # only the live file
    assert [r.step for r in read_jsonl(path, include_rotated=False)] == steps[-len(path.read_text().splitlines()):]


def test_rotation_without_backups(tmp_path):
    path = tmp_path / "run.jsonl"
    one = tmp_path / "one.jsonl"
    write_run(one, 1)
    write_run(path, 10, max_bytes=int(one.stat().st_size * 2.5), backups=0)
    assert rotated_files(path) == [path]
    assert [r.step for r in read_jsonl(path)] == [8, 9]


def test_truncated_last_line_tolerated(tmp_path):
    path = tmp_path / "run.jsonl"
    recs = write_run(path, 6)
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    # simulate a crash in the middle of writing step 6
    torn = lines[-1][: len(lines[-1]) // 2]
    path.write_bytes(data + torn)
    back = list(read_jsonl(path))
    assert [r.step for r in back] == list(range(6))
    for a, b in zip(recs, back):
        assert_same(a, b)
    # a torn line ending right before its newline is also skipped
    path.write_bytes(data + lines[-1][:-2])
    assert len(list(read_jsonl(path))) == 6


def test_reopen_after_crash_cuts_torn_tail(tmp_path):
    path = tmp_path / "run.jsonl"
    write_run(path, 3)
    with open(path, "ab") as f:
        f.write(b'{"schema":1,"step":3,"micro_st')
    rng = np.random.default_rng(5)
    with JsonlSink(path) as sink:
        sink.write(make_record(3, param_names(), rng))
    assert [r.step for r in read_jsonl(path)] == [0, 1, 2, 3]


def test_malformed_middle_line_raises(tmp_path):
    path = tmp_path / "run.jsonl"
    write_run(path, 3)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"{not json\n" + lines[1])
    with pytest.raises(ValueError, match=r"run.jsonl:2"):
        list(read_jsonl(path))


@pytest.mark.parametrize("delta", [1, -1])
def test_other_schema_rejected(tmp_path, delta):
    """A newer line format, and the pre-release one (schema 1, no release wrote it), are refused
    with the schema named instead of read into a record with its diagnostics missing."""
    path = tmp_path / "run.jsonl"
    write_run(path, 1)
    d = json.loads(path.read_text())
    d["schema"] = SCHEMA_VERSION + delta
    path.write_text(json.dumps(d) + "\n")
    with pytest.raises(ValueError, match=f"schema {SCHEMA_VERSION + delta}"):
        list(read_jsonl(path))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(read_jsonl(tmp_path / "nope.jsonl"))


def test_fsync_and_bad_args(tmp_path):
    path = tmp_path / "sub" / "run.jsonl"
    write_run(path, 2, fsync=True)
    assert len(list(read_jsonl(path))) == 2
    with pytest.raises(ValueError):
        JsonlSink(tmp_path / "x.jsonl", max_bytes=-1)
    with pytest.raises(ValueError):
        JsonlSink(tmp_path / "x.jsonl", backups=-1)
    assert os.path.exists(path)


def test_parts_read_back_by_their_annotations_and_validated(tmp_path):
    """StepRecord.from_dict builds every part (nested ones too) from the dataclasses' own
    annotations (pydantic): a record with the non-finite event's nested provenance, rows,
    culprits and culprit module, a clip part and loss components reads back equal to what was
    written, with the typed classes; a wrong type or a missing field is refused, named."""
    import pydantic

    from distgrad.record import Clip, Culprit, NonfiniteEvent, ParamProvenance, Provenance, RankCount
    from distgrad.record.culprit import CulpritModule
    from distgrad.record.loss import LossComponents

    rec = make_record(4, param_names(), np.random.default_rng(0))
    prov = Provenance(4, [ParamProvenance("a", 2, 1, [0, 3])], "a", "0")
    rec.nonfinite_event = NonfiniteEvent(4, [RankCount("a", 3, 2, 1, 3)], prov, [Culprit(3, loss=True)],
                                         CulpritModule(4, "found", rank=3, module="blocks.0", micro_batch=1))
    rec.clip = Clip(1.0, 0.25, 1.0)
    rec.loss_components = LossComponents(names=["lm", "z"], mean=[2.0, float("nan")], weight=[1.0, 0.01])
    path = tmp_path / "run.jsonl"
    with JsonlSink(path) as sink:
        sink.write(rec)
    (back,) = read_jsonl(path)
    ev = back.nonfinite_event
    assert type(ev) is NonfiniteEvent and type(ev.provenance.params[0]) is ParamProvenance
    assert type(ev.rows[0]) is RankCount and type(ev.culprits[0]) is Culprit and type(ev.culprit_module) is CulpritModule
    assert ev == rec.nonfinite_event and back.clip == rec.clip
    assert back.loss_components.names == ["lm", "z"] and math.isnan(back.loss_components.mean[1])
    line = json.loads(path.read_text().splitlines()[0])
    line.pop("schema")
    assert json.dumps(back.to_dict(), sort_keys=True) == json.dumps(line, sort_keys=True)  # the line, exactly

    d = json.loads(json.dumps(line))
    d["nonfinite_event"]["rows"][0]["rank"] = "three"
    with pytest.raises(pydantic.ValidationError, match="rank"):
        StepRecord.from_dict(d)
    with pytest.raises(pydantic.ValidationError, match="step"):
        Provenance.from_dict({"params": []})
