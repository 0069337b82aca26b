"""The gradient noise scale on 2 gloo ranks under DDP, DeepSpeed ZeRO-2 and ZeRO-3, FSDP1 and
FSDP2 (one launch of tests/dist/gns_cases.py): each step's |G_small|^2 (the micro-batch gradients of both ranks,
before the reduction) and |G_big|^2 (the reduced gradient) against float64 recomputations from
every rank's data, and B_simple against the known tr(C) / |G|^2 of the synthetic problem within
4 standard errors of its estimator, computed from the run."""

from __future__ import annotations


import numpy as np
import pytest

from tests.helpers import launch


from tests.closed_forms import known_covariance, ratio_and_stderr


@pytest.fixture(scope="module")
def gns_results(tmp_path_factory):
    return launch("gns_cases.py", tmp_path_factory.mktemp("gns") / "gns.json")


@pytest.mark.parametrize("key", ["ddp", "z2", "z3", "fsdp1", "fsdp2"])
def test_noise_scale_multirank(gns_results, key):
    from tests.dist.gns_cases import B, DECAY, GAS, STEPS

    case = gns_results["cases"][key]
    assert "error" not in case, case.get("traceback")
    world = gns_results["world_size"]
    assert world == 2 and case["internal_errors"] == 0
    assert case["steps"] == list(range(STEPS))
    # an opt-in signal that still costs nothing more than the step's 2 collectives and 1 host copy
    assert case["counts"] == [{"collectives": 2, "syncs": 1}] * 3
    recs = case["records"]
    n = GAS * world
    for rec, (small, big) in zip(recs, case["reference"]):
        assert (rec["micro_batches"], rec["small_batch"], rec["big_batch"]) == (n, B, n * B)
        np.testing.assert_allclose(rec["grad_sq_small"], small, rtol=1e-6)
        np.testing.assert_allclose(rec["grad_sq_big"], big, rtol=1e-6)
    g2 = np.array([r["true_grad_sq"] for r in recs])
    tr = np.array([r["noise_trace"] for r in recs])
    G, C, truth = known_covariance(10)
    assert abs(g2.mean() - float(G.pow(2).sum())) < 4 * g2.std() / np.sqrt(len(g2))
    assert abs(tr.mean() - float(C.sum())) < 4 * tr.std() / np.sqrt(len(tr))
    r, se = ratio_and_stderr(tr, g2)
    assert abs(r - truth) < 4 * se and se < 0.15 * truth, (r, truth, se)
    w = DECAY ** np.arange(len(g2) - 1, -1, -1)
    r_ema, se_ema = ratio_and_stderr(tr, g2, w)
    assert recs[-1]["noise_scale"] == pytest.approx(r_ema, rel=1e-9)
    assert abs(recs[-1]["noise_scale"] - truth) < 4 * se_ema, (recs[-1]["noise_scale"], truth, se_ema)


@pytest.mark.parametrize("key", ["z0-fp16", "z2-fp16", "z3-fp16"])
def test_noise_scale_deepspeed_fp16_divides_the_loss_scale_out(gns_results, key):
    """DeepSpeed fp16 (loss scale 2**8): under ZeRO 1-3 engine.backward scales the loss, so the
    hooked micro-batch gradients and the reduced pieces carry the scale; at ZeRO-0 neither does.
    It is divided out where present: the components match the float64 recomputation from the fp16
    inputs to fp16 precision (a scale left in, or divided out where absent, is off by 2**16)."""
    from tests.dist.gns_cases import FP16_STEPS

    case = gns_results["cases"][key]
    assert "error" not in case, case.get("traceback")
    assert case["internal_errors"] == 0 and case["steps"] == list(range(FP16_STEPS))
    assert case["loss_scale"] == [256.0] * FP16_STEPS
    for rec, (small, big) in zip(case["records"], case["reference"]):
        np.testing.assert_allclose(rec["grad_sq_small"], small, rtol=5e-3)
        np.testing.assert_allclose(rec["grad_sq_big"], big, rtol=5e-3)


@pytest.mark.parametrize("key", ["curv-z2", "curv-z3", "curv-fsdp2"])
def test_curvature_multirank(gns_results, key):
    """Curvature along the last update under ZeRO-2, ZeRO-3 and FSDP2 (2 ranks, AdamW, a
    quadratic loss): per layer and overall, the exact dtheta^T H dtheta / |dtheta|^2 from the
    gathered full weights (tests/test_curvature.py's reference), rtol 1e-5."""
    from tests.dist.gns_cases import CURV_STEPS

    case = gns_results["cases"][key]
    assert "error" not in case, case.get("traceback")
    assert case["internal_errors"] == 0
    assert case["steps"] == list(range(CURV_STEPS))
    assert case["counts"] == [{"collectives": 2, "syncs": 1}] * CURV_STEPS
    assert case["records"][0] is None  # no update before the first step
    for rec, (layer, total) in zip(case["records"][1:], case["reference"][1:]):
        assert sorted(rec["layer"]) == sorted(layer) == ["0", "1"]
        for k, v in layer.items():
            assert rec["layer"][k] == pytest.approx(v, rel=1e-5), (k, rec, layer)
        assert rec["total"] == pytest.approx(total, rel=1e-5)
