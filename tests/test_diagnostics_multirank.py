"""Diagnostics on 2 gloo ranks under DeepSpeed ZeRO-2 (driver: tests/dist/diag_cases.py):
provenance of injected NaN/Inf names the parameter and the rank, the counter moves by one per
event, a 100x spike fires each detector exactly once, a NaN does not poison the detectors,
a zeroed layer is reported vanishing after `health_patience` samples, fp16 overflow is
counted with its skipped step and loss-scale drop, bf16 has no loss-scale wording, and a run
resumed from a checkpoint with Instrument.state_dict() keeps its detectors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank


def _case(diag_results, name):
    c = diag_results[name]
    if "error" in c:
        pytest.fail(f"{name}: {c['error']}\n{c.get('traceback', '')}")
    return c


def _by_step(c):
    return {r["step"]: r for r in c["records"]}


def test_nan_and_inf_provenance_name_parameter_and_rank(diag_results):
    c = _case(diag_results, "faults")
    r = _by_step(c)
    nan, inf = r[130], r[135]
    assert math.isnan(nan["grad_norm"]) and math.isinf(inf["grad_norm"])
    assert nan["provenance"]["params"] == [{"name": c["X"], "nan": 1, "inf": 0, "ranks": [1]}]
    assert nan["provenance"]["first_param"] == c["X"] and nan["nonfinite_ranks"] == [1]
    assert inf["provenance"]["params"] == [{"name": c["Y"], "nan": 0, "inf": 1, "ranks": [0]}]
    assert inf["nonfinite_ranks"] == [0]
    # the counter goes up by exactly one per non-finite step, and only then
    counts = [r[s]["counters"]["nonfinite_steps"] for s in (129, 130, 131, 134, 135, 136)]
    assert counts == [0, 1, 1, 1, 2, 2]
    assert r[131]["provenance"] is None and math.isfinite(r[131]["grad_norm"])


def test_spike_fires_each_detector_once_and_nan_does_not_poison(diag_results):
    r = _by_step(_case(diag_results, "faults"))
    spiking = [s for s, rec in r.items() if rec["spikes"]]
    assert spiking == [145], spiking  # after the NaN (130) and Inf (135): detection still works
    assert r[145]["spikes"] == ["grad_norm"]  # the loss did not spike
    assert r[144]["grad_norm_spikes_total"] == {"ema": 0, "window": 0, "robust": 0}
    assert r[159]["grad_norm_spikes_total"] == {"ema": 1, "window": 1, "robust": 1}  # the paging one too
    assert r[159]["loss_spikes_total"] == {"ema": 0, "window": 0, "robust": 0}
    assert r[145]["grad_norm"] == pytest.approx(100 * r[144]["grad_norm"], rel=0.05)


def test_one_log_line_per_event_from_rank_0_naming_the_ranks(diag_results):
    """Both ranks' distgrad log lines (a handler on the ``distgrad`` logger of each rank): each
    event (the NaN at 130, the Inf at 135, the spike at 145) is logged once in the job, by rank 0,
    whatever the number of ranks; the spike line names the rank with the highest own loss (from
    the step's per-rank losses) and the non-finite line names the culprit and shard ranks."""
    c = _case(diag_results, "faults")
    logs = c["logs"]
    assert len(logs) == 2
    for step, what in ((130, "non-finite gradients"), (135, "non-finite gradients"), (145, "grad_norm spike")):
        per_rank = [[ln for ln in logs[r] if ln.startswith(f"distgrad: step {step}: {what}")] for r in (0, 1)]
        assert len(per_rank[0]) == 1 and per_rank[1] == [], (step, per_rank)
    spike = next(ln for ln in logs[0] if ln.startswith("distgrad: step 145: grad_norm spike"))
    r = _by_step(c)
    lm = r[145]["rank_loss_max"]
    top = max(range(2), key=lambda k: (lm[k], -k))  # the highest loss, ties to the lower rank
    assert r[145]["rank_loss_max_rank"] == top and spike.endswith(
        f"; rank {top} had the highest own loss ({lm[top]:.4g}, median over ranks {(lm[0] + lm[1]) / 2:.4g})"), spike
    nan_line = next(ln for ln in logs[0] if ln.startswith("distgrad: step 130: non-finite gradients"))
    # the NaN is written into rank 1's shard of the reduced gradient (no rank made it itself)
    assert "culprit rank(s), whose own loss / gradient was non-finite before the reduction: none seen" in nan_line
    assert f"{c['X']}: 1 NaN, 0 Inf, ranks [1]" in nan_line
    # nothing else is logged by every rank without its rank: rank 1 logs only what names rank 1
    assert all("rank 1" in ln for ln in logs[1]), logs[1]


def test_zeroed_layer_is_reported_vanishing_after_patience(diag_results):
    c = _case(diag_results, "faults")
    r = _by_step(c)
    assert [r[s]["vanishing"] for s in (149, 150, 151)] == [[], [], []]
    assert all(r[s]["vanishing"] == [c["Z"]] for s in range(152, 160))  # 3rd zero sample on


def test_flight_recorder_report_names_parameter_and_rank(diag_results):
    c = _case(diag_results, "faults")
    js = [Path(p) for p in c["reports"] if p.endswith(".json")]
    assert len(js) == 1 and "step130" in js[0].name  # once, on the first non-finite step only
    dump = json.loads(js[0].read_text())
    assert dump["provenance"]["first_param"] == c["X"]
    assert dump["provenance"]["params"][0]["ranks"] == [1]
    txt = js[0].with_suffix(".txt").read_text()
    assert c["X"] in txt and "130" in txt
    assert len(dump["records"]) >= 64  # the last N sampled steps before it


def test_fp16_overflow_counted_skipped_and_scale_dropped(diag_results):
    c = _case(diag_results, "fp16")
    r = _by_step(c)
    assert (r[2]["overflow"], r[3]["overflow"], r[4]["overflow"]) == (False, True, False)
    assert r[3]["step_applied"] is False and r[4]["step_applied"] is True
    assert r[3]["loss_scale"] == r[2]["loss_scale"] / 2  # hysteresis 1: halved at the overflow
    assert not math.isfinite(r[3]["grad_norm"])  # never the previous step's value
    assert (r[3]["counters"]["overflow_steps"], r[3]["counters"]["skipped_steps"]) == (1, 1)
    assert (r[3]["consecutive_overflow_steps"], r[4]["consecutive_overflow_steps"]) == (1, 0)
    assert c["engine_skipped"] == 1 == c["counters"]["skipped_steps"]
    assert c["min_loss_scale"] == 1.0
    assert (r[2]["loss_scale"], r[3]["loss_scale"]) == (2.0, 1.0)
    assert (r[2]["loss_scale_at_minimum"], r[3]["loss_scale_at_minimum"]) == (0, 1)
    # the overflow step is counted as an overflow (above), not as a non-finite step
    assert c["counters"]["nonfinite_steps"] == 0
    # the collapse signal from DeepSpeed's own loss scale (collapse_factor 2 in this case): the
    # largest applied scale (2, step 2) over the step's scale
    assert [r[s]["loss_scale_drop_factor"] for s in (2, 3, 4)] == [1.0, 2.0, 2.0]
    assert [r[s]["loss_scale_collapsed"] for s in (2, 3, 4)] == [0, 1, 1]


def test_bf16_nonfinite_counted_without_loss_scale_wording(diag_results):
    c = _case(diag_results, "bf16")
    r = _by_step(c)
    assert math.isnan(r[2]["grad_norm"]) and r[2]["counters"]["nonfinite_steps"] == 1
    for rec in c["records"]:
        assert rec["loss_scale"] is None and rec["overflow"] is None
        assert not any("loss_scale" in k or "overflow" in k or k == "scaler" for k in rec["set_fields"])
    assert "loss_scale" not in c["metrics_text"] and "overflow" not in c["metrics_text"]
    assert "distgrad_nonfinite_steps_total 1.0" in c["metrics_text"]


def test_tracer_armed_after_the_nonfinite_step_and_report_written(diag_results):
    """trace_micro_batches=1: the forward of the micro-batch after step 130 is traced (the NaN was
    injected into the gradient, so the forward is clean: the report says so) and written once."""
    c = _case(diag_results, "faults")
    tr = [Path(p) for p in c["reports"] if Path(p).name.startswith("tracer-rank")]
    assert [p.name for p in tr] == ["tracer-rank0.txt"]
    text = tr[0].read_text()
    assert "blocks.0" in text  # per-module frames of the traced forward


def test_resumed_run_keeps_its_detectors(diag_results):
    """#11: checkpoint ``Instrument.state_dict()`` in DeepSpeed's client_state at step 8, restart
    on a fresh engine loaded from the checkpoint: every detector output (z-scores, spike
    decisions, spike totals, health) and the counters after the restart equal those of the
    uninterrupted run with the same data, and so does the final detector state. Without the
    restore, the detectors start a new warm-up (z-scores NaN), which is what this prevents."""
    c = _case(diag_results, "resume")
    cut, spike = c["cut"], c["spike_step"]
    straight, resumed, fresh = c["straight"], c["resumed"], c["not_restored"]
    assert [r["step"] for r in resumed] == list(range(cut, len(straight)))
    # the same training data and model state: the inputs of the detectors agree exactly
    assert [(r["grad_norm"], r["loss"]) for r in resumed] == [(r["grad_norm"], r["loss"]) for r in straight[cut:]]
    # exact equality of the detector outputs (compared as JSON text, so that NaN equals NaN)
    assert json.dumps(resumed) == json.dumps(straight[cut:])
    assert json.dumps(c["resumed_state"], sort_keys=True) == json.dumps(c["straight_state"], sort_keys=True)
    assert json.dumps(c["first"]) == json.dumps(straight[:cut])
    # the detectors were past warm-up at the cut, and the spike is detected after the restart
    assert all(math.isfinite(z) for z in resumed[0]["spikes"]["zscore"]["grad_norm"].values())
    assert resumed[spike - cut]["spikes"]["flagged"] == ["grad_norm"]
    tot = resumed[-1]["spikes"]["total"]["grad_norm"]
    assert tot["window"] == 1 and tot["ema"] >= 1  # ZClip's 2.5-sigma EMA test also fires on noise
    assert resumed[0]["counters"]["sampled_steps"] == cut + 1
    # control: a restart without the state is blind (warm-up again) and misses the spike
    assert all(math.isnan(z) for z in fresh[0]["spikes"]["zscore"]["grad_norm"].values())
    assert fresh[spike - cut]["spikes"]["flagged"] == [] and fresh[0]["counters"]["sampled_steps"] == 1
