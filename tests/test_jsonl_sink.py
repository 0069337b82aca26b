"""JsonlSink / read_jsonl: exact round trip, NaN, rotation, torn last line."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from distgrad.record import STAT_FIELDS, ParamStats, StepRecord
from distgrad.sinks.jsonl import SCHEMA_VERSION, JsonlSink, read_jsonl, rotated_files

NAN_STEP = 7
NAN_PARAM = "model.layers.1.mlp.up_proj.weight"


def param_names(n_layers: int = 3) -> list[str]:
    out = ["model.embed_tokens.weight"]
    for i in range(n_layers):
        out += [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"]
    return out + ["model.norm.weight", "lm_head.weight"]


def make_record(step: int, names: list[str], rng: np.random.Generator, nan_param: str | None = None) -> StepRecord:
    """A synthetic record with full-precision random floats; NaN injected in ``nan_param``."""
    P = len(names)
    numel = rng.integers(10, 10_000, P).astype(np.float64)
    sumsq = numel * rng.uniform(1e-8, 1e-2, P)
    s = rng.standard_normal(P) * 1e-3
    nan = np.zeros(P)
    inf = np.zeros(P)
    mn = -rng.uniform(0, 1, P)
    mx = rng.uniform(0, 1, P)
    mn[0] = -0.0  # signed zero must survive too
    ranks: list[int] = []
    if nan_param is not None:
        j = names.index(nan_param)
        nan[j] = 5.0
        sumsq[j] = s[j] = mn[j] = mx[j] = np.nan
        ranks = [1]
    ps = ParamStats(names=list(names), numel=numel, sum=s, sumsq=sumsq, nan=nan, inf=inf,
                    zeros=np.floor(numel * rng.uniform(0, 0.1, P)), min=mn, max=mx)
    return StepRecord(
        step=step, micro_step=4 * step + 3, timestamp=1.7e9 + step * 0.123456789, world_size=4, params=ps,
        grad_norm=float(np.sqrt(sumsq.sum())), loss=None if step == 0 else float(2.5 + rng.standard_normal() * 0.1),
        loss_scale=2.0 ** 15, overflow=False, step_applied=True,
        counters={"sampled_steps": step + 1, "nonfinite_steps": int(step >= NAN_STEP)},
        nonfinite_ranks=ranks,
        extra={"update_ratio": {names[0]: float(rng.uniform(1e-4, 1e-2))}, "note": [1, "a", None],
               "z": np.float32(1.5), "n": np.int64(3)},
    )


def assert_same(a: StepRecord, b: StepRecord) -> None:
    for f in ("step", "micro_step", "timestamp", "world_size", "loss", "loss_scale", "overflow", "step_applied",
              "counters", "replica_mismatch_ranks", "nonfinite_ranks"):
        assert getattr(a, f) == getattr(b, f), f
    assert math.isnan(a.grad_norm) == math.isnan(b.grad_norm)
    if not math.isnan(a.grad_norm):
        assert a.grad_norm == b.grad_norm
    assert a.params.names == b.params.names
    for f in STAT_FIELDS:
        x, y = getattr(a.params, f), getattr(b.params, f)
        assert y.dtype == np.float64
        # bit-exact, NaN and -0.0 included
        assert x.tobytes() == y.tobytes(), f


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
    # numpy scalars in extra were converted
    assert back[3].extra["z"] == 1.5 and back[3].extra["n"] == 3
    assert back[3].extra["update_ratio"] == recs[3].extra["update_ratio"]


def test_line_format(tmp_path):
    path = tmp_path / "run.jsonl"
    write_run(path, 10)
    lines = path.read_text().splitlines()
    assert len(lines) == 10
    d = json.loads(lines[NAN_STEP])
    assert d["schema"] == SCHEMA_VERSION == 1
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


def test_newer_schema_rejected(tmp_path):
    path = tmp_path / "run.jsonl"
    write_run(path, 1)
    d = json.loads(path.read_text())
    d["schema"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(d) + "\n")
    with pytest.raises(ValueError, match="schema"):
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
