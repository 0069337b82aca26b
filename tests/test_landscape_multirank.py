"""distgrad.report.landscape on 2 gloo ranks (tests/dist/landscape_cases.py, one launch): under DDP,
FSDP2 and DeepSpeed ZeRO-3 (persistent and gathered parameters) the 1-D and 2-D slices equal the
one-process slice of the gathered full weights over every rank's batches (same seed), the local
weight shards are bit-identical afterwards, and the slices make one all-reduce per grid point
(plus one at set-up when parameters are sharded)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import launch

CASES = ("ddp", "fsdp2", "zero3", "zero3-gathered")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("landscape_cases.py", tmp_path_factory.mktemp("landscape") / "landscape.json")


@pytest.mark.parametrize("kind", CASES)
def test_slice_equals_single_process(results, kind):
    r = results[kind]
    assert "error" not in r, r.get("error")
    assert r["n_params"] == 15  # TinyModel's trainable parameters, the tied head counted once
    for got, want in ((r["r1"], r["f1"]), (r["r2"], r["f2"])):
        assert got["alphas"] == want["alphas"] and got["betas"] == want["betas"]
        np.testing.assert_allclose(np.asarray(got["loss"]), np.asarray(want["loss"]), rtol=1e-5, atol=0)
        assert got["center"] == pytest.approx(want["center"], rel=1e-5)
        assert got["world"] == 2 and want["world"] == 1
    # the slice moves the loss: the directions are not zero on this model
    assert np.ptp(np.asarray(r["r1"]["loss"])) > 1e-3


@pytest.mark.parametrize("kind", CASES)
def test_weights_restored_and_collectives(results, kind):
    r = results[kind]
    assert "error" not in r, r.get("error")
    assert r["identical"]
    assert r["loss_after"] == r["loss_before"]
    setup = 0 if kind == "ddp" else 2  # one filter-norm all-reduce per slice call
    assert r["all_reduce"] == r["points"] + setup
