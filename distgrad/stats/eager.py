"""The eager statistics kernel: about ten torch kernels per piece (the default on CUDA and for
dtypes the native kernel does not take; the fallback of the others)."""

from __future__ import annotations

import torch

_CHUNK = 1 << 16


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """``sum(x**2)`` of a 1-D floating tensor as a 0-d float64 tensor, accurate to ~1e-7 relative.

    Args:
        x: 1-D tensor, float32 (other float dtypes are upcast to float32 first).

    Chunked fp32 dot products (2**16 elements each; worst-case relative error ~2**16 * 2**-24
    per chunk, typically ~1e-8) are summed in float64. On CUDA the chunks are one batched
    ``linalg.vecdot`` over a 2-D view, so the kernel count does not grow with the size.
    """
    if x.dtype != torch.float32:
        x = x.float()
    n = x.numel()
    if n <= _CHUNK:
        return torch.dot(x, x).double()
    if x.device.type == "cpu":
        return torch.stack([torch.dot(c, c) for c in x.split(_CHUNK)]).double().sum()
    m = n // _CHUNK * _CHUNK
    head = x[:m].view(-1, _CHUNK)
    tail = x[m:]
    return torch.linalg.vecdot(head, head).double().sum() + torch.dot(tail, tail).double()


def _piece_stats_eager(x: torch.Tensor) -> torch.Tensor:
    """The eager kernel: one non-empty piece -> float64 ``[8]`` (SUM_COLS then MAX_COLS)."""
    xf = x if x.dtype == torch.float32 else x.float()
    n = xf.numel()
    mn, mx = torch.aminmax(xf)
    nz = torch.count_nonzero(xf)
    nan = torch.count_nonzero(torch.isnan(xf))
    inf = torch.count_nonzero(torch.isinf(xf))
    return torch.stack([
        torch.tensor(float(n), dtype=torch.float64, device=xf.device),
        xf.sum().double(),
        sum_of_squares(xf),
        nan.double(),
        inf.double(),
        (n - nz).double(),
        mx.double(),
        -mn.double(),
    ])
