"""The statistics core on one process (no collectives): pack -> reduce -> unpack equals torch's
float64 statistics of the concatenated pieces, special values included (NaN, +-Inf, -0.0, empty
pieces), for every kernel; and a replicated gradient sliced per rank adds up to the whole."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distgrad import stats
from distgrad.engines.base import slice_for_rank
from distgrad.stats import Layout, pack_local, reduce_blocks, unpack


def _pieces():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(100_003, generator=g)
    b = torch.randn(70_001, generator=g)
    b[5], b[70_000] = float("inf"), -float("inf")
    c = torch.randn(3, generator=g)
    c[1] = float("nan")
    d = torch.zeros(17)
    d[3] = -0.0
    return {"a": a, "b_inf": b, "c_nan": c, "d_zero": d, "e_empty": torch.zeros(0), "f_none": None}


@pytest.mark.parametrize("kernel", ["auto", "eager", "native"])
def test_pack_reduce_unpack_equals_float64_reference(kernel):
    old = stats.stats_kernel()
    stats.set_stats_kernel(kernel)
    try:
        pieces = _pieces()
        names = list(pieces)
        layout = Layout(len(names), 1)
        s, m = pack_local(list(pieces.values()), layout, 0, torch.device("cpu"))
        red = unpack(reduce_blocks(s, m), layout, names)
    finally:
        stats.set_stats_kernel(old)
    p = red.params
    for i, n in enumerate(names):
        x = pieces[n]
        if x is None or x.numel() == 0:
            assert (p.numel[i], p.sumsq[i], p.nan[i]) == (0, 0, 0)
            assert p.max[i] == -math.inf and p.min[i] == math.inf  # SUM/MAX identities
            continue
        x = x.double()
        assert p.numel[i] == x.numel()
        assert (p.nan[i], p.inf[i], p.zeros[i]) == (int(x.isnan().sum()), int(x.isinf().sum()), int((x == 0).sum()))
        if n == "c_nan":
            assert math.isnan(p.max[i]) and math.isnan(p.min[i]) and math.isnan(p.norm[i])
        elif n == "b_inf":  # +-Inf extrema are reported as such, not clamped to a finite max
            assert p.max[i] == math.inf and p.min[i] == -math.inf and p.norm[i] == math.inf
        else:
            assert p.max[i] == x.max().item() and p.min[i] == x.min().item()
            assert p.norm[i] == pytest.approx(torch.linalg.vector_norm(x).item(), rel=1e-7)
            assert p.sum[i] == pytest.approx(x.sum().item(), rel=1e-5, abs=1e-6 * x.abs().sum().item())


def test_replicated_slices_add_up_to_the_whole():
    x = torch.randn(1001)
    for world in (1, 2, 3, 7):
        parts = [slice_for_rank(x, r, world) for r in range(world)]
        assert sum(p.numel() for p in parts) == x.numel()
        assert torch.equal(torch.cat(parts), x)


def test_unpack_divides_by_the_loss_scale_exactly():
    x = torch.tensor([3.0, -5.0, 0.5]) * 1024
    layout = Layout(1, 1)
    s, m = pack_local([x], layout, 0, torch.device("cpu"))
    p = unpack(reduce_blocks(s, m), layout, ["w"], scale=1024.0).params
    assert (p.max[0], p.min[0], p.sum[0]) == (3.0, -5.0, -1.5)
    assert p.sumsq[0] == np.float64(9 + 25 + 0.25)
