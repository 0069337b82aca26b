"""The series budget, counted on what a scrape actually returns: a 70B-LLaMA-shaped model
(723 parameter tensors, widths scaled down) through Diagnostics and the Prometheus collector
with default settings stays under DistgradConfig.statistics.max_param_series (2,500), keeps every
non-finite parameter, drops stale label sets when the top-k changes, and the exported layer
norms equal the root-sum-square of the per-parameter float64 reference."""

from __future__ import annotations

import math

import numpy as np
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from distgrad.config import DistgradConfig
from distgrad.diagnostics import Diagnostics
from distgrad.naming.classify import classify
from distgrad.record import ParamStats, StepRecord
from distgrad.export.prometheus import PrometheusSink
from tests.synthetic import llama70b_layout


def _record(names, grads, step):
    g = [t.double().reshape(-1) for t in grads]
    stats = ParamStats(names=names, numel=[t.numel() for t in g], sum=[t.sum().item() for t in g],
                       sumsq=[t.pow(2).sum().item() for t in g],
                       nan=[int(torch.isnan(t).sum()) for t in g], inf=[int(torch.isinf(t).sum()) for t in g],
                       zeros=[int((t == 0).sum()) for t in g], min=[t.min().item() for t in g],
                       max=[t.max().item() for t in g])
    return StepRecord(step=step, micro_step=step, timestamp=1.0 + step, world_size=8, params=stats,
                      grad_norm=float(np.sqrt(stats.sumsq.sum())), loss=2.0,
                      headroom=(stats.abs_max / 3.4e38).tolist())


def _samples(sink):
    out = []
    for fam in text_string_to_metric_families(generate_latest(sink.registry).decode()):
        out += [(s.name, dict(s.labels), s.value) for s in fam.samples]
    return out


def test_70b_layout_under_budget_with_exact_layer_norms():
    names, shapes = llama70b_layout()
    assert len(names) == 723
    torch.manual_seed(0)
    grads = [torch.randn(shape) * (1 + i % 7) for i, shape in enumerate(shapes)]
    grads[100].view(-1)[0] = float("nan")  # a non-finite parameter outside the top-k by norm
    cfg = DistgradConfig()
    diag = Diagnostics(cfg, names)
    sink = PrometheusSink("127.0.0.1", 0, {"engine": "deepspeed"}, 8, serve=False, has_loss_scaler=False)
    rec = _record(names, grads, step=0)
    diag.on_record(rec)
    sink.write(rec)
    s = _samples(sink)
    assert len(s) <= cfg.statistics.max_param_series, len(s)
    per_param = {lab["param"] for n, lab, _ in s if n == "distgrad_param_grad_norm"}
    assert 50 <= len(per_param) < 723 and names[100] in per_param  # non-finite always kept
    # exact layer re-aggregation against the float64 reference
    layer_norm = {lab["layer"]: v for n, lab, v in s if n == "distgrad_layer_grad_norm"}
    ref: dict[str, float] = {}
    for name, g in zip(names, grads):
        lay = classify(name).layer
        ref[lay] = ref.get(lay, 0.0) + g.double().pow(2).sum().item()
    assert set(layer_norm) == set(ref) and len(ref) == 83  # 80 blocks + embed, norm, head
    for lay, sq in ref.items():
        if math.isnan(sq):
            assert math.isnan(layer_norm[lay])
        else:
            assert layer_norm[lay] == pytest_approx(math.sqrt(sq))

    # the next step has other top-k parameters: label sets of parameters that left are gone
    grads2 = [g * (0.01 if i in {names.index(p) for p in per_param} else 1.0) for i, g in enumerate(grads)]
    grads2[100] = grads2[100].nan_to_num()
    rec2 = _record(names, grads2, step=1)
    diag.on_record(rec2)
    sink.write(rec2)
    s2 = _samples(sink)
    per_param2 = {lab["param"] for n, lab, _ in s2 if n == "distgrad_param_grad_norm"}
    assert len(s2) <= cfg.statistics.max_param_series
    assert per_param2 != per_param
    exported_families = {n for n, _, _ in s2 if n.startswith("distgrad_param_")}
    for fam in exported_families:
        assert {lab["param"] for n, lab, _ in s2 if n == fam} <= per_param2, fam


def pytest_approx(x):
    import pytest

    return pytest.approx(x, rel=1e-9)
