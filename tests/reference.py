"""The comparisons shared by the reference-equality tests of every engine: per-parameter
statistics against ``tests/dist/common.full_stats``, gradient histograms against a float64 numpy
recomputation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distgrad.record import StepRecord
from distgrad.signals.histogram import GradHistogram


def case(results: dict, key: str) -> dict:
    """One case of a multi-rank driver's JSON output; fails the test with the driver's traceback
    when that case raised on the ranks."""
    c = results["cases"][key]
    if "error" in c:
        pytest.fail(f"{key} failed in the 2-rank run: {c['error']}\n{c.get('traceback', '')}")
    return c


def check_against(rec: StepRecord, ref: dict, rtol: float, exact: bool, skip: tuple = ()) -> None:
    """Assert that the per-parameter statistics of ``rec`` equal ``ref`` (from
    ``tests/dist/common.full_stats``), parameters in ``skip`` excepted.

    Tolerances (see tests/test_deepspeed_reference.py for the rationale): ``rtol`` relative on
    norm, std and the global norm; the mean within ``rtol`` relative or 1e-6 of the rms; with
    ``exact`` extrema and counts bit-equal, else extrema within ``rtol``."""
    p = rec.params
    assert set(p.names) == {k for k, v in ref.items() if v is not None}
    for i, n in enumerate(p.names):
        if n in skip:
            continue
        r = ref[n]
        assert p.numel[i] == r["numel"], n
        assert p.norm[i] == pytest.approx(r["norm"], rel=rtol), (n, "norm")
        assert p.std[i] == pytest.approx(r["std"], rel=rtol, abs=1e-12), (n, "std")
        assert abs(p.mean[i] - r["mean"]) <= max(rtol * abs(r["mean"]), 1e-6 * r["rms"]), (n, "mean")
        for stat, arr in (("min", p.min), ("max", p.max), ("abs_max", p.abs_max)):
            if exact:
                assert arr[i] == r[stat], (n, stat, arr[i], r[stat])
            else:
                assert arr[i] == pytest.approx(r[stat], rel=rtol, abs=1e-12), (n, stat)
        if exact:
            assert (p.nan[i], p.inf[i], p.zeros[i]) == (r["nan"], r["inf"], r["zeros"]), n
    if not skip:
        gref = math.sqrt(sum(v["norm"] ** 2 for v in ref.values() if v is not None))
        assert rec.grad_norm == pytest.approx(gref, rel=rtol)


def histogram_reference(values: np.ndarray, lo: int, hi: int, et: int) -> dict[str, object]:
    """Histogram of one group's values (float64, exact copies of the gradient elements)."""
    v = np.asarray(values, dtype=np.float64)
    fin = np.isfinite(v)
    zero = v == 0
    a = np.abs(v[fin & ~zero])
    _, e = np.frexp(a)
    fl = e.astype(np.int64) - 1  # floor(log2|x|), exact for every finite non-zero float64
    inside = (fl >= lo) & (fl < hi)
    return {"counts": np.bincount(fl[inside] - lo, minlength=hi - lo).tolist(),
            "below": int((fl < lo).sum()), "above": int((fl >= hi).sum()), "zeros": int(zero.sum()),
            "underflow": int((a < math.ldexp(1.0, et)).sum()), "nonfinite": int((~fin).sum()), "numel": int(v.size)}


def check_histogram(h: GradHistogram, groups: dict[str, np.ndarray], lo: int, hi: int, et: int) -> None:
    """Assert that each group's counts in ``h`` (layer ``j`` = the ``j``-th key of ``groups``)
    equal :func:`histogram_reference` of that group's float64 values."""
    assert h.layers == list(groups)
    for j, (name, vals) in enumerate(groups.items()):
        ref = histogram_reference(vals, lo, hi, et)
        got = {k: (getattr(h, k)[j]) for k in ref}
        assert got == ref, name
