"""Asynchronous records (config ``async_records``, the default on CUDA) on CPU: the sampled
step makes no blocking host read on the training thread, its record appears at the next
optimizer-step boundary (or at ``flush()`` / ``close()``), and every record equals the one the
synchronous mode builds at its own step, non-finite provenance and update ratios included.

Host reads are counted as in tests/test_stats_kernels.py (the tensor methods that wait for the
device); ``HostCopy.wait`` (the event wait of the asynchronous mode) is spied on to show when
the parked copy is read. On CPU the copy is always complete; ``launch/gpu_check.sh`` runs the
same test with a CUDA model (``DISTGRAD_TEST_DEVICE=cuda``), where the event is real."""

from __future__ import annotations

import os

import pytest
import torch

import distgrad
from distgrad.stats import HostCopy

from tests.dist.common import HostSyncs as _Syncs, TinyModel, batch_for

DEV = torch.device(os.environ.get("DISTGRAD_TEST_DEVICE", "cpu"))




def _run(mode: str, monkeypatch, steps: int = 4, nan_at: int | None = None, **cfg) -> dict:
    """Train TinyModel for ``steps`` optimizer steps with ``async_records=mode``; per step: the
    host syncs in distgrad's boundary (``Instrument.collect``/``finish``/``skip``, called from
    the optimizer hooks; the optimizer's own are not counted), ``last_record.step`` after the
    step, the steps whose parked copy was read (and whether it was complete)."""
    from distgrad import stats

    stats.stats_table([torch.ones(3, device=DEV)], DEV)  # one-time kernel set-up (native self-check)
    torch.manual_seed(0)
    model = TinyModel().to(DEV)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    statistics = {"async_records": mode, **cfg.pop("statistics", {})}
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics=statistics, **cfg)
    published: list = []
    inst.add_hook(published.append)
    waits: list = []
    now = {"step": -1}
    real_wait = HostCopy.wait

    def spy(self):
        waits.append((now["step"], self.ready()))
        return real_wait(self)

    monkeypatch.setattr(HostCopy, "wait", spy)
    counted = {"n": 0}

    def counting(fn):
        def wrapper(*a, **k):
            with _Syncs() as m:
                try:
                    return fn(*a, **k)
                finally:
                    counted["n"] += m.n
        return wrapper

    for name in ("collect", "finish", "skip"):
        setattr(inst, name, counting(getattr(inst, name)))
    out = {"syncs": [], "last": [], "waits": waits}
    for step in range(steps):
        now["step"] = step
        x, y = batch_for(step, 0, 0)
        model(x.to(DEV), y.to(DEV)).backward()
        if step == nan_at:
            with torch.no_grad():
                model.inp.weight.grad.view(-1)[2] = float("nan")
        counted["n"] = 0
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["syncs"].append(counted["n"])
        out["last"].append(inst.last_record.step if inst.last_record else None)
    out["before_flush"] = [r.step for r in published]
    now["step"] = steps
    out["flushed"] = inst.flush()
    out["records"] = [r.to_dict() for r in published]
    out["async"] = inst.async_records
    inst.close()
    monkeypatch.setattr(HostCopy, "wait", real_wait)
    return out


def _same_records(a: list[dict], b: list[dict]) -> None:
    """Equal but for the wall-clock timestamp, the ranks' measured times (NaN equal to NaN:
    compared as JSON text) and the culprit-module replay, which asynchronous records cannot make
    (checked by the caller)."""
    import json

    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        ra, rb = dict(ra), dict(rb)
        ra.pop("timestamp"), rb.pop("timestamp")
        for r in (ra, rb):
            r.pop("culprit_module")
            if r.get("nonfinite_event"):
                r["nonfinite_event"] = {k: v for k, v in r["nonfinite_event"].items() if k != "culprit_module"}
        for r in (ra, rb):
            if r.get("ranks"):
                r["ranks"] = {k: v for k, v in r["ranks"].items()
                              if k not in ("step_time", "data_time", "straggler_rank", "straggler_ratio")}
        assert json.dumps(ra, sort_keys=True) == json.dumps(rb, sort_keys=True)


@pytest.mark.parametrize("nan_at", [None, 1])
def test_async_records_one_step_late_without_host_reads(monkeypatch, nan_at):
    sync = _run("off", monkeypatch, nan_at=nan_at)
    asyn = _run("on", monkeypatch, nan_at=nan_at)
    assert sync["async"] is False and asyn["async"] is True
    # (the NaN reaches the weights, so every step from nan_at on is non-finite)
    bad = [nan_at is not None and s >= nan_at for s in range(4)]
    # synchronous: one host copy per sampled step (+1 for the provenance read on non-finite
    # steps), the record at its own step
    assert sync["syncs"] == [1 + b for b in bad]
    assert sync["last"] == [0, 1, 2, 3] and sync["waits"] == [] and sync["flushed"] is None
    # asynchronous: no host read inside the sampled steps; step k's record appears at step
    # k + 1's boundary, where its copy (complete by then) is read; the provenance of a
    # non-finite step is gathered and read there too (one step late)
    assert asyn["syncs"] == [0] + [int(b) for b in bad[:-1]]
    assert asyn["last"] == [None, 0, 1, 2]
    assert asyn["before_flush"] == [0, 1, 2]
    assert asyn["waits"] == [(1, True), (2, True), (3, True), (4, True)]
    assert asyn["flushed"] is not None and asyn["flushed"].step == 3
    # the same records, values and counters
    _same_records(asyn["records"], sync["records"])
    # the NaN was written into a gradient after the backward: the synchronous boundary's forward
    # replay stays finite; asynchronous records learn of the NaN after the update and say so
    modules = [(r["culprit_module"] or {}).get("outcome") for r in sync["records"]]
    assert modules == ([None] * 4 if nan_at is None else [None, "finite", None, None])
    modules = [(r["culprit_module"] or {}).get("outcome") for r in asyn["records"]]
    assert modules == ([None] * 4 if nan_at is None else [None, "async_records", None, None])
    if nan_at is not None:
        rec = asyn["records"][nan_at]
        assert rec["nonfinite_params"] == [{"param": "inp.weight", "rank": 0, "nan": 1, "inf": 0,
                                                     "count": 1}]


def test_async_records_with_interval_and_update_ratio(monkeypatch):
    """Unsampled boundaries (``skip``) publish the parked step too; the update-ratio
    all-reduce is enqueued at the step and read with the record."""
    sync = _run("off", monkeypatch, steps=5, sampling={"interval": 2}, statistics={"update_ratio": True})
    asyn = _run("on", monkeypatch, steps=5, sampling={"interval": 2}, statistics={"update_ratio": True})
    assert sync["last"] == [0, 0, 2, 2, 4]
    assert asyn["last"] == [None, 0, 0, 2, 2]
    assert all(n == 0 for n in asyn["syncs"])
    assert [w[0] for w in asyn["waits"]] == [1, 1, 3, 3, 5, 5]  # statistics and ratio copies
    _same_records(asyn["records"], sync["records"])
    assert all(r["update_ratio"] for r in asyn["records"])


def test_close_publishes_the_parked_step(monkeypatch):
    torch.manual_seed(0)
    model = TinyModel().to(DEV)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "on"})
    x, y = batch_for(0, 0, 0)
    model(x.to(DEV), y.to(DEV)).backward()
    opt.step()
    assert inst.last_record is None and inst.counters["sampled_steps"] == 0
    inst.close()
    assert inst.last_record.step == 0 and inst.counters["sampled_steps"] == 1


def test_auto_is_synchronous_on_cpu():
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}) as inst:
        assert inst.config.statistics.async_records == "auto" and inst.async_records is False
