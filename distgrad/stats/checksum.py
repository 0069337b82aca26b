"""The replica fingerprint: an order-insensitive integer checksum of the bit patterns of a
replicated gradient, which changes when any element changes (a sign flip, a swap of two
elements, a single flipped bit), unlike a sum of squares compared with a tolerance.

Definition (all arithmetic on 64-bit integers modulo 2**64). For element ``i`` of the
concatenation of the gradient pieces (global position ``i``, bit pattern ``b_i`` of its
dtype read as an unsigned integer: 16 bits for fp16/bf16, 32 for fp32, 64 for fp64)::

    x_i = fmix64(b_i * K1 + i * K2)            # MurmurHash3's 64-bit finaliser, a bijection
    checksum = (sum_i (x_i mod 2**40)) mod 2**52

``fmix64`` and the constants are MurmurHash3's (Austin Appleby, public domain) and the golden
ratio's. The sum is exact integer arithmetic, so the result does not depend on the order in
which elements or chunks are added; it is below 2**52, so a float64 carries it exactly, in
the rank's own slot of the step's SUM collective (every other rank contributes 0 there).

What it detects: changing any one element changes ``x_i`` (``b -> b * K1 + c`` with ``K1`` odd
and ``fmix64`` are bijections), so its 40 low bits, and the sum, change unless the 40 low
bits happen to coincide: a change (of one element, or of several at once, e.g. a swap, which
moves the values to other positions) goes undetected with probability about 2**-40 (~1e-12)
per compared pair of replicas. False positives: none. All-reduce gives every replica the same
bits, and the checksum is a deterministic function of the bits, so healthy replicas always
agree exactly (no tolerance to tune).

A piece holding NaN/Inf gives a NaN fingerprint (as the previous sum-of-squares fingerprint
did), so that a replica whose full copy is non-finite is visible even when its 1/W slice is
not.

Cost: about a dozen element-wise int64 operations per element of the rank's *full* copy of
the gradient, in chunks of 2**22 elements (32 MiB of int64 temporaries), on sampled steps
with ``replica_check`` only; no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["replica_checksum", "checksum_reference"]

_M64 = (1 << 64) - 1
_K1 = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd
_K2 = 0xC2B2AE3D27D4EB4F  # a MurmurHash / xxHash prime, odd
_F1 = 0xFF51AFD7ED558CCD  # MurmurHash3 fmix64 constants
_F2 = 0xC4CEB9FE1A85EC53
_LOW = (1 << 40) - 1
_MOD = 1 << 52
_CHUNK = 1 << 22

_INT_VIEW = {torch.float32: (torch.int32, 0xFFFFFFFF), torch.float16: (torch.int16, 0xFFFF),
             torch.bfloat16: (torch.int16, 0xFFFF), torch.float64: (torch.int64, None)}


def _signed(c: int) -> int:
    """The int64 with the bit pattern of the unsigned 64-bit constant ``c``."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _lshr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 ``x`` by ``s`` bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _fmix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _lshr(x, 33)
    x = x * _signed(_F1)
    x = x ^ _lshr(x, 33)
    x = x * _signed(_F2)
    return x ^ _lshr(x, 33)


def _bits(piece: torch.Tensor) -> torch.Tensor:
    """The unsigned bit patterns of a 1-D floating tensor as int64."""
    t = piece.detach().contiguous()
    if t.dtype not in _INT_VIEW:
        t = t.to(torch.float32)
    view, mask = _INT_VIEW[t.dtype]
    b = t.view(view).to(torch.int64)
    return b & mask if mask is not None else b


def replica_checksum(pieces: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The checksum (module docstring) of the concatenation of ``pieces``.

    Args:
        pieces: 1-D floating tensors (fp32, fp16, bf16, fp64; other dtypes are read as fp32),
            the rank's full copy of each replicated gradient in parameter order; None or empty
            pieces contribute nothing but still count their position (0 elements).
        device: device of the result.

    Returns:
        0-d float64 tensor on ``device``: an integer in [0, 2**52), or NaN when an element is
        NaN/Inf. No host synchronisation.
    """
    total = torch.zeros((), dtype=torch.int64, device=device)
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)
    offset = 0
    for p in pieces:
        if p is None or p.numel() == 0:
            continue
        p = p.reshape(-1)
        for s in range(0, p.numel(), _CHUNK):
            c = p[s: s + _CHUNK]
            nonfinite = nonfinite | (~torch.isfinite(c)).any().to(device)
            idx = torch.arange(offset + s, offset + s + c.numel(), dtype=torch.int64, device=c.device)
            x = _fmix(_bits(c) * _signed(_K1) + idx * _signed(_K2))
            total = (total + (x & _LOW).sum().to(device)) % _MOD  # < 2**22 * 2**40: no overflow
        offset += p.numel()
    return torch.where(nonfinite, torch.full((), float("nan"), dtype=torch.float64, device=device),
                       total.to(torch.float64))


def checksum_reference(values: Sequence[Sequence[float]], dtype: torch.dtype) -> int:
    """The same checksum in pure Python integers (for tests): ``values`` are the pieces'
    elements, converted to ``dtype`` to read their bits."""
    def fmix(x: int) -> int:
        x ^= x >> 33
        x = (x * _F1) & _M64
        x ^= x >> 33
        x = (x * _F2) & _M64
        return x ^ (x >> 33)

    total, i = 0, 0
    for piece in values:
        if not len(piece):
            continue
        bits = _bits(torch.tensor(list(piece), dtype=dtype)).tolist()
        for b in bits:
            total += fmix((b * _K1 + i * _K2) & _M64) & _LOW
            i += 1
    return total % _MOD
