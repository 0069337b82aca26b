"""Cases of the fused Triton statistics kernel (``distgrad.stats.triton_kernel``), run by
tests/test_stats_triton.py in a fresh process with ``TRITON_INTERPRET=1`` (not collected by
pytest directly: the interpreter must be on before anything imports triton, and other tests
import it through torch.compile), so on CPU tensors under Triton's interpreter; with
``DISTGRAD_TEST_DEVICE=cuda`` the compiled kernels on CUDA tensors (``launch/gpu_check.sh``).

Against float64 references computed directly with torch and against the native CPU kernel:
sizes across the chunk (1,024) and block boundaries, NaN/Inf/-0.0 on those boundaries, empty
pieces, fp32/bf16/fp16, results independent of the launch grid, the block table and its cache,
the kernel forced through ``stats_table``. The interpreter costs milliseconds per operation:
sizes stay small, and blocks are made small (``block=``) to cross many block boundaries cheaply;
the kernel code does not depend on the block size, only the host-side table does, which is also
tested with the production size.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from distgrad import stats

from tests.dist.common import HostSyncs as _Syncs

CPU = torch.device("cpu")
DEV = torch.device(os.environ.get("DISTGRAD_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module")
def st():
    """``distgrad.stats.triton_kernel``, its kernels interpreted on CPU."""
    if DEV.type == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_stats_triton.py"
        assert "triton" not in sys.modules or "distgrad.stats.triton_jit" not in sys.modules
    from distgrad.stats import triton_kernel as stats_triton

    assert stats_triton._get_kernels() is not None, "triton is not installed (pip install -e .[gpu])"
    return stats_triton


def _data(n: int, seed: int) -> torch.Tensor:
    """fp32 ``[n]`` on the test device: wide dynamic range, 2% zeros, one -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    x[torch.randperm(n, generator=g)[: max(1, n // 50)]] = 0.0
    x[n // 2] = -0.0
    return x.to(DEV)


def _reference(x: torch.Tensor) -> list[float]:
    """float64 statistics computed directly with torch: numel, sum, sumsq, nan, inf, zeros,
    max, -min (NaN extrema when there is a NaN)."""
    d = x.double()
    nan = int(torch.isnan(d).sum())
    row = [d.numel(), d.sum().item(), (d * d).sum().item(), nan, int(torch.isinf(d).sum()), int((d == 0).sum())]
    return row + ([math.nan, math.nan] if nan else [d.max().item(), -d.min().item()])


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _check(row: torch.Tensor, x: torch.Tensor) -> None:
    """Counts and extrema exactly; sum within 1e-6 * sum |x|, sum of squares (and so the norm)
    within 1e-6 relative. Non-finite pieces: NaN/Inf propagate like float64."""
    r, want = row.tolist(), _reference(x)
    assert [r[0], r[3], r[4], r[5]] == [want[0], want[3], want[4], want[5]], (r, want)
    assert _same(r[6], want[6]) and _same(r[7], want[7]), (r, want)
    if bool(torch.isfinite(x).all()):
        abs_sum = x.double().abs().sum().item()
        assert abs(r[1] - want[1]) <= 1e-6 * abs_sum + 1e-300, (r[1], want[1])
        assert r[2] == pytest.approx(want[2], rel=1e-6)
    else:
        assert _same(r[1], want[1]) and _same(r[2], want[2]), (r, want)


SMALL_BLOCK = 2048
SIZES = [1, 15, 1023, 1024, 1025, 2047, 2048, 2049, 3 * 2048 + 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_float64_across_chunk_and_block_boundaries(st, dtype):
    pieces = [_data(n, n).to(dtype) for n in SIZES]
    tab = st.table(pieces, block=SMALL_BLOCK, cache=False)
    assert tab.shape == (len(pieces), 8) and tab.dtype == torch.float64
    for x, row in zip(pieces, tab):
        _check(row, x)


def test_production_block_size(st):
    """One piece crossing the real 16,384-element block boundary, one shorter."""
    pieces = [_data(st.BLOCK + 3, 1), _data(777, 2).half()]
    for x, row in zip(pieces, st.table(pieces, cache=False)):
        _check(row, x)


def test_nonfinite_and_negative_zero_on_boundaries(st):
    n = 2 * SMALL_BLOCK + 77
    x = _data(n, 7)
    pieces = []
    for i in (0, 1023, 1024, 2047, 2048, n - 1):
        y = x.clone()
        y[i] = math.nan
        z = x.clone()
        z[i] = math.inf
        z[(i + 1025) % n] = -math.inf
        m = x.clone()
        m[i] = -0.0
        pieces += [y, z, m]
        if i == 2048:
            pieces += [y.half(), z.bfloat16()]
    pieces += [torch.full((33,), math.nan, device=DEV), torch.full((5,), -math.inf, device=DEV),
               torch.zeros(1500, device=DEV).neg()]
    tab = st.table(pieces, block=SMALL_BLOCK, cache=False)
    for p, row in zip(pieces, tab):
        _check(row, p)
    assert math.isnan(tab[1, 1]) and tab[1, 2] == math.inf  # inf + -inf; inf**2
    assert tab[1, 6] == math.inf and tab[1, 7] == math.inf  # +-Inf extrema kept


def test_result_does_not_depend_on_the_grid(st):
    pieces = [_data(n, n) for n in (3 * SMALL_BLOCK + 5, 17, 2 * SMALL_BLOCK)] + [_data(1500, 9).bfloat16()]
    pieces[0][SMALL_BLOCK + 1] = math.inf
    ref = st.table(pieces, block=SMALL_BLOCK, cache=False)
    for g in (2, 3, 100):
        got = st.table(pieces, grid=g, block=SMALL_BLOCK, cache=False)
        assert torch.equal(got.nan_to_num(), ref.nan_to_num()) and torch.equal(got.isnan(), ref.isnan())


def test_equals_native_kernel(st):
    native = stats._native()
    assert native is not None, "the native kernel needs a C compiler (cc/gcc/clang)"
    pieces = [_data(n, 100 + n) for n in (1, 1025, 2 * SMALL_BLOCK + 3)] + [_data(4000, 5).bfloat16()]
    pieces[2][SMALL_BLOCK] = math.nan
    tri = st.table(pieces, block=SMALL_BLOCK, cache=False)
    nat = stats._call_native(native, [p.cpu() for p in pieces]).to(DEV)
    assert torch.equal(tri[:, [0, 3, 4, 5]], nat[:, [0, 3, 4, 5]])
    assert torch.equal(tri[:, 6:].isnan(), nat[:, 6:].isnan())
    assert torch.equal(tri[:, 6:].nan_to_num(), nat[:, 6:].nan_to_num())
    fin = torch.isfinite(nat[:, 2])
    assert torch.allclose(tri[fin, 1:3], nat[fin, 1:3], rtol=1e-6, atol=0)


def test_block_table_and_cache(st):
    """The host table on the production block size: blocks grouped by dtype, addresses, lengths,
    per-piece first block/count/numel; the cache hits for the same pieces and misses when one
    changes."""
    base = torch.zeros(3 * st.BLOCK + 10, device=DEV)
    pieces = [base[: st.BLOCK + 1], torch.zeros(5, dtype=torch.bfloat16, device=DEV), base[st.BLOCK + 4:]]
    meta, groups = st.block_table(pieces)
    nblk = [2, 1, 3]  # 16385, 5 and 2 * 16384 + 6 elements
    nb = sum(nblk)
    assert meta.size == 2 * nb + 9
    assert [(c, lo, n) for c, lo, n, _ in groups] == [(0, 0, 5), (1, 5, 1)]
    assert groups[0][3] is True and groups[1][3] == (pieces[1].data_ptr() % 16 == 0)
    addr, lens = meta[:nb], meta[nb:2 * nb]
    first, count, numel = meta[2 * nb:2 * nb + 3], meta[2 * nb + 3:2 * nb + 6], meta[2 * nb + 6:]
    assert first.tolist() == [0, 5, 2] and count.tolist() == nblk and numel.tolist() == [p.numel() for p in pieces]
    p0, p2 = pieces[0].data_ptr(), pieces[2].data_ptr()
    assert addr.tolist() == [p0, p0 + 4 * st.BLOCK, p2, p2 + 4 * st.BLOCK, p2 + 8 * st.BLOCK, pieces[1].data_ptr()]
    assert lens.tolist() == [st.BLOCK, 1, st.BLOCK, st.BLOCK, 6, 5]

    a, b = _data(3000, 1), _data(100, 2)
    st._cache.clear()
    first_out = st.table([a, b], block=SMALL_BLOCK)
    meta_obj = st._cache[str(DEV)][1]
    again = st.table([a, b], block=SMALL_BLOCK)
    assert st._cache[str(DEV)][1] is meta_obj and torch.equal(first_out, again)
    c = _data(101, 3)
    changed = st.table([a, c], block=SMALL_BLOCK)
    assert st._cache[str(DEV)][1] is not meta_obj
    _check(changed[1], c)


def test_empty_list_and_self_check(st):
    assert st.table([]).shape == (0, 8)
    st.self_check(DEV)  # raises on any difference
    assert st.available(DEV)


def test_stats_table_with_the_triton_kernel_forced(st, monkeypatch):
    """``DISTGRAD_STATS_KERNEL=triton`` routes the eligible pieces through the kernel and the
    others (fp64, non-contiguous) through eager into the same table, in their order; empty
    pieces get the identities; :func:`distgrad.stats.kernel_use` shows which kernel ran."""
    from distgrad.stats import kernels as stats_kernels

    monkeypatch.setattr(stats_kernels, "_kernel", "triton")
    base = _data(5000, 3)
    pieces = [base, None, base[:0], base.bfloat16(), base.half(), base.double(), base[::3], base[1:4001]]
    before = stats.kernel_use()
    tab = stats.stats_table(pieces, DEV)
    used = {k: v - before.get(k, 0) for k, v in stats.kernel_use().items()}
    assert used == {"triton": 4, "eager": 2} or used == {"triton": 4, "eager": 2, "native": 0}, used
    for i, (p, row) in enumerate(zip(pieces, tab)):
        if p is None or p.numel() == 0:
            assert row.tolist() == [0.0] * 6 + [-math.inf] * 2
        elif i in (5, 6):  # fp64 and non-contiguous: exactly what the eager kernel gives
            assert torch.equal(row.nan_to_num(), stats._piece_stats_eager(p).nan_to_num())
        else:
            _check(row, p)
    # the same through pack_local: the packed SUM/MAX blocks equal the eager kernel's counts/extrema
    monkeypatch.setattr(stats_kernels, "_kernel", "eager")
    eager = stats.stats_table(pieces, DEV)
    assert torch.equal(tab[:, [0, 3, 4, 5]], eager[:, [0, 3, 4, 5]])
    assert torch.equal(tab[:, 6:].nan_to_num(), eager[:, 6:].nan_to_num())


def test_auto_on_cpu_never_uses_triton(st, monkeypatch):
    """``auto`` keeps the native/eager kernels on CPU, even where triton could run."""
    from distgrad.stats import kernels as stats_kernels

    monkeypatch.setattr(stats_kernels, "_kernel", "auto")
    before = stats.kernel_use()
    stats.stats_table([_data(100, 1).cpu()], CPU)
    assert stats.kernel_use().get("triton", 0) == before.get("triton", 0)


def test_no_host_sync_in_the_statistics_pass(st, monkeypatch):
    """``pack_local`` with the Triton kernel reads nothing back from the device, for 3 or 30
    pieces (the interpreter costs ~50 ms per block), with the block table built (first call) or
    cached (second)."""
    from distgrad.stats import kernels as stats_kernels

    monkeypatch.setattr(stats_kernels, "_kernel", "triton")
    assert st.available(DEV)  # the one-time self-check reads the device; not counted below
    for n_pieces in (3, 30):
        pieces = [_data(50 + i, i) for i in range(n_pieces)]
        layout = stats.Layout(n_pieces, 1)
        for _ in range(2):
            before = stats.kernel_use().get("triton", 0)
            with _Syncs() as mode:
                stats.pack_local(pieces, layout, 0, DEV)
            assert mode.n == 0 and stats.kernel_use()["triton"] - before == n_pieces
