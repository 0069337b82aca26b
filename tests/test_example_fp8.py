"""The example job's ``--fp8`` model (launch/train.py ``to_float8``: the blocks' linears as torchao
float8 layers, emulated on the CPU) with ``fp8.enabled`` as README's "The example job" says, on
one process: every float8 layer is observed, labelled with its block, and each layer's and
tensor's amax, scale and underflow count equal the float64 reference of the casts captured by
hooks another way (tests/fp8_models.py). The 2-rank DeepSpeed run of the same flags is in the
README's trial, not repeated here (float8 emulation makes a step ~6 s on the shared CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao.float8")

import distgrad  # noqa: E402
from tests.fp8_models import DTYPES, capture, reference  # noqa: E402
from tests.helpers import example_step, example_train  # noqa: E402


def test_example_fp8_layers_are_observed_and_equal_float64_references():
    train = example_train("example_train_fp8")
    torch.manual_seed(0)
    model = train.to_float8(train.GPT(n_layer=2, d=32, n_head=2, block=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             fp8={"enabled": True})
    caps, handles = capture(model)
    rec = example_step(model, opt, dg, handles, batch=4)
    linears = [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    assert rec.fp8.layers == {n: n.split(".")[1] for n in linears}  # every block linear, its block's label
    for name in linears:
        for role in ("input", "weight", "grad_output"):
            ref = reference(caps[(name, role)], DTYPES[role])
            got = rec.fp8.stats[name][role]
            for k in ("amax_min", "amax_max", "scale_min", "scale_max"):
                assert got[k] == pytest.approx(ref[k], rel=1e-6), (name, role, k)
            assert (got["elements"], got["underflow"], got["saturated"]) == (
                ref["elements"], ref["underflow"], ref["saturated"]), (name, role)
    assert dg.counters["internal_errors"] == 0
