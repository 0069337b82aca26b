"""Does distgrad name the cause of a failure, not only its symptom? Realistic failures on 3 gloo
CPU ranks (tests/dist/cause_cases.py, one launch), plus single-process checks of the replica
checksum."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from tests.helpers import launch
from distgrad.stats import replica_outliers
from distgrad.stats.checksum import checksum_reference, replica_checksum

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def causes(tmp_path_factory):
    out = tmp_path_factory.mktemp("causes") / "causes.json"
    return launch("cause_cases.py", out, nproc=3)["cases"]


def _rank0(causes, key):
    r0 = causes[key]["ranks"][0]
    assert "error" not in r0, r0.get("traceback")
    return r0


# ---------------------------------------------------------------------------- culprit rank
@pytest.mark.multirank
def test_nan_from_one_ranks_batch_names_that_rank(causes):
    """A zero-padded sample on rank 1 at step 4 makes 0/0 in ``feat_norm``: rank 1's own loss
    and gradients are NaN (its local loss says so: checked against the loop's own value), the
    all-reduce spreads it, so every rank's shard of the reduced gradient holds NaN (the shard
    view names ranks 0, 1, 2) while the culprit view names rank 1 alone, with both its loss
    and its pre-reduction gradient flagged."""
    c = _rank0(causes, "nan")
    local = [causes["nan"]["ranks"][r]["local_loss"] for r in range(3)]
    for step, rec in enumerate(c["records"][:5]):
        bad = [r for r in range(3) if not math.isfinite(local[r][step])]
        assert bad == ([1] if step == 4 else [])
        assert rec["nonfinite"] == (step == 4)
        if step < 4:
            assert rec["culprits"] == [] and rec["nonfinite_ranks"] == []
    rec = c["records"][4]
    assert rec["nonfinite_ranks"] == [0, 1, 2]  # the shard view: where the NaN landed
    assert rec["culprits"] == [{"rank": 1, "loss": True, "grad": True}]  # where it came from
    # the optimizer applied the NaN step: from step 5 every rank makes NaN itself
    assert [x["rank"] for x in c["records"][5]["culprits"]] == [0, 1, 2]
    # served: the culprit view of the event's first step, and the shard view named as such
    served = c["served"].splitlines()
    assert sorted(ln for ln in served if ln.startswith("distgrad_nonfinite_culprit{")) == [
        'distgrad_nonfinite_culprit{rank="1",source="grad"} 1.0',
        'distgrad_nonfinite_culprit{rank="1",source="loss"} 1.0']
    shard_ranks = {ln.split('rank="')[1].split('"')[0] for ln in served if ln.startswith("distgrad_nonfinite_params{")}
    # (20 series at most, in rank order: rank 0's shards fill most of them; that view cannot
    # say who made the NaN, which is why the culprit view exists)
    assert "0" in shard_ranks and shard_ranks <= {"0", "1", "2"}


@pytest.mark.multirank
def test_culprit_flags_ride_in_the_two_collectives_without_host_syncs(causes):
    """With the local gradient check on (DDP default), a healthy sampled step still makes 2
    collectives and 1 host copy in distgrad's work (counted as tests/dist/layout_cases.py does), and the backward pass (where the check's
    hooks run) makes no host sync; the non-finite step adds only the provenance all-gather
    (and its host read)."""
    for r in range(3):
        c = causes["nan"]["ranks"][r]
        assert "error" not in c, c.get("traceback")
        assert c["backward_syncs"] == [0] * 7
        # (step 0 also pays the statistics kernel's one-time self-check against float64)
        assert c["counts"][1:4] == [{"collectives": 2, "syncs": 1}] * 3
        assert c["counts"][4] == {"collectives": 3, "syncs": 2}


# ---------------------------------------------------------------------------- no gradient
@pytest.mark.multirank
def test_detached_layer_under_ddp_is_counted_and_flagged_every_step(causes):
    """A stray ``.detach()`` on an adapter under DDP ``find_unused_parameters=True``: its
    gradients stay None on every rank (checked in the loop). distgrad keeps the parameters in
    the record, counts them on every sampled step and flags them vanishing from the
    ``health.patience``-th (3rd) step on, like the exact zeros DeepSpeed writes for the same bug."""
    c = _rank0(causes, "detached")
    adapter = ["adapter.bias", "adapter.weight"]
    for r in range(3):
        assert causes["detached"]["ranks"][r]["none_grads"] == [adapter] * 5
    for i, rec in enumerate(c["records"]):
        assert {"adapter.weight", "adapter.bias"} <= set(rec["names"])
        assert rec["n_no_grad"] == 2 and sorted(rec["no_grad"]) == adapter
        assert sorted(rec["vanishing"]) == (adapter if i >= 2 else [])


# ---------------------------------------------------------------------------- every engine
#: tests/dist/cause_cases.py ENGINE_KINDS, and what each engine leaves for a detached adapter
#: (the engine's own view, checked in the test): None (no gradient) or exact zeros
ENGINE_KINDS = {"ds-z0": "zeros", "ds-z1": "zeros", "ds-z2": "zeros", "ds-z3": "zeros",
                "fsdp1-orig-own": "none", "fsdp1-orig-shared": "zeros", "fsdp1-flat-own": "none",
                "fsdp1-flat-shared": "zeros", "fsdp2": "none"}
PAD_STEP, PAD_RANK = 4, 1
ADAPTER = {"adapter.weight": 256.0, "adapter.bias": 16.0}  # numel


@pytest.mark.multirank
@pytest.mark.parametrize("kind", sorted(ENGINE_KINDS))
def test_nan_made_in_one_ranks_backward_names_that_rank_under_every_engine(causes, kind):
    """Rank 1's batch at step 4 is padded with a masked row; a hand-written feature norm
    ``sqrt(sum(h^2))`` of that all-zero row is finite in the forward pass, but its backward is
    0/0: NaN in rank 1's own gradients only, while every rank's loss stays finite (checked in
    the loop, and the reference -- a plain float64 copy of the model loaded with the full
    weights, run on each rank's batch -- says rank 1's gradient alone was non-finite). The
    loss flag cannot see it; the pre-reduction gradient check names rank 1 alone, under
    DeepSpeed ZeRO 0-3, FSDP1 (both parameter modes) and FSDP2, while the shard view of the
    reduced gradient names other ranks too."""
    res = causes[f"engine-{kind}"]["ranks"]
    for r in range(3):
        assert "error" not in res[r], res[r].get("traceback")
        assert res[r]["own_bad"] == [r == PAD_RANK and s == PAD_STEP for s in range(PAD_STEP + 1)]
        assert all(math.isfinite(v) for v in res[r]["local_loss"][:PAD_STEP + 1])
    recs = res[0]["records"]
    for rec in recs[:PAD_STEP]:
        assert not rec["nonfinite"] and rec["culprits"] == [] and rec["internal_errors"] == 0
    rec = recs[PAD_STEP]
    assert rec["nonfinite"]
    assert rec["culprits"] == [{"rank": PAD_RANK, "loss": False, "grad": True}]
    assert set(rec["nonfinite_ranks"]) - {PAD_RANK}  # the shard view: where the NaN landed
    # DeepSpeed ZeRO 1-3 skip an optimizer step whose reduced gradients are non-finite even in
    # fp32 (their overflow check always runs): the weights stay finite; ZeRO-0 and FSDP apply it
    skipped = kind in ("ds-z1", "ds-z2", "ds-z3")
    assert rec["step_applied"] is not skipped
    assert all(math.isfinite(res[r]["local_loss"][PAD_STEP + 1]) is skipped for r in range(3))


@pytest.mark.multirank
@pytest.mark.parametrize("kind", sorted(ENGINE_KINDS))
def test_detached_adapter_is_flagged_every_step_under_every_engine(causes, kind):
    """The adapter's output is added through a stray ``.detach()``. What the engine leaves
    (its own view, read in the loop: DeepSpeed ``safe_get_full_grad``, FSDP ``.grad`` of the
    adapter's parameters or FlatParameter on every rank): no gradient (FSDP2; FSDP1 when the
    adapter is its own unit) or exact zeros (DeepSpeed ZeRO 0-3; FSDP1 when the adapter shares
    a unit with used parameters). Either way distgrad keeps both parameters in every record
    under their names; None is counted on every step (``n_no_grad``), zeros are exact zeros
    over every element; both are flagged vanishing from the ``health.patience``-th (3rd) step."""
    res = causes[f"engine-{kind}"]["ranks"]
    for r in range(3):
        assert "error" not in res[r], res[r].get("traceback")
    none = ENGINE_KINDS[kind] == "none"
    for step in range(PAD_STEP):  # before the NaN step (the adapter is untouched by it anyway)
        seen = [v for r in range(3) for v in res[r]["engine_adapter"][step]]
        if none:
            assert seen == [None] * len(seen)
        else:
            assert any(v is not None for v in seen) and {v for v in seen if v is not None} == {0.0}
    for i, rec in enumerate(res[0]["records"]):
        assert set(ADAPTER) <= set(rec["names"])
        if none:
            assert rec["n_no_grad"] == 2 and sorted(rec["no_grad"]) == sorted(ADAPTER)
            assert all(a["numel"] == 0 for a in rec["adapter"].values())
        else:
            assert rec["n_no_grad"] == 0
            for name, a in rec["adapter"].items():
                assert a["numel"] == a["zeros"] == ADAPTER[name] and a["norm"] == 0.0
        assert sorted(rec["vanishing"]) == (sorted(ADAPTER) if i >= 2 else [])


def test_local_grad_check_hooks_each_leaf_once_and_flags_a_backward_only_nan():
    """``sqrt(sum(0 * w))`` is 0 in the forward pass, 0/0 = NaN in the backward pass: the
    check flags it (finite gradients do not), a leaf added twice is hooked once, and an engine
    without a known hook point is refused by name."""
    from distgrad.diagnostics.culprit import LocalGradCheck, pre_reduction_leaves

    lin = torch.nn.Linear(3, 2)
    check = LocalGradCheck([lin.weight])
    assert check.add(lin.parameters()) == 1  # the bias; the weight is hooked already
    lin(torch.ones(1, 3)).sum().backward()
    assert check.take(CPU).item() == 0.0
    out = (lin.weight * 0).sum().sqrt()
    assert out.item() == 0.0
    out.backward()
    assert torch.isnan(lin.weight.grad).all()
    assert check.take(CPU).item() == 1.0 and check.take(CPU).item() == 0.0  # take starts over
    check.remove()
    with pytest.raises(ValueError, match="megatron"):
        pre_reduction_leaves("megatron", lin)


# ---------------------------------------------------------------------------- replica fingerprint
@pytest.mark.multirank
def test_sign_flip_and_bit_flip_of_one_reduced_element_on_one_of_three_ranks(causes):
    """A comm hook corrupts the reduced gradient after the all-reduce: the sign of one element
    on rank 2 at step 3, the lowest mantissa bit of one element on rank 0 at step 5. The
    majority of 3 names the corrupted rank on exactly those steps. The previous fingerprint
    (sum of squares, relative tolerance 1e-6; recomputed by the driver from the gradients) is
    blind to both: equal on all ranks for the sign flip, within 1e-9 for the bit flip."""
    c = _rank0(causes, "flip")
    assert causes["flip"]["ranks"][2]["changed"] == [[3, "sign"]]
    assert c["changed"] == [[5, "bit"]]
    got = {rec["step"]: rec["replica_mismatch_ranks"] for rec in c["records"]}
    assert got == {0: [], 1: [], 2: [], 3: [2], 4: [], 5: [0], 6: []}
    assert c["records"][-1]["counters"]["replica_mismatch"] == 2
    old = c["old_fingerprints"]
    assert old[3][0] == old[3][1] == old[3][2]
    assert replica_outliers(old[5], 1e-6) == [] and old[5][0] != old[5][1]


def test_checksum_matches_its_pure_python_definition():
    """The device implementation (int64 tensors, wrapping multiplication) against the
    definition in Python integers, for every supported dtype and a piece spanning chunks."""
    import distgrad.stats.checksum as ck

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        pieces = [torch.randn(300, generator=gen).to(dtype), None, torch.zeros(0, dtype=dtype),
                  torch.randn(41, generator=gen).to(dtype)]
        want = ck.checksum_reference([p.tolist() if p is not None else [] for p in pieces], dtype)
        assert replica_checksum(pieces, CPU).item() == float(want), dtype
    old, ck._CHUNK = ck._CHUNK, 64  # several chunks per piece: the same integer
    try:
        p = [torch.randn(300, generator=gen)]
        assert replica_checksum(p, CPU).item() == float(checksum_reference([p[0].tolist()], torch.float32))
    finally:
        ck._CHUNK = old


def _bitflip(x: float, bit: int) -> float:
    (i,) = struct.unpack("<I", struct.pack("<f", x))
    return struct.unpack("<f", struct.pack("<I", i ^ (1 << bit)))[0]


def test_checksum_catches_every_single_element_change_and_is_order_free():
    """Every sign flip, every single-bit flip of a few elements, swaps of two elements
    (including +a/-a pairs, invisible to any sum of squares) and -0.0 for 0.0 change the
    checksum; the same bits always give the same value."""
    rnd = random.Random(5)
    base = [rnd.gauss(0, 1) for _ in range(64)] + [0.0]
    t = torch.tensor(base)
    ref = replica_checksum([t], CPU).item()
    assert replica_checksum([t.clone()], CPU).item() == ref
    seen = 0
    for i in range(len(base)):
        u = t.clone()
        u[i] = -u[i]
        assert replica_checksum([u], CPU).item() != ref, i
        seen += 1
    for i in (0, 17, 63):
        for bit in range(32):
            u = t.clone()
            u[i] = _bitflip(base[i], bit)
            if math.isfinite(u[i].item()):
                assert replica_checksum([u], CPU).item() != ref, (i, bit)
                seen += 1
    pm = torch.tensor([0.5, -0.5, 1.0])
    assert replica_checksum([pm], CPU).item() != replica_checksum([pm[[1, 0, 2]]], CPU).item()
    for i, j in ((0, 1), (5, 40), (10, 64)):
        u = t.clone()
        u[i], u[j] = t[j], t[i]
        assert replica_checksum([u], CPU).item() != ref
    # the split into pieces does not matter, the positions do
    assert replica_checksum([t[:10], t[10:]], CPU).item() == ref
    assert seen > 150


def test_checksum_of_a_nonfinite_copy_is_nan():
    assert math.isnan(replica_checksum([torch.tensor([1.0, float("inf")])], CPU).item())
    assert math.isnan(replica_checksum([torch.tensor([float("nan")], dtype=torch.bfloat16)], CPU).item())


def test_majority_attribution_with_exact_checksums():
    """rtol 0 (what the instrument passes): the ranks outside the majority; a two-way tie goes
    against the higher ranks."""
    assert replica_outliers([7.0, 7.0, 9.0], 0.0) == [2]
    assert replica_outliers([9.0, 7.0, 7.0, 7.0], 0.0) == [0]
    assert replica_outliers([7.0, 7.0 + 2 ** -40, 7.0], 0.0) == [1]
    assert replica_outliers([7.0, 9.0], 0.0) == [1]


# ---------------------------------------------------------------------------- spikes that page
#: the detectors the spike alerts page on (grafana/config.py ALERTS[...]["detectors"])
PAGING = ("robust", "window")


@pytest.mark.multirank
def test_healthy_300_step_run_pages_nothing(causes):
    """300 healthy DDP steps on 3 ranks: no paging detector fires on the loss or the grad
    norm (ZClip's EMA test, which does not page, may)."""
    c = _rank0(causes, "spike-healthy")
    assert len(c["records"]) == 300
    for series in ("loss", "grad_norm"):
        assert {d: c["totals"][series][d] for d in PAGING} == {"robust": 0, "window": 0}, series
    assert not any(d in PAGING for r in c["records"] for ds in r["fired"].values() for d in ds)
    # the detection policy opens no incident: no alert, and the verdict has nothing to say
    assert all(r["incidents"]["opened"] == [] for r in c["records"])
    assert c["records"][-1]["incidents"]["total"] == {"divergence": 0, "bad_batch": 0, "spike_burst": 0}
    assert c["verdict"] == {"healthy": True, "problems": []}  # distgrad summary agrees


@pytest.mark.multirank
def test_one_rank_garbage_batch_pages_on_its_step_and_names_the_rank(causes):
    """A quarter of rank 1's labels are wrong at step 150: the global loss about doubles
    (checked), the robust detector flags exactly that step on the loss series (OLMo's window
    test, inflated by the early descent in its window, does not), and the per-rank loss
    (distgrad_loss_max_rank) names rank 1 on that step."""
    c = _rank0(causes, "spike-garbage")
    recs = {r["step"]: r for r in c["records"]}
    assert 1.8 < recs[150]["loss"] / recs[149]["loss"] < 3.0
    fired = {r["step"]: r["fired"] for r in c["records"] if r["fired"]}
    assert fired == {150: {"loss": ["robust"]}}
    assert recs[150]["loss_max_rank"] == 1
    assert c["totals"]["loss"]["window"] == 0
    # it pages (DistgradBadBatch, critical) on its own step: the policy's bad_batch incident names
    # rank 1 (its own loss vs the median of the others', from the loop's values) and step 150
    opened = [(r["step"], i) for r in c["records"] for i in r["incidents"]["opened"]]
    assert [(s, i["kind"], i["step"], i["rank"]) for s, i in opened] == [(150, "bad_batch", 150, 1)]
    ranks = recs[150]["rank_loss"]
    assert opened[0][1]["value"] == ranks[1] and opened[0][1]["level"] == (ranks[0] + ranks[2]) / 2
    # distgrad summary reads the same incident from the JSONL records: one decision
    assert [p[:3] for p in c["verdict"]["problems"]] == [["bad_batch", 150, [1]]]
    assert c["verdict"]["problems"][0][3].startswith(opened[0][1]["detail"])


@pytest.mark.multirank
def test_learning_rate_blow_up_pages_within_a_few_steps_early_in_a_run(causes):
    """The learning rate is multiplied by 30 at step 20 (the window detector cannot test
    before 128 samples): the robust detector flags the gradient norm within 5 steps, and not
    before the blow-up."""
    c = _rank0(causes, "spike-lr")
    first = min(r["step"] for r in c["records"] if "robust" in r["fired"].get("grad_norm", []))
    assert 20 <= first <= 25
    assert not any(r["fired"] for r in c["records"] if r["step"] < 20)
    # it opens a ticket (DistgradRecurringSpikes, warning): the policy's spike_burst incident
    # within 7 sampled steps of the blow-up, on the fourth robust spike (incidents.burst_spikes),
    # nothing before
    opened = [i for r in c["records"] for i in r["incidents"]["opened"]]
    assert opened and {i["kind"] for i in opened} == {"spike_burst"}
    burst = opened[0]
    robust = [r["step"] for r in c["records"] if any("robust" in d for d in r["fired"].values())]
    assert burst["step"] == robust[3] <= 27 and burst["first_step"] == robust[0]
    assert [p[:2] for p in c["verdict"]["problems"]] == [["spike_burst", burst["step"]]]  # the same in the verdict


# ---------------------------------------------------------------------------- culprit module
@pytest.mark.multirank
def test_nan_from_one_ranks_batch_names_the_module(causes):
    """The same zero-padded sample (0/0 in ``feat_norm``, rank 1, step 4): the forward replay at
    the step's boundary names ``feat_norm`` on rank 1, micro-batch 0, on that step only (the
    first step of the streak), in the record of every rank and in the served metrics; it costs
    one all-gather on that step and nothing on the others."""
    for r in range(3):
        c = causes["nan"]["ranks"][r]
        mods = [rec["culprit_module"] for rec in c["records"]]
        assert mods == [None] * 4 + [{"step": 4, "outcome": "found", "rank": 1, "module": "feat_norm",
                                      "micro_batch": 0}] + [None] * 2
        assert [x["collectives"] for x in c["replay_counts"]] == [0, 0, 0, 0, 1, 0, 0]
    served = causes["nan"]["ranks"][0]["served"].splitlines()
    assert [ln for ln in served if ln.startswith("distgrad_nonfinite_culprit_module")] == [
        'distgrad_nonfinite_culprit_module{module="feat_norm",rank="1"} 1.0']
    assert [ln for ln in served if ln.startswith("distgrad_nonfinite_replay_outcome")] == [
        'distgrad_nonfinite_replay_outcome{outcome="found"} 1.0']


@pytest.mark.parametrize("engine", ["ddp", "fsdp1", "fsdp2", "zero3"])
@pytest.mark.multirank
def test_log_of_underflowed_softmax_on_one_rank_names_router_module(causes, engine):
    """``log(softmax(.))`` in ``layers.1.router`` underflows to log(0) = -inf for one sample of
    rank 1's second micro-batch at step 3 (a 1e4 unit mix-up in the data), under DDP (no_sync
    accumulation), FSDP1, FSDP2 (fully_shard) and DeepSpeed ZeRO-3, whose replayed forwards
    gather the parameters on every rank. Reference: the driver's own forward hooks saw ``layers.1.router``
    as the first module with a non-finite output in that training forward, on rank 1 only.
    distgrad names exactly that step, rank, module and micro-batch on every rank. Nothing the
    training depends on is touched: DDP / FSDP1 / FSDP2: the RNG state, the BatchNorm buffers and the
    Adam state an optimizer pre-hook sees after distgrad's boundary equal those seen before it
    on every step; ZeRO-3: the RNG state and the buffers are the same before and after
    ``engine.step()``; and every loss and final parameter shard of the run equal those of the
    same run with ``tracer.replays: 0``, bit for bit (the loop zeroes the NaN gradients after
    distgrad read them, DeepSpeed skips the step: training goes on finite). The healthy steps
    replay nothing."""
    want = {"step": 3, "outcome": "found", "rank": 1, "module": "layers.1.router", "micro_batch": 1}
    for r in range(3):
        c = causes[f"module-{engine}"]["ranks"][r]
        assert "error" not in c, c.get("traceback")
        recs = c["records"]
        ref = [rec["reference"] for rec in recs]
        assert ref == [[None, None]] * 3 + ([[None, "layers.1.router"]] if r == 1 else [[None, None]]) + [[None, None]] * 2
        assert [rec["nonfinite"] for rec in recs] == [False] * 3 + [True] + [False] * 2
        if engine == "zero3":
            assert [rec["step_applied"] for rec in recs] == [True] * 3 + [False] + [True] * 2
        assert recs[3]["culprits"] == [1]
        assert [rec["culprit_module"] for rec in recs] == [None] * 3 + [want] + [None] * 2
        assert [rec["replays"] for rec in recs] == [0, 0, 0, 1, 1, 1]
        assert all(rec["untouched"] for rec in recs)
        assert c["same_training"]
        assert all(math.isfinite(v) for v in c["losses"][8:])  # training went on finite
        n = [rec["replay_counts"]["collectives"] for rec in recs]
        assert n[:3] == [0, 0, 0] and n[4:] == [0, 0]
        if engine == "ddp":
            assert n[3] == 1  # the result all-gather; the inner module's forward makes none
        elif engine in ("fsdp1", "fsdp2"):
            assert n[3] > 2  # + the micro-batch count all-reduce + the forwards' all-gathers
        else:
            assert n[3] == 2  # (DeepSpeed gathers its partitions through its own comm layer)


@pytest.mark.multirank
def test_healthy_run_replays_nothing(causes):
    """300 healthy steps: no replay, no culprit module anywhere."""
    c = _rank0(causes, "spike-healthy")
    assert c["replays"] == 0
