"""Statistics read from 2-rank PyTorch-native runs (DDP; FSDP1 use_orig_params True/False x
FULL_SHARD/SHARD_GRAD_OP; FSDP2; fp32 and bf16; gradient accumulation 1 and 2) equal statistics
of the unsharded reduced gradient computed in float64 on one process: the same standard as
tests/test_deepspeed_reference.py (reference A at 1e-5 relative with exact extrema and counts,
reference B against a float64 model; see tests/dist/torch_cases.py for how each is gathered).

Also pinned here: what the optimizer step pre-hook sees under ``torch.amp.GradScaler``, the
overflow accounting, the replica check under DDP, the single-process plain-module path, and the
errors of ``distgrad.instrument`` for PyTorch models.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import distgrad
from distgrad.record import StepRecord
from tests.reference import case as _case, check_against as _check_against

from tests.dist.common import TinyModel, batch_for, full_stats

ENGINES = ("ddp", "fsdp1-orig-full", "fsdp1-orig-sgo", "fsdp1-flat-full", "fsdp1-flat-sgo", "fsdp2")
CASES = [f"{e}-{d}-gas{g}" for e in ENGINES for d in ("fp32", "bf16") for g in (1, 2)] + [
    "ddp-fp32-gas2-sync", "fsdp1-flat-full-fp32-gas2-sync", "fsdp2-fp32-gas2-sync"] + [
    f"fsdp1-{m}-noshard-{d}" for m in ("orig", "flat") for d in ("fp32-gas2", "bf16-gas1")]
REF_B_RTOL = {"fp32": 1e-5, "bf16": 3e-2}


def _dtype(key: str) -> str:
    return "bf16" if "-bf16-" in key else "fp32"


def _scaled(ref: dict, factor: float) -> dict:
    """Statistics of ``g / factor`` from those of ``g`` (exact for a power-of-two factor)."""
    out = {}
    for n, r in ref.items():
        out[n] = None if r is None else {k: (v / factor if k in ("norm", "mean", "std", "min", "max", "abs_max", "rms")
                                             else v) for k, v in r.items()}
    return out


# ---------------------------------------------------------------------------------------------
# 2-rank reference cases

@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_sharded_stats_equal_full_gradient(torch_results, key):
    """Reference A on both optimizer steps."""
    c = _case(torch_results, key)
    assert torch_results["world_size"] == 2
    assert len(c["records"]) == 2 and all(c["records"]) and len(c["ref_full"]) == 2
    for step, (rec, ref) in enumerate(zip(c["records"], c["ref_full"])):
        rec = StepRecord.from_dict(rec)
        assert rec.step == step and rec.world_size == 2
        _check_against(rec, ref, rtol=1e-5, exact=True)


@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_local_pieces_sit_at_local_offsets(torch_results, key):
    """On both ranks and steps, each gradient piece and each weight piece
    (``local_param_pieces``) equals the full tensor at ``source.local_offsets()`` (the whole
    parameter for replicated sources)."""
    c = _case(torch_results, key)
    assert c["offset_mismatches"] == [0, 0]


@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_update_ratio_equals_full_weights(torch_results, key):
    """``update_ratio`` (||w_after - w_before|| / ||w_before||, from local_param_pieces)
    equals the ratio of the full weights gathered around the step."""
    c = _case(torch_results, key)
    for rec, ref in zip(c["records"], c["ref_update_ratio"]):
        got = rec["update_ratio"]
        assert set(got) == set(ref)
        for n, r in ref.items():
            assert got[n] == pytest.approx(r, rel=1e-4, abs=1e-12), n


@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_stats_are_the_averaged_post_reduction_gradient(torch_results, key):
    """Reference B at step 0: a float64 single-process model over all ranks' micro-batches."""
    c = _case(torch_results, key)
    rec = StepRecord.from_dict(c["records"][0])
    dtype = _dtype(key)
    ref = c["ref_fp64_step0"]
    if dtype == "fp32":
        _check_against(rec, ref, rtol=REF_B_RTOL[dtype], exact=False)
    else:  # bf16 arithmetic: norms only (see test_deepspeed_reference.py)
        for i, n in enumerate(rec.params.names):
            assert rec.params.norm[i] == pytest.approx(ref[n]["norm"], rel=REF_B_RTOL[dtype]), n


@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_names_are_the_users_own_in_registration_order(torch_results, key):
    """No wrapper prefixes, no ``_flat_param``, frozen excluded, tied weight once, and the order
    of the unwrapped model's ``named_parameters()`` (FSDP1 flat mode reorders units)."""
    c = _case(torch_results, key)
    rec = StepRecord.from_dict(c["records"][0])
    assert rec.params.names == c["expected_names"]
    assert "frozen.weight" in c["frozen"] and "frozen.weight" not in rec.params.names
    assert rec.params.names.count("emb.weight") == 1 and "head.weight" not in rec.params.names
    assert not any("_fsdp" in n or "_flat_param" in n or n.startswith("module.") for n in rec.params.names)
    full = {n: r["numel"] for n, r in c["ref_fp64_step0"].items()}
    assert [int(x) for x in rec.params.numel] == [full[n] for n in rec.params.names]


@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_loss_and_step_counters(torch_results, key):
    """The loss returned by the model's forward is captured automatically and averaged over
    ranks and micro-batches; ``step`` counts optimizer steps, ``micro_step`` forward passes."""
    c = _case(torch_results, key)
    gas = int(key.split("gas")[1][0])
    dtype = _dtype(key)
    for step, rec in enumerate(c["records"]):
        assert rec["step"] == step
        assert rec["micro_step"] == gas * (step + 1)
        assert rec["loss"] is not None and np.isfinite(rec["loss"])
    assert c["records"][0]["loss"] == pytest.approx(c["ref_loss_step0"], rel=REF_B_RTOL[dtype])
    assert c["counters"]["sampled_steps"] == 2
    assert c["counters"]["internal_errors"] == 0
    assert c["counters"]["nonfinite_steps"] == 0
    assert c["counters"]["overflow_steps"] == 0 and c["counters"]["skipped_steps"] == 0


@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_engine_labels_and_dtypes(torch_results, key):
    """DDP reduces the model's own dtype; FSDP1 MixedPrecision and FSDP2 MixedPrecisionPolicy
    compute in bf16 and hand the optimizer fp32 gradients (reduced ones cast back)."""
    c = _case(torch_results, key)
    engine = key.split("-")[0]
    dtype = _dtype(key)
    assert c["engine_name"] == engine
    assert c["replicated"] == (engine == "ddp" or "-noshard-" in key)  # NO_SHARD: full grads everywhere
    assert c["compute_dtype"] == ("torch.bfloat16" if dtype == "bf16" else "torch.float32")
    want_grad = "torch.bfloat16" if (dtype == "bf16" and engine == "ddp") else "torch.float32"
    assert c["grad_dtype"] == want_grad
    rec = StepRecord.from_dict(c["records"][0])
    assert rec.grad_dtype == {"torch.bfloat16": "bf16", "torch.float32": "fp32"}[want_grad]


@pytest.mark.multirank
@pytest.mark.parametrize("key", [k for k in CASES if k.startswith("ddp") or "-noshard-" in k])
def test_healthy_replicated_run_reports_no_replica_mismatch(torch_results, key):
    c = _case(torch_results, key)
    assert c["counters"]["replica_mismatch"] == 0
    for rec in c["records"]:
        assert rec["replica_mismatch_ranks"] == []
        assert rec["replica_mismatch_rank"] == -1


@pytest.mark.multirank
def test_corrupted_ddp_gradient_on_rank_1_is_reported(torch_results):
    """Rank 1 adds 1.0 to one element of its (replicated) ``inp.weight`` gradient in a pre-hook
    registered before distgrad's: the fingerprint check names rank 1 on every step (with two
    ranks there is no majority; the tie goes against the higher rank)."""
    c = _case(torch_results, "ddp-fp32-gas1-corrupt")
    assert c["counters"]["replica_mismatch"] == 2
    for rec in c["records"]:
        assert rec["replica_mismatch_ranks"] == [1]
        assert rec["replica_mismatch_rank"] == 1


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["plain", "unscale"])
def test_grad_scaler_pre_hook_sees_unscaled_gradients(torch_results, mode):
    """Non-fused optimizer: ``scaler.step`` unscales (or the loop already called
    ``scaler.unscale_``) before ``optimizer.step``, so the step pre-hook, and distgrad, see the
    gradients divided by the loss scale."""
    c = _case(torch_results, f"scaler-{mode}")
    for i, s in enumerate(c["steps"]):
        if i == c["overflow_step"]:
            continue
        assert s["prehook"]["opt_grad_scale"] is None
        for n, r in s["prehook"]["stats"].items():
            assert s["raw_before_step"][n]["norm"] == pytest.approx(s["scale"] * r["norm"], rel=1e-12), n
        rec = StepRecord.from_dict(s["record"])
        _check_against(rec, s["prehook"]["stats"], rtol=1e-5, exact=True)
        assert rec.loss_scale == s["scale"] and rec.overflow is False and rec.step_applied is True


@pytest.mark.multirank
def test_grad_scaler_fused_optimizer_sees_scaled_gradients(torch_results):
    """``AdamW(fused=True)`` (``_step_supports_amp_scaling``): ``scaler.step`` calls
    ``optimizer.step`` with the gradients still scaled and ``optimizer.grad_scale`` set; distgrad
    divides by it and reports the unscaled statistics."""
    c = _case(torch_results, "scaler-fused")
    for i, s in enumerate(c["steps"]):
        assert s["prehook"]["opt_grad_scale"] == s["scale"]
        if i == c["overflow_step"]:
            continue
        for n, r in s["prehook"]["stats"].items():
            assert r["norm"] == s["raw_before_step"][n]["norm"], n
        rec = StepRecord.from_dict(s["record"])
        _check_against(rec, _scaled(s["prehook"]["stats"], s["scale"]), rtol=1e-5, exact=True)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["plain", "unscale", "fused"])
def test_grad_scaler_overflow_step_is_recorded_and_skipped(torch_results, mode):
    """An Inf injected after the backward of step 1: GradScaler skips the update; distgrad still
    records that step (its statistics, with the Inf, unscaled), with overflow=True,
    step_applied=False and the loss scale of that backward; the next step has half the scale."""
    c = _case(torch_results, f"scaler-{mode}")
    k = c["overflow_step"]
    steps = c["steps"]
    assert [s["record"]["step"] for s in steps] == [0, 1, 2]  # skipped steps are counted
    rec = StepRecord.from_dict(steps[k]["record"])
    assert rec.overflow is True and rec.step_applied is False
    assert rec.loss_scale == steps[k]["scale"] == 1024.0
    i = rec.params.index("inp.weight")
    assert rec.params.inf[i] == 1 and rec.params.nan[i] == 0 and math.isinf(rec.grad_norm)
    if mode == "fused":  # optimizer.step ran (the kernel skips the update) with scaled grads
        ref = _scaled(steps[k]["prehook"]["stats"], steps[k]["scale"])
    else:  # optimizer.step never ran: read after scaler.step, gradients unscaled by unscale_
        assert steps[k]["prehook"] is None
        ref = steps[k]["after_step"]
    _check_against(rec, ref, rtol=1e-5, exact=True, skip=("inp.weight",))
    nxt = StepRecord.from_dict(steps[k + 1]["record"])
    assert nxt.loss_scale == 512.0 and nxt.overflow is False and nxt.step_applied is True
    assert c["counters"]["overflow_steps"] == 1 and c["counters"]["skipped_steps"] == 1
    assert c["counters"]["nonfinite_steps"] == 0  # an overflow the scaler skipped, not a non-finite step
    assert c["counters"]["sampled_steps"] == 3 and c["counters"]["internal_errors"] == 0


@pytest.mark.multirank
def test_instrument_errors_under_two_ranks(torch_results):
    c = _case(torch_results, "errors")
    msg = c["plain_module_2_ranks"]
    assert msg and msg.startswith("ValueError") and "DistributedDataParallel" in msg and "fully_shard" in msg
    msg = c["optimizer_before_wrap"]
    assert msg and msg.startswith("ValueError") and "after DDP / FSDP wrapping" in msg
    msgs = c["disabled_on_one_rank"]  # rank 0 enabled, rank 1 enabled: false
    assert len(msgs) == 2 and all(m and m.startswith("RuntimeError") and "same config" in m for m in msgs), msgs
    assert "enabled=True" in msgs[0] and "enabled=False" in msgs[1]


@pytest.mark.multirank
def test_nonfinite_gradient_and_loss_on_unsampled_steps_under_ddp(torch_results):
    """Injected: a NaN in rank 1's gradient on step 1 (before the all-reduce), a NaN loss on rank 0
    on step 3; interval 2
    samples steps 0, 2, 4. The sampled steps after them report them (a flag carried in their
    MAX collective: no collective on unsampled steps)."""
    c = _case(torch_results, "unsampled-nonfinite")
    assert c["reported"] == {"0": None, "2": {"grad": [1], "loss": []}, "4": {"grad": [], "loss": [3]}}
    k = c["counters"]
    assert (k["nonfinite_unsampled_steps"], k["nonfinite_loss_steps"], k["nonfinite_steps"]) == (1, 1, 0)
    assert c["collectives_per_step"] == [2, 0, 2, 0, 2]


# ---------------------------------------------------------------------------------------------
# single process (no launch)

def _train(model, opt, steps, gas, inst=None, scaler=None, inject_inf_at=None):
    records = []
    for step in range(steps):
        for micro in range(gas):
            x, y = batch_for(step, micro, 0)
            loss = model(x, y)
            (scaler.scale(loss / gas) if scaler else loss / gas).backward()
        if step == inject_inf_at:
            with torch.no_grad():
                model.inp.weight.grad.view(-1)[2] = float("nan")
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if inst is not None:
            records.append(inst.last_record)
    return records


def _grads(model):
    return {n: p.grad.detach().double().reshape(-1).clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def test_plain_module_single_process():
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False})
    refs = []
    opt.register_step_pre_hook(lambda o, a, k: refs.append(full_stats(_grads(model))))
    records = _train(model, opt, steps=2, gas=2, inst=inst)
    assert inst.source.engine_name == "torch" and inst.world_size == 1 and not inst.source.replicated
    expected = [n for n, p in TinyModel().named_parameters() if p.requires_grad]
    for step, (rec, ref) in enumerate(zip(records, refs)):
        assert rec.step == step and rec.micro_step == 2 * (step + 1)
        assert rec.params.names == expected
        _check_against(rec, ref, rtol=1e-5, exact=True)
        assert rec.loss is not None and rec.overflow is None and rec.loss_scale is None
    inst.close()
    _train(model, opt, steps=1, gas=1)  # hooks removed: nothing recorded after close()
    assert inst.counters["sampled_steps"] == 2 and inst.last_record is records[-1]


def test_explicit_observe_loss_replaces_automatic_capture():
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False})
    x, y = batch_for(0, 0, 0)
    model(x, y).backward()
    inst.observe_loss(7.0)
    opt.step()
    assert inst.last_record.loss == pytest.approx(7.0)
    inst.close()


def test_interval_samples_every_nth_optimizer_step():
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, sampling={"interval": 2})
    records = _train(model, opt, steps=5, gas=1, inst=inst)
    assert [r.step for r in records] == [0, 0, 2, 2, 4]
    assert inst.counters["sampled_steps"] == 3
    inst.close()


def test_grad_scaler_single_process_overflow():
    """Same contract as the 2-rank GradScaler tests, on one process (runs without torchrun)."""
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=10**6)
    inst = distgrad.instrument(model, optimizer=opt, scaler=scaler, exporter={"enabled": False})
    refs = []
    opt.register_step_pre_hook(lambda o, a, k: refs.append(full_stats(_grads(model))))
    records = _train(model, opt, steps=3, gas=1, inst=inst, scaler=scaler, inject_inf_at=1)
    assert [r.step for r in records] == [0, 1, 2]
    assert [r.loss_scale for r in records] == [256.0, 256.0, 128.0]
    assert [r.overflow for r in records] == [False, True, False]
    assert [r.step_applied for r in records] == [True, False, True]
    assert len(refs) == 2  # the pre-hook did not fire on the skipped step
    _check_against(records[0], refs[0], rtol=1e-5, exact=True)
    _check_against(records[2], refs[1], rtol=1e-5, exact=True)
    assert records[1].params.nan[records[1].params.index("inp.weight")] == 1
    assert inst.counters["overflow_steps"] == 1 and inst.counters["skipped_steps"] == 1
    assert inst.counters["nonfinite_steps"] == 0
    inst.close()
    assert "step" not in vars(scaler)  # the instance wrapper is gone


def test_instrument_requires_the_optimizer():
    model = TinyModel()
    with pytest.raises(TypeError, match=r"optimizer=opt"):
        distgrad.instrument(model, exporter={"enabled": False})
    with pytest.raises(TypeError, match=r"torch.optim.Optimizer"):
        distgrad.instrument(model, optimizer=object(), exporter={"enabled": False})
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"none of the model's trainable parameters"):
        distgrad.instrument(model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), exporter={"enabled": False})
    with pytest.raises(TypeError, match=r"GradScaler"):
        distgrad.instrument(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scaler=object(),
                            exporter={"enabled": False})


def test_unsupported_object_lists_supported_types():
    with pytest.raises(TypeError) as e:
        distgrad.instrument(object(), exporter={"enabled": False})
    msg = str(e.value)
    for word in ("DeepSpeedEngine", "DistributedDataParallel", "FullyShardedDataParallel", "fully_shard",
                 "nn.Module", "optimizer="):
        assert word in msg, word


def test_flat_layout_pin_rejects_an_unknown_layout():
    """The private FlatParameter attributes read with use_orig_params=False are checked at
    instrument() time; a layout that does not add up is refused with a clear error."""
    from distgrad.engines.fsdp1 import _check_flat_layout

    info = SimpleNamespace(in_shard=True, offset_in_shard=0, numel_in_shard=4)
    good = SimpleNamespace(_fqns=("a",), _numels=(7,), _param_infos=(None,), _shard_param_infos=(info,),
                           _shard_numel_padded=1, numel=lambda: 5)
    _check_flat_layout(good, "unit")
    bad = SimpleNamespace(**{**vars(good), "_shard_numel_padded": 0})
    with pytest.raises(RuntimeError, match="use_orig_params=True"):
        _check_flat_layout(bad, "unit")
    missing = SimpleNamespace(_fqns=("a",), numel=lambda: 5)
    with pytest.raises(RuntimeError, match="lacks an attribute"):
        _check_flat_layout(missing, "unit")


def test_compiled_plain_module_has_the_users_names():
    """``torch.compile`` wraps the module in ``OptimizedModule`` (``_orig_mod.`` names); the
    names reported are the user's own (eager backend: no compiler needed)."""
    torch.manual_seed(0)
    model = TinyModel()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    inst = distgrad.instrument(compiled, optimizer=opt, exporter={"enabled": False})
    x, y = batch_for(0, 0, 0)
    compiled(x, y).backward()
    opt.step()
    rec = inst.last_record
    assert rec.params.names == [n for n, p in model.named_parameters() if p.requires_grad]
    assert rec.micro_step == 1 and rec.loss is not None
    inst.close()


def test_prometheus_exports_overflow_series_only_with_a_scaler():
    """The scaler is known before the exporter starts: ``distgrad_overflow_steps`` and the loss
    scale exist with ``scaler=``, and not without."""
    from prometheus_client import CollectorRegistry, generate_latest

    def exported(scaler):
        torch.manual_seed(0)
        model = TinyModel()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        inst = distgrad.instrument(model, optimizer=opt, scaler=scaler, exporter={"port": 0})
        try:
            _train(model, opt, steps=1, gas=1, scaler=scaler)
            reg = CollectorRegistry()
            reg.register(inst.prometheus.collector)
            return generate_latest(reg).decode()
        finally:
            inst.close()

    with_scaler = exported(torch.amp.GradScaler("cpu", init_scale=64.0))
    assert "distgrad_overflow_steps_total 0.0" in with_scaler
    assert "distgrad_loss_scale 64.0" in with_scaler
    without = exported(None)
    assert "distgrad_overflow_steps" not in without and "distgrad_loss_scale" not in without
    assert 'engine="torch"' in without


def test_diagnostics_and_tracer_are_wired(tmp_path):
    """The PyTorch path gets the same diagnostics as DeepSpeed: detectors and layer
    aggregates in every record, provenance on a non-finite step, and the forward tracer (armed
    by that step) writes its report once the next micro-batch ran (written at the latest when
    the next optimizer step starts)."""
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, flight_recorder={"dir": str(tmp_path)},
                               tracer={"micro_batches": 1})
    records = _train(model, opt, steps=3, gas=1, inst=inst, inject_inf_at=1)
    assert set(records[0].spikes.zscore) == {"grad_norm", "loss"}
    assert records[0].aggregates.layer_norm and records[0].aggregates.module_kind_norm
    assert records[0].health is not None and records[0].health.n_vanishing == 0
    assert records[1].provenance.first_param == "inp.weight"
    assert (tmp_path / "tracer-rank0.txt").exists()
    inst.close()
