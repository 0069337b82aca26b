"""The underflow signal on 2 gloo ranks (one launch of tests/dist/underflow_cases.py): under DDP
with fp16 autocast, under DeepSpeed ZeRO-2 and ZeRO-3 fp16 and under FSDP2 with an fp16
``MixedPrecisionPolicy`` or with fp16 autocast, each recomputed step's per-layer lost and genuinely-zero ratios equal
the sums over both ranks of the float64 recomputation of each rank's first micro-batch against
the training-precision backward of the same micro-batch (under FSDP2 and ZeRO-3 on a plain
decoder built from the full parameters), and the sampled step keeps its 2 collectives and 1
host copy; an FSDP2 / ZeRO-3 recomputation step adds exactly one collective (the parameters'
all-gather)."""

from __future__ import annotations

import pytest

from tests.helpers import launch


@pytest.fixture(scope="module")
def underflow_results(tmp_path_factory):
    return launch("underflow_cases.py", tmp_path_factory.mktemp("underflow") / "underflow.json")


def _ranks(results: dict, key: str) -> list[dict]:
    """The per-rank results of one case of the 2-rank launch; fails on a rank that raised or
    counted an internal error."""
    assert results["world_size"] == 2
    ranks = results["cases"][key]["ranks"]
    for r in ranks:
        assert "error" not in r, r.get("traceback")
        assert r["internal_errors"] == 0
    return ranks


def _assert_reference(rec: dict | None, ranks: list[dict], measured: int, s: int) -> None:
    """Step ``s``'s record serves recomputation step ``measured``: its per-layer lost and zero
    ratios equal the sums over the ranks of their float64 reference counts ``[lost, zero,
    elements]`` of that step, exactly, and it names the same layers."""
    assert rec is not None and rec["step"] == measured
    layers = set(ranks[0]["refs"][measured])
    assert set(rec["lost"]) == layers
    for layer in layers:
        lost, zero, n = (sum(r["refs"][measured][layer][i] for r in ranks) for i in range(3))
        assert rec["lost"][layer] == lost / n, (s, layer)
        assert rec["zero"][layer] == zero / n, (s, layer)


@pytest.mark.parametrize("key", ["ddp", "z2", "fsdp2_autocast"])
def test_underflow_multirank_equals_float64_recomputation_over_the_ranks(underflow_results, key):
    from tests.dist.underflow_cases import STEPS

    ranks = _ranks(underflow_results, key)
    r0 = ranks[0]
    n = 3 if key == "fsdp2_autocast" else 2  # FSDP2 recomputes every step here: + its one all-gather
    assert [c["collectives"] for c in r0["counts"]] == [n] * STEPS
    assert r0["counts"][1:] == [{"collectives": n, "syncs": 1}] * (STEPS - 1)
    for s, rec in enumerate(r0["records"]):
        _assert_reference(rec, ranks, s, s)
    print(key, [(rec["total_lost"], rec["loss_scale"], rec["worst"]) for rec in r0["records"]])


@pytest.mark.parametrize("key", ["fsdp2", "z3"])
def test_underflow_sharded_gathers_once_and_equals_float64_recomputation(underflow_results, key):
    """FSDP2 (fp16 param_dtype, uneven shards) and DeepSpeed ZeRO-3 (fp16, dynamic loss scale,
    odd sizes: padded partitions): on the recomputation steps (0, 2, 4) the ratios equal the
    float64 reference summed over the ranks, with 3 collectives (the SUM and MAX all-reduces and
    one all-gather of the parameters); on the sampled steps that do not recompute (1, 3) 2
    collectives, and they serve the last measurement; 1 host copy on every step after the first.
    Some layer loses elements on every recomputation: the counts are not trivially zero. FSDP2's
    step 4 is refused by rank 1 alone (it clipped): both ranks still make its 3 collectives (the
    all-gather runs in PackedSignal.exchange, pieces or not; gathered inside local() the ranks'
    collectives would not match), every rank drops the step (step 2's measurement stays
    served) and neither keeps the gathered copy."""
    from tests.dist.underflow_cases import FSDP2_CLIPPED, FSDP2_INTERVAL, FSDP2_STEPS, Z3_STEPS

    ranks = _ranks(underflow_results, key)
    r0 = ranks[0]
    steps = FSDP2_STEPS if key == "fsdp2" else Z3_STEPS
    recomputed = [s for s in range(steps) if s % FSDP2_INTERVAL == 0]
    assert recomputed == ([0, 2, 4] if key == "fsdp2" else [0, 2])
    dropped = {FSDP2_CLIPPED} if key == "fsdp2" else set()
    # underflow.max_gather_bytes: one byte below the plain decoder's 4 * numel refused at instrument(),
    # exactly it accepted (the run below)
    for r in ranks if key == "fsdp2" else ():
        assert r["refused"] is not None and "underflow.max_gather_bytes" in r["refused"], r["refused"]
        assert f"is {r['full_bytes']} bytes" in r["refused"]
        # HSDP ((replicate, shard) mesh): refused at instrument(), naming the placements
        assert r["hsdp_refused"] is not None and "2-D mesh" in r["hsdp_refused"], r["hsdp_refused"]
        assert r["refused_steps"] == {"clipped": 1} and r["copy_dropped"]
    for r in ranks:
        assert [c["collectives"] for c in r["counts"]] == [3 if s in recomputed else 2 for s in range(steps)]
    assert [c["syncs"] for c in r0["counts"][1:]] == [1] * (steps - 1)
    for s, rec in enumerate(r0["records"]):
        measured = max(m for m in recomputed if m <= s and m not in dropped)
        _assert_reference(rec, ranks, measured, s)
        assert max(rec["lost"].values()) > (0.5 if key == "fsdp2" else 0.0)
    print(key, [(rec["total_lost"], rec["loss_scale"], rec["worst"]) for rec in r0["records"]])
