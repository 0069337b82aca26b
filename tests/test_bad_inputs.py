"""Each bad input or broken output gets one clear message naming the key or argument, and is
counted where it belongs; training goes on (issue 14, point 5). One process."""

from __future__ import annotations

import errno
import logging

import pytest
import torch
from prometheus_client import generate_latest

from distgrad.diagnostics import flight_recorder as fr_mod
from distgrad.config import DistgradConfig
from distgrad.engines.base import GradSource
from distgrad.core.instrument import Instrument
from distgrad.core.step import StepOutcome, StepToken


class Two(GradSource):
    """Two parameters; ``bad`` puts a NaN into the second one's gradient."""

    names, numels = ["a", "b"], [3, 2]

    def __init__(self):
        self.bad = False

    def local_pieces(self):
        return [torch.tensor([1.0, -2.0, 2.0]), torch.tensor([float("nan") if self.bad else 0.0, 4.0])]


def _run(inst, src, steps, bad_steps=()):
    for step in steps:
        src.bad = step in bad_steps
        inst.finish(StepToken(step, True, inst.collect(step)), StepOutcome(micro_step=step))


def test_full_flight_recorder_directory_leaves_no_file_and_counts_a_sink_error(tmp_path, monkeypatch, caplog):
    d = tmp_path / "fr"
    src = Two()
    inst = Instrument(src, DistgradConfig(exporter={"port": 0}, flight_recorder={"dir": str(d)}))
    inst.start()
    inst.attach_diagnostics()
    real_open = open

    class Full:
        """A file the disk has no room for: created (0 bytes), every write fails."""

        def __init__(self, f):
            self.f = f

        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(fr_mod, "open", lambda p, *a, **kw: Full(real_open(p, *a, **kw)), raising=False)
    try:
        with caplog.at_level(logging.WARNING, logger="distgrad"):
            _run(inst, src, range(4), bad_steps={2, 3})  # one failure per event, not per step
            assert list(d.iterdir()) == []  # no 0-byte or partial report left to shadow a later one
            monkeypatch.undo()  # space freed: the next non-finite event gets its report
            _run(inst, src, range(4, 7), bad_steps={5})
        text = generate_latest(inst.prometheus.registry).decode()
    finally:
        inst.close()
    assert inst.counters["nonfinite_steps"] == 3  # the steps were seen and published
    assert sorted(f.name for f in d.iterdir()) == ["flightrec-step5-nonfinite.json", "flightrec-step5-nonfinite.txt"]
    assert fr_mod.load_dump(d / "flightrec-step5-nonfinite.json")["step"] == 5
    assert inst.sink_errors == {"flight_recorder": 1} and inst.counters["internal_errors"] == 0
    assert 'distgrad_sink_errors_total{sink="flight_recorder"} 1.0' in text
    msgs = [m for m in caplog.messages if "flight-recorder report" in m and "not written" in m]
    assert len(msgs) == 1 and "flight_recorder_dir" in msgs[0] and "Traceback" not in msgs[0]


def test_failing_sink_logs_its_traceback_once():
    from distgrad.export.base import Sink

    class Broken(Sink):
        name = "broken"

        def write(self, record):
            raise RuntimeError("bug")

    src = Two()
    inst = Instrument(src, DistgradConfig(exporter={"enabled": False}))
    inst.sinks.append(Broken())
    logger = logging.getLogger("distgrad")
    seen = []
    h = logging.Handler()
    h.emit = lambda r: seen.append(r.getMessage())
    logger.addHandler(h)
    try:
        _run(inst, src, range(5))
    finally:
        logger.removeHandler(h)
        inst.close()
    assert inst.counters["internal_errors"] == 5 and inst.sink_errors == {"broken": 5}
    assert len([m for m in seen if "internal error in sink broken" in m]) == 1


def test_non_scalar_loss_gives_one_clear_error_and_is_counted(caplog):
    src = Two()
    inst = Instrument(src, DistgradConfig(exporter={"enabled": False}))
    try:
        with caplog.at_level(logging.WARNING, logger="distgrad"):
            for step in range(5):
                inst.observe_loss(torch.full((4, 3), 2.0))  # per-token losses, not reduced
                inst.observe_loss(torch.tensor(1.5 + step))
                inst.observe_loss("oops")
                inst.finish(StepToken(step, True, inst.collect(step)), StepOutcome(micro_step=step))
    finally:
        inst.close()
    errs = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errs) == 1 and errs[0].exc_info is None
    assert "observe_loss(loss)" in errs[0].getMessage() and "[4, 3]" in errs[0].getMessage() \
        and "loss.mean()" in errs[0].getMessage()
    assert inst.counters["internal_errors"] == 10
    assert inst.last_record.loss == 5.5  # the good losses still count, alone


def test_unwritable_file_sd_path_names_the_key(tmp_path):
    from distgrad.config import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("")
    inst = Instrument(Two(), DistgradConfig(exporter={"port": 0, "file_sd_path": str(blocker / "sub" / "t.json")}))
    with pytest.raises(ConfigError, match=r"'exporter.file_sd_path'.* = .*cannot be written.*set it to null"):
        inst.start()
    assert inst.prometheus is None or inst._closed


def test_grad_norm_of_inf_and_nan_gradients_is_what_torch_gives_and_docs_say():
    """Reference: torch.linalg.vector_norm of the concatenated gradient (Inf -> +Inf, NaN -> NaN),
    and docs/metrics.md says the same."""
    import math
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    cases = {"inf": [torch.tensor([1.0, -float("inf"), 2.0]), torch.tensor([0.0, 4.0])],
             "nan": [torch.tensor([1.0, float("inf"), 2.0]), torch.tensor([float("nan"), 4.0])]}
    for kind, pieces in cases.items():
        class Src(GradSource):
            names, numels = ["a", "b"], [3, 2]

            def local_pieces(self):
                return [p.clone() for p in pieces]

        inst = Instrument(Src(), DistgradConfig(exporter={"port": 0}))
        inst.start()
        try:
            rec = inst.finish(StepToken(0, True, inst.collect(0)), StepOutcome(micro_step=0))
            scraped = {s.name: s.value for fam in text_string_to_metric_families(
                generate_latest(inst.prometheus.registry).decode()) for s in fam.samples}
        finally:
            inst.close()
        ref = float(torch.linalg.vector_norm(torch.cat(pieces).double()))
        for got in (rec.grad_norm, scraped["distgrad_grad_norm"]):
            assert (math.isnan(got) and math.isnan(ref)) if kind == "nan" else got == ref == math.inf
    doc = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    line = next(x for x in doc.splitlines() if x.startswith("| `distgrad_grad_norm`"))
    assert "NaN when an element is NaN" in line and "+Inf when one is +-Inf" in line
