"""The logit precursors, the FP8 scaling health and (FSDP2) the MoE router health on 2 gloo
ranks under DeepSpeed ZeRO-2 and FSDP2 (one launch of tests/dist/logits_cases.py): each step's
per-layer, per-head maximum attention logit equals the max over both ranks and both micro-batches
of the float64 recomputation, the output z statistics the float64 ones over every position of
both ranks, and the sampled step keeps its 2 collectives and 1 host copy."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import launch


@pytest.fixture(scope="module")
def logits_results(tmp_path_factory):
    return launch("logits_cases.py", tmp_path_factory.mktemp("logits") / "logits.json")


def _clean_ranks(results: dict, key: str, steps: int) -> list[dict]:
    """The ranks' results of case ``key``, after checking that every rank ran without error or
    internal error, and that rank 0's sampled steps each made 2 collectives and, from the second
    step on, 1 host copy (the first step under ZeRO-2 also has the one-time host reads of
    distgrad's set-up on this engine: 66 here, the same with the signals off)."""
    ranks = results["cases"][key]["ranks"]
    for r in ranks:
        assert "error" not in r, r.get("traceback")
        assert r["internal_errors"] == 0
    assert ranks[0]["counts"][0]["collectives"] == 2
    assert ranks[0]["counts"][1:] == [{"collectives": 2, "syncs": 1}] * (steps - 1)
    return ranks


@pytest.mark.parametrize("key", ["z2", "fsdp2"])
def test_logits_multirank_equal_float64_over_the_global_batch(logits_results, key):
    from tests.dist.logits_cases import STEPS

    assert logits_results["world_size"] == 2
    ranks = _clean_ranks(logits_results, key, STEPS)
    r0 = ranks[0]
    for s, rec in enumerate(r0["records"]):
        refs = [r["refs"][s] for r in ranks]
        assert rec is not None
        for layer in ("0", "1"):
            ref = np.max([ref["heads"][layer] for ref in refs], axis=0)
            np.testing.assert_allclose(rec["attention_head_max"][layer], ref, rtol=1e-5, atol=1e-6)
            assert rec["attention_max"][layer] == pytest.approx(float(ref.max()), rel=1e-5)
        z = np.concatenate([ref["z"] for ref in refs])
        assert rec["positions"] == z.size
        assert rec["z_mean"] == pytest.approx(z.mean(), rel=1e-6)
        assert rec["z_sq_mean"] == pytest.approx((z * z).mean(), rel=1e-6)
        assert rec["z_max"] == pytest.approx(z.max(), rel=1e-6)
        assert rec["output_abs_max"] == pytest.approx(max(ref["heads"]["abs_max"] for ref in refs), rel=1e-6)


@pytest.mark.parametrize("key", ["fp8_z2", "fp8_fsdp2"])
def test_fp8_multirank_equal_float64_over_both_ranks(logits_results, key):
    """FP8 scaling health (tests/dist/fp8_cases.py): per float8 layer and tensor, the amax and
    scale extremes over both ranks' micro-batches, the underflow / saturation counts summed over
    them, against the float64 references each rank made from the tensors its layers cast; under
    FSDP2 with fp8.tp_size 2 the amax disagreement is max/min over the ranks of each rank's
    largest amax; 2 collectives and 1 host copy per sampled step."""
    pytest.importorskip("torchao")
    from tests.dist.fp8_cases import GAS, STEPS

    ranks = _clean_ranks(logits_results, key, STEPS)
    r0 = ranks[0]
    for s, rec in enumerate(r0["records"]):
        assert rec is not None and rec["tp_size"] == (2 if key == "fp8_fsdp2" else 1)
        keys = set(ranks[0]["refs"][s])
        assert len(keys) == 12 and {k.split("|")[0] for k in keys} == set(rec["stats"])
        for k in keys:
            name, role = k.split("|")
            per_rank = [r["refs"][s][k] for r in ranks]
            refs = [m for pr in per_rank for m in pr]
            st = rec["stats"][name][role]
            assert st["observed"] == len(refs) == 2 * GAS
            for c in ("elements", "underflow", "saturated"):
                assert st[c] == sum(m[c] for m in refs), (k, c)
            assert st["amax_min"] == pytest.approx(min(m["amax_min"] for m in refs), rel=1e-6)
            assert st["amax_max"] == pytest.approx(max(m["amax_max"] for m in refs), rel=1e-6)
            assert st["scale_min"] == pytest.approx(min(m["scale_min"] for m in refs), rel=1e-6)
            assert st["scale_max"] == pytest.approx(max(m["scale_max"] for m in refs), rel=1e-6)
            if key == "fp8_fsdp2":
                hi = [max(m["amax_max"] for m in pr) for pr in per_rank]
                assert st["amax_disagreement"] == pytest.approx(max(hi) / min(hi), rel=1e-6)
                if role == "input" and name == "blocks.0.up":  # rank 1's inputs are 2-4x larger
                    assert st["amax_disagreement"] > 1.2
            else:
                assert "amax_disagreement" not in st


def test_router_fsdp2_equal_float64_over_both_ranks(logits_results):
    """MoE router health under FSDP2 (tests/dist/router_cases.py: a tiny Hugging Face Mixtral,
    each decoder layer an FSDP2 unit, 2 ranks with their own data): per layer the tokens per
    expert equal the float64 top-k counts of both ranks' micro-batches summed (exact integers),
    the entropy the float64 softmax entropy summed over both ranks over their tokens, imbalance and
    coefficient of variation those of the counts, the auxiliary loss the mean of the model's own
    ``aux_loss`` over the four forwards; 2 collectives and 1 host copy per sampled step."""
    from distgrad.signals.router import RouterHealth
    from tests.dist.router_cases import GAS, STEPS

    ranks = _clean_ranks(logits_results, "router_fsdp2", STEPS)
    r0 = ranks[0]
    assert len(r0["records"]) == STEPS
    for s, rec in enumerate(r0["records"]):
        part = RouterHealth.Part.from_dict(rec)
        fwd = [m for r in ranks for m in r["refs"][s]]
        assert len(fwd) == 2 * GAS
        assert set(part.tokens) == {"0", "1"}
        for layer in ("0", "1"):
            counts = np.sum([m["layers"][layer]["counts"] for m in fwd], axis=0)
            n = sum(m["layers"][layer]["tokens"] for m in fwd)
            assert part.tokens[layer] == counts.tolist()  # exact integers
            assert part.routed[layer] == n and counts.sum() == 2 * n  # top-2
            assert part.entropy[layer] == pytest.approx(sum(m["layers"][layer]["entropy"] for m in fwd) / n, rel=1e-6)
            assert part.imbalance[layer] == pytest.approx(counts.max() / counts.mean(), rel=1e-12)
            assert part.cv[layer] == pytest.approx(counts.std() / counts.mean(), rel=1e-12)
            assert part.dead[layer] == []
        assert part.aux_loss == pytest.approx(np.mean([m["aux_loss"] for m in fwd]), rel=1e-6)
    # the ranks saw different tokens: the sums are over both, not one rank's twice
    assert r0["refs"][0][0]["layers"]["0"]["counts"] != ranks[1]["refs"][0][0]["layers"]["0"]["counts"]


def test_router_dead_experts_fsdp2_judged_on_the_job_s_tokens(logits_results):
    """Dead experts under FSDP2 on 2 ranks (tests/dist/router_cases.py ``router_dead_fsdp2``: a
    tiny DeepSeek-V3, both ranks' balancing bias starving expert 1 of layer 0, each rank starving
    another expert of layer 1): per step the tokens per expert equal the float64 top-1 counts of
    both ranks summed (exact), and the dead experts (the record and the served per-layer count)
    equal those counted from the summed float64 counts over router.dead_after steps: expert 1 of
    layer 0 from the second step on, none in layer 1, although each rank alone never fed one of
    layer 1's experts; 2 collectives and 1 host copy per sampled step."""
    from distgrad.signals.router import RouterHealth
    from tests.dist.router_cases import DEAD_AFTER, DEAD_STEPS
    from tests.test_router import dead_from_counts

    ranks = _clean_ranks(logits_results, "router_dead_fsdp2", DEAD_STEPS)
    summed = [{lay: np.sum([r["refs"][s][lay] for r in ranks], axis=0) for lay in ("0", "1")}
              for s in range(DEAD_STEPS)]
    dead = dead_from_counts(summed, DEAD_AFTER)
    for s, rec in enumerate(ranks[0]["records"]):
        part = RouterHealth.Part.from_dict(rec)
        assert part.tokens == {lay: c.tolist() for lay, c in summed[s].items()}
        assert part.dead == dead[s]
        assert RouterHealth.samples(part)["distgrad_router_layer_dead_experts"] == {
            lay: float(len(e)) for lay, e in dead[s].items()}
    assert dead[0] == {"0": [], "1": []} and all(d == {"0": [1], "1": []} for d in dead[DEAD_AFTER - 1:]), dead
    # each rank alone starved an expert of layer 1 on every step (rank 0 expert 3, rank 1 expert 2)
    for r, e in zip(ranks, (3, 2)):
        assert all(step["1"][e] == 0 for step in r["refs"]), r["refs"]
