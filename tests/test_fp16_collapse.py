"""fp16 loss-scale collapse under torch AMP ``GradScaler`` (no configured minimum), from real
runs on CPU (``torch.amp.GradScaler("cpu")`` with ``enabled=True`` scales, unscales, finds Inf
and skips steps exactly as on a GPU; the gradients are fp32, so they overflow at fp32's largest
value instead of fp16's, which changes where the overflow starts, not the scaler's logic).

* collapse: a residual branch whose activations grow 2.5x per step (a layer blowing up). Once
  the scaled gradients overflow, the scaler halves the scale every step but the gradients grow
  faster, so every step overflows and the scale falls without bound;
* healthy: occasional outlier batches overflow once each; the scaler halves, then grows back.

Checked: ``distgrad_loss_scale_drop_factor`` against the scaler's own scale history (the largest
scale of an applied step / the scale of the step), ``distgrad_loss_scale_collapsed`` from the
first step that is 1024x below (ten overflows) and never on the healthy run, the exported series,
and that the overflow steps count in ``overflow_steps`` / ``skipped_steps`` and not in
``nonfinite_steps`` (the loss itself stays finite)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import distgrad
from distgrad.diagnostics.loss_scale import LossScaleCollapse
from distgrad.record import StepRecord
from distgrad.export.prometheus import PrometheusSink


class BlowUp(nn.Module):
    """L1 regression loss of lin2(proj(x) + gain * tanh(lin1(x))): ``gain`` is the residual
    branch's scale (set per step); the gradients grow linearly with it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 1)
        self.proj = nn.Linear(8, 16)
        self.gain = 1.0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.lin2(self.proj(x) + self.gain * torch.tanh(self.lin1(x))).squeeze(-1)
        return (out - y).abs().mean()


def _run(steps: int, gain_at, scale_x_at, growth_interval: int, tmp_path) -> tuple[list[StepRecord], list, dict]:
    torch.manual_seed(0)
    model = BlowUp()
    opt = torch.optim.SGD(model.parameters(), lr=2e-2)
    # init_scale 2^100 puts the overflow of these fp32 gradients (scaled gradient > 3.4e38) at an
    # unscaled gradient of ~2.7e8, as an fp16 scaler at 2^16 overflows at ~1 (65504 / 2^16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100, growth_interval=growth_interval, enabled=True)
    inst = distgrad.instrument(model, optimizer=opt, scaler=scaler, exporter={"enabled": False},
                               sinks={"jsonl": {"path": str(tmp_path / "run.jsonl")}})
    records, history = [], []  # history: (scale used by the step, applied) from the scaler itself
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        model.gain = gain_at(step)
        x = torch.randn(32, 8, generator=g) * scale_x_at(step)
        loss = model(x, x.sum(-1))
        assert math.isfinite(float(loss.detach()))  # the loss stays finite: only the scaled gradients overflow
        scaler.scale(loss).backward()
        used = float(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        history.append((used, float(scaler.get_scale()) >= used))  # halved <=> the step was skipped
        opt.zero_grad(set_to_none=True)
        records.append(inst.last_record)
    counters = dict(inst.counters)
    inst.close()
    return records, history, counters


def _reference_drop(history, window: int = 1000) -> list[float | None]:
    """Largest scale of an applied step within the last ``window`` steps (else the last one ever)
    over each step's scale, by brute force."""
    out, last = [], None
    for i, (s, _) in enumerate(history):
        if history[i][1]:
            last = s
        inwin = [h[0] for j, h in enumerate(history[:i + 1]) if h[1] and j > i - window]
        ref = max(inwin) if inwin else last
        out.append(None if ref is None else max(1.0, ref / s))
    return out


def _scrape(rec: StepRecord) -> dict[str, float]:
    sink = PrometheusSink("127.0.0.1", 0, {"engine": "ddp"}, 1, serve=False)
    sink.write(rec)
    return {s.name: s.value for f in text_string_to_metric_families(generate_latest(sink.registry).decode())
            for s in f.samples if not s.labels}


def test_grad_scaler_collapse_fires_and_overflows_are_not_nonfinite(tmp_path):
    N = 42  # (beyond ~45 steps the unscaled gradients' squares overflow fp32 itself)
    recs, hist, c = _run(N, gain_at=lambda t: 2.5 ** t, scale_x_at=lambda t: 1.0, growth_interval=2000,
                         tmp_path=tmp_path)
    over = [r.step for r in recs if r.overflow]
    first = over[0]
    assert 10 < first < N - 12 and over == list(range(first, N))  # from then on every step overflows
    assert [r.overflow for r in recs] == [not a for _, a in hist]  # distgrad agrees with the scaler
    # overflows are counted as overflows (and skipped steps), never as non-finite steps
    assert c["overflow_steps"] == len(over) == c["skipped_steps"]
    assert c["nonfinite_steps"] == 0 and c["nonfinite_loss_steps"] == 0
    assert not any(math.isfinite(r.grad_norm) for r in recs if r.overflow)  # the statistics still show it
    # the drop factor equals the brute-force reference from the scaler's own history
    ref = _reference_drop(hist)
    assert [r.scaler.loss_scale_drop_factor for r in recs] == ref
    assert recs[first - 1].scaler.loss_scale_drop_factor == 1.0
    # collapsed from the 10th consecutive overflow's step on (2^100 / 2^90 = 1024), not before
    collapsed = [r.step for r in recs if r.scaler.loss_scale_collapsed]
    assert collapsed == list(range(first + 10, N))
    assert recs[first + 10].loss_scale == 2.0 ** 90
    assert all(not r.scaler.loss_scale_at_minimum for r in recs)  # GradScaler: no minimum
    m = _scrape(recs[-1])
    assert m["distgrad_loss_scale_collapsed"] == 1.0 and m["distgrad_loss_scale_at_minimum"] == 0.0
    assert m["distgrad_loss_scale_drop_factor"] == ref[-1] == 2.0 ** 100 / recs[-1].loss_scale
    assert m["distgrad_overflow_steps_total"] == len(over) and m["distgrad_nonfinite_steps_total"] == 0
    # the offline verdict names it (distgrad summary), and no non-finite gradient problem
    from distgrad.report import analyze
    kinds = {p.kind: p for p in analyze(tmp_path / "run.jsonl").problems}
    assert "nonfinite_grad" not in kinds
    assert kinds["loss_scale_collapse"].step == first + 10


def test_healthy_grad_scaler_run_with_occasional_overflows_does_not_collapse(tmp_path):
    outliers = set(range(25, 300, 40))  # one outlier batch every 40 steps overflows once
    recs, hist, c = _run(300, gain_at=lambda t: 1.0, scale_x_at=lambda t: 1e10 if t in outliers else 1.0,
                         growth_interval=20, tmp_path=tmp_path)
    over = [r.step for r in recs if r.overflow]
    assert over == sorted(outliers)
    assert c["overflow_steps"] == len(outliers) and c["nonfinite_steps"] == 0
    ref = _reference_drop(hist)
    assert [r.scaler.loss_scale_drop_factor for r in recs] == ref
    assert max(r.scaler.loss_scale_drop_factor for r in recs) == 2.0  # one halving, grown back
    assert not any(r.scaler.loss_scale_collapsed for r in recs)
    from distgrad.report import analyze
    a = analyze(tmp_path / "run.jsonl")
    assert a.healthy, a.verdict()


def test_collapse_ignores_the_initial_calibration_and_clears_after_recovery():
    det = LossScaleCollapse(factor=1024, window=100)
    # calibration: 20 overflows from 2^32 before any step applies: no reference, never collapsed
    for t in range(20):
        assert det.update(t, 2.0 ** (32 - t), applied=False) == (None, False)
    assert det.update(20, 2.0 ** 12, applied=True) == (1.0, False)
    # ten overflows in a row: collapsed at the tenth
    out = [det.update(21 + k, 2.0 ** (12 - k), applied=False) for k in range(11)]
    assert [d for d, _ in out] == [2.0 ** k for k in range(11)]
    assert [f for _, f in out] == [False] * 10 + [True]
    # training works again at 2^2: the reference leaves the window 100 steps after step 20
    assert det.update(40, 4.0, applied=True) == (1024.0, True)
    assert det.update(119, 4.0, applied=True) == (1024.0, True)
    assert det.update(120, 4.0, applied=True) == (1.0, False)
    assert det.update(121, 0.0, applied=False) == (math.inf, True)  # GradScaler underflowed to 0
    sd = det.state_dict()
    det2 = LossScaleCollapse(factor=1024, window=100)
    det2.load_state_dict(sd)
    assert det2.update(122, 4.0 / 2048, applied=False) == (2048.0, True)
    assert np.isfinite(det2.update(123, None, applied=False)[0] or 0.0)  # no scale: no value
