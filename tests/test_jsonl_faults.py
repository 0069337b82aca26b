"""JsonlSink under faults: directory removed, disk full, path replaced, rotation failing.

Reference: the records handed to the sink. Every record is either in the file, whole and
bit-identical, or counted as lost (``SinkError`` raised, ``lost_records``); the file never holds
a line glued to another.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil

import numpy as np
import pytest

from distgrad.export import jsonl as jsonl_mod
from distgrad.export.base import SinkError
from distgrad.export.jsonl import JsonlSink, read_jsonl
from distgrad.core.step import StepOutcome, StepToken
from tests.synthetic import assert_same, make_record, param_names


class Clock:
    """A fake monotonic clock the test advances by one second per training step."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def drive(sink: JsonlSink, clock: Clock, steps: range, fault=None) -> tuple[dict[int, object], list[int]]:
    """Write one record per step (``fault(step)`` first), 1 s apart; return the records by step
    and the steps whose write raised SinkError."""
    rng = np.random.default_rng(7)
    names = param_names()
    recs, lost = {}, []
    for t in steps:
        if fault is not None:
            fault(t)
        recs[t] = make_record(t, names, rng)
        try:
            sink.write(recs[t])
        except SinkError:
            lost.append(t)
        clock.t += 1.0
    return recs, lost


def read_strict(path) -> list:
    """All records; any malformed line (glued or torn in the middle) fails the test."""
    return list(read_jsonl(path, include_rotated=False))


def test_directory_removed_is_recreated_and_nothing_is_lost(tmp_path):
    d = tmp_path / "logs"
    path = d / "run.jsonl"
    sink = JsonlSink(path)
    clock = Clock()
    sink._clock = clock

    def fault(t):
        if t == 5:
            shutil.rmtree(d)
        if t == 15:  # the user recreates it 10 steps later: harmless
            d.mkdir(exist_ok=True)

    recs, lost = drive(sink, clock, range(30), fault)
    sink.close()
    assert lost == [] and sink.lost_records == 0
    back = read_strict(path)
    # steps 0-4 went with the removed directory; every later one is in the new file, none went to
    # the unlinked file
    assert [r.step for r in back] == list(range(5, 30))
    for r in back:
        assert_same(recs[r.step], r)


def test_directory_unavailable_for_ten_steps_loses_only_those_counts_them_and_backs_off(tmp_path, caplog):
    d = tmp_path / "logs"
    path = d / "run.jsonl"
    sink = JsonlSink(path, retry_min_s=1.0, retry_max_s=4.0)
    clock = Clock()
    sink._clock = clock
    attempts = []
    real_open = sink._open

    def counting_open():
        attempts.append(clock.t - 1000.0)
        return real_open()

    def fault(t):
        if t == 5:  # the directory is removed and a file sits in its place: mkdir fails
            shutil.rmtree(d)
            d.write_text("not a directory")
        if t == 15:
            d.unlink()
            d.mkdir()

    with caplog.at_level(logging.WARNING, logger="distgrad"):
        sink._open = counting_open
        recs, lost = drive(sink, clock, range(40), fault)
    sink.close()
    # back-off 1, 2, 4, 4 s after the failures at t=5: attempts at steps 6, 8, 12, 16 -> step 16
    # succeeds; steps 5..15 are lost, every one counted
    assert lost == list(range(5, 16))
    assert sink.lost_records == len(lost)
    assert [r.step for r in read_strict(path)] == list(range(16, 40))
    for r in read_strict(path):
        assert_same(recs[r.step], r)
    assert attempts == [5.0, 6.0, 8.0, 12.0, 16.0]
    msgs = [m for m in caplog.messages if "jsonl sink" in m]
    # one line for the vanished file, one per failure kind, one for the recovery: not one per step
    assert len(msgs) <= 4, msgs
    assert any("11 record(s) lost (steps 5..15)" in m for m in msgs), msgs


@pytest.mark.parametrize("truncate_works", [True, False])
def test_disk_full_then_freed_never_glues_lines(tmp_path, monkeypatch, truncate_works, caplog):
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, retry_min_s=0.0)
    clock = Clock()
    sink._clock = clock
    real_write = os.write
    state = {"full": False, "room": 0}

    def write(fd, data):
        if fd == sink._fd and state["full"]:
            if state["room"] > 0:  # the disk fills up in the middle of this line: a short write
                n = min(state["room"], len(data))
                state["room"] -= n
                return real_write(fd, bytes(data[:n]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(jsonl_mod.os, "write", write)
    if not truncate_works:  # cannot cut the fragment off: the next line must start on its own line
        def no_truncate(*a):
            raise OSError(errno.EIO, "ftruncate failed")

        def no_cut(p):
            raise OSError(errno.EIO, "cannot cut the tail")

        monkeypatch.setattr(jsonl_mod.os, "ftruncate", no_truncate)
        monkeypatch.setattr(jsonl_mod, "_drop_torn_tail", no_cut)

    def fault(t):
        if t == 5:
            state.update(full=True, room=300)  # part of step 5's line fits
        if t == 25:
            state["full"] = False

    with caplog.at_level(logging.WARNING, logger="distgrad"):
        recs, lost = drive(sink, clock, range(35), fault)
    sink.close()
    assert lost == list(range(5, 25)) and sink.lost_records == 20
    bad: list[str] = []
    back = list(read_jsonl(path, on_bad_line=bad.append))
    assert [r.step for r in back] == list(range(5)) + list(range(25, 35))
    for r in back:
        assert_same(recs[r.step], r)
    if truncate_works:
        assert bad == []
        assert path.read_bytes().count(b"\n") == 15
    else:  # the 300-byte fragment of step 5 is one malformed line of its own, nothing glued to it
        assert len(bad) == 1 and ":6:" in bad[0], bad
    enospc = [m for m in caplog.messages if "ENOSPC" in m]
    assert len(enospc) == 1, enospc


def test_path_renamed_away_is_reopened(tmp_path):
    """An external logrotate (rename, no copytruncate): later records go to a new ``path``."""
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path)
    clock = Clock()
    sink._clock = clock
    recs, lost = drive(sink, clock, range(10),
                       lambda t: os.rename(path, tmp_path / "old.jsonl") if t == 4 else None)
    sink.close()
    assert lost == []
    assert [r.step for r in read_strict(tmp_path / "old.jsonl")] == [0, 1, 2, 3]
    assert [r.step for r in read_strict(path)] == list(range(4, 10))


def test_failed_rotation_keeps_appending_and_is_retried(tmp_path, monkeypatch, caplog):
    path = tmp_path / "run.jsonl"
    one = tmp_path / "one.jsonl"
    with JsonlSink(one) as s:
        s.write(make_record(0, param_names(), np.random.default_rng(7)))
    max_bytes = int(one.stat().st_size * 3.5)
    sink = JsonlSink(path, max_bytes=max_bytes, backups=2, retry_max_s=5.0)
    clock = Clock()
    sink._clock = clock
    real_replace = os.replace
    state = {"broken": True}

    def replace(a, b):
        if state["broken"]:
            raise OSError(errno.EACCES, "Permission denied")
        return real_replace(a, b)

    monkeypatch.setattr(jsonl_mod.os, "replace", replace)
    with caplog.at_level(logging.WARNING, logger="distgrad"):
        recs, lost = drive(sink, clock, range(10), lambda t: state.update(broken=t < 6))
    sink.close()
    assert lost == []
    # steps 0-2 fill the file; rotation fails at step 3 (retried 5 s later, at step 8, which works)
    assert [r.step for r in read_strict(tmp_path / "run.jsonl.1")] == list(range(8))
    assert [r.step for r in read_strict(path)] == [8, 9]
    assert len([m for m in caplog.messages if "rotating" in m]) == 1


def test_instrument_counts_each_lost_record_as_a_sink_error_without_tracebacks(tmp_path, monkeypatch, caplog):
    """Through the instrument (one process): distgrad_sink_errors_total{sink="jsonl"} equals the
    records missing from the file, internal_errors stays 0, no traceback is logged."""
    import torch
    from prometheus_client import generate_latest

    from distgrad.config import DistgradConfig
    from distgrad.engines.base import GradSource
    from distgrad.core.instrument import Instrument

    class Two(GradSource):
        names, numels = ["a", "b"], [3, 2]

        def local_pieces(self):
            return [torch.tensor([1.0, -2.0, 2.0]), torch.tensor([0.0, 4.0])]

    path = tmp_path / "d" / "run.jsonl"
    inst = Instrument(Two(), DistgradConfig(exporter={"port": 0}, sinks={"jsonl": {"path": str(path)}}))
    inst.start()
    sink = next(s for s in inst.sinks if s.name == "jsonl")
    sink.retry_min_s = 0.0
    real_write = os.write
    full = {"on": False}

    def write(fd, data):
        if fd == sink._fd and full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(jsonl_mod.os, "write", write)
    try:
        with caplog.at_level(logging.WARNING, logger="distgrad"):
            for step in range(12):
                full["on"] = 3 <= step < 7
                inst.finish(StepToken(step, True, inst.collect(step)), StepOutcome(micro_step=step))
        text = generate_latest(inst.prometheus.registry).decode()
    finally:
        inst.close()
    assert [r.step for r in read_jsonl(path)] == [0, 1, 2, 7, 8, 9, 10, 11]
    assert inst.sink_errors == {"jsonl": 4} and inst.counters["internal_errors"] == 0
    assert 'distgrad_sink_errors_total{sink="jsonl"} 4.0' in text
    assert not any("Traceback" in (r.exc_text or "") + r.getMessage() for r in caplog.records)
    assert len([m for m in caplog.messages if "jsonl sink" in m]) == 2  # the failure, the recovery
