"""The culprit-module replay (distgrad/diagnostics/replay.py) on one process: the module it names, and the
outcome it records instead when it cannot vouch for a module (multi-rank DDP / FSDP2 cases:
tests/test_causes.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn
from prometheus_client import generate_latest

import distgrad
from distgrad.record import StepRecord
from distgrad.diagnostics.replay import KEEP, decide, nonfinite_verdict
from distgrad.stats.layout import CULPRIT_GRAD, CULPRIT_LOSS, RANK_COLS, SUM_COLS


class LogEnergy(nn.Module):
    """log of each sample's squared norm: -inf for an all-zero sample (log(0))."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, torch.log(h.pow(2).sum(-1, keepdim=True))], -1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4, bias=False)
        self.drop = nn.Dropout(0.25)
        self.energy = LogEnergy()
        self.bn = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        if scale is not None:
            x = x * next(scale)  # a one-shot iterator: cannot be replayed
        return self.head(self.bn(self.drop(self.energy(self.inp(x))))).pow(2).mean()


def _x(step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + micro))


def _train(steps: int, bad: dict, gas: int = 1, restore_after_bad: bool = False, **cfg):
    """Train ``Net`` with SGD; ``bad[(step, micro)]`` mutates the input or the model before that
    micro-batch's forward (or, as ``"after:..."``, after its backward). Returns the records and
    the instrument (closed) and the model."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, **cfg)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    recs = []
    for step in range(steps):
        for micro in range(gas):
            x, kw = _x(step, micro), {}
            what = bad.get((step, micro))
            if what in ("zero_row", "modified"):
                x[0] = 0.0
            elif what == "nan_weight":
                with torch.no_grad():
                    model.inp.weight[0, 0] = float("nan")
            elif what == "one_shot":
                x[0] = 0.0
                kw["scale"] = iter([1.0])
            h = None
            if what == "nan_grad":  # NaN made in the backward pass only
                h = model.inp.weight.register_hook(lambda g: g * float("nan"))
            model(x, **kw).backward()
            if h is not None:
                h.remove()
            if what == "modified":
                x.copy_(_x(99))  # the loop reuses its input buffer for the next batch
        opt.step()
        opt.zero_grad()
        if restore_after_bad and inst.last_record is not None and inst.last_record.nonfinite:
            model.load_state_dict(good)  # the user reloads a good checkpoint
        recs.append(inst.last_record)
    inst.flush()
    recs.append(inst.last_record)
    inst.close()
    return recs, inst, model


def _modules(recs) -> dict:
    return {r.step: r.culprit_module.to_dict() for r in recs if r is not None and r.culprit_module is not None}


def test_names_the_module_that_took_log_of_zero_and_leaves_rng_and_buffers_alone():
    """log(0) in ``energy`` on step 2: the replay names it (micro-batch 0, rank 0); the CPU RNG
    stream continues exactly as in the same run with replay off, and the BatchNorm running
    statistics after the run are those of the run without replay."""
    on, inst_on, m_on = _train(4, {(2, 0): "zero_row"})
    rng_on = torch.get_rng_state()
    off, inst_off, m_off = _train(4, {(2, 0): "zero_row"}, tracer={"replays": 0})
    rng_off = torch.get_rng_state()
    for a, b in zip(m_on.bn.buffers(), m_off.bn.buffers()):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert _modules(on) == {2: {"step": 2, "outcome": "found", "rank": 0, "module": "energy", "micro_batch": 0}}
    assert _modules(off) == {2: {"step": 2, "outcome": "off", "rank": None, "module": None, "micro_batch": None}}
    assert torch.equal(rng_on, rng_off)
    assert inst_on.replay.replays == 1 and inst_off.replay.replays == 0


def test_offending_micro_batch_is_found_among_several():
    recs, _, _ = _train(3, {(1, 2): "zero_row"}, gas=4)
    assert _modules(recs) == {1: {"step": 1, "outcome": "found", "rank": 0, "module": "energy", "micro_batch": 2}}


@pytest.mark.parametrize("what, outcome", [
    ("nan_grad", "finite"),            # the NaN comes from the backward pass: the forward replays finite
    ("nan_weight", "weights_nonfinite"),
    ("modified", "no_input"),          # the input tensor was overwritten in place after its forward
    ("one_shot", "failed"),            # an exhausted iterator among the inputs: the replay raises
])
def test_impossible_replays_say_why_and_name_no_module(what, outcome):
    recs, inst, _ = _train(3, {(1, 0): what})
    assert recs[1].nonfinite
    got = _modules(recs)
    assert got == {1: {"step": 1, "outcome": outcome, "rank": 0 if outcome == "weights_nonfinite" else None,
                       "module": None, "micro_batch": None}}
    assert inst.counters["internal_errors"] == (1 if outcome == "failed" else 0)


def test_offending_micro_batch_not_kept():
    recs, _, _ = _train(2, {(1, 0): "zero_row"}, gas=KEEP + 1)
    assert _modules(recs)[1]["outcome"] == "not_kept"


def test_first_step_of_each_streak_within_the_budget():
    """Two streaks (the loop reloads good weights after each NaN step), budget 1: the first is
    replayed, the second says ``budget``."""
    recs, inst, _ = _train(5, {(1, 0): "zero_row", (3, 0): "zero_row"}, restore_after_bad=True, tracer={"replays": 1})
    got = _modules(recs)
    assert got[1]["outcome"] == "found" and got[1]["module"] == "energy"
    assert got[3]["outcome"] == "budget"
    assert sorted(got) == [1, 3] and inst.replay.replays == 1


def test_asynchronous_records_cannot_replay():
    recs, _, _ = _train(4, {(2, 0): "zero_row"}, statistics={"async_records": "on"})
    assert _modules(recs) == {2: {"step": 2, "outcome": "async_records", "rank": None, "module": None,
                                  "micro_batch": None}}


def test_exported_recorded_and_dumped(tmp_path):
    """The metric, the JSON record round trip, the flight-recorder summary, the replay's tracer
    report and ``distgrad report``'s problem name the module."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"port": 0, "host": "127.0.0.1"},
                               flight_recorder={"dir": str(tmp_path)},
                               sinks={"jsonl": {"path": str(tmp_path / "run.jsonl")}})
    for step in range(3):
        x = _x(step)
        if step == 1:
            x[3] = 0.0
        model(x).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            rec = inst.last_record
    text = generate_latest(inst.prometheus.registry).decode()
    inst.close()
    assert 'distgrad_nonfinite_culprit_module{module="energy",rank="0"} 1.0' in text
    assert 'distgrad_nonfinite_replay_outcome{outcome="found"} 1.0' in text
    back = StepRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert back.culprit_module == rec.culprit_module and back.nonfinite_event.culprit_module == rec.culprit_module
    summary = next(tmp_path.glob("flightrec-*.txt")).read_text()
    assert "forward replay of step 1: first non-finite forward output in module 'energy' on rank 0" in summary
    assert "energy" in (tmp_path / "replay-step1-rank0.txt").read_text()
    # distgrad report: the non-finite step's problem names the culprit rank and module
    from distgrad.report import analyze

    prob = next(p for p in analyze(tmp_path / "run.jsonl").problems if p.kind == "nonfinite_grad")
    assert prob.step == 1 and "culprit rank(s) [0]" in prob.detail
    # the replay's module leads the verdict line; the parameter the backward met first comes last,
    # named for what it is (one answer: module, its layer and the culprit rank agree with the replay)
    assert prob.detail.startswith("non-finite gradient made in the forward pass: first non-finite forward output "
                                  "in module 'energy' on rank 0, micro-batch 0 (forward replay); culprit rank(s) [0]")
    assert prob.detail.endswith("the last of them in forward order, where the backward pass met the NaN first: "
                                "'head.bias' (layer head)")
    assert (prob.module, prob.param, prob.ranks) == ("energy", None, [0])


# ---------------------------------------------------------------------------- pure decisions
def _host(n_params: int, world: int, nan=0.0, loss=1.0, flags=(), error=()) -> np.ndarray:
    per = np.zeros((n_params, len(SUM_COLS)))
    per[0, 3] = nan
    ranks = np.zeros((world, len(RANK_COLS)))
    for r, f in flags:
        ranks[r, 3] = f
    for r in error:
        ranks[r, 2] = 1.0
    return np.concatenate([per.ravel(), ranks.ravel(), [loss, 1.0], np.zeros(2 * n_params)])


def test_verdict_from_reduced_values():
    assert nonfinite_verdict(_host(3, 2), 3, 2, False) is None
    assert nonfinite_verdict(_host(3, 2, nan=4), 3, 2, False) == []
    assert nonfinite_verdict(_host(3, 2, loss=float("nan"), flags=[(1, CULPRIT_LOSS)]), 3, 2, False) == [1]
    # a rank failed / refused: the step is dropped, nothing replayed
    assert nonfinite_verdict(_host(3, 2, nan=4, error=[0]), 3, 2, False) is None
    # fp16 with a loss scaler: non-finite gradients with a finite loss are an overflow
    assert nonfinite_verdict(_host(3, 2, nan=4, flags=[(0, CULPRIT_GRAD)]), 3, 2, True) is None
    assert nonfinite_verdict(_host(3, 2, nan=4, loss=float("inf"), flags=[(0, CULPRIT_LOSS)]), 3, 2, True) == [0]


def test_decide_prefers_the_culprit_rank_and_vouches_for_nothing_with_bad_weights():
    rows = np.array([[1, 5, 0], [1, 7, 1], [2, -1, -1]], dtype=np.float64)  # found, found, finite
    assert decide(rows, [1]) == ("found", 1, 7, 1)
    assert decide(rows, []) == ("found", 0, 5, 0)
    rows[2, 0] = 6  # rank 2's weights were non-finite
    assert decide(rows, [1]) == ("weights_nonfinite", 2, None, None)
    assert decide(np.array([[0, -1, -1], [2, -1, -1], [3, -1, -1]], dtype=np.float64), [1])[0] == "failed"
    assert decide(np.array([[0, -1, -1], [2, -1, -1]], dtype=np.float64), [1])[0] == "finite"


def test_budget_and_open_streak_survive_a_checkpoint():
    """A run resumed from ``state_dict()`` in the middle of a non-finite streak does not replay
    its next (still non-finite) step, and keeps counting against the same budget."""
    recs, inst, model = _train(3, {(1, 0): "zero_row"}, tracer={"replays": 2})
    state = json.loads(json.dumps(inst.state_dict()))
    assert state["replay"] == {"replays": 1, "in_streak": True}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    inst2 = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, tracer={"replays": 2})
    inst2.load_state_dict(state)
    model(_x(5)).backward()  # the weights are NaN since step 1: the streak goes on
    opt.step()
    assert inst2.last_record.nonfinite and inst2.last_record.culprit_module is None
    assert inst2.replay.replays == 1
    inst2.close()
