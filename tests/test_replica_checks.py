"""The data-parallel replica checks (issue #26 items 5 and 2): ranks training on the same data
(distgrad/signals/duplicate_data.py) and replica weight hashes (distgrad/signals/weight_hash.py).

Multi-rank (tests/dist/replica_cases.py on gloo: a 2-rank and a 3-rank DDP launch, a 4-rank HSDP one): a loader
that does not shard is flagged after ``duplicate_data.steps`` sampled steps with both ranks named,
a sharded one never is, each against the per-rank losses the ranks saw; a bit flipped in one
weight on rank 2 after an optimizer step is caught at the next hash step with that rank and that
parameter, against the weights all-gathered and compared element for element, and written to the
flight recorder; no flag before it; both within the step's 2 collectives and 1 host copy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from distgrad.signals.duplicate_data import SameDataStreaks
from distgrad.signals.weight_hash import is_hash_step
from tests.helpers import launch


def test_hash_steps_are_the_first_sampled_step_of_each_window():
    """Against the definition by enumeration: per window [k N, (k+1) N) the smallest sampled step."""
    for n, s in itertools.product((1, 3, 4, 10), (1, 2, 3, 7)):
        sampled = [t for t in range(200) if t % s == 0]
        want = {min(t for t in sampled if t // n == k) for k in {t // n for t in sampled}}
        assert {t for t in sampled if is_hash_step(t, n, s)} == want, (n, s)


def _brute(losses: np.ndarray, groups, k: int) -> list[list[list[int]]]:
    """Reference for SameDataStreaks: at each step, the sets of >= 2 ranks of one group whose
    (mean, max) losses were equal to each other on each of their last k informative steps (a
    step on which the pair of a rank differs from its previous step's), recomputed per step
    from the whole history by brute force over subsets."""
    T = losses.shape[0]
    out = []
    for t in range(T):
        found = set()
        for g in groups:
            for size in range(len(g), 1, -1):
                for sub in itertools.combinations(g, size):
                    if any(set(sub) <= set(f) for f in found):
                        continue
                    a = sub[0]
                    if not all(np.isfinite(losses[t, r]).all() for r in sub):
                        continue
                    # informative steps of rank a up to t (all ranks of sub move together when equal)
                    info, ok = [], True
                    for u in range(t, -1, -1):
                        if not all((losses[u, r] == losses[u, a]).all() for r in sub):
                            ok = False
                            break
                        if u == 0 or not (losses[u, a] == losses[u - 1, a]).all():
                            info.append(u)
                        if len(info) == k:
                            break
                    if ok and len(info) == k:
                        found.add(sub)
        out.append(sorted([list(f) for f in found]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_same_data_streaks_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    T, W, k = 12, 4, 3
    losses = rng.integers(0, 3, size=(T, W, 2)).astype(np.float64)  # few values: many coincidences
    if seed % 2:
        losses[:, 1] = losses[:, 3]  # ranks 1 and 3 on the same data
    streaks = SameDataStreaks([list(range(W))], W, k)
    got = [streaks.observe(t, losses[t, :, 0], losses[t, :, 1]) for t in range(T)]
    want = _brute(losses, [list(range(W))], k)
    # the streak's running intersection also flags a set that held on the last k informative
    # steps of its own ranks; compare on the ranks flagged
    assert [sorted({r for g in x for r in g}) for x in got] == [sorted({r for g in x for r in g}) for x in want]


def test_same_data_streaks_ignore_a_loss_that_does_not_move_and_other_groups():
    s = SameDataStreaks([[0, 1], [2, 3]], 4, 2)
    const = [2.5, 2.5, 1.0, 2.0]
    for t in range(5):  # ranks 0 and 1 share a constant loss (a zero-initialised head): no information
        assert s.observe(t, const, const) == []
    # ranks 1 and 2 equal but in different data-parallel groups (e.g. tensor-parallel peers): never
    assert s.observe(5, [1.0, 3.0, 3.0, 4.0], [1.0, 3.0, 3.0, 4.0]) == []
    assert s.observe(6, [1.5, 3.5, 3.5, 4.5], [1.5, 3.5, 3.5, 4.5]) == []
    assert s.observe(7, [9.0, 9.0, 0.0, 1.0], [9.0, 9.0, 0.0, 1.0]) == []
    assert s.observe(8, [8.0, 8.0, 0.5, 1.5], [8.0, 8.0, 0.5, 1.5]) == [[0, 1]]
    assert s.observe(9, [8.0, 8.0, 0.5, 1.5], [8.0, 8.0, 0.5, np.nan]) == [[0, 1]]  # no move: kept
    assert s.observe(10, [7.0, 7.5, 0.5, 1.5], [7.0, 7.5, 0.5, 1.5]) == []  # they differ: reset


@pytest.fixture(scope="module")
def dup():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        return launch("replica_cases.py", Path(d) / "dup.json", "--cases", "dup-unsharded,dup-sharded", nproc=2)


def test_unsharded_loader_is_flagged_with_both_ranks_and_sharded_never(dup):
    from tests.dist.replica_cases import DUP_K, DUP_STEPS

    for key in ("dup-unsharded", "dup-sharded"):
        ranks = dup["cases"][key]["ranks"]
        assert all("error" not in r for r in ranks), ranks[0].get("traceback")
        r0 = ranks[0]
        assert r0["internal_errors"] == 0
        # every rank's record agrees (decided from the reduced values)
        assert all(r["parts"] == r0["parts"] for r in ranks)
        # reference: the losses each rank computed, compared bit for bit
        same = [ranks[0]["losses"][s] == ranks[1]["losses"][s] for s in range(DUP_STEPS)]
        assert all(same) if key == "dup-unsharded" else not any(same)
        want = [[[0, 1]] if key == "dup-unsharded" and s >= DUP_K - 1 else [] for s in range(DUP_STEPS)]
        assert [p["groups"] for p in r0["parts"]] == want
        assert [p["ranks"] for p in r0["parts"]] == [[r for g in w for r in g] for w in want]
        if key == "dup-unsharded":
            assert {p["first_step"] for p in r0["parts"][DUP_K - 1:]} == {DUP_K - 1}
        # no collective or host copy of its own
        assert r0["counts"] == [{"collectives": 2, "syncs": 1}] * DUP_STEPS


@pytest.fixture(scope="module")
def flip(tmp_path_factory):
    d = tmp_path_factory.mktemp("replica")
    return launch("replica_cases.py", d / "flip.json", "--cases", "flip", "--frdir", str(d / "fr"), nproc=3)


def test_weight_bit_flip_is_caught_at_the_next_hash_step_with_rank_and_parameter(flip):
    from tests.dist.replica_cases import (
        FLIP_AFTER,
        FLIP_PARAM,
        FLIP_RANK,
        FLIP_STEPS,
        HASH_EVERY,
    )

    ranks = flip["cases"]["flip"]["ranks"]
    assert all("error" not in r for r in ranks), ranks[0].get("traceback")
    r0 = ranks[0]
    assert flip["world_size"] == 3 and r0["internal_errors"] == 0
    assert all(r["parts"] == r0["parts"] for r in ranks)
    # reference: the weights all-gathered at each boundary, compared element for element
    assert r0["differ"] == [[] if s <= FLIP_AFTER else [FLIP_PARAM] for s in range(FLIP_STEPS)]
    caught = next(s for s in range(FLIP_AFTER + 1, FLIP_STEPS) if s % HASH_EVERY == 0)
    for s, part in enumerate(r0["parts"]):
        assert part["hash_step"] == s - s % HASH_EVERY and part["checked_ranks"] == [0, 1, 2]
        if s < caught:  # healthy until then: never flagged
            assert (part["mismatch_ranks"], part["mismatch_params"], part["mismatch_rank"]) == ([], [], -1), s
        else:
            assert part["mismatch_ranks"] == [FLIP_RANK] and part["mismatch_rank"] == FLIP_RANK
            assert part["mismatch_params"] == r0["differ"][caught] and part["n_mismatch_params"] == 1
    # the gradients stay identical after the all-reduce: the gradient fingerprint cannot see it
    assert r0["grad_mismatch"] == [[]] * FLIP_STEPS
    # written to the flight recorder once, at the hash step that caught it
    assert [s for s, p in enumerate(r0["reports"]) if p] == [caught]
    assert r0["files"] == [f"flightrec-step{caught}-replica_weights.json", f"flightrec-step{caught}-replica_weights.txt"]
    assert r0["counts"] == [{"collectives": 2, "syncs": 1}] * FLIP_STEPS


def _record(step: int, **parts):
    from distgrad.record import ParamStats, StepRecord

    p = ParamStats(["w"], numel=[2], sum=[0.0], sumsq=[2.0], nan=[0], inf=[0], zeros=[0], min=[-1.0], max=[1.0])
    rec = StepRecord(step, step, 0.0, 3, p, float(np.sqrt(2.0)))
    for k, v in parts.items():  # the signals' parts (the signal contract: attributes, not fields)
        setattr(rec, k, v)
    return rec


def test_report_findings_name_the_ranks_and_parameters():
    """distgrad summary's FINDINGS: the first flagged step of each check, from the records alone."""
    from distgrad.report.signals import SignalsAccumulator, summary_lines
    from distgrad.signals.duplicate_data import DuplicateDataSignal
    from distgrad.signals.weight_hash import WeightHash

    acc = SignalsAccumulator()
    ok = WeightHash.Part(interval=5, hash_step=0, checked_ranks=[0, 1, 2])
    bad = WeightHash.Part(interval=5, hash_step=10, checked_ranks=[0, 1, 2], mismatch_ranks=[2],
                         mismatch_params=["blocks.1.1.weight"], n_mismatch_params=1, mismatch_rank=2)
    for s in range(15):
        dup = DuplicateDataSignal.Part(streak=3, groups=[[0, 1]] if s >= 7 else [], ranks=[0, 1] if s >= 7 else [],
                            first_step=7 if s >= 7 else None)
        acc.add(_record(s, duplicate_data=dup, replica_weights=bad if s >= 10 else ok))
    rep = acc.result()
    found = {f.kind: f for f in rep.findings}
    assert set(found) == {"duplicate_data", "replica_weights"}
    assert found["duplicate_data"].step == 7 and "ranks 0, 1 " in found["duplicate_data"].detail
    assert found["replica_weights"].step == 10 and "rank(s) 2 " in found["replica_weights"].detail
    assert "blocks.1.1.weight" in found["replica_weights"].detail
    lines = summary_lines(rep)
    assert lines[0].startswith("FINDINGS (2;")
    healthy = SignalsAccumulator()
    for s in range(15):
        healthy.add(_record(s, duplicate_data=DuplicateDataSignal.Part(streak=3), replica_weights=ok))
    assert healthy.result().findings == [] and summary_lines(healthy.result()) == []


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    return launch("replica_cases.py", tmp_path_factory.mktemp("hsdp") / "hsdp.json", "--cases", "hsdp", nproc=4)


def test_hsdp_compares_the_replicas_of_the_same_shard(hsdp):
    """HSDP on a ("replicate", "shard") 2 x 2 mesh: each rank hashes its own shard and is compared
    with the rank holding the same shard (groups [0, 2] and [1, 3]), never with the other shard
    (which differs: comparing it would flag every healthy step). A bit flipped in rank 3's shard is
    caught at the next hash step with that parameter; with two replicas per shard there is no
    majority, so the higher rank of the pair is named (here the one that flipped). The data is
    sharded over both dimensions: the duplicate-data check, which covers this all-data-parallel
    mesh, stays silent."""
    from tests.dist.replica_cases import (
        FLIP_AFTER,
        FLIP_PARAM,
        FLIP_RANK_HSDP,
        FLIP_STEPS,
        HASH_EVERY,
    )

    ranks = hsdp["cases"]["hsdp"]["ranks"]
    assert all("error" not in r for r in ranks), ranks[0].get("traceback")
    r0 = ranks[0]
    assert hsdp["world_size"] == 4 and r0["internal_errors"] == 0 and r0["groups"] == [[0, 2], [1, 3]]
    assert all(r["parts"] == r0["parts"] for r in ranks)
    # reference: the local shards all-gathered and compared within each replica group
    assert r0["differ"] == [[] if s <= FLIP_AFTER else [FLIP_PARAM] for s in range(FLIP_STEPS)]
    caught = next(s for s in range(FLIP_AFTER + 1, FLIP_STEPS) if s % HASH_EVERY == 0)
    for s, part in enumerate(r0["parts"]):
        rw = part["replica_weights"]
        assert rw["hash_step"] == s - s % HASH_EVERY and rw["checked_ranks"] == [0, 1, 2, 3]
        want = ([], []) if s < caught else ([FLIP_RANK_HSDP], r0["differ"][caught])
        assert (rw["mismatch_ranks"], rw["mismatch_params"]) == want, s
        assert part["duplicate_data"]["groups"] == []


def test_data_parallel_groups_skip_layouts_with_peers_that_share_data():
    """Only ranks known to be data-parallel replicas are compared: tensor-parallel peers (an FSDP2
    mesh with a 'tp' dimension) and pipeline / expert layouts are skipped with the reason."""
    from types import SimpleNamespace as NS

    from distgrad.signals.duplicate_data import data_parallel_groups

    def inst(engine, mesh=None, job=None, world=4):
        return NS(world_size=world, job=job, source=NS(engine_name=engine, mesh=mesh))

    assert data_parallel_groups(inst("ddp")) == ([[0, 1, 2, 3]], "")
    assert data_parallel_groups(inst("fsdp2", NS(ndim=2, mesh_dim_names=("replicate", "shard"))))[0] == [[0, 1, 2, 3]]
    groups, why = data_parallel_groups(inst("fsdp2", NS(ndim=2, mesh_dim_names=("dp", "tp"))))
    assert groups is None and "tensor" in why
    groups, why = data_parallel_groups(inst("deepspeed", job=object()))
    assert groups is None and "pipeline" in why
    assert data_parallel_groups(inst("ddp", world=1))[0] is None
