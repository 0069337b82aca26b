"""Per-rank loss attribution and the straggler rank on 2 gloo ranks (DeepSpeed ZeRO-2 and FSDP2,
2 micro-batches per step; tests/dist/common.py loss_attribution_loop): rank 1's batch carries a
loss spike at step 6 and rank 1 sleeps before its forward on steps 2 and 5.

Reference: every micro-batch loss as each rank's loop saw it, in float64, gathered from all
ranks; the steps and rank the loop made slow; the sample indices the loop passed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from distgrad.loss.tracker import rank_stats  # noqa: F401  (the unit under test, for the single-process checks)
from distgrad.record import StepRecord

from tests.dist.common import ATTR_GAS, ATTR_SLEEP, ATTR_SLOW_STEPS, ATTR_SPIKE, ATTR_STEPS, sample_ids


def _case(results, engine):
    c = results["special"]["loss_attribution"] if engine == "deepspeed" else results["cases"]["loss-attribution-fsdp2"]
    assert "error" not in c, c.get("traceback")
    return c


def _reference(c):
    """{step: (per-rank mean [W], per-rank max [W], per-rank argmax micro [W])} in float64."""
    W = len(c["losses"])
    ref = {}
    for s in range(ATTR_STEPS):
        per = [[v for st, m, v in sorted(c["losses"][r]) if st == s] for r in range(W)]
        ref[s] = ([math.fsum(p) / len(p) for p in per], [max(p) for p in per], [int(np.argmax(p)) for p in per])
    return ref


ENGINES = ["deepspeed", "fsdp2"]


@pytest.fixture(params=ENGINES)
def attribution(request):
    fixture = "ds_results" if request.param == "deepspeed" else "torch_results"
    return request.param, _case(request.getfixturevalue(fixture), request.param)


@pytest.mark.multirank
def test_per_rank_loss_mean_and_max_equal_float64_reference(attribution):
    engine, c = attribution
    ref = _reference(c)
    recs = [StepRecord.from_dict(r) for r in c["records"]]
    assert [r.step for r in recs] == list(range(ATTR_STEPS))
    for rec in recs:
        mean, mx, micro = ref[rec.step]
        r = rec.ranks
        assert r is not None
        np.testing.assert_allclose(r.loss_mean, mean, rtol=1e-12)
        np.testing.assert_allclose(r.loss_max, mx, rtol=1e-12)
        assert r.loss_max_micro == micro
        assert r.loss_max_rank == int(np.argmax(mx))
        assert rec.loss == pytest.approx(math.fsum(mean) / len(mean), rel=1e-12)  # equal micro-batch counts


@pytest.mark.multirank
def test_loss_spike_is_attributed_to_the_rank_and_its_samples(attribution):
    engine, c = attribution
    step, rank, micro = ATTR_SPIKE
    rec = StepRecord.from_dict(c["records"][step])
    assert "loss" in rec.spikes.flagged
    assert rec.ranks.loss_max_rank == rank and rec.ranks.loss_max_micro[rank] == micro
    # the culprit rank wrote its batch's sample indices next to the flight-recorder reports
    d = Path(c["dir"])
    files = sorted(p.name for p in d.glob("lossspike-*.json"))
    assert files == [f"lossspike-step{step}-rank{rank}.json"], files
    doc = json.loads((d / files[0]).read_text())
    assert doc["samples"] == sample_ids(step, micro, rank, 3)
    assert doc["micro_batch"] == micro and doc["rank"] == rank and doc["reason"] == "loss_spike"
    assert doc["rank_loss_max"] == pytest.approx(_reference(c)[step][1][rank], rel=1e-12)
    assert doc["samples_by_micro_batch"] == {str(m): sample_ids(step, m, rank, 3) for m in range(ATTR_GAS)}


@pytest.mark.multirank
def test_slow_rank_is_named_straggler(attribution):
    engine, c = attribution
    for s, raw in enumerate(c["records"]):
        r = StepRecord.from_dict(raw).ranks
        assert r.data_reported == [engine == "fsdp2"] * 2
        if s in ATTR_SLOW_STEPS:
            assert r.straggler_rank == 1, (s, r)
            assert r.data_time[1] >= ATTR_SLEEP > r.data_time[0] + 0.1, (s, r.data_time)
            # the step lasted at least rank 1's sleep (the other rank waited for it)
            assert max(r.step_time) >= ATTR_SLEEP
            # slowest / median step time, recomputed from the per-rank times
            excess = max(r.data_time) - float(np.median(r.data_time))
            assert r.straggler_ratio == pytest.approx(max(r.step_time) / (max(r.step_time) - excess), rel=1e-12)
            assert r.straggler_ratio > 1.2
        elif s == 0 and engine == "deepspeed":  # measured from the previous boundary: none yet
            assert r.straggler_rank is None and all(math.isnan(t) for t in r.data_time + r.step_time)
        else:
            assert max(r.data_time) < ATTR_SLEEP / 2, (s, r.data_time)


@pytest.mark.multirank
def test_attribution_adds_no_collective_and_no_host_sync(attribution):
    """Still 2 collectives and 1 host copy per sampled step (interval 1: every step), the spike
    step included (its report reads host lists only)."""
    engine, c = attribution
    assert [n["collectives"] for n in c["counts"]] == [2] * ATTR_STEPS
    # step 0 of a process may load and check the statistics kernel against float64 (one-time)
    assert c["counts"][1:] == [{"collectives": 2, "syncs": 1}] * (ATTR_STEPS - 1)


def test_rank_stats_culprit_of_a_nonfinite_loss_and_no_loss():
    from distgrad.loss.tracker import RANK_LOSS_COLS

    rows = np.zeros((3, len(RANK_LOSS_COLS)))
    rows[:, 1] = 2.0
    rows[:, 0] = [4.0, np.nan, 6.0]
    rows[:, 2] = [9.0, np.nan, 3.5]
    rows[:, 4] = [1.0, 1.0, 1.0]
    rows[:, 5] = [0.1, 0.5, 0.2]
    r = rank_stats(rows)
    assert r.loss_max_rank == 1  # a NaN loss names its rank even though 9.0 is larger
    assert r.loss_mean[0] == 2.0 and r.loss_mean[2] == 3.0
    assert r.straggler_rank == 1 and r.straggler_ratio == pytest.approx(1.0 / (1.0 - 0.3))
    rows[:, 1] = 0.0  # no loss observed anywhere
    rows[:, 5] = np.nan  # no data time known
    r = rank_stats(rows)
    assert r.loss_max_rank is None and all(math.isnan(v) for v in r.loss_mean)
    assert r.straggler_rank is None and r.straggler_ratio is None
