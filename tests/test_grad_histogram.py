"""The gradient value distribution (distgrad.signals.histogram) against a float64 numpy reference
(np.frexp exponents of the full gradient): exponent-bin, below/above, zero, underflow and
non-finite counts are exact, for fp32/bf16/fp16/fp64 pieces holding zeros, subnormals of each
dtype, edge values, NaN and Inf, under each training dtype; through instrument() on one process
(record part, JSON round trip, Prometheus ratios); edges under loss scaling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import distgrad
from distgrad.naming.grouping import group_keys
from distgrad.record import StepRecord
from distgrad.signals.histogram import GradHistogram
from distgrad.signals import histogram as hist_mod
from distgrad.signals import histogram_native
from distgrad.signals.histogram import TRAINING_DTYPES, GradHistogramSignal
from tests.reference import check_histogram, histogram_reference

CPU = torch.device("cpu")


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Zeros, the dtype's subnormals and normals at the edges, powers of two and their
    neighbours below, NaN and +/-Inf, in ``dtype``."""
    fi = torch.finfo(dtype)
    tiny = fi.tiny
    sub_min = fi.smallest_normal * fi.eps  # smallest positive subnormal
    vals = [0.0, -0.0, sub_min, -sub_min, tiny * (1 - fi.eps), tiny, -tiny, tiny * 2, fi.max, -fi.max,
            float("nan"), float("inf"), -float("inf"), 1.0, -1.0, 0.75, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 65504.0,
            2.0 ** -64, 2.0 ** -65, 2.0 ** 16, 2.0 ** 15, 2.0 ** -126, 2.0 ** -127, 2.0 ** -133, 2.0 ** -149]
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    # powers of two and the next value below each, across the dtype's range
    e = torch.arange(-160, 130, dtype=torch.float64)
    p = torch.pow(2.0, e).to(dtype)
    below = torch.nextafter(p, torch.zeros_like(p))
    g = torch.Generator().manual_seed(int(fi.bits))
    rnd = (torch.randn(3000, generator=g, dtype=torch.float64)
           * torch.pow(2.0, torch.randint(-150, 130, (3000,), generator=g).double())).to(dtype)
    return torch.cat([t, p, below, -p, rnd])


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("train", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("lo,hi", [(-64, 16), (-126, 128), (-20, -10)])
def test_counts_equal_the_float64_reference(train, lo, hi, kernel, monkeypatch):
    """``auto`` on CPU: the native kernel (one pass); ``torch``: the torch kernels (CUDA's path)."""
    monkeypatch.setattr(hist_mod, "CHUNK", 1000)  # several chunks per piece (torch path)
    monkeypatch.setattr(hist_mod, "KERNEL", kernel)
    if kernel == "auto":
        assert histogram_native.native() is not None  # compiled and passed its self-check here
    names = ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.bias",
             "model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight", "lm_head.weight"]
    pieces = [special_values(torch.float32), special_values(torch.bfloat16), special_values(torch.float16),
              special_values(torch.float32)[::3], None]
    sig = GradHistogramSignal(names, lo, hi, train)
    s, m = sig.local(None, pieces, CPU)
    assert m is None and s.dtype == torch.float64 and s.numel() == sig.sum_size
    h = sig.decode(s.numpy(), 1.0)
    as64 = [p.double().numpy() if p is not None else np.zeros(0) for p in pieces]
    groups = {"0": np.concatenate(as64[:2]), "1": as64[2], "embed": as64[3], "head": as64[4]}
    check_histogram(h, groups, lo, hi, TRAINING_DTYPES[train][1])
    # the whole model: every list summed
    t = h.total()
    check_histogram(t, {"global": np.concatenate(as64)}, lo, hi, TRAINING_DTYPES[train][1])
    assert h.tiny == math.ldexp(1.0, TRAINING_DTYPES[train][1]) and h.scale_log2 == 0.0
    # the underflow ratio is the count over numel; zero ratio likewise
    assert h.underflow_ratio()["0"] == h.underflow[0] / h.numel[0] > 0
    assert math.isnan(h.underflow_ratio()["head"])


def test_fp64_pieces_and_fp64_training():
    names = ["a.weight", "b.weight"]
    x = special_values(torch.float64)
    sig = GradHistogramSignal(names, -126, 128, "fp64", [(r"^a\.", "A", "other"), (r"^b\.", "B", "other")])
    h = sig.decode(sig.local(None, [x, x[:100]], CPU)[0].numpy(), 1.0)
    check_histogram(h, {"A": x.numpy(), "B": x[:100].numpy()}, -126, 128, -1022)
    # fp32 pieces under an fp64 training dtype: their subnormals are no fp64 underflow: refused
    with pytest.raises(ValueError, match="fp64"):
        sig.local(None, [x.float(), None], CPU)


def test_edges_under_loss_scaling():
    sig = GradHistogramSignal(["w"], -4, 4, "fp16")
    g = torch.Generator().manual_seed(3)
    held = (torch.rand(5000, generator=g, dtype=torch.float64) * 40 - 20).exp2().float()  # log2|g| in [-20, 20)
    part = sig.local(None, [held], CPU)[0].numpy()
    for scale in (1024.0, 3.0):
        h = sig.decode(part, scale)
        assert h.scale_log2 == math.log2(scale)
        edges = h.log2_edges()
        np.testing.assert_array_equal(edges, np.arange(-4, 5) - math.log2(scale))
        # the unscaled values fall in the same bins, at the shifted edges (random values, none on an edge)
        unscaled = np.log2(np.abs(held.double().numpy()) / scale)
        want, _ = np.histogram(unscaled, bins=edges)
        assert h.counts[0] == want.tolist()
    # a power-of-two scale shifts the exponents by an integer: the fp16 underflow stays in held units
    assert sig.decode(part, 1024.0).underflow == sig.decode(part, 1.0).underflow


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_exponent"):
        GradHistogramSignal(["w"], -130, 0, "fp32")
    with pytest.raises(ValueError, match="dtype"):
        GradHistogramSignal(["w"], -10, 0, "fp8")
    with pytest.raises(distgrad.ConfigError, match="histogram.max_exponent"):
        distgrad.DistgradConfig(histogram={"min_exponent": 4, "max_exponent": 4})
    sig = GradHistogramSignal(["w"], -10, 0, "fp32")
    with pytest.raises(ValueError, match="integers"):
        sig.decode(np.full(sig.sum_size, 0.5), 1.0)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for lin in self.layers:
            x = torch.relu(lin(x))
        return self.head(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_through_instrument_one_process(dtype, tmp_path):
    torch.manual_seed(0)
    m = _Net().to(dtype)
    with torch.no_grad():
        m.layers[0].weight[:4] = 0.0  # dead rows: exact zeros in the next layer's gradient
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, histogram={"enabled": True},
                             sinks={"jsonl": {"path": str(tmp_path / "r.jsonl")}, "tensorboard": {"dir": str(tmp_path / "tb")}})
    recs: list[StepRecord] = []
    dg.add_hook(recs.append)
    grads = []
    for _ in range(2):
        loss = m(torch.randn(8, 6, dtype=dtype) * 1e-3).float().pow(2).mean() * 1e-30  # small: some underflow
        loss.backward()
        grads.append({n: p.grad.double().numpy().ravel().copy() for n, p in m.named_parameters()})
        opt.step()
        opt.zero_grad()
    dg.close()
    assert len(recs) == 2 and dg.counters["internal_errors"] == 0
    train = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    for rec, g in zip(recs, grads):
        h = rec.grad_histogram
        assert h is not None and h.dtype == train
        groups: dict[str, list] = {}
        for n, v in g.items():
            groups.setdefault(group_keys([n], "layer")[0], []).append(v)
        assert list(groups) == ["0", "1", "head"]
        check_histogram(h, {k: np.concatenate(v) for k, v in groups.items()}, -64, 16, -126)
        assert sum(h.zeros) > 0 and sum(h.underflow) + sum(h.below) > 0
        # the core statistics count the same zeros and non-finite elements, another way
        assert h.zero_ratio() == rec.aggregates.layer_zero_ratio
        assert dict(zip(h.layers, map(float, h.nonfinite))) == rec.aggregates.layer_nonfinite
        back = StepRecord.from_dict(rec.to_dict())
        assert back.grad_histogram == h
    # the JSONL record carries it
    import json
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [StepRecord.from_dict(d).grad_histogram for d in lines if "params" in d] == [r.grad_histogram for r in recs]
    # TensorBoard: real histograms of log2|g|, read back from the event file
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0})
    acc.Reload()
    assert {f"grad_log2_abs/{k}" for k in ("0", "1", "head", "global")} <= set(acc.Tags()["histograms"])
    for layer in ("0", "1", "head", "global"):
        events = acc.Histograms(f"grad_log2_abs/{layer}")
        assert [e.step for e in events] == [r.step for r in recs]
        for e, rec, g in zip(events, recs, grads):
            vals = np.concatenate([v for n, v in g.items() if layer == "global" or group_keys([n], "layer")[0] == layer])
            ref = histogram_reference(vals, -64, 16, -126)
            hv = e.histogram_value
            assert list(hv.bucket) == [0.0, ref["below"], *ref["counts"], ref["above"]]
            assert list(hv.bucket_limit) == [-65.0] + list(np.arange(-64, 18, dtype=np.float64))
            assert hv.num == ref["numel"] - ref["zeros"] - ref["nonfinite"]
            nz = np.flatnonzero(hv.bucket)
            assert hv.min == hv.bucket_limit[nz[0] - 1] and hv.max == hv.bucket_limit[nz[-1]]
    under = acc.Scalars("grad/underflow_ratio")
    assert [u.value for u in under] == pytest.approx([r.grad_histogram.total().underflow_ratio()["global"] for r in recs])
    # the offline report: its heat-map's counts are the records' bins, summed per bucket of steps
    if dtype == torch.float32:
        from distgrad.report import write_report
        from distgrad.report.histogram import SHIFT_MARGIN

        res = write_report(tmp_path / "r.jsonl", tmp_path / "report")
        assert (tmp_path / "report" / "grad_histogram.png") in res.pngs
        assert "grad_histogram.png" in res.html.read_text()
        rep = res.analysis.grad_histogram
        tots = [r.grad_histogram.total() for r in recs]
        got = rep.series["global"].counts.sum(axis=0)
        assert got[0] == sum(t.below[0] for t in tots) and got[-1] == sum(t.above[0] for t in tots)
        assert got[1:1 + SHIFT_MARGIN].sum() == 0
        np.testing.assert_array_equal(got[1 + SHIFT_MARGIN:-1], np.sum([t.counts[0] for t in tots], axis=0))
        assert rep.underflow_ratio["global"] == sum(t.underflow[0] for t in tots) / sum(t.numel[0] for t in tots)
        assert set(rep.series) == {"global", "0", "1", "head"}


def test_report_places_loss_scaled_bins_at_unscaled_exponents():
    from distgrad.record import ParamStats
    from distgrad.report.histogram import SHIFT_MARGIN, HistogramAccumulator

    def rec(step: int, scale_log2: float) -> StepRecord:
        p = ParamStats(["w"], [8], [0.0], [1.0], [0], [0], [0], [0.0], [0.0])
        r = StepRecord(step, step, 0.0, 1, p, 1.0)
        r.grad_histogram = GradHistogram("fp16", 2.0 ** -14, -4, 4, scale_log2, ["0"], [[0, 1, 2, 0, 0, 0, 0, 3]],
                                         [1], [1], [0], [1], [0], [8])
        return r

    acc = HistogramAccumulator(max_points=8)
    acc.add(rec(0, 0.0))
    acc.add(rec(1, 10.0))  # fp16 loss scale 2**10: held exponent e is e - 10 unscaled
    acc.add(rec(2, 9.6))  # not a power of two: rounded to 10, said in the caption
    rep = acc.result()
    assert rep.fractional and rep.exponents[0] == -4 - SHIFT_MARGIN and rep.exponents[-1] == 3
    c = rep.series["global"].counts
    base = 1 + SHIFT_MARGIN  # column of exponent -4
    assert c[0, base + 1] == 1 and c[0, base + 2] == 2 and c[0, base + 7] == 3 and c[0, 0] == 1 and c[0, -1] == 1
    assert c[1, base - 9] == 1 and c[1, base - 8] == 2 and c[1, base - 3] == 3 and c[1, 0] == 1 and c[1, -1] == 1
    np.testing.assert_array_equal(c[2], c[1])
    assert rep.top_layers() == ["0"] and rep.underflow_ratio["0"] == 3 / 24


def test_off_by_default():
    m = nn.Linear(2, 2)
    dg = distgrad.instrument(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), exporter={"enabled": False})
    assert not any(s.name == "grad_histogram" for s in dg.signals.signals)
    dg.close()
