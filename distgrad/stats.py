"""Statistics core: per-parameter sufficient statistics of local gradient pieces, packed into
two float64 tensors and combined across ranks with exactly two collectives (one SUM, one MAX),
then copied to the host once.

Knows nothing about engines: an engine adapter (``distgrad.engines``) hands it, per trainable
parameter, the 1-D piece of the reduced gradient that this rank holds (or None).

Kernels (chosen per piece; ``DISTGRAD_STATS_KERNEL=auto|native|compile|eager``, default auto):

- ``native`` (auto on CPU for fp32 and bf16 pieces): one C function, compiled once per process
  with the system C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``; about 0.2 s) and loaded with
  ctypes, reads every piece once and produces all statistics in that single pass, for all pieces
  in one call (threads: ``torch.get_num_threads()``, results independent of the thread count). It
  is checked against float64 references on load; if there is no compiler, compilation fails or
  the check fails, the eager kernel is used (logged once). Accuracy: fp32 lane accumulators over
  chunks of 2048 elements (128 additions per lane: worst case ~8e-6 relative on a sum of
  squares; measured 2e-8 to 5e-8 on gradients and on heavy-tailed data), chunks and blocks
  combined in float64.
- ``compile``: the same statistics as one ``torch.compile``-d reduction per piece (Triton on
  CUDA, C++ on CPU), eager on any compilation failure. Not the default anywhere yet: it has
  only been measured on CPU, where ``native`` is faster (see docs/performance.md).
- ``eager`` (auto on CUDA and for other dtypes): about ten torch kernels per piece. fp32
  ``torch._foreach_norm`` / ``vector_norm`` reach ~1e-3 relative error on 13M elements on this
  project's CPU build (``shared/notes/engines.md``), so they are not used: the sum uses torch's
  cascade ``sum`` in fp32 (~1e-8 relative to sum |g|) and the sum of squares fp32 dot products
  over chunks of 2**16 elements accumulated in float64 (~4e-8 to 3e-7 relative on gradients,
  up to ~1e-5 on heavy-tailed data).

Extrema and counts are exact in every kernel. All partial results are float64 from the packing
on, and integer counts are exact below 2**53.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from distgrad.record import ParamStats

log = logging.getLogger("distgrad")

#: columns of the SUM-reduced per-parameter block
SUM_COLS = ("numel", "sum", "sumsq", "nan", "inf", "zeros")
#: columns of the MAX-reduced per-parameter block (min is carried as -min)
MAX_COLS = ("max", "neg_min")
#: per-rank slots in the SUM block: replica fingerprint, non-finite element count, error flag
RANK_COLS = ("fingerprint", "nonfinite", "error")
#: trailing SUM slots: observed loss sum and count (micro-batches x ranks)
TAIL_COLS = ("loss_sum", "loss_count")

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


def _fused_reduction(x: torch.Tensor) -> torch.Tensor:
    """All statistics but numel of one piece as float64 ``[7]``, written so that
    ``torch.compile`` turns it into a single reduction over ``x``."""
    xf = x.float()
    f64 = torch.float64
    return torch.stack([
        xf.sum().to(f64), (xf * xf).sum().to(f64), (xf != xf).sum().to(f64),
        (xf.abs() == float("inf")).sum().to(f64), (xf == 0).sum().to(f64),
        xf.amax().to(f64), -xf.amin().to(f64)])


# ----------------------------------------------------------------------------------------------
# kernel selection

_KERNELS = ("auto", "native", "compile", "eager")
_kernel = os.environ.get("DISTGRAD_STATS_KERNEL", "auto").strip().lower() or "auto"
if _kernel not in _KERNELS:
    log.warning("distgrad: DISTGRAD_STATS_KERNEL=%r is not one of %s; using auto", _kernel, _KERNELS)
    _kernel = "auto"


def set_stats_kernel(name: str) -> None:
    """Choose the statistics kernel for this process: ``auto`` (native C on CPU fp32/bf16,
    eager elsewhere), ``native``, ``compile`` or ``eager``. ``native`` and ``compile`` fall back
    to eager for pieces they cannot take or when they are unavailable. The environment variable
    ``DISTGRAD_STATS_KERNEL`` sets the initial choice."""
    global _kernel
    if name not in _KERNELS:
        raise ValueError(f"stats kernel must be one of {_KERNELS}, got {name!r}")
    _kernel = name


def stats_kernel() -> str:
    """The kernel chosen with :func:`set_stats_kernel` / ``DISTGRAD_STATS_KERNEL``."""
    return _kernel


# ----------------------------------------------------------------------------------------------
# native kernel: one pass per piece, all pieces in one call

_C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>

#define LANES 16
#define CHUNK 2048   /* fp32 lane accumulators restart every CHUNK elements */
#define BLOCK 65536  /* unit of work for threads; partials combined in order, in float64 */

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = ((uint32_t)b) << 16; float f; memcpy(&f, &u, sizeof f); return f;
}

/* out[0..6]: sum, sumsq, nan, inf, zeros, max, min of n elements; max/min skip NaN. */
#define DG_BLOCK_FN(NAME, T, LOAD)                                                         \
static void NAME(const T* restrict x, int64_t n, double* restrict out) {                  \
    double s = 0, ss = 0, cn = 0, ci = 0, cz = 0;                                          \
    float mx = -INFINITY, mn = INFINITY;                                                   \
    for (int64_t b = 0; b < n; b += CHUNK) {                                               \
        const int64_t e = n - b < CHUNK ? n - b : CHUNK;                                   \
        const T* restrict p = x + b;                                                       \
        float ls[LANES], lq[LANES], lmx[LANES], lmn[LANES];                                \
        int32_t lz[LANES], ln[LANES], li[LANES];                                           \
        for (int k = 0; k < LANES; k++) {                                                  \
            ls[k] = 0.f; lq[k] = 0.f; lmx[k] = -INFINITY; lmn[k] = INFINITY;               \
            lz[k] = 0; ln[k] = 0; li[k] = 0;                                               \
        }                                                                                  \
        int64_t i = 0;                                                                     \
        for (; i + LANES <= e; i += LANES) {                                               \
            for (int k = 0; k < LANES; k++) {                                              \
                const float v = LOAD(p[i + k]);                                            \
                ls[k] += v; lq[k] += v * v;                                                \
                lmx[k] = v > lmx[k] ? v : lmx[k];                                          \
                lmn[k] = v < lmn[k] ? v : lmn[k];                                          \
                lz[k] += (v == 0.f); ln[k] += (v != v); li[k] += (fabsf(v) == INFINITY);   \
            }                                                                              \
        }                                                                                  \
        for (; i < e; i++) {                                                               \
            const float v = LOAD(p[i]);                                                    \
            ls[0] += v; lq[0] += v * v;                                                    \
            lmx[0] = v > lmx[0] ? v : lmx[0];                                              \
            lmn[0] = v < lmn[0] ? v : lmn[0];                                              \
            lz[0] += (v == 0.f); ln[0] += (v != v); li[0] += (fabsf(v) == INFINITY);       \
        }                                                                                  \
        for (int k = 0; k < LANES; k++) {                                                  \
            s += ls[k]; ss += lq[k]; cz += lz[k]; cn += ln[k]; ci += li[k];                \
            mx = lmx[k] > mx ? lmx[k] : mx; mn = lmn[k] < mn ? lmn[k] : mn;                \
        }                                                                                  \
    }                                                                                      \
    out[0] = s; out[1] = ss; out[2] = cn; out[3] = ci; out[4] = cz; out[5] = mx; out[6] = mn; \
}

#define DG_ID(v) (v)
DG_BLOCK_FN(block_f32, float, DG_ID)
DG_BLOCK_FN(block_bf16, uint16_t, bf16_to_f32)

typedef struct {
    const int64_t *ptr, *len; const int32_t *kind; double *part; int64_t lo, hi;
} job_t;

static void run_blocks(const job_t* j) {
    for (int64_t i = j->lo; i < j->hi; i++) {
        if (j->kind[i] == 0) block_f32((const float*)(intptr_t)j->ptr[i], j->len[i], j->part + 7 * i);
        else block_bf16((const uint16_t*)(intptr_t)j->ptr[i], j->len[i], j->part + 7 * i);
    }
}

static void* worker(void* arg) { run_blocks((const job_t*)arg); return NULL; }

/* P pieces (kind 0 = float32, 1 = bfloat16; len > 0) -> out[P][8]:
   numel, sum, sumsq, nan, inf, zeros, max, -min (max and -min are NaN when nan > 0).
   Returns 0, or -1 when memory could not be allocated. */
int dg_stats(int64_t P, const int64_t* ptrs, const int64_t* lens, const int32_t* kinds,
             double* out, int32_t nthreads) {
    int64_t nb = 0, total = 0;
    for (int64_t p = 0; p < P; p++) { nb += (lens[p] + BLOCK - 1) / BLOCK; total += lens[p]; }
    int64_t* bptr = malloc(sizeof(int64_t) * (nb + 1));
    int64_t* blen = malloc(sizeof(int64_t) * (nb + 1));
    int32_t* bkind = malloc(sizeof(int32_t) * (nb + 1));
    double* part = malloc(sizeof(double) * 7 * (nb + 1));
    if (!bptr || !blen || !bkind || !part) { free(bptr); free(blen); free(bkind); free(part); return -1; }
    int64_t b = 0;
    for (int64_t p = 0; p < P; p++) {
        const int64_t esize = kinds[p] == 0 ? 4 : 2;
        for (int64_t o = 0; o < lens[p]; o += BLOCK, b++) {
            bptr[b] = ptrs[p] + o * esize;
            blen[b] = lens[p] - o < BLOCK ? lens[p] - o : BLOCK;
            bkind[b] = kinds[p];
        }
    }
    int64_t T = nthreads < 1 ? 1 : nthreads;
    if (T > total / (4 * BLOCK)) T = total / (4 * BLOCK);
    if (T < 1) T = 1;
    if (T > 64) T = 64;
    job_t jobs[64];
    pthread_t tid[64];
    int started[64];
    for (int64_t t = 0; t < T; t++) {
        jobs[t] = (job_t){bptr, blen, bkind, part, nb * t / T, nb * (t + 1) / T};
        started[t] = t > 0 && pthread_create(&tid[t], NULL, worker, &jobs[t]) == 0;
    }
    run_blocks(&jobs[0]);
    for (int64_t t = 1; t < T; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run_blocks(&jobs[t]);
    }
    b = 0;
    for (int64_t p = 0; p < P; p++) {
        double s = 0, ss = 0, cn = 0, ci = 0, cz = 0, mx = -INFINITY, mn = INFINITY;
        for (int64_t o = 0; o < lens[p]; o += BLOCK, b++) {
            const double* q = part + 7 * b;
            s += q[0]; ss += q[1]; cn += q[2]; ci += q[3]; cz += q[4];
            mx = q[5] > mx ? q[5] : mx; mn = q[6] < mn ? q[6] : mn;
        }
        double* r = out + 8 * p;
        r[0] = (double)lens[p]; r[1] = s; r[2] = ss; r[3] = cn; r[4] = ci; r[5] = cz;
        r[6] = cn > 0 ? NAN : mx; r[7] = cn > 0 ? NAN : -mn;
    }
    free(bptr); free(blen); free(bkind); free(part);
    return 0;
}
"""

_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_native_lock = threading.Lock()
_native_fn = None  # the loaded dg_stats, False once it proved unavailable, None before trying


def _compile_native():
    """Compile and load ``_C_SOURCE``; returns the ctypes function or raises."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler found (set CC)")
    d = tempfile.mkdtemp(prefix="distgrad-kernel-")
    try:
        src, so = os.path.join(d, "stats.c"), os.path.join(d, "stats.so")
        with open(src, "w") as f:
            f.write(_C_SOURCE)
        errors = []
        # -ffast-math must not be used: it would break NaN/Inf counting and NaN-skipping extrema
        for arch in (["-march=native"], []):
            cmd = [cc, "-O3", *arch, "-fno-math-errno", "-std=gnu99", "-shared", "-fPIC", "-pthread",
                   "-o", so, src]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                break
            errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[-500:]}")
        else:
            raise RuntimeError("; ".join(errors))
        lib = ctypes.CDLL(so)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    fn = lib.dg_stats
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int32]
    fn._keep = lib  # keep the library loaded as long as the function lives
    return fn


def _call_native(fn, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
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


def _self_check(fn) -> None:
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


def _native():
    """The native kernel function, or None when unavailable (tried once per process)."""
    global _native_fn
    if _native_fn is None:
        with _native_lock:
            if _native_fn is None:
                try:
                    if os.name != "posix":
                        raise RuntimeError("only built on POSIX systems")
                    fn = _compile_native()
                    _self_check(fn)
                    _native_fn = fn
                except Exception as e:  # noqa: BLE001 - fall back to the eager kernel
                    log.warning("distgrad: native statistics kernel unavailable, using the eager torch "
                                "kernel (%s: %s)", type(e).__name__, e)
                    _native_fn = False
    return _native_fn or None


# ----------------------------------------------------------------------------------------------
# torch.compile kernel

_compiled = None  # compiled _fused_reduction, False once compilation failed


def _compiled_fn():
    global _compiled
    if _compiled is None:
        try:
            _compiled = torch.compile(_fused_reduction, dynamic=True)
        except Exception as e:  # noqa: BLE001
            log.warning("distgrad: torch.compile unavailable for the statistics, using eager (%s)", e)
            _compiled = False
    return _compiled or None


def _piece_stats_compiled(x: torch.Tensor) -> torch.Tensor:
    global _compiled
    fn = _compiled_fn()
    if fn is not None:
        try:
            r = fn(x)
            n = torch.full((1,), float(x.numel()), dtype=torch.float64, device=r.device)
            return torch.cat([n, r])
        except Exception as e:  # noqa: BLE001
            log.warning("distgrad: compiled statistics failed, using eager from now on (%s: %s)",
                        type(e).__name__, e)
            _compiled = False
    return _piece_stats_eager(x)


# ----------------------------------------------------------------------------------------------

def stats_table(pieces: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Local statistics of all pieces as one float64 ``[P, 8]`` tensor on ``device``:
    ``SUM_COLS`` then ``MAX_COLS`` per row, rows as documented in :func:`piece_stats` (empty
    pieces: identities of SUM and MAX; NaN max/-min where the piece has a NaN). No host sync."""
    P = len(pieces)
    kernel = _kernel
    rows: list[torch.Tensor | None] = [None] * P
    native_idx: list[int] = []
    fn = None
    if kernel in ("auto", "native") and any(
            p is not None and p.device.type == "cpu" and p.dtype in _NATIVE_DTYPES for p in pieces):
        fn = _native()
    for i, p in enumerate(pieces):
        if p is None or p.numel() == 0:
            continue
        if fn is not None and p.device.type == "cpu" and p.dtype in _NATIVE_DTYPES and p.is_contiguous():
            native_idx.append(i)
    native = _call_native(fn, [pieces[i] for i in native_idx]) if native_idx else None
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
        else:
            rows[i] = _piece_stats_eager(p)
    if native is not None:
        for j, i in enumerate(native_idx):
            rows[i] = native[j]
    if not rows:
        return torch.zeros((0, len(SUM_COLS) + len(MAX_COLS)), dtype=torch.float64, device=device)
    return torch.stack([r.to(device) for r in rows])


@dataclasses.dataclass
class Layout:
    """Positions in the packed tensors for P parameters and W ranks.

    SUM block, float64 ``[P*6 + W*3 + 2]``: per-parameter ``SUM_COLS`` row-major, then per-rank
    ``RANK_COLS`` (each rank writes only its own slot, others stay 0, so SUM gathers them),
    then ``TAIL_COLS``. MAX block, float64 ``[P*2]``: per-parameter ``MAX_COLS``.
    """

    n_params: int
    world_size: int

    @property
    def sum_size(self) -> int:
        return self.n_params * len(SUM_COLS) + self.world_size * len(RANK_COLS) + len(TAIL_COLS)

    @property
    def max_size(self) -> int:
        return self.n_params * len(MAX_COLS)

    @property
    def rank_offset(self) -> int:
        return self.n_params * len(SUM_COLS)

    @property
    def tail_offset(self) -> int:
        return self.rank_offset + self.world_size * len(RANK_COLS)


def pack_local(pieces: Sequence[torch.Tensor | None], layout: Layout, rank: int, device: torch.device,
               fingerprint: torch.Tensor | None = None, loss_sum: torch.Tensor | None = None,
               loss_count: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute and pack this rank's contribution.

    Args:
        pieces: length P; the 1-D local gradient piece of each parameter or None.
        layout: sizes; ``layout.n_params == len(pieces)``.
        rank: this rank's index in the process group (its slot in the per-rank block).
        device: device of the packed tensors (the gradients' device; CUDA under NCCL).
        fingerprint: 0-d tensor, sum of squares of the rank's full replicated gradient (DDP,
            ZeRO-0) or None.
        loss_sum: 0-d tensor, sum of losses observed on this rank since the last boundary.
        loss_count: number of losses in ``loss_sum``.

    Returns:
        ``(sum_block, max_block)``, float64 tensors of ``layout.sum_size`` and
        ``layout.max_size`` elements on ``device``. No host synchronisation happens here.
    """
    if len(pieces) != layout.n_params:
        raise ValueError(f"expected {layout.n_params} gradient pieces, got {len(pieces)}")
    table = stats_table(pieces, device)
    per_sum = table[:, : len(SUM_COLS)]
    per_max = torch.nan_to_num(table[:, len(SUM_COLS):], nan=-float("inf"), posinf=float("inf"),
                               neginf=-float("inf"))  # keep +-Inf: only NaN is mapped
    ranks = torch.zeros((layout.world_size, len(RANK_COLS)), dtype=torch.float64, device=device)
    if fingerprint is not None:
        ranks[rank, 0] = fingerprint.to(device=device, dtype=torch.float64)
    ranks[rank, 1] = per_sum[:, 3].sum() + per_sum[:, 4].sum()
    tail = torch.zeros(len(TAIL_COLS), dtype=torch.float64, device=device)
    if loss_sum is not None and loss_count:
        tail[0] = loss_sum.detach().to(device=device, dtype=torch.float64)
        tail[1] = float(loss_count)
    sum_block = torch.cat([per_sum.reshape(-1), ranks.reshape(-1), tail])
    return sum_block, per_max.reshape(-1)


def error_blocks(layout: Layout, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks a rank contributes when its local computation failed: identities of SUM/MAX with
    its error flag set, so every rank still makes the same collectives and learns of the error."""
    sum_block = torch.zeros(layout.sum_size, dtype=torch.float64, device=device)
    sum_block[layout.rank_offset + rank * len(RANK_COLS) + 2] = 1.0
    max_block = torch.full((layout.max_size,), -float("inf"), dtype=torch.float64, device=device)
    return sum_block, max_block


def reduce_blocks(sum_block: torch.Tensor, max_block: torch.Tensor,
                  group: "dist.ProcessGroup | None" = None) -> np.ndarray:
    """Combine the packed blocks over all ranks and bring them to the host.

    Exactly two collectives (``all_reduce`` SUM, ``all_reduce`` MAX; none when the default
    group is not initialised or has one rank) and one device-to-host copy.

    Returns:
        float64 numpy array ``[sum_size + max_size]``: the reduced SUM block then MAX block.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sum_block, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(max_block, op=dist.ReduceOp.MAX, group=group)
    return torch.cat([sum_block, max_block]).cpu().numpy()


@dataclasses.dataclass
class Reduced:
    """Host-side result of one sampled step, unpacked."""

    params: ParamStats
    fingerprints: np.ndarray  # [W]
    rank_nonfinite: np.ndarray  # [W]
    rank_error: np.ndarray  # [W]
    loss_sum: float
    loss_count: float


def unpack(host: np.ndarray, layout: Layout, names: Sequence[str], scale: float = 1.0) -> Reduced:
    """Turn the reduced host array into statistics.

    Args:
        host: output of :func:`reduce_blocks`.
        layout: the layout used to pack.
        names: P parameter names.
        scale: the gradients were multiplied by this (fp16 loss scale); sum, min, max are
            divided by it and the sum of squares by its square, which is exact for the power-of-2
            scales dynamic loss scaling uses.
    """
    P = layout.n_params
    s = host[: layout.sum_size]
    m = host[layout.sum_size:]
    per = s[: layout.rank_offset].reshape(P, len(SUM_COLS))
    ranks = s[layout.rank_offset: layout.tail_offset].reshape(layout.world_size, len(RANK_COLS))
    tail = s[layout.tail_offset:]
    mx = m.reshape(P, len(MAX_COLS))
    nan = per[:, 3]
    with np.errstate(invalid="ignore"):
        vmax = np.where(nan > 0, np.nan, mx[:, 0]) / scale
        vmin = np.where(nan > 0, np.nan, -mx[:, 1]) / scale
    stats = ParamStats(
        names=list(names), numel=per[:, 0], sum=per[:, 1] / scale, sumsq=per[:, 2] / (scale * scale),
        nan=nan, inf=per[:, 4], zeros=per[:, 5], min=vmin, max=vmax)
    return Reduced(stats, ranks[:, 0].copy(), ranks[:, 1].copy(), ranks[:, 2].copy(),
                   float(tail[0]), float(tail[1]))


def global_norm(stats: ParamStats) -> float:
    """Global L2 norm over all parameters, ``sqrt(sum_p sumsq_p)`` (NaN/Inf propagate)."""
    return float(np.sqrt(np.sum(stats.sumsq)))


def replica_outliers(fingerprints: np.ndarray, rtol: float) -> list[int]:
    """Ranks whose replicated-gradient fingerprint disagrees with the reference value.

    The reference is the value shared (within ``rtol``) by the most ranks; ties go to the
    group containing the lowest rank, so with two ranks a mismatch is attributed to rank 1
    (with two copies there is no majority: document this when alerting). Non-finite
    fingerprints compare equal only to identical non-finite values.
    """
    fp = np.asarray(fingerprints, dtype=np.float64)
    w = len(fp)
    if w < 2:
        return []

    def same(a: float, b: float) -> bool:
        if not (np.isfinite(a) and np.isfinite(b)):
            return (np.isnan(a) and np.isnan(b)) or a == b
        return abs(a - b) <= rtol * max(abs(a), abs(b))

    best = max(range(w), key=lambda i: (sum(same(fp[i], fp[j]) for j in range(w)), -i))
    return [j for j in range(w) if not same(fp[best], fp[j])]
