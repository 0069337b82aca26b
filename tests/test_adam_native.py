"""The native CPU kernel of the optimizer signals (distgrad/signals/dg_adam.c) against the torch
path of ``AdamSignal._sums`` and a float64 computation, on awkward inputs: zeros and values
below eps^2 in v, NaN/Inf in g, bfloat16/float16 gradients, bfloat16 moments, lengths that are
not multiples of the lane (16), chunk (2048) or block (65536) sizes, a loss scale, maximize,
no bias correction, the step count as a CPU tensor."""

from __future__ import annotations

import math

import pytest
import torch

from distgrad.signals import adam_native
from distgrad.signals.adam import AdamSignal


def _signal(theta: float) -> AdamSignal:
    s = AdamSignal.__new__(AdamSignal)
    s.theta = theta
    return s


def _inputs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)[torch.randperm(n, generator=gen)]
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    k = max(1, n // 50)
    v[torch.randperm(n, generator=gen)[:k]] = 0.0
    v[torch.randperm(n, generator=gen)[:k]] = 1e-22  # below eps^2 = 1e-16
    return g, m, v


CASES = [  # n, g dtype, state dtype, scale, t, group
    (3 * 65536 + 2048 * 5 + 7, torch.float32, torch.float32, 1.0, 3, {}),
    (65536 + 13, torch.bfloat16, torch.float32, 1024.0, torch.tensor(7.0), {}),
    (4099, torch.float16, torch.float32, 1.0, torch.tensor(2.0), {"maximize": True}),
    (2 * 65536 + 1, torch.float32, torch.bfloat16, 1.0, 5, {"bias_correction": False}),
    (15, torch.bfloat16, torch.bfloat16, 8.0, 1, {}),
    (1, torch.float32, torch.float32, 1.0, torch.tensor(1.0), {}),
]


@pytest.mark.parametrize("n,gdt,sdt,scale,t,extra", CASES)
@pytest.mark.parametrize("bad", [False, True])
def test_native_equals_torch_path_and_float64(n, gdt, sdt, scale, t, extra, bad):
    fn = adam_native.native()
    assert fn is not None  # compiled and passed its self-check on this machine
    g, m, v = _inputs(n, n)
    if bad:
        g[-1] = float("inf")
        g[n // 2] = float("nan")
    g, m, v = g.to(gdt), m.to(sdt), v.to(sdt)
    assert adam_native.eligible(g, m, v)
    group = {"betas": (0.9, 0.95), "eps": 1e-8, **extra}
    sig = _signal(theta=3.0)
    torch_path = sig._sums(g, m, v, t, group, scale).tolist()  # [n, ratio, spikes, gm, gg, mm, vv, vhat]
    prm_t = sig._params([(t, group)], scale)  # from the step count as the signal computes it
    prm = tuple(prm_t[0].tolist())
    assert prm == pytest.approx((scale, 1.0 - 0.95 ** float(t) if extra.get("bias_correction", True) else 1.0,
                                 1e-16, 3.0, -1.0 if extra.get("maximize") else 1.0), rel=1e-7)
    native = adam_native.run(fn, [(g, m, v)], prm_t)[0].tolist()
    assert torch_path[0] == n
    # the float32 elementwise formulas summed in float64 (same rounding of every element)
    want = adam_native.reference(g, m, v, prm)
    assert adam_native.close(native, want, g, m, rtol=2e-6), (native, want)
    # the torch path sums 64K-element chunks in float32 (dot products: a few 1e-6 off measured)
    assert adam_native.close(torch_path[1:], want, g, m, rtol=1e-5), (torch_path, want)
    assert native[1] == torch_path[2]  # spike counts exact
    if bad:
        assert math.isnan(native[0]) and math.isnan(native[3]) and math.isnan(native[2])
    else:
        assert 0 < native[1] < n or n == 1
        # and against float64 elementwise (independent of float32 rounding of each element)
        bc = 1.0 - 0.95 ** float(t) if extra.get("bias_correction", True) else 1.0
        g64, m64, v64 = g.double() / scale, m.double(), v.double()
        d = (v64 / bc).clamp_min(1e-16)
        sign = -1.0 if extra.get("maximize") else 1.0
        ref = [(g64 * g64 / d).sum().item(), sign * (g64 * m64).sum().item(), (g64 * g64).sum().item(),
               (m64 * m64).sum().item(), (v64 * v64).sum().item(), (v64 / bc).sum().item()]
        got = [native[0], native[2], native[3], native[4], native[5], native[6]]
        gm_scale = (g64.abs() * m64.abs()).sum().item()
        for k, (a, b) in enumerate(zip(got, ref)):
            # + float32's smallest normal: squares of v = 1e-22 are subnormal in float32
            assert abs(a - b) <= 1e-5 * (gm_scale if k == 1 else abs(b)) + 1.2e-38, (k, a, b)


def test_several_pieces_threads_and_ineligible_pieces():
    """Many pieces in one call (threads over blocks) equal one call per piece; pieces the kernel
    does not take are recognised."""
    fn = adam_native.native()
    pieces = [_inputs(n, n) for n in (5 * 65536 + 3, 17, 65536, 2049)]
    prms = [(1.0, 0.1, 1e-16, 2.0, 1.0)] * len(pieces)
    together = adam_native.run(fn, pieces, prms)
    for p, q, row in zip(pieces, prms, together):
        assert torch.equal(row, adam_native.run(fn, [p], [q])[0])
    g, m, v = pieces[0]
    assert not adam_native.eligible(g.double(), m, v)
    assert not adam_native.eligible(g, m.bfloat16(), v)
    assert not adam_native.eligible(g[::2], m[::2], v[::2])
    assert not adam_native.eligible(g, m.half(), v.half())
    assert adam_native.run(fn, [], []).shape == (0, 7)
