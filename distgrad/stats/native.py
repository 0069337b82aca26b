"""The native statistics kernel: ``dg_stats.c`` (package data next to this module), compiled once
per machine into the kernel cache with the system C compiler (:mod:`distgrad.stats.cbuild`) and
loaded with ctypes; checked against float64
references on load, ``None`` (eager fallback, logged once) when unavailable."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import numpy as np
import torch

from distgrad.stats import cbuild

log = logging.getLogger("distgrad")


def c_source() -> str:
    """The C source of the kernel, read from the installed package (``distgrad/stats/dg_stats.c``,
    shipped as package data).

    Raises:
        FileNotFoundError: the file is missing from the installation (then the eager kernel is
            used, see :func:`_native`).
    """
    return cbuild.c_source("distgrad.stats", "dg_stats.c")


_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
def _compile_native() -> cbuild.NativeFn:
    """Compile and load ``dg_stats.c``; returns the ctypes function or raises."""
    return cbuild.compile_c(c_source(), "dg_stats",
                            [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int32], flags=["-fno-math-errno", "-pthread"])


def _call_native(fn: cbuild.NativeFn, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """Run the native kernel on non-empty contiguous CPU fp32/bf16 pieces -> float64 [P, 8]."""
    P = len(pieces)
    meta = torch.tensor([[p.data_ptr(), p.numel(), _NATIVE_DTYPES[p.dtype]] for p in pieces],
                        dtype=torch.int64).reshape(P, 3)
    ptrs, lens = meta[:, 0].contiguous(), meta[:, 1].contiguous()
    kinds = meta[:, 2].to(torch.int32)
    out = torch.empty((P, 8), dtype=torch.float64)
    rc = fn(P, ptrs.data_ptr(), lens.data_ptr(), kinds.data_ptr(), out.data_ptr(),
            int(torch.get_num_threads()))
    if rc != 0:
        raise MemoryError("distgrad native statistics kernel could not allocate its work list")
    return out


def _self_check(fn: cbuild.NativeFn) -> None:
    """Compare the native kernel with float64 torch on awkward inputs; raise on any difference."""
    g = torch.Generator().manual_seed(0)
    n = 3 * 65536 + 2048 * 3 + 21  # several blocks, chunk and lane tails
    base = torch.randn(n, generator=g) * torch.logspace(-6, 2, n)[torch.randperm(n, generator=g)]
    base[torch.randperm(n, generator=g)[:97]] = 0.0
    base[11] = -0.0
    bad = base.clone()
    bad[5], bad[65536 + 3], bad[2 * 2048 + 1], bad[n - 1] = float("nan"), float("inf"), -float("inf"), float("nan")
    cases = [base, bad, base.bfloat16(), bad.bfloat16(), base[7:7 + 33], bad[1:9], base[:1]]
    got = _call_native(fn, cases)
    for x, row in zip(cases, got):
        d = x.double()
        fin = torch.isfinite(d)
        nan = int(torch.isnan(d).sum())
        want = [d.numel(), d.sum().item(), (d * d).sum().item(), nan, int(torch.isinf(d).sum()),
                int((d == 0).sum())]
        want += [float("nan"), float("nan")] if nan else [d.max().item(), -d.min().item()]
        r = row.tolist()
        for i in (0, 3, 4, 5):
            if r[i] != want[i]:
                raise RuntimeError(f"native kernel self-check: column {i} is {r[i]}, expected {want[i]}")
        for i in (6, 7):
            if not (r[i] == want[i] or (np.isnan(r[i]) and np.isnan(want[i]))):
                raise RuntimeError(f"native kernel self-check: column {i} is {r[i]}, expected {want[i]}")
        if bool(fin.all()):
            scale = [d.abs().sum().item(), (d * d).sum().item()]
            for i, sc in ((1, scale[0]), (2, scale[1])):
                if abs(r[i] - want[i]) > 1e-6 * sc + 1e-30:
                    raise RuntimeError(f"native kernel self-check: column {i} is {r[i]}, expected {want[i]}")
        elif not np.isnan(r[2]) and not np.isinf(r[2]):
            raise RuntimeError("native kernel self-check: non-finite input gave a finite sum of squares")


#: dg_stats, built and self-checked on first use (``_kernel.fn`` False: unavailable)
_kernel = cbuild.LazyKernel(_compile_native, _self_check,
                            "native statistics kernel (the eager torch kernel is used instead)")


def _native() -> cbuild.NativeFn | None:
    """The native kernel function, or None when unavailable (loaded, self-checked, once per process)."""
    return _kernel()
