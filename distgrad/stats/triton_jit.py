"""Triton JIT definitions of the fused statistics kernel (see ``distgrad.stats.triton_kernel``, which
imports this module only when the kernel is first used: importing it imports triton, and
``TRITON_INTERPRET=1`` must be set before that for the kernels to run on CPU tensors).

Table ``meta`` (int64): ``[0, NB)`` block addresses, ``[NB, 2 NB)`` block lengths, then per piece
``[2 NB, 2 NB + P)`` first block, ``[+P, +2P)`` number of blocks, ``[+2P, +3P)`` numel.
Partials ``part``: float64 ``[NB, 8]`` (sum, sumsq, nan, inf, zeros, max, min, unused)."""

import triton
import triton.language as tl


@triton.jit
def block_kernel(meta, part, lo, count, n_blocks, grid, DTYPE: tl.constexpr, CHUNK: tl.constexpr,
                 ALIGNED: tl.constexpr):
    """Blocks ``lo .. lo + count`` (all of element type ``DTYPE``); program ``pid`` takes blocks
    ``lo + pid, lo + pid + grid, ...``. Per block: fp32 lane sums and sums of squares (at most
    block / CHUNK additions per lane) reduced in float64, int32 NaN/Inf/zero counts, NaN-skipping
    fp32 max and min; one partial row per block, so the result does not depend on ``grid``.
    ``ALIGNED``: every block address is a multiple of 16 bytes (lets the compiler emit 16-byte
    loads)."""
    pid = tl.program_id(0)
    offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, CHUNK), CHUNK), CHUNK)
    for i in range(pid, count, grid):
        b = lo + i
        p = tl.load(meta + b).to(tl.pointer_type(DTYPE))
        if ALIGNED:
            p = tl.multiple_of(p, 16)
        n = tl.load(meta + n_blocks + b)
        s = tl.zeros([CHUNK], dtype=tl.float32)
        q = tl.zeros([CHUNK], dtype=tl.float32)
        cn = tl.zeros([CHUNK], dtype=tl.int32)
        ci = tl.zeros([CHUNK], dtype=tl.int32)
        cz = tl.zeros([CHUNK], dtype=tl.int32)
        mx = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
        mn = tl.full([CHUNK], float("inf"), dtype=tl.float32)
        n_full = (n // CHUNK) * CHUNK
        for start in range(0, n_full, CHUNK):  # full chunks: unmasked (vectorisable) loads
            start = tl.multiple_of(start, CHUNK)
            v = tl.load(p + start + offs).to(tl.float32)
            s += v
            q += v * v
            cn += (v != v).to(tl.int32)
            ci += (tl.abs(v) == float("inf")).to(tl.int32)
            cz += (v == 0.0).to(tl.int32)
            keep = v == v
            mx = tl.maximum(mx, tl.where(keep, v, float("-inf")))
            mn = tl.minimum(mn, tl.where(keep, v, float("inf")))
        # the tail (possibly empty): masked lanes load 0 and are left out of zeros and extrema
        valid = n_full + offs < n
        v = tl.load(p + n_full + offs, mask=valid, other=0.0).to(tl.float32)
        s += v
        q += v * v
        cn += (v != v).to(tl.int32)
        ci += (tl.abs(v) == float("inf")).to(tl.int32)
        cz += (valid & (v == 0.0)).to(tl.int32)
        keep = valid & (v == v)
        mx = tl.maximum(mx, tl.where(keep, v, float("-inf")))
        mn = tl.minimum(mn, tl.where(keep, v, float("inf")))
        row = part + b * 8
        tl.store(row, tl.sum(s.to(tl.float64), axis=0))
        tl.store(row + 1, tl.sum(q.to(tl.float64), axis=0))
        tl.store(row + 2, tl.sum(cn, axis=0).to(tl.float64))
        tl.store(row + 3, tl.sum(ci, axis=0).to(tl.float64))
        tl.store(row + 4, tl.sum(cz, axis=0).to(tl.float64))
        tl.store(row + 5, tl.max(mx, axis=0).to(tl.float64))
        tl.store(row + 6, tl.min(mn, axis=0).to(tl.float64))


@triton.jit
def combine_kernel(meta, part, out, n_blocks, n_pieces, grid, RB: tl.constexpr):
    """Per piece (program ``pid`` takes pieces ``pid, pid + grid, ...``): its block rows summed in
    float64 in block order, ``RB`` rows per vector (a fixed tree); out float64 ``[P, 8]``: numel,
    sum, sumsq, nan, inf, zeros, max, -min (NaN max/-min when nan > 0; 0 x 6, -inf, -inf for
    a piece without blocks)."""
    pid = tl.program_id(0)
    base = meta + 2 * n_blocks
    r = tl.arange(0, RB)
    for p in range(pid, n_pieces, grid):
        first = tl.load(base + p)
        nb = tl.load(base + n_pieces + p)
        numel = tl.load(base + 2 * n_pieces + p)
        s = tl.zeros([RB], dtype=tl.float64)
        q = tl.zeros([RB], dtype=tl.float64)
        cn = tl.zeros([RB], dtype=tl.float64)
        ci = tl.zeros([RB], dtype=tl.float64)
        cz = tl.zeros([RB], dtype=tl.float64)
        mx = tl.full([RB], float("-inf"), dtype=tl.float64)
        mn = tl.full([RB], float("inf"), dtype=tl.float64)
        for start in range(0, nb, RB):
            i = start + r
            m = i < nb
            row = part + (first + i) * 8
            s += tl.load(row, mask=m, other=0.0)
            q += tl.load(row + 1, mask=m, other=0.0)
            cn += tl.load(row + 2, mask=m, other=0.0)
            ci += tl.load(row + 3, mask=m, other=0.0)
            cz += tl.load(row + 4, mask=m, other=0.0)
            mx = tl.maximum(mx, tl.load(row + 5, mask=m, other=float("-inf")))
            mn = tl.minimum(mn, tl.load(row + 6, mask=m, other=float("inf")))
        nan = tl.sum(cn, axis=0)
        o = out + p * 8
        tl.store(o, numel.to(tl.float64))
        tl.store(o + 1, tl.sum(s, axis=0))
        tl.store(o + 2, tl.sum(q, axis=0))
        tl.store(o + 3, nan)
        tl.store(o + 4, tl.sum(ci, axis=0))
        tl.store(o + 5, tl.sum(cz, axis=0))
        tl.store(o + 6, tl.where(nan > 0, float("nan"), tl.max(mx, axis=0)))
        tl.store(o + 7, tl.where(nan > 0, float("nan"), -tl.min(mn, axis=0)))
