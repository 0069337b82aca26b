"""Behaviour of the instrument around training, on 2 gloo ranks (results from the same
DeepSpeed launch as the reference tests) and on one process."""

from __future__ import annotations

import pytest

import distgrad
from distgrad.core.step import StepOutcome, StepToken


@pytest.mark.multirank
def test_local_failure_on_one_rank_is_counted_and_training_goes_on(ds_results):
    f = ds_results["special"]["fault"]
    assert f["global_steps"] == 3  # all three optimizer steps ran: no crash, no deadlock
    # step 1's statistics were discarded on every rank (rank 1 flagged its failure in the SUM);
    # steps 0 and 2 were published
    assert f["steps_seen"] == [0, 0, 2]
    assert f["internal_errors"] == 1  # rank 0 learned of rank 1's failure from the error flag


@pytest.mark.multirank
def test_two_collectives_and_one_host_sync_per_sampled_step(ds_results):
    per_step = ds_results["special"]["counts"]
    assert [s["step"] for s in per_step] == [0, 1, 2, 3]
    for s in per_step:
        if s["step"] % 2 == 1:  # interval 2: not sampled -> nothing at all
            assert (s["all_reduce"], s["all_gather"], s["other"], s["syncs"]) == (0, 0, 0, []), s
        elif s["step"] == 0:  # healthy sampled step
            assert (s["all_reduce"], s["all_gather"], s["other"]) == (2, 0, 0), s
            assert s["syncs"] == ["cpu"], s
        else:  # step 2 is non-finite: one extra all-gather for per-rank provenance, one more copy
            assert (s["all_reduce"], s["all_gather"], s["other"]) == (2, 1, 0), s
            assert s["syncs"] == ["cpu", "cpu"], s
    assert ds_results["special"]["counts_nonfinite_steps"] == 1


@pytest.mark.multirank
def test_nan_on_an_unsampled_step_is_reported_by_the_next_sampled_step_zero2(ds_results):
    """Injected: a NaN input on rank 1 at step 1 (interval 2: not sampled)."""
    c = ds_results["special"]["unsampled_nan"]
    assert c["step"] == 2 and c["reported"] == {"grad": [1], "loss": [1]}
    k = c["counters"]
    # DeepSpeed's ZeRO-2 optimizer finds the non-finite reduced gradient itself (also in fp32) and
    # skips step 1 (its own skipped-step count says so), so the weights stay finite and the sampled
    # step 2 is clean: only the unsampled step 1 is non-finite, in its gradients and rank 1's loss.
    assert (k["nonfinite_unsampled_steps"], k["nonfinite_steps"], k["internal_errors"]) == (1, 0, 0)
    assert k["skipped_steps"] == 1
    assert k["nonfinite_loss_steps"] == 1  # step 1 (rank 1's loss)


@pytest.mark.multirank
def test_port_in_use_raises_on_every_rank_at_instrument_time(ds_results):
    msg = ds_results["special"]["port_taken"]
    assert msg is not None and msg.startswith("OSError") and "port=0" in msg


@pytest.mark.multirank
def test_failure_while_attaching_to_deepspeed_frees_the_port(ds_results):
    """The attach is made to fail after rank 0 bound its port: instrument() raises on every rank
    and has closed the instrument, so the same port can be bound at once (by a plain socket and
    by a new instrument) and the engine is neither left wrapped nor marked as instrumented."""
    a = ds_results["special"]["attach_failure"]
    assert a["error"] is not None and "injected failure while attaching" in a["error"]
    assert a["rebound"] is True, a["rebound"]
    assert a["port"] > 0 and a["served"] == a["port"]
    assert a["restored"] and a["unmarked"]


def test_unsupported_engine_is_named_with_the_fix():
    with pytest.raises(TypeError, match=r"got a builtins\.object.*supported"):
        distgrad.instrument(object())


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["z0-fp32", "z1-fp32", "z2-bf16", "z3-fp32", "z3-bf16"])
def test_update_ratio_equals_full_master_weight_reference(ds_results, key):
    """||w_after - w_before|| / ||w_before|| from sharded fp32 master weights (one extra
    all-reduce) equals the same ratio of the gathered full weights in float64."""
    c = ds_results["special"]["update_ratio"][key]
    assert len(c["got"]) == len(c["ref"]) == 2
    for got, ref in zip(c["got"], c["ref"]):
        assert got is not None and set(got) == set(ref)
        for name, r in ref.items():
            assert r > 0, name  # AdamW moved every parameter: the check is not vacuous
            assert got[name] == pytest.approx(r, rel=1e-6), name


@pytest.mark.multirank
def test_ranks_with_different_sampling_settings_are_refused_at_instrument_time(ds_results):
    msg = ds_results["special"]["disagree"]  # rank 0's message; rank 1 raised too (else no JSON)
    assert msg is not None and "same config" in msg


@pytest.mark.multirank
def test_enabled_false_on_one_rank_raises_on_every_rank(ds_results):
    msgs = ds_results["special"]["disabled_on_one_rank"]  # rank 0 enabled, rank 1 enabled: false
    assert len(msgs) == 2 and all(m and m.startswith("RuntimeError") and "same config" in m for m in msgs), msgs
    assert "enabled=True" in msgs[0] and "enabled=False" in msgs[1]


@pytest.mark.multirank
def test_distgrad_section_of_the_deepspeed_config(ds_results):
    assert ds_results["special"]["ds_section"] == {"interval": 3, "spike_window": 16, "prometheus": False}


def test_failing_sink_is_counted_and_others_still_get_the_record():
    """One process, no engine: a GradSource with two tensors, a sink that always raises."""
    import torch

    from distgrad.config import DistgradConfig
    from distgrad.engines.base import GradSource
    from distgrad.core.instrument import Instrument
    from distgrad.export.base import Sink

    class Two(GradSource):
        names, numels = ["a", "b"], [3, 2]

        def local_pieces(self):
            return [torch.tensor([1.0, -2.0, 2.0]), torch.tensor([0.0, 4.0])]

    class Broken(Sink):
        name = "broken"

        def write(self, record):
            raise OSError("disk full")

    class Keep(Sink):
        name = "keep"

        def __init__(self):
            self.records = []

        def write(self, record):
            self.records.append(record)

    inst = Instrument(Two(), DistgradConfig(exporter={"port": 0}))
    inst.start()
    from prometheus_client import generate_latest

    assert 'distgrad_sink_errors_total{sink="prometheus"} 0.0' in generate_latest(inst.prometheus.registry).decode()
    keep = Keep()
    inst.sinks[:0] = [Broken()]
    inst.sinks.append(keep)
    try:
        for step in range(2):
            inst.finish(StepToken(step, True, inst.collect(step)), StepOutcome(micro_step=step))
        assert [r.step for r in keep.records] == [0, 1]
        assert keep.records[-1].grad_norm == pytest.approx(5.0)  # sqrt(1 + 4 + 4 + 16)
        assert inst.counters["internal_errors"] == 2
        from prometheus_client import generate_latest

        text = generate_latest(inst.prometheus.registry).decode()
        assert 'distgrad_sink_errors_total{sink="broken"} 2.0' in text
        assert "distgrad_internal_errors_total 2.0" in text
    finally:
        inst.close()
