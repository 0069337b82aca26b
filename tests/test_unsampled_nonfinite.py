"""Non-finite gradients and losses on steps that are not sampled (interval > 1) are flagged on the
device, carried in the next sampled step's MAX collective and counted (one process here; the
2-rank DDP case is in tests/dist/torch_cases.py)."""

from __future__ import annotations

import logging
import math

import torch
from prometheus_client import generate_latest

from distgrad.config import DistgradConfig
from distgrad.engines.base import GradSource
from distgrad.core.instrument import Instrument
from distgrad.core.step import StepOutcome, StepToken


class Mixed(GradSource):
    """Three parameters of different dtypes; ``bad[step]`` names the one holding NaN/Inf."""

    names, numels = ["a", "b", "c"], [3, 2, 2]

    def __init__(self):
        self.bad: dict[int, str] = {}
        self.step = 0

    def local_pieces(self):
        a = torch.tensor([1.0, -2.0, 2.0])
        b = torch.tensor([0.5, 4.0], dtype=torch.bfloat16)
        c = torch.tensor([2.0, -3.0])
        which = self.bad.get(self.step)
        if which == "a":
            a[1] = float("nan")
        elif which == "b":
            b[0] = float("inf")
        return [a, b, c]


def drive(inst, src, steps, nan_loss=(), overflow=()):
    """The boundary a DeepSpeed or PyTorch engine runs: watch() on unsampled steps, collect() and
    finish() on sampled ones."""
    records = {}
    for step in steps:
        src.step = step
        inst.observe_loss(float("nan") if step in nan_loss else 1.0)
        if inst.is_sampled(step):
            rec = inst.finish(StepToken(step, True, inst.collect(step)), StepOutcome(micro_step=step))
            records[step] = rec
        else:
            inst.watch(step)
            inst.skip(StepOutcome(overflow=step in overflow, step_applied=step not in overflow))
    return records


def test_nan_and_inf_on_unsampled_steps_are_counted_at_the_next_sampled_step(caplog):
    src = Mixed()
    src.bad = {1: "a", 5: "b", 7: "a", 8: "b"}
    inst = Instrument(src, DistgradConfig(exporter={"port": 0}, sampling={"interval": 3}))
    inst.start()
    try:
        with caplog.at_level(logging.WARNING, logger="distgrad"):
            recs = drive(inst, src, range(13), nan_loss={4, 9})
        text = generate_latest(inst.prometheus.registry).decode()
    finally:
        inst.close()
    got = {s: r.unsampled_nonfinite and r.unsampled_nonfinite.to_dict() for s, r in recs.items()}
    assert got == {0: None, 3: {"grad": [1], "loss": []}, 6: {"grad": [5], "loss": [4]},
                   9: {"grad": [7, 8], "loss": []}, 12: None}
    assert math.isnan(recs[9].loss)  # the sampled step's own NaN loss
    c = inst.counters
    assert (c["nonfinite_unsampled_steps"], c["nonfinite_loss_steps"], c["nonfinite_steps"]) == (4, 2, 0)
    assert "distgrad_nonfinite_unsampled_steps_total 4.0" in text
    assert "distgrad_nonfinite_loss_steps_total 2.0" in text
    warned = [m for m in caplog.messages if "unsampled" in m]
    assert len(warned) == 1 and "step(s) 1 " in warned[0]  # once per streak of flagged folds
    assert c["internal_errors"] == 0


def test_interval_one_adds_nothing_to_the_collective():
    src = Mixed()
    inst = Instrument(src, DistgradConfig(exporter={"enabled": False}, sampling={"interval": 1}))
    host = inst.collect(0)
    base = inst.layout.sum_size + inst.layout.max_size + inst.loss.sum_size + inst.loss.max_size  # + the loss parts
    assert host.size == base
    inst3 = Instrument(src, DistgradConfig(exporter={"enabled": False}, sampling={"interval": 3}))
    assert inst3.collect(0).size == base + 2 * 2


def test_fp16_overflow_steps_are_not_reported_as_unsampled_nonfinite():
    """An unsampled step the engine reports as an fp16 overflow has Inf gradients by design: it
    is counted in overflow_steps, not as a non-finite step."""
    src = Mixed()
    src.bad = {1: "b", 2: "b", 4: "a"}
    inst = Instrument(src, DistgradConfig(exporter={"enabled": False}, sampling={"interval": 3}))
    try:
        recs = drive(inst, src, range(7), overflow={1, 4})
    finally:
        inst.close()
    assert recs[3].unsampled_nonfinite.to_dict() == {"grad": [2], "loss": []}
    assert recs[6].unsampled_nonfinite is None
    c = inst.counters
    assert (c["nonfinite_unsampled_steps"], c["overflow_steps"], c["skipped_steps"]) == (1, 2, 2)
