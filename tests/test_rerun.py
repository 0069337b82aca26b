"""Rerun attribution (distgrad/diagnostics/rerun.py): the verdict on injected faults on 2 gloo CPU
ranks (tests/dist/rerun_cases.py, one launch), the rerun's fingerprints against a float64
reference computed on a plain copy of the weights, and the decision table on one process."""

from __future__ import annotations

import math
import socket

import numpy as np
import pytest
import torch
import torch.nn as nn

import distgrad
from distgrad.diagnostics.rerun import VERDICTS, classify
from distgrad.report import analyze

from tests.helpers import launch

BAD = 3  # the step of the fault (tests/dist/rerun_cases.py)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return launch("rerun_cases.py", tmp_path_factory.mktemp("rerun") / "out.json", nproc=2)["cases"]


def _ranks(cases, kind):
    ranks = cases[kind]["ranks"]
    for r, res in enumerate(ranks):
        assert "error" not in res, f"{kind} rank {r}: {res.get('traceback')}"
    return ranks


@pytest.mark.parametrize("kind, trigger, verdict, quarantine", [
    ("data", "nonfinite", "data", -1),                    # garbage batch on rank 1: NaN on rank 0 too
    ("transient", "nonfinite", "transient", 1),           # one corrupted activation, once
    ("device", "nonfinite", "device", 1),                 # every matmul output wrong on rank 1
    ("weights", "replica_mismatch", "device", 1),         # one weight bit flipped on rank 1's replica
])
def test_verdict_on_injected_faults(cases, kind, trigger, verdict, quarantine):
    ranks = _ranks(cases, kind)
    for res in ranks:
        recs = res["records"]
        assert res["internal_errors"] == 0
        for rec in recs[:BAD]:  # healthy steps: no rerun, every counter at 0
            assert rec["rerun"]["step"] is None and rec["rerun"]["verdict"] is None
            assert rec["rerun"]["totals"] == {v: 0 for v in VERDICTS}
        part = recs[BAD]["rerun"]
        assert part["step"] == BAD and part["trigger"] == trigger and part["verdict"] == verdict
        assert part["culprit_rank"] == 1 and part["other_rank"] == 0
        assert part["quarantine_rank"] == quarantine
        assert part["quarantine_host"] == (socket.gethostname() if quarantine >= 0 else None)
        assert part["totals"] == {v: int(v == verdict) for v in VERDICTS}
        for rec in recs[BAD + 1:]:  # carried, never rerun again (first step of a streak; healthy after)
            assert rec["rerun"] == part
    keys = ("step", "trigger", "verdict", "culprit_rank", "other_rank", "quarantine_rank", "totals")
    for a, b in zip(ranks[0]["records"], ranks[1]["records"]):  # every rank holds the same verdict
        assert [a["rerun"][k] for k in keys] == [b["rerun"][k] for k in keys]
        assert np.array_equal(np.array(a["rerun"]["rows"]), np.array(b["rerun"]["rows"]), equal_nan=True)


@pytest.mark.parametrize("kind", ["data", "transient", "device", "weights"])
def test_every_rank_issues_the_same_collectives_and_healthy_steps_none(cases, kind):
    ranks = _ranks(cases, kind)
    seqs = [[rec["boundary_collectives"] for rec in res["records"]] for res in ranks]
    assert seqs[0] == seqs[1]
    assert all(s == [] for s in seqs[0][:BAD])  # healthy steps: no collective at the boundary
    rerun = [c for c in seqs[0][BAD] if c in ("broadcast_object_list", "all_gather_into_tensor")]
    assert rerun[-2:] == ["broadcast_object_list", "all_gather_into_tensor"]  # the rerun's two


@pytest.mark.parametrize("kind", ["data", "transient", "device", "weights"])
def test_rerun_fingerprints_match_a_float64_reference_of_the_weights_before_the_step(cases, kind):
    """Each rank's rerun of rank 1's micro-batches = rank 1's batches through a plain copy of
    *that rank's* weights before step 3 (``.backward()``, no fault): rank 0 always (its arithmetic
    is sound); rank 1 where its fault does not persist in the forward (transient; the flipped
    weight of the weights case is in its copy too)."""
    ranks = _ranks(cases, kind)
    rows = np.array(ranks[0]["records"][BAD]["rerun"]["rows"], dtype=np.float64)
    assert rows[:, 1].tolist() == [2, 2]  # both micro-batches of the step on both ranks
    for r in range(2):
        ref = ranks[r]["reference"][str(BAD)]
        if kind == "device" and r == 1:
            assert rows[1, 2] == 2 and rows[1, 3] == 0  # every micro-batch non-finite, from the first
            assert ref["nonfinite"] == 0  # ... where sound arithmetic is finite
            continue
        assert rows[r, 2] == ref["nonfinite"]
        if ref["nonfinite"]:
            assert rows[r, 3] == 1 and math.isnan(rows[r, 4])  # the garbage micro-batch is the second
            continue
        assert rows[r, 4] == pytest.approx(ref["loss"], rel=1e-12)
        assert rows[r, 5] == pytest.approx(ref["grad_sq"], rel=1e-9)


def test_deepspeed_zero2_reruns_and_zero3_says_sharded(cases):
    z2, z3 = _ranks(cases, "zero2"), _ranks(cases, "zero3")
    for res in z2:
        part = res["records"][BAD]["rerun"]
        assert res["records"][BAD]["culprits"] == [1]
        got = (part["verdict"], part["culprit_rank"], part["other_rank"], part["quarantine_rank"])
        assert got == ("device", 1, 0, 1)
        assert res["internal_errors"] == 0
    for res in z3:  # the forward gathers every rank's shards: no rerun, no collective of its own
        part = res["records"][BAD]["rerun"]
        assert res["records"][BAD]["culprits"] == [1]
        assert (part["step"], part["verdict"], part["reason"], part["culprit_rank"]) == (BAD, None, "sharded", 1)
        assert part["totals"] == {v: 0 for v in VERDICTS} and res["internal_errors"] == 0
    for case in (z2, z3):
        assert case[0]["records"][BAD]["boundary_collectives"] == case[1]["records"][BAD]["boundary_collectives"]
    assert "broadcast_object_list" not in z3[0]["records"][BAD]["boundary_collectives"]


def test_weights_case_reruns_differ_beyond_tolerance_and_match_each_replica(cases):
    ranks = _ranks(cases, "weights")
    r0, r1 = ranks[0]["reference"][str(BAD)], ranks[1]["reference"][str(BAD)]
    assert abs(r0["loss"] - r1["loss"]) > 1e-6 * abs(r0["loss"])  # the flipped bit shows


def test_rerun_backward_does_not_leak_into_the_next_steps_flags(cases):
    """The data case's reruns make NaN gradients (on both ranks) after step 3's flags were taken:
    step 4 must still be finite with no culprit (distgrad's leaf hooks are paused in a rerun)."""
    for res in _ranks(cases, "data"):
        rec = res["records"][BAD + 1]
        assert not rec["nonfinite"] and rec["culprits"] == [] and rec["applied"]
        # nor into the output-logit statistics, armed for the next step at this boundary
        assert all(r["logit_max"] is not None and math.isfinite(r["logit_max"]) for r in res["records"][BAD + 1:])


def test_served_verdict_metrics(cases):
    served = _ranks(cases, "device")[0]["served"].splitlines()
    host = socket.gethostname()
    assert 'distgrad_rerun_verdicts_total{verdict="device"} 1.0' in served
    for v in ("data", "transient", "inconclusive"):
        assert f'distgrad_rerun_verdicts_total{{verdict="{v}"}} 0.0' in served
    assert "distgrad_rerun_quarantine_rank 1.0" in served
    assert f'distgrad_rerun_quarantine_host_info{{host="{host}"}} 1.0' in served
    assert f"distgrad_rerun_step {float(BAD)}" in served


def _rows(*rows):
    return np.array(rows, dtype=np.float64)


def test_decision_table():
    ok_a = [1, 2, 0, -1, 3.0, 1.5]
    nan = [1, 2, 1, 1, float("nan"), float("nan")]
    assert classify(_rows(nan, nan), 1, 0, 0.0)[0] == "data"
    assert classify(_rows(ok_a, nan), 1, 0, 0.0)[0] == "device"
    assert classify(_rows(ok_a, ok_a), 1, 0, 0.0)[0] == "transient"
    assert classify(_rows(nan, ok_a), 1, 0, 0.0)[0] == "inconclusive"  # the other rank fails alone
    near = [1, 2, 0, -1, 3.0 * (1 + 1e-9), 1.5]
    assert classify(_rows(ok_a, near), 1, 0, 0.0)[0] == "device"  # bitwise
    assert classify(_rows(ok_a, near), 1, 0, 1e-6)[0] == "transient"  # within rtol
    failed, no_input = [3, 0, 0, -1, 0, 0], [2, 0, 0, -1, 0, 0]
    assert classify(_rows(ok_a, failed), 1, 0, 0.0) == ("inconclusive", "culprit rerun failed")
    assert classify(_rows(ok_a, no_input), 1, 0, 0.0) == ("inconclusive", "culprit rerun no_input")
    assert classify(_rows(failed, nan), 1, 0, 0.0)[0] == "inconclusive"  # reproduces, nothing to compare
    assert classify(_rows(failed, ok_a), 1, 0, 0.0)[0] == "transient"  # does not reproduce
    assert classify(_rows(nan), 0, None, 0.0)[0] == "inconclusive"  # one process: cannot compare
    assert classify(_rows(ok_a), 0, None, 0.0)[0] == "transient"


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x / x.pow(2).mean(-1, keepdim=True).sqrt())  # 0/0 on a zero row; loss computed outside


@pytest.mark.parametrize("enabled", [True, False])
def test_one_process_reruns_with_the_output_sum_and_says_it_cannot_compare(enabled, tmp_path):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, rerun={"enabled": enabled},
                               action={"on_nonfinite": "skip"}, flight_recorder={"dir": str(tmp_path)},
                               sinks={"jsonl": {"path": str(tmp_path / "run.jsonl")}})
    recs = []
    for step in range(4):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        if step == 2:
            x[1] = 0.0
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        recs.append(inst.last_record)
    state = inst.state_dict()
    inst.close()
    if not enabled:
        assert all(getattr(r, "rerun", None) is None for r in recs)
        return
    part = recs[2].rerun
    assert (part.step, part.trigger, part.verdict, part.culprit_rank, part.other_rank) == (2, "nonfinite",
                                                                                          "inconclusive", 0, -1)
    assert part.rows[0][:4] == [1.0, 1.0, 1.0, 0.0]  # reproduces: the one micro-batch non-finite
    assert recs[3].rerun.to_dict() == part.to_dict() and not recs[3].nonfinite
    # the flight recorder's summary and the offline report's verdict carry it
    summary = (tmp_path / "flightrec-step2-rerun.txt").read_text()
    assert "rerun attribution of step 2 (nonfinite, culprit rank 0, compared on rank -1): inconclusive" in summary
    verdict = analyze(tmp_path / "run.jsonl").verdict()
    assert verdict.startswith("PROBLEM at step 2: non-finite")
    assert "rerun attribution: inconclusive (reproduces on the culprit rank; no other rank)" in verdict
    # a resumed run keeps the budget used, the counts and the last verdict
    model2 = _Net()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    inst2 = distgrad.instrument(model2, optimizer=opt2, exporter={"enabled": False}, rerun={"enabled": True})
    inst2.load_state_dict(state)
    assert inst2.replay.rerun.reruns == 1
    diag = inst2.diagnostics.get("rerun")
    assert diag.totals == {v: int(v == "inconclusive") for v in VERDICTS} and diag.last.step == 2
    inst2.close()
