"""The underflow signal on 2 gloo ranks (one launch of tests/dist/underflow_cases.py): under DDP
with fp16 autocast and under DeepSpeed ZeRO-2 fp16, each step's per-layer lost and genuinely-zero
ratios equal the sums over both ranks of the float64 recomputation of each rank's first
micro-batch against the training-precision backward of the same micro-batch, and the sampled
step keeps its 2 collectives and 1 host copy."""

from __future__ import annotations

import pytest

from tests.helpers import launch


@pytest.fixture(scope="module")
def underflow_results(tmp_path_factory):
    return launch("underflow_cases.py", tmp_path_factory.mktemp("underflow") / "underflow.json")


@pytest.mark.parametrize("key", ["ddp", "z2"])
def test_underflow_multirank_equals_float64_recomputation_over_the_ranks(underflow_results, key):
    from tests.dist.underflow_cases import STEPS

    assert underflow_results["world_size"] == 2
    ranks = underflow_results["cases"][key]["ranks"]
    for r in ranks:
        assert "error" not in r, r.get("traceback")
        assert r["internal_errors"] == 0
    r0 = ranks[0]
    assert [c["collectives"] for c in r0["counts"]] == [2] * STEPS
    assert r0["counts"][1:] == [{"collectives": 2, "syncs": 1}] * (STEPS - 1)
    for s, rec in enumerate(r0["records"]):
        assert rec is not None and rec["step"] == s
        layers = set(ranks[0]["refs"][s])
        assert set(rec["lost"]) == layers
        for layer in layers:
            lost, zero, n = (sum(r["refs"][s][layer][i] for r in ranks) for i in range(3))
            assert rec["lost"][layer] == lost / n, (s, layer)
            assert rec["zero"][layer] == zero / n, (s, layer)
    print(key, [(rec["total_lost"], rec["loss_scale"], rec["worst"]) for rec in r0["records"]])
