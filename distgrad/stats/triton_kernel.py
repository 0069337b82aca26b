"""The fused Triton statistics kernel: all local gradient pieces of a step in one launch per
dtype present (normally one) plus one combine launch.

Produces the same ``[P, 8]`` float64 table as the other kernels of ``distgrad.stats``
(``numel, sum, sumsq, nan, inf, zeros, max, -min`` per piece; an empty piece gives the SUM/MAX
identities ``0 x 6, -inf, -inf``; a piece holding a NaN gives NaN max and -min; +-Inf extrema
are kept), for contiguous fp32, bf16 and fp16 pieces anywhere in memory, without concatenating
them:

1. **Block table** (host, numpy, cached while the pieces' addresses, sizes and dtypes stay the
   same, which they do for the flat gradient buffers of DeepSpeed, FSDP and DDP): every piece is
   cut into blocks of ``BLOCK`` (16,384) elements, numbered dtype by dtype; one int64 entry per
   block (address, length) and per piece (first block, number of blocks, numel), copied to the
   device in one host-to-device copy (from pinned memory on CUDA, non-blocking). Like
   ``multi_tensor_apply``'s address lists, but one launch covers any number of pieces.
2. **Block kernel** (one launch per dtype, specialised for it): each program takes blocks
   ``pid, pid + grid, ...``; per block
   it reads the elements once in chunks of ``CHUNK`` (1,024) lanes, accumulating fp32 lane sums
   (at most 16 additions per lane), int32 counts and fp32 NaN-skipping extrema, then reduces the
   lanes in float64 and writes one float64 partial row per block.
3. **Combine kernel** (one launch, one program per piece): sums the piece's block rows in
   float64, in block order, in vectors of ``RB`` rows (a fixed tree), so the result depends only
   on the data and ``BLOCK``, never on the launch grid or the GPU.

Accuracy: sums and sums of squares within ~1e-7 relative of float64 (16 fp32 additions per lane,
everything above in float64); counts and extrema exact (extrema are the fp32 values of the
elements; bf16/fp16 convert to fp32 exactly). Memory: 64 bytes of partials per block (~4 KB per
million gradient elements) and the table (16 bytes per block, 24 per piece).

The first use on a device compiles the kernels for the dtypes present (seconds; Triton caches
them on disk for later runs). Loads are 16 bytes wide only when every block of a dtype starts on a
16-byte boundary (flat gradient buffers of power-of-two-sized parameters do); otherwise that dtype's launch uses
element-wide loads: the same results, slower.

Runs on CUDA (the default there, chosen in ``distgrad.stats``) and, for tests, on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported; slow, only for
correctness). ``triton`` is the optional extra ``distgrad[gpu]``; this module imports it only
when the kernel is first used. Before first use on a device the kernel is checked against
float64 on awkward data (NaN/Inf/-0.0 on block and chunk boundaries, every dtype, empty pieces);
:func:`available` is False (logged once) when triton is missing, the launch fails or the check
fails, and the caller then uses the eager kernel.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

log = logging.getLogger("distgrad")

BLOCK = 16384  #: elements per block (one partial row each)
CHUNK = 1024  #: lanes of a program (elements read per iteration)
RB = 128  #: block rows combined per vector in the combine kernel
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  #: dtype codes in the block table
_ESIZE = np.array([4, 2, 2], dtype=np.int64)

_lock = threading.RLock()
_kernels: Any = None  # (block_kernel, combine_kernel) once built, False when triton is unusable
_checked: dict[str, bool] = {}  # device string -> self-check result
_cache: dict[str, tuple] = {}  # device string -> (key, meta tensor, groups, n_blocks)
_TL_DTYPES: tuple = ()  # triton dtypes by dtype code, set when the kernels are built


def _build() -> tuple[Any, Any]:
    """Import the kernels (imports triton)."""
    import triton.language as tl

    from distgrad.stats import triton_jit as k

    global _TL_DTYPES
    _TL_DTYPES = (tl.float32, tl.bfloat16, tl.float16)
    return k.block_kernel, k.combine_kernel


def _get_kernels() -> tuple[Any, Any] | None:
    global _kernels
    if _kernels is None:
        with _lock:
            if _kernels is None:
                try:
                    _kernels = _build()
                except Exception as e:  # noqa: BLE001 - e.g. triton not installed
                    log.warning("distgrad: Triton statistics kernel unavailable, using the eager torch "
                                "kernel (%s: %s)", type(e).__name__, e)
                    _kernels = False
    return _kernels or None


def eligible(x: torch.Tensor | None) -> bool:
    """Whether the kernel takes this piece: non-empty, contiguous, fp32/bf16/fp16."""
    return x is not None and x.numel() > 0 and x.dtype in DTYPES and x.is_contiguous()


def block_table(pieces: Sequence[torch.Tensor | None], block: int = BLOCK) -> tuple[np.ndarray, list]:
    """The int64 table the kernels read, for contiguous fp32/bf16/fp16 ``pieces`` (None or
    empty: no blocks; the combine kernel gives them the SUM/MAX identities).

    Blocks are numbered dtype by dtype (fp32, then bf16, then fp16; pieces in their order
    within a dtype), so that each dtype is one contiguous range of blocks and one launch.

    Returns:
        ``(meta, groups)``: ``meta`` int64 ``[2 * NB + 3 * P]``: block addresses, block lengths,
        then per piece (in the order given) its first block, its number of blocks and its
        numel. ``groups``: per dtype present, ``(dtype code, first block, number of blocks,
        aligned)``, ``aligned`` when every block of the group starts on a 16-byte boundary.
    """
    P = len(pieces)
    addr = np.fromiter((0 if p is None else p.data_ptr() for p in pieces), dtype=np.int64, count=P)
    lens = np.fromiter((0 if p is None else p.numel() for p in pieces), dtype=np.int64, count=P)
    kind = np.fromiter((0 if p is None else DTYPES[p.dtype] for p in pieces), dtype=np.int64, count=P)
    nblk = (lens + block - 1) // block
    order = np.argsort(kind, kind="stable")
    first = np.empty(P, dtype=np.int64)
    first[order] = np.cumsum(nblk[order]) - nblk[order]
    nb = int(nblk.sum())
    piece = np.repeat(order, nblk[order])  # the piece of each block, in block order
    within = np.arange(nb, dtype=np.int64) - first[piece]
    b_addr = addr[piece] + within * block * _ESIZE[kind[piece]]
    b_len = np.minimum(lens[piece] - within * block, block)
    groups = []
    for code in range(len(_ESIZE)):
        sel = (kind == code) & (nblk > 0)
        if sel.any():
            lo = int(first[sel].min())
            count = int(nblk[sel].sum())
            groups.append((code, lo, count, bool(np.all(b_addr[lo:lo + count] % 16 == 0))))
    return np.concatenate([b_addr, b_len, first, nblk, lens]), groups


def table(pieces: Sequence[torch.Tensor | None], grid: int | None = None, block: int = BLOCK,
          cache: bool = True, device: torch.device | None = None) -> torch.Tensor:
    """Statistics of eligible pieces (see :func:`eligible`), all on one device: one launch of
    the block kernel per dtype present and one of the combine kernel.

    Args:
        pieces: P contiguous fp32/bf16/fp16 tensors on the same device (CUDA, or CPU under
            ``TRITON_INTERPRET=1``), or None / empty (identity rows).
        grid: number of programs per launch (default: one per block / piece on CUDA, 1 under
            the interpreter, where every program costs milliseconds); the result does not
            depend on it.
        block: elements per block (tests use small blocks to cross many block boundaries).
        cache: reuse the device copy of the block table while the pieces' addresses, sizes and
            dtypes are unchanged.
        device: the device when no piece is a tensor (default: the first piece's).

    Returns:
        float64 ``[P, 8]`` on the pieces' device, rows as described in the module docstring.
        No host synchronisation (the table's host-to-device copy is non-blocking on CUDA).

    Raises:
        RuntimeError: triton unavailable; anything triton raises on launch.
    """
    kernels = _get_kernels()
    if kernels is None:
        raise RuntimeError("triton is not available")
    block_kernel, combine_kernel = kernels
    P = len(pieces)
    device = next((p.device for p in pieces if p is not None), device or torch.device("cpu"))
    out = torch.empty((P, 8), dtype=torch.float64, device=device)
    if P == 0:
        return out
    key = (str(device), block, tuple(None if p is None else (p.data_ptr(), p.numel(), p.dtype) for p in pieces))
    hit = _cache.get(key[0]) if cache else None
    if hit is not None and hit[0] == key:
        meta, groups, nb = hit[1:]
    else:
        host, groups = block_table(pieces, block)
        nb = (host.size - 3 * P) // 2
        t = torch.from_numpy(host)
        meta = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
        if cache:
            _cache[key[0]] = (key, meta, groups, nb)
    part = torch.empty((max(nb, 1), 8), dtype=torch.float64, device=device)
    interp = device.type == "cpu"
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device, np.errstate(all="ignore"):  # launch on the pieces' GPU; the interpreter: numpy NaN/Inf
        for code, lo, count, aligned in groups:
            g = (1 if interp else count) if grid is None else max(1, min(int(grid), count))
            block_kernel[(g,)](meta, part, lo, count, nb, g, DTYPE=_TL_DTYPES[code], CHUNK=CHUNK,
                               ALIGNED=aligned)
        g = (1 if interp else P) if grid is None else max(1, min(int(grid), P))
        combine_kernel[(g,)](meta, part, out, nb, P, g, RB=RB)
    return out


# ----------------------------------------------------------------------------------------------
# check on first use per device

def _reference_row(x: torch.Tensor) -> list[float]:
    d = x.double()
    nan = int(torch.isnan(d).sum())
    row = [float(d.numel()), d.sum().item(), (d * d).sum().item(), float(nan),
           float(torch.isinf(d).sum()), float((d == 0).sum())]
    return row + ([math.nan, math.nan] if nan else [d.max().item(), -d.min().item()])


def self_check(device: torch.device) -> None:
    """Run the kernel on awkward data on ``device`` and compare with float64 torch; raise
    ``RuntimeError`` naming the first difference. Host reads happen here (once per device)."""
    g = torch.Generator().manual_seed(0)
    blk = 2 * CHUNK  # small blocks: the same kernel code, several block boundaries at little cost
    n = 2 * blk + CHUNK + 21
    base = torch.randn(n, generator=g) * torch.logspace(-4, 2, n)[torch.randperm(n, generator=g)]
    base[torch.randperm(n, generator=g)[:50]] = 0.0
    base[11] = -0.0
    bad = base.clone()
    bad[5], bad[blk], bad[blk - 1 + CHUNK], bad[n - 1] = math.nan, math.inf, -math.inf, math.nan
    infs = base.clone()
    infs[CHUNK], infs[n - 2] = math.inf, -math.inf
    cases = [base, bad, infs, base.bfloat16(), bad.half(), base[3:3 + CHUNK + 1].half(), base[:1]]
    cases = [c.to(device) for c in cases]
    got = table(cases, block=blk, cache=False).cpu().tolist()
    for x, r in zip(cases, got):
        want = _reference_row(x)
        finite = bool(torch.isfinite(x).all())
        for i in range(8):
            a, b = r[i], want[i]
            if i in (1, 2) and finite:
                scale = x.double().abs().sum().item() if i == 1 else abs(b)
                ok = abs(a - b) <= 1e-6 * scale + 1e-30
            else:
                ok = a == b or (math.isnan(a) and math.isnan(b)) or (i in (1, 2) and not finite)
            if not ok:
                raise RuntimeError(f"Triton statistics kernel self-check on {device}: column {i} of a "
                                   f"{x.dtype} piece of {x.numel()} elements is {a}, expected {b}")
        if not finite and not (math.isnan(r[2]) or math.isinf(r[2])):
            raise RuntimeError("Triton statistics kernel self-check: non-finite input gave a finite sum "
                               "of squares")


def available(device: torch.device) -> bool:
    """Whether the kernel can be used on ``device`` (triton imports, it launches there and its
    self-check passes; tried once per device, a failure is logged once)."""
    dkey = str(device)
    ok = _checked.get(dkey)
    if ok is None:
        with _lock:
            ok = _checked.get(dkey)
            if ok is None:
                ok = False
                if _get_kernels() is not None:
                    try:
                        self_check(device)
                        ok = True
                    except Exception as e:  # noqa: BLE001 - fall back to the eager kernel
                        log.warning("distgrad: Triton statistics kernel unusable on %s, using the eager "
                                    "torch kernel (%s: %s)", device, type(e).__name__, e)
                _checked[dkey] = ok
    return ok
