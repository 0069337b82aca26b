"""Kernel selection (``DISTGRAD_STATS_KERNEL`` / :func:`set_stats_kernel`) and the per-piece
statistics table every kernel fills (see the package docstring for the kernels)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from distgrad.stats.compiled import _piece_stats_compiled
from distgrad.stats.eager import _piece_stats_eager
from distgrad.stats.layout import MAX_COLS, SUM_COLS
from distgrad.stats.native import _NATIVE_DTYPES, _call_native, _native

log = logging.getLogger("distgrad")

_KERNELS = ("auto", "native", "compile", "eager", "triton")
_ALIASES = {"compiled": "compile"}
_kernel = os.environ.get("DISTGRAD_STATS_KERNEL", "auto").strip().lower() or "auto"
_kernel = _ALIASES.get(_kernel, _kernel)
if _kernel not in _KERNELS:
    log.warning("distgrad: DISTGRAD_STATS_KERNEL=%r is not one of %s; using auto", _kernel, _KERNELS)
    _kernel = "auto"
_use: dict[str, int] = {}  # kernel -> pieces computed with it in this process


def set_stats_kernel(name: str) -> None:
    """Choose the statistics kernel for this process: ``auto`` (native C on CPU fp32/bf16,
    Triton on CUDA, eager elsewhere), ``native``, ``compile`` (alias ``compiled``), ``eager`` or
    ``triton``. ``native``, ``compile`` and ``triton`` fall back to eager for pieces they cannot
    take or when they are unavailable (logged once). ``triton`` on CPU tensors needs
    ``TRITON_INTERPRET=1`` (tests only). The environment variable ``DISTGRAD_STATS_KERNEL`` sets
    the initial choice."""
    global _kernel
    name = _ALIASES.get(name, name)
    if name not in _KERNELS:
        raise ValueError(f"stats kernel must be one of {_KERNELS}, got {name!r}")
    _kernel = name


def kernel_use() -> dict[str, int]:
    """How many non-empty pieces each kernel (``native``, ``triton``, ``compile``, ``eager``)
    has computed in this process: shows which kernel actually ran after fallbacks."""
    return dict(_use)


def _count(kernel: str, n: int) -> None:
    if n:
        _use[kernel] = _use.get(kernel, 0) + n


def stats_kernel() -> str:
    """The kernel chosen with :func:`set_stats_kernel` / ``DISTGRAD_STATS_KERNEL``."""
    return _kernel


def piece_stats(x: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Local sufficient statistics of one gradient piece.

    Args:
        x: 1-D gradient piece of any floating dtype (fp32, bf16, fp16, fp64), or None / empty
            when this rank holds no element of the parameter.
        device: where to create the result for an empty piece.

    Returns:
        ``(sums, maxes)``: float64 tensors of shape ``[6]`` (numel, sum, sumsq, nan count,
        inf count, zero count) and ``[2]`` (max, -min). An empty piece gives zeros and
        ``-inf`` (the identities of SUM and MAX). A piece containing NaN has NaN max/-min
        here; :func:`pack_local` replaces them with -inf before the MAX collective (NCCL and
        gloo do not define how NaN propagates through MAX) and :func:`unpack` restores NaN
        from the NaN count, matching ``torch.amax`` on the full tensor.
    """
    row = stats_table([x], x.device if x is not None else device)[0]
    return row[: len(SUM_COLS)], row[len(SUM_COLS):]


def stats_table(pieces: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Local statistics of all pieces as one float64 ``[P, 8]`` tensor on ``device``:
    ``SUM_COLS`` then ``MAX_COLS`` per row, rows as documented in :func:`piece_stats` (empty
    pieces: identities of SUM and MAX; NaN max/-min where the piece has a NaN). No host sync."""
    P = len(pieces)
    kernel = _kernel
    if kernel == "triton" or (kernel == "auto" and device.type == "cuda"):
        out = _triton_table(pieces, device)
        if out is not None:
            return out
        if kernel == "triton":
            kernel = "eager"
    rows: list[torch.Tensor | None] = [None] * P
    native_idx: list[int] = []
    native_in: list[torch.Tensor] = []
    fn = None
    if kernel in ("auto", "native") and any(
            p is not None and p.device.type == "cpu" and p.dtype in _NATIVE_DTYPES for p in pieces):
        fn = _native()
    for i, p in enumerate(pieces):
        if p is None or p.numel() == 0:
            continue
        if fn is not None and p.device.type == "cpu" and p.dtype in _NATIVE_DTYPES and p.is_contiguous():
            native_idx.append(i)
            native_in.append(p)
    native = _call_native(fn, native_in) if fn is not None and native_in else None
    _count("native", len(native_idx))
    if native is not None and len(native_idx) == P:
        return native.to(device)
    empty = torch.tensor([0.0] * len(SUM_COLS) + [-float("inf")] * len(MAX_COLS), dtype=torch.float64,
                         device=device)
    done = set(native_idx)
    for i, p in enumerate(pieces):
        if i in done:
            continue
        if p is None or p.numel() == 0:
            rows[i] = empty
        elif kernel == "compile":
            rows[i] = _piece_stats_compiled(p)
            _count("compile", 1)
        else:
            rows[i] = _piece_stats_eager(p)
            _count("eager", 1)
    if native is not None:
        for j, i in enumerate(native_idx):
            rows[i] = native[j]
    done_rows = [r for r in rows if r is not None]  # all P of them: every row is filled above
    if not done_rows:
        return torch.zeros((0, len(SUM_COLS) + len(MAX_COLS)), dtype=torch.float64, device=device)
    return torch.stack([r.to(device) for r in done_rows])


def _triton_table(pieces: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor | None:
    """All pieces through the fused Triton kernel (eligible ones; the others, fp64 or
    non-contiguous, through eager into the same table), or None when the kernel is unavailable
    on the device or fails (logged once; the caller falls back)."""
    from distgrad.stats import triton_kernel as tk

    dev = next((p.device for p in pieces if p is not None), device)
    if not any(tk.eligible(p) for p in pieces) or not tk.available(dev):
        return None
    take = [p if (p is not None and p.device == dev and tk.eligible(p)) else None for p in pieces]
    try:
        out = tk.table(take, device=dev)
    except Exception as e:  # noqa: BLE001 - fall back to eager from now on
        log.warning("distgrad: Triton statistics kernel failed on %s, using the eager torch kernel from "
                    "now on (%s: %s)", dev, type(e).__name__, e)
        tk._checked[str(dev)] = False
        return None
    _count("triton", sum(t is not None for t in take))
    for i, p in enumerate(pieces):
        if take[i] is None and p is not None and p.numel():
            out[i] = _piece_stats_eager(p).to(dev)
            _count("eager", 1)
    return out.to(device)
