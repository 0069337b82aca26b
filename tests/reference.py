"""The comparisons shared by the reference-equality tests of every engine: per-parameter
statistics against ``tests/dist/common.full_stats``, gradient histograms against a float64 numpy
recomputation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

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


def update_geometry_reference(before: dict, after: dict) -> dict:
    """float64 applied-update geometry from the full weights before and after one optimizer step
    (``{name: tensor or nested list}``; layer label = the second dotted component of
    ``layers.<i>.<...>``): ``{"param_rms", "param_ratio", "layer_rms", "layer_ratio", "rms",
    "ratio"}`` (see :mod:`distgrad.signals.update`)."""
    b = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in before.items()}
    d = {k: torch.as_tensor(after[k], dtype=torch.float64) - b[k] for k in b}
    out: dict = {"param_rms": {}, "param_ratio": {}, "layer_rms": {}, "layer_ratio": {}}
    lsums: dict[str, list[float]] = {}
    for k in d:
        dsq, wsq, n = float(d[k].pow(2).sum()), float(b[k].pow(2).sum()), d[k].numel()
        out["param_rms"][k] = math.sqrt(dsq / n)
        out["param_ratio"][k] = math.sqrt(dsq / wsq)
        acc = lsums.setdefault(k.split(".")[1], [0.0, 0.0, 0.0])
        acc[0] += dsq
        acc[1] += wsq
        acc[2] += n
    for lk, (dsq, wsq, n) in lsums.items():
        out["layer_rms"][lk] = math.sqrt(dsq / n)
        out["layer_ratio"][lk] = math.sqrt(dsq / wsq)
    tot = np.sum(list(lsums.values()), axis=0)
    out["rms"], out["ratio"] = math.sqrt(tot[0] / tot[2]), math.sqrt(tot[0] / tot[1])
    return out


def spectral_reference(updates: list[dict], names: list[str]) -> list[dict]:
    """The warm-started power iteration of :class:`distgrad.signals.update.UpdateGeometry` run in
    float64 on the full update matrices ``updates[t][name]`` (the matrices ``names``, in parameter
    order, viewed as ``shape[0] x rest``): per update ``{name: max(|A v|, |A^T u|)}``. The products
    of update t use the unit vectors ``u = A' v' / |A' v'|``, ``v = A'^T u' / |A'^T u'|`` of update
    t-2's products (the reduction of update t-1 arrives after update t's products are taken); the
    first two updates use the signal's seeded draw."""
    gen = torch.Generator().manual_seed(0)
    start = {}
    for k in names:
        a = torch.as_tensor(updates[0][k], dtype=torch.float64)
        rows, cols = a.shape[0], a.numel() // a.shape[0]
        v, u = torch.randn(cols, generator=gen, dtype=torch.float64), torch.randn(rows, generator=gen,
                                                                                 dtype=torch.float64)
        start[k] = (v / v.norm(), u / u.norm())
    vecs: list[dict] = [start, start]  # the vectors update t's products use
    out = []
    for t, upd in enumerate(updates):
        est, nxt = {}, {}
        for k in names:
            v, u = vecs[t][k]
            a = torch.as_tensor(upd[k], dtype=torch.float64)
            a = a.reshape(a.shape[0], -1)
            av, atu = a @ v, a.t() @ u
            est[k] = max(float(av.norm()), float(atu.norm()))
            nxt[k] = (atu / atu.norm(), av / av.norm())
        vecs.append(nxt)
        out.append(est)
    return out


def adafactor_trace(opt: torch.optim.Optimizer) -> float:
    """The trace of Adafactor's second-moment estimate as torch builds it (the full factored
    matrix ``row_var @ col_var / max(mean(row_var), eps1)``; ``variance`` for vectors)."""
    tot = 0.0
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state[p]
            if st.get("variance") is not None:
                tot += float(st["variance"].double().sum())
                continue
            rv, cv = st["row_var"].double(), st["col_var"].double()
            eps1 = g["eps"][0] if g["eps"][0] is not None else torch.finfo(p.dtype).eps
            tot += float((rv @ cv / rv.mean(dim=-2, keepdim=True).clamp(min=eps1)).sum())
    return tot
