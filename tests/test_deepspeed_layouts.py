"""DeepSpeed beyond data parallelism, on 4 gloo CPU ranks (tests/dist/ds_layout_cases.py, one
launch): mixture of experts (``deepspeed.moe.layer.MoE``, 4 experts, ``ep_size`` 2, ZeRO-2),
where each expert's gradient is reduced only over its expert-data-parallel group, must be
exported exactly, every expert once under its global index (was: experts 2 and 3 missing, 0 and 1
mixing two ranks' experts); the ``PipelineEngine`` (2 stages x 2-way data parallel, ZeRO-0 and
ZeRO-1) reports the whole model on every rank (was: refused); what distgrad cannot vouch for
(MoE under ZeRO-0, a pipeline with tied layers) is refused at ``instrument()``."""

from __future__ import annotations

import pytest

from tests.helpers import launch
from distgrad.record import StepRecord
from tests.reference import case as _case, check_against as _check_against

pytestmark = pytest.mark.multirank
EXPERTS = [f"moe.deepspeed_moe.experts.deepspeed_experts.{e}.{m}.{k}" for e in range(4) for m in (0, 2)
           for k in ("weight", "bias")]


@pytest.fixture(scope="session")
def ds_layout_results(tmp_path_factory):
    return launch("ds_layout_cases.py", tmp_path_factory.mktemp("dsl") / "dsl.json", nproc=4)


def test_moe_experts_exported_once_under_global_index(ds_layout_results):
    """Every rank names its own 2 experts 0 and 1; the record holds experts 0-3 once each,
    equal to the full reduced gradient of that expert (reference A, both steps, 1e-5, extrema and
    counts exact), with 2 collectives and 1 host copy per sampled step."""
    c = _case(ds_layout_results, "moe-z2")
    assert ds_layout_results["world_size"] == 4
    for local in c["local_names"]:  # every rank's module names its two experts 0 and 1
        assert [n for n in local if "deepspeed_experts" in n] == EXPERTS[:8]
    assert c["names"] == ["inp.weight", "inp.bias", "moe.deepspeed_moe.gate.wg.weight", *EXPERTS,
                          "head.weight", "head.bias"]
    for step, (rec, ref) in enumerate(zip(c["records"], c["ref_full"])):
        rec = StepRecord.from_dict(rec)
        assert rec.step == step and rec.world_size == 4
        _check_against(rec, ref, rtol=1e-5, exact=True)
    assert c["counts"] == [{"collectives": 2, "syncs": 1}] * 2
    assert c["counters"]["internal_errors"] == 0


def test_moe_router_health_sums_every_rank_and_equals_float64(ds_layout_results):
    """router.enabled on the same run (ep_size 2, ZeRO-2, 4 ranks; the 2 collectives and 1 host
    copy above are with it on): the tokens per expert equal the float64 top-1 of every rank's
    gate inputs summed over ranks (exact), the entropy and l_aux the test's float64 / DeepSpeed's
    values, the imbalance max/mean of those counts."""
    c = _case(ds_layout_results, "moe-z2")
    for rec, ranks in zip(c["records"], c["router_ref"]):
        r = StepRecord.from_dict(rec).router
        fwd = [f for per_rank in ranks for f in per_rank]
        assert len(ranks) == 4 and len(fwd) == 4  # one forward per rank
        (layer,) = r.tokens
        counts = [sum(f["counts"][e] for f in fwd) for e in range(4)]
        n = sum(f["tokens"] for f in fwd)
        assert r.tokens[layer] == counts and sum(counts) == n == 4 * 6 and r.routed[layer] == n
        assert r.entropy[layer] == pytest.approx(sum(f["entropy"] for f in fwd) / n, rel=1e-6)
        assert r.imbalance[layer] == pytest.approx(max(counts) / (n / 4), rel=1e-12)
        assert r.layer_aux_loss[layer] == pytest.approx(sum(f["l_aux"] for f in fwd) / 4, rel=1e-6)
        assert r.aux_loss == pytest.approx(r.layer_aux_loss[layer], rel=1e-12)


def test_nan_in_one_expert_named_with_global_expert_and_rank(ds_layout_results):
    """Step 1: a NaN in global rank 3's ZeRO-2 fragment of one of its experts (expert-parallel
    rank 1, so a global expert 2 or 3): named with that expert's global name and rank 3."""
    c = _case(ds_layout_results, "moe-z2-nan")
    name = c["injected"][3]
    assert name is not None and (".deepspeed_experts.2." in name or ".deepspeed_experts.3." in name)
    ok, bad = (StepRecord.from_dict(r) for r in c["records"])
    assert not ok.nonfinite and bad.nonfinite and bad.nonfinite_ranks == [3]
    assert c["records"][1]["nonfinite_params"] == [{"param": name, "rank": 3, "nan": 1, "inf": 0, "count": 1}]


@pytest.mark.parametrize("key, words", [
    ("moe-z0", ["expert parallelism", "ZeRO stage 1 or 2, not 0", "Use ZeRO-2, or ep_size 1"]),
    ("pipeline-tied", ["PipelineEngine with tied layers ['w'] is not supported", "distgrad would add the copies",
                       "untie them"]),
])
def test_unsupported_deepspeed_layouts_refused_with_why_and_what_to_do(ds_layout_results, key, words):
    msg = _case(ds_layout_results, "refusals")[key]
    assert msg is not None
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("key", ["pipe-z0", "pipe-z1"])
def test_pipeline_engine_reports_the_whole_model(ds_layout_results, key):
    """Each rank's ``PipelineModule`` holds its stage's layers (rank 0: layers 0 and 2); the record
    holds both stages' parameters under their global layer names and equals the full gradient
    gathered from both stages (reference A, both steps), with 2 collectives and 1 host copy per
    step. ZeRO-0: each stage's two data-parallel replicas split its parameters and are compared."""
    c = _case(ds_layout_results, key)
    assert c["local_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert c["names"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    for step, (rec, ref) in enumerate(zip(c["records"], c["ref_full"])):
        rec = StepRecord.from_dict(rec)
        assert rec.step == step
        _check_against(rec, ref, rtol=1e-5, exact=True)
    assert c["counts"] == [{"collectives": 2, "syncs": 1}] * 2
    assert c["counters"]["internal_errors"] == 0 and c["counters"]["replica_mismatch"] == 0
    if key == "pipe-z0":
        assert c["copies"][:4] == [2] * 4 and c["groups"] == [[0, 1], [2, 3]]


def test_pipeline_engine_counting_both_replicas_fails_the_comparison(ds_layout_results):
    """The mutation (``inst.own`` patched so that each ZeRO-0 replica counts its whole copy) must
    be rejected by the reference comparison, so the test above can fail."""
    c = _case(ds_layout_results, "pipe-z0-double")
    for rec, ref in zip(c["records"], c["ref_full"]):
        with pytest.raises(AssertionError):
            _check_against(StepRecord.from_dict(rec), ref, rtol=1e-5, exact=True)
