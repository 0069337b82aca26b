"""The native kernel of the optimizer signals on CPU: ``dg_adam.c`` (package data next to this
module), compiled once per machine (kernel cache) with the system C compiler and loaded with ctypes
(:mod:`distgrad.stats.cbuild`); checked on load against the same float32 elementwise formulas
evaluated by torch and summed in float64; None (the torch path of
:mod:`distgrad.signals.adam` is used, logged once) when unavailable.

One pass per piece over ``g``, ``m``, ``v`` instead of the torch path's ten elementwise
operations over 64K-element chunks; every elementwise operation in float32 as the torch path
does it (so the spike counts agree exactly), sums in 16 float32 lanes restarted every 2048
elements and combined in float64 (like ``dg_stats.c``), threads over 64K-element blocks."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch

from distgrad.stats import cbuild

#: gradient dtype -> kind code of dg_adam.c (plus 3 * the state code of :data:`STATE_KINDS`)
GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: exp_avg / exp_avg_sq dtype (both the same) -> state code
STATE_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def _compile() -> cbuild.NativeFn:
    return cbuild.compile_c(cbuild.c_source("distgrad.signals", "dg_adam.c"), "dg_adam",
                            [ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int32],
                            flags=["-fno-math-errno", "-pthread"])


def eligible(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes this piece: 1-D-contiguous CPU tensors of equal length, ``g``
    float32/bfloat16/float16, ``m`` and ``v`` both float32 or both bfloat16."""
    return (g.device.type == "cpu" and m.device.type == "cpu" and v.device.type == "cpu"
            and g.dtype in GRAD_KINDS and m.dtype in STATE_KINDS and v.dtype == m.dtype
            and g.numel() == m.numel() == v.numel() > 0
            and g.is_contiguous() and m.is_contiguous() and v.is_contiguous())


def run(fn: cbuild.NativeFn, pieces: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        params: Sequence[tuple[float, float, float, float, float]] | torch.Tensor) -> torch.Tensor:
    """The sums of :func:`eligible` pieces ``(g, m, v)`` with per-piece ``(scale, bc, eps2,
    theta, sign)`` (a float32 ``[P, 5]`` CPU tensor or numbers; ``g / scale``; ``v_hat = v / bc``;
    ``d = max(v_hat, eps2)``; spikes ``g^2 / d > theta``; ``sign`` multiplies ``g.m``) -> float64
    ``[P, 7]``: ``(sum g^2/d, #spikes, sign * g.m, g.g, m.m, v.v, sum v_hat)``.

    Raises:
        MemoryError: the kernel could not allocate its work list.
    """
    P = len(pieces)
    out = torch.empty((P, 7), dtype=torch.float64)
    if not P:
        return out
    meta = torch.tensor([[g.data_ptr(), m.data_ptr(), v.data_ptr(), g.numel(),
                          GRAD_KINDS[g.dtype] + 3 * STATE_KINDS[m.dtype]] for g, m, v in pieces],
                        dtype=torch.int64)
    cols = [meta[:, k].contiguous() for k in range(4)]
    kinds = meta[:, 4].to(torch.int32)
    prm = (params.to(torch.float32) if isinstance(params, torch.Tensor)
           else torch.tensor(list(params), dtype=torch.float32)).reshape(P, 5).contiguous()
    rc = fn(P, cols[0].data_ptr(), cols[1].data_ptr(), cols[2].data_ptr(), cols[3].data_ptr(),
            kinds.data_ptr(), prm.data_ptr(), out.data_ptr(), int(torch.get_num_threads()))
    if rc == -1:
        raise MemoryError("distgrad native optimizer-signal kernel could not allocate its work list")
    if rc != 0:
        raise RuntimeError(f"distgrad native optimizer-signal kernel failed ({rc})")
    return out


def reference(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
              prm: tuple[float, float, float, float, float]) -> list[float]:
    """The sums of :func:`run` for one piece from the same float32 elementwise formulas in torch,
    summed in float64 (the self-check's and the tests' reference)."""
    scale, bc, eps2, theta, sign = (torch.tensor(x, dtype=torch.float32) for x in prm)
    gf, mf, vf = g.float() / scale, m.float(), v.float()
    d = vf / bc
    r = (gf * gf) / torch.maximum(d, eps2)  # NaN in d propagates, as clamp_min does
    d64, g64, m64, v64 = d.double(), gf.double(), mf.double(), vf.double()
    return [r.double().sum().item(), float((r > theta).sum()), float(sign) * (g64 * m64).sum().item(),
            (g64 * g64).sum().item(), (m64 * m64).sum().item(), (v64 * v64).sum().item(), d64.sum().item()]


def close(got: Sequence[float], want: Sequence[float], g: torch.Tensor, m: torch.Tensor, rtol: float) -> bool:
    """Whether kernel sums ``got`` match ``want`` of :func:`reference`: the count exactly, NaN
    where NaN, Inf where Inf, the others within ``rtol`` of their magnitude (``g.m`` of
    ``|g|.|m|``, as it may cancel)."""
    if got[1] != want[1]:
        return False
    gm_scale = (g.double().abs() * m.double().abs()).sum().item()
    for k in (0, 2, 3, 4, 5, 6):
        a, b = got[k], want[k]
        if math.isnan(b) or math.isinf(b):
            if not (math.isnan(a) and math.isnan(b)) and a != b:
                return False
            continue
        sc = gm_scale if k == 2 else abs(b)
        if not math.isfinite(a) or abs(a - b) > rtol * sc + 1e-30:
            return False
    return True


def _self_check(fn: cbuild.NativeFn) -> None:
    """Compare the kernel with :func:`reference` on every dtype combination, tails, zeros and
    tiny values in ``v``, NaN/Inf in ``g``; raise on a difference."""
    gen = torch.Generator().manual_seed(0)
    n = 2 * 65536 + 2048 * 3 + 21  # several blocks, chunk and lane tails
    g = torch.randn(n, generator=gen) * torch.logspace(-4, 1, n)[torch.randperm(n, generator=gen)]
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    v[torch.randperm(n, generator=gen)[:101]] = 0.0
    v[torch.randperm(n, generator=gen)[:103]] = 1e-20
    bad = g.clone()
    bad[5], bad[65536 + 3], bad[n - 1] = float("nan"), float("inf"), -float("inf")
    prm = (1.0, 0.05, 1e-16, 4.0, 1.0)
    cases = [((g, m, v), prm), ((g.bfloat16(), m, v), (8.0, 0.3, 1e-12, 50.0, -1.0)),
             ((g.half(), m, v), prm), ((g, m.bfloat16(), v.bfloat16()), prm),
             ((g.bfloat16()[7:7 + 33], m.bfloat16()[7:7 + 33], v.bfloat16()[7:7 + 33]), prm),
             ((g.half()[1:9], m.bfloat16()[1:9], v.bfloat16()[1:9]), prm), ((bad, m, v), prm)]
    got = run(fn, [c for c, _ in cases], [p for _, p in cases])
    for (c, p), row in zip(cases, got.tolist()):
        want = reference(*c, p)
        if not close(row, want, c[0], c[1], 1e-5):
            raise RuntimeError(f"native optimizer-signal kernel self-check: {row} differs from {want}")


#: the kernel, built and self-checked on first use (``_kernel.fn`` False: unavailable)
_kernel = cbuild.LazyKernel(_compile, _self_check, "native optimizer-signal kernel (torch kernels are used instead)")


def native() -> cbuild.NativeFn | None:
    """The kernel function, or None when unavailable (tried once per process; logged once)."""
    return _kernel()
