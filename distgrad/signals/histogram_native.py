"""The native kernel of the gradient histogram on CPU: ``dg_hist.c`` (package data next to this
module), compiled once per machine (kernel cache of :mod:`distgrad.stats.cbuild`) with the
system C compiler and loaded with ctypes, like the statistics kernel
(:mod:`distgrad.stats.native`); checked against numpy's bit operations on load; None (the torch path of
:mod:`distgrad.signals.histogram` is used, logged once) when unavailable.

One pass per piece instead of the torch path's four: the biased exponent of ``|x|`` is counted
into the piece's layer row of a raw-exponent table and the non-zero elements are counted."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import numpy as np
import torch

from distgrad.stats import cbuild

log = logging.getLogger("distgrad")

#: piece dtype -> kind code of dg_hist.c
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


def _compile() -> cbuild.NativeFn:
    return cbuild.compile_c(cbuild.c_source("distgrad.signals", "dg_hist.c"), "dg_hist",
                            [ctypes.c_int64] + [ctypes.c_void_p] * 7)


def run(fn: cbuild.NativeFn, pieces: Sequence[torch.Tensor], rows: Sequence[int], n_rows: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count contiguous CPU pieces (dtypes of :data:`KINDS`) into ``(raw32 int64 [n_rows, 256],
    raw64 int64 [n_rows, 2048], nonzero int64 [n_rows])``; ``rows[i]``: the row of piece i."""
    raw32 = torch.zeros((n_rows, 256), dtype=torch.int64)
    raw64 = torch.zeros((n_rows, 2048), dtype=torch.int64)
    nonzero = torch.zeros(n_rows, dtype=torch.int64)
    P = len(pieces)
    if P:
        ptrs = torch.tensor([p.data_ptr() for p in pieces], dtype=torch.int64)
        lens = torch.tensor([p.numel() for p in pieces], dtype=torch.int64)
        kinds = torch.tensor([KINDS[p.dtype] for p in pieces], dtype=torch.int32)
        rws = torch.tensor(list(rows), dtype=torch.int64)
        rc = fn(P, ptrs.data_ptr(), lens.data_ptr(), kinds.data_ptr(), rws.data_ptr(), raw32.data_ptr(),
                raw64.data_ptr(), nonzero.data_ptr())
        if rc != 0:
            raise RuntimeError("distgrad native histogram kernel: unknown piece kind")
    return raw32, raw64, nonzero


def _expected(x: torch.Tensor) -> tuple[np.ndarray, int]:
    """Raw-exponent counts and non-zero count of one piece with numpy bit operations."""
    a = x.float().numpy() if x.dtype in (torch.bfloat16, torch.float16) else x.numpy()
    if a.dtype == np.float64:
        u = a.view(np.uint64) & np.uint64(0x7FFFFFFFFFFFFFFF)
        return np.bincount((u >> np.uint64(52)).astype(np.int64), minlength=2048), int((u != 0).sum())
    u = a.view(np.uint32) & np.uint32(0x7FFFFFFF)
    return np.bincount((u >> np.uint32(23)).astype(np.int64), minlength=256), int((u != 0).sum())


def _self_check(fn: cbuild.NativeFn) -> None:
    """Compare the kernel with numpy on every kind, zeros, subnormals, NaN and Inf; raise on a difference."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4099, generator=g, dtype=torch.float64) * torch.pow(
        2.0, torch.randint(-1100, 1000, (4099,), generator=g).double())
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 5e-324, 1e-45, 6e-8, 1e-40, 65504.0])
    x = torch.cat([base, special.double()])
    pieces = [x.float(), x.bfloat16(), x.half(), x, x.float()[3:10]]
    rows = [0, 1, 2, 3, 1]
    raw32, raw64, nonzero = run(fn, pieces, rows, 4)
    want32, want64, wantnz = np.zeros((4, 256), np.int64), np.zeros((4, 2048), np.int64), np.zeros(4, np.int64)
    for p, r in zip(pieces, rows):
        c, nz = _expected(p)
        (want64 if p.dtype == torch.float64 else want32)[r] += c
        wantnz[r] += nz
    if not (np.array_equal(raw32.numpy(), want32) and np.array_equal(raw64.numpy(), want64)
            and np.array_equal(nonzero.numpy(), wantnz)):
        raise RuntimeError("native histogram kernel self-check: counts differ from numpy's")


#: the kernel, built and self-checked on first use (``_kernel.fn`` False: unavailable)
_kernel = cbuild.LazyKernel(_compile, _self_check, "native histogram kernel (torch kernels are used instead)")


def native() -> cbuild.NativeFn | None:
    """The kernel function, or None when unavailable (tried once per process; logged once)."""
    return _kernel()
