"""Parallelism layouts beyond one data-parallel axis, on 4 gloo CPU ranks (a 2 x 2 mesh): HSDP
(FSDP1 ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``, FSDP2 on a ``(replicate, shard)`` mesh) and
FSDP2 + tensor parallelism on a ``(dp, tp)`` mesh. Each element of each gradient must be counted
by exactly one rank of the job: the statistics equal those of the full unsharded gradient of
the same step (reference A, 1e-5, extrema and counts exact) and of a float64 model (reference
B), a mutation counting the replicated dimension twice is caught, the replica check covers the
replicated dimension, and a sampled step makes 2 collectives and 1 host copy (drivers:
tests/dist/layout_cases.py, one launch for every case)."""

from __future__ import annotations

import pytest

from tests.helpers import launch
from distgrad.record import StepRecord
from tests.reference import case as _case, check_against as _check_against

HSDP = ["fsdp1-hybrid-orig", "fsdp1-hybrid-zero2-orig", "fsdp1-hybrid-flat", "fsdp2-hsdp"]
TP = ["fsdp2-tp"]
TINY_NAMES = ["inp.weight", "inp.bias", "blocks.0.0.weight", "blocks.0.0.bias", "blocks.0.1.weight",
              "blocks.0.1.bias", "blocks.0.3.weight", "blocks.0.3.bias", "blocks.1.0.weight", "blocks.1.0.bias",
              "blocks.1.1.weight", "blocks.1.1.bias", "blocks.1.3.weight", "blocks.1.3.bias", "emb.weight"]
TP_NAMES = ["inp.weight", "inp.bias", "norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight",
            "down.bias", "head.weight"]


@pytest.fixture(scope="session")
def layout_results(tmp_path_factory):
    """Every HSDP, tensor-parallel and pipeline case: one 4-rank launch."""
    return launch("layout_cases.py", tmp_path_factory.mktemp("layouts") / "layouts.json", nproc=4)


@pytest.fixture
def hsdp_results(layout_results):
    return layout_results


@pytest.fixture
def tp_results(layout_results):
    return layout_results


@pytest.fixture
def pp_results(layout_results):
    return layout_results


@pytest.fixture
def results(layout_results):
    return layout_results


@pytest.mark.multirank
@pytest.mark.parametrize("key", HSDP + TP)
def test_stats_equal_full_unsharded_gradient(results, key):
    """Reference A on both steps: every per-parameter statistic and the global norm."""
    c = _case(results, key)
    assert results["world_size"] == 4
    assert len(c["records"]) == 2 and all(c["records"])
    for step, (rec, ref) in enumerate(zip(c["records"], c["ref_full"])):
        rec = StepRecord.from_dict(rec)
        assert rec.step == step and rec.world_size == 4
        _check_against(rec, ref, rtol=1e-5, exact=True)
    assert c["counters"]["internal_errors"] == 0 and c["counters"]["replica_mismatch"] == 0


@pytest.mark.multirank
@pytest.mark.parametrize("key", HSDP + TP)
def test_stats_equal_float64_model(results, key):
    """Reference B at step 0: a float64 single-process model over every data-parallel rank's
    batch; and the names are the user's own, in registration order."""
    c = _case(results, key)
    rec = StepRecord.from_dict(c["records"][0])
    _check_against(rec, c["ref_fp64_step0"], rtol=1e-5, exact=False)
    assert rec.params.names == (TP_NAMES if key.startswith("fsdp2-tp") else TINY_NAMES)


@pytest.mark.multirank
@pytest.mark.parametrize("key", HSDP + TP)
def test_two_collectives_and_one_host_copy_per_sampled_step(results, key):
    """Counted inside distgrad's ``collect`` / ``finish`` on every step (every step is sampled)."""
    c = _case(results, key)
    assert c["counts"] == [{"collectives": 2, "syncs": 1}] * 2


@pytest.mark.multirank
@pytest.mark.parametrize("key", HSDP)
def test_hsdp_ownership_and_pieces(results, key):
    """Each shard has 2 copies (one per replica group); replica groups pair the ranks of equal
    shard index ({0, 2}, {1, 3} on a (replicate, shard) mesh); every rank's piece is the full
    gradient at ``source.local_offsets()``."""
    c = _case(results, key)
    assert set(c["copies"]) == {2}
    assert c["groups"] == [[0, 2], [1, 3]]
    assert c["offset_mismatches"] == [0, 0]


@pytest.mark.multirank
def test_tp_ownership(tp_results):
    """TP-sharded parameters have one copy; the TP-replicated LayerNorm, row-parallel bias and
    the layers left out of tensor parallelism (implicit replicas over ``tp``) have two; the
    replica check compares the two TP ranks of each data-parallel coordinate."""
    c = _case(tp_results, "fsdp2-tp")
    copies = dict(zip(c["names"], c["copies"]))
    assert copies == {"inp.weight": 2, "inp.bias": 2, "norm.weight": 2, "norm.bias": 2, "up.weight": 1,
                      "up.bias": 1, "down.weight": 1, "down.bias": 2, "head.weight": 2}
    assert c["groups"] == [[0, 1], [2, 3]]


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["fsdp2-hsdp-double", "fsdp2-tp-double"])
def test_counting_a_replicated_dimension_twice_fails_the_comparison(hsdp_results, tp_results, key):
    """The mutation: ``inst.own`` patched so that every replica counts its whole copy. The
    reference comparison must reject it (so the tests above can fail)."""
    c = _case(tp_results if "-tp-" in key else hsdp_results, key)
    for rec, ref in zip(c["records"], c["ref_full"]):
        with pytest.raises(AssertionError):
            _check_against(StepRecord.from_dict(rec), ref, rtol=1e-5, exact=True)
    assert set(c["copies"]) == {1}


@pytest.mark.multirank
@pytest.mark.parametrize("key, coordinate", [("fsdp2-hsdp-corrupt", "mesh replicate=1, shard=1"),
                                             ("fsdp1-hybrid-orig-corrupt", "replica 1, shard 1"),
                                             ("fsdp2-tp-corrupt", "mesh dp=1, tp=1")])
def test_replica_check_names_global_rank_and_mesh_coordinate(hsdp_results, tp_results, key, coordinate):
    """Global rank 3 changes one element of a replicated piece (HSDP: a bias replicated over the
    replicate dimension; TP: the LayerNorm weight replicated over ``tp``) before distgrad
    reads it: the replica check names rank 3 on every step, and the warning its coordinate."""
    c = _case(tp_results if "-tp-" in key else hsdp_results, key)
    assert c["counters"]["replica_mismatch"] == 2
    for rec in c["records"]:
        assert rec["replica_mismatch_ranks"] == [3]
        assert rec["replica_mismatch_rank"] == 3
    assert any(f"global rank 3 ({coordinate})" in w for w in c["warnings"]), c["warnings"]


@pytest.mark.multirank
def test_nan_in_one_tp_shard_is_named_with_parameter_and_global_rank(tp_results):
    """Step 1: a NaN put into global rank 3's block of the column-parallel ``up.weight``."""
    c = _case(tp_results, "fsdp2-tp-nan")
    ok, bad = (StepRecord.from_dict(r) for r in c["records"])
    assert not ok.nonfinite and bad.nonfinite
    assert [x.to_dict() for x in bad.nonfinite_params] == [{"param": "up.weight", "rank": 3, "nan": 1, "inf": 0, "count": 1}]
    assert bad.nonfinite_ranks == [3]
    i = bad.params.names.index("up.weight")
    assert bad.params.nan[i] == 1 and sum(bad.params.nan) == 1
    # the NaN was written into a gradient after the backward: the forward replay of the step (on
    # every rank: its FSDP2 + tensor-parallel forward makes collectives) stays finite and says so
    assert bad.culprit_module.to_dict() == {"step": 1, "outcome": "finite", "rank": None, "module": None,
                                            "micro_batch": None}


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["ddp-subgroup", "fsdp2-submesh"])
def test_same_names_reduced_over_different_groups_are_refused(hsdp_results, key):
    """Two copies of one model on two halves of the job (DDP on each 2-rank group, FSDP2 on
    each ``dp`` sub-mesh): the same names held by different rank sets are separate tensors that
    distgrad would add; refused at instrument() with why and what to do."""
    msg = _case(hsdp_results, "refusals")[key]
    assert msg is not None and msg.startswith("ValueError")
    assert "'inp.weight' is held by ranks [0, 1]" in msg and "ranks [2, 3]" in msg
    assert "two separate tensors under one name" in msg and "give the parameters distinct names" in msg


# ---------------------------------------------------------------------------------------------
# pipeline parallel: torch.distributed.pipelining, 2 stages x 2-way DDP / FSDP2

PP = ["pp-ddp", "pp-fsdp2"]
PP_NAMES = ["inp.weight", "inp.bias"] + [f"blocks.{b}.{m}.{k}" for b in (0, 1) for m in (0, 1, 3)
                                         for k in ("weight", "bias")] + ["head.weight", "head.bias"]


@pytest.mark.multirank
@pytest.mark.parametrize("key", PP)
def test_pipeline_stages_report_the_whole_model(pp_results, key):
    """Each rank instruments only its stage's module; every rank's record covers all 16
    parameters of both stages under the user's names, in model order, and equals the full
    gradient gathered from the stages (reference A, both steps) and a float64 model over both
    data-parallel ranks' batches (reference B). The loss (observed on the last stage) is the
    model's mean loss. (Was: stage 0 alone reported as the model.)"""
    c = _case(pp_results, key)
    assert c["local_names"] == PP_NAMES[:8]  # rank 0 holds stage 0 only
    for step, (rec, ref) in enumerate(zip(c["records"], c["ref_full"])):
        rec = StepRecord.from_dict(rec)
        assert rec.step == step and rec.params.names == PP_NAMES
        _check_against(rec, ref, rtol=1e-5, exact=True)
    rec = StepRecord.from_dict(c["records"][0])
    _check_against(rec, c["ref_fp64_step0"], rtol=1e-5, exact=False)
    assert rec.loss == pytest.approx(c["ref_loss_step0"], rel=1e-6)
    assert c["counts"] == [{"collectives": 2, "syncs": 1}] * 2
    assert c["counters"]["internal_errors"] == 0 and c["counters"]["replica_mismatch"] == 0


@pytest.mark.multirank
def test_pipeline_ddp_replicas_split_within_their_stage(pp_results):
    """DDP inside each stage: each stage's parameters are counted half by each of its two
    replicas, and the replica check compares the ranks of one stage ({0, 1}, {2, 3}); counting
    both replicas (the mutation) fails the comparison."""
    c = _case(pp_results, "pp-ddp")
    assert c["copies"][:8] == [2] * 8 and c["groups"] == [[0, 1], [2, 3]]
    d = _case(pp_results, "pp-ddp-double")
    for rec, ref in zip(d["records"], d["ref_full"]):
        with pytest.raises(AssertionError):
            _check_against(StepRecord.from_dict(rec), ref, rtol=1e-5, exact=True)


@pytest.mark.multirank
def test_nan_in_one_pipeline_stage_is_named_with_parameter_and_global_rank(pp_results):
    """Step 1: a NaN put into global rank 3's FSDP2 shard of stage 1's ``blocks.1.1.weight``; rank
    0 (stage 0, which does not hold it) exports it under its name with rank 3."""
    c = _case(pp_results, "pp-fsdp2-nan")
    ok, bad = (StepRecord.from_dict(r) for r in c["records"])
    assert not ok.nonfinite and bad.nonfinite and bad.nonfinite_ranks == [3]
    assert c["records"][1]["nonfinite_params"] == [{"param": "blocks.1.1.weight", "rank": 3, "nan": 1, "inf": 0,
                                                     "count": 1}]
    # a stage cannot replay its forward without the others' activations: no module, and why
    assert bad.culprit_module.outcome == "model_parallel" and bad.culprit_module.module is None
