"""Update geometry (distgrad/signals/update.py) on 2 gloo ranks (one launch of
tests/dist/update_cases.py): under DDP with AdamW, SGD with momentum, Muon and Adafactor, FSDP2
with AdamW, SGD with momentum and Muon (rows of each matrix sharded) and DeepSpeed ZeRO-2 with its
AdamW and wrapped client SGD-momentum / Adafactor (flat fp32 partitions cutting rows, on which
Adafactor keeps an unfactored second moment), each record's applied-update RMS and update/weight
ratio per parameter, per layer and overall, the spectral norm's power iteration, Muon's step RMS per lr and
Adafactor's second-moment trace against float64 recomputations from the full weights gathered
before and after each optimizer step; and no collective or host sync beyond the step's own."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import launch
from tests.reference import case, spectral_reference, update_geometry_reference

KEYS = ["ddp-adamw", "ddp-sgd", "ddp-muon", "ddp-adafactor", "fsdp2-adamw", "fsdp2-sgd", "fsdp2-muon", "z2-adamw",
        "z2-sgd", "z2-adafactor"]


@pytest.fixture(scope="module")
def update_results(tmp_path_factory):
    return launch("update_cases.py", tmp_path_factory.mktemp("update") / "update.json")


@pytest.mark.parametrize("key", KEYS)
def test_update_geometry_multirank_matches_the_gathered_float64_update(update_results, key):
    from tests.dist.update_cases import STEPS

    c = case(update_results, key)
    assert update_results["world_size"] == 2 and c["internal_errors"] == 0
    assert c["steps"] == list(range(STEPS))
    # the sums ride in the next sampled step's SUM collective: still 2 collectives and 1 host copy
    assert c["counts"] == [{"collectives": 2, "syncs": 1}] * 3
    recs, weights = c["records"], c["weights"]
    assert recs[0] is None
    mats = [k for k, v in weights[0].items() if isinstance(v[0], list)]
    updates = [{k: (torch.tensor(weights[t + 1][k]) - torch.tensor(weights[t][k])) for k in mats}
               for t in range(STEPS - 1)]
    spectral = spectral_reference(updates, mats)
    for s, u in enumerate(recs[1:], start=1):
        t = u["step"]
        assert t == s - 1 and u["applied"]
        ref = update_geometry_reference(weights[t], weights[t + 1])
        for k, v in ref["param_rms"].items():
            assert u["param_update_rms"][k] == pytest.approx(v, rel=1e-5), k
            assert u["param_update_ratio"][k] == pytest.approx(ref["param_ratio"][k], rel=1e-5), k
        assert u["layer_update_rms"] == pytest.approx(ref["layer_rms"], rel=1e-5)
        assert u["layer_update_ratio"] == pytest.approx(ref["layer_ratio"], rel=1e-5)
        assert u["update_rms"] == pytest.approx(ref["rms"], rel=1e-5)
        assert u["update_ratio"] == pytest.approx(ref["ratio"], rel=1e-5)
        # the same power iteration in float64 on the full update matrices (float32 differences
        # of the weights carry ~1e-5 relative noise)
        assert u["param_update_spectral"] == pytest.approx(spectral[t], rel=1e-4)
        if key.endswith("-muon"):
            lr, wd = 2e-2, 0.1
            st = [torch.tensor(weights[t + 1][k], dtype=torch.float64)
                  - (1 - lr * wd) * torch.tensor(weights[t][k], dtype=torch.float64) for k in mats]
            rms = math.sqrt(sum(float(x.pow(2).sum()) for x in st) / sum(x.numel() for x in st)) / lr
            assert u["muon_rms_per_lr"] == pytest.approx(rms, rel=1e-4)
            assert u["muon_rms_ratio"] == pytest.approx(rms / 0.2, rel=1e-4)
        else:
            assert u["muon_rms_per_lr"] is None
        if key in ("ddp-adafactor", "z2-adafactor"):
            assert u["adafactor_trace"] == pytest.approx(c["traces"][t], rel=1e-6)
        else:
            assert u["adafactor_trace"] is None
