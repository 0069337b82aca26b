"""``distgrad report`` / ``summary`` for the packed signals (distgrad/report/signals.py): series
and FINDINGS from the JSONL log of real short runs with the signals on (the instrument on a tiny
model in this process), the expected finding derived from the rule applied to the logged values;
rule thresholds on hand-built records; an end-to-end report whose findings link runbook sections
that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

import distgrad
from distgrad.cli import main
from distgrad.record import StepRecord
from distgrad.signals.histogram import GradHistogram
from distgrad.report import analyze
from distgrad.report import signals as sig

RUNBOOK = Path(__file__).resolve().parents[1] / "docs" / "runbook.md"


class Net(nn.Module):
    """layers.0 -> relu -> layers.1 -> relu -> head (layer labels "0", "1", "head");
    ``x_scale`` scales the input, so ``layers.0.weight``'s gradient is that much smaller (a cold
    input feature: below fp16's normal range at 1e-6)."""

    def __init__(self, x_scale: float = 1.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 1)
        self.x_scale = x_scale

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.layers[0](x * self.x_scale))
        h = torch.relu(self.layers[1](h))
        return ((self.head(h).squeeze(-1) - y) ** 2).mean()


def run(tmp_path: Path, steps: int = 30, x_scale: float = 1.0, **cfg) -> Path:
    """Train Net with Adam on a linear teacher, distgrad on with ``cfg``, every step sampled."""
    torch.manual_seed(0)
    net = Net(x_scale)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    path = tmp_path / "run.jsonl"
    inst = distgrad.instrument(net, optimizer=opt, exporter={"enabled": False},
                               sinks={"jsonl": {"path": str(path)}}, **cfg)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(8, generator=g)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = net(x, x @ teacher)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert inst.counters["internal_errors"] == 0
    inst.close()
    return path


def records(path: Path) -> list[StepRecord]:
    return [StepRecord.from_dict(json.loads(x)) for x in path.read_text().splitlines() if '"params"' in x]


def anchors() -> set[str]:
    return {m.group(1) for m in re.finditer(r"^#+ (\S+)\s*$", RUNBOOK.read_text(), re.M)}


# ---------------------------------------------------------------- histogram: underflow
def expected_underflow(recs: list[StepRecord]) -> tuple[list[str], str, float]:
    """The rule recomputed from the logged counts: layers whose median underflow ratio over the
    last WINDOW records is >= UNDERFLOW_RATIO, the worst one and its median."""
    last = [r.grad_histogram for r in recs[-sig.WINDOW:]]
    layers = last[-1].layers
    med = {k: float(np.median([h.underflow[h.layers.index(k)] / h.numel[h.layers.index(k)] for h in last]))
           for k in layers}
    hit = [k for k in layers if med[k] >= sig.UNDERFLOW_RATIO]
    worst = max(hit, key=med.get) if hit else None
    return hit, worst, (med[worst] if worst else 0.0)


def test_underflow_finding_from_a_real_fp16_run(tmp_path):
    # fp16 training dtype without loss scaling: the cold input layer's gradients sit below 2^-14
    path = run(tmp_path, x_scale=1e-6, histogram={"enabled": True, "dtype": "fp16"})
    recs = records(path)
    hit, worst, med = expected_underflow(recs)
    assert worst == "0" and med > 0.4  # the run does what it is meant to
    a = analyze(path)
    f = [x for x in a.signals.findings if x.kind == "underflow"]
    assert len(f) == 1
    assert f[0].layer == worst
    assert f"{100 * med:.1f}% of layer {worst}'s gradient elements underflow fp16" in f[0].detail
    assert f"{len(hit)} layer(s)" in f[0].detail and "loss scal" in f[0].detail
    first = next(int(r.step) for r in recs
                 if r.grad_histogram.underflow[r.grad_histogram.layers.index(worst)]
                 >= sig.UNDERFLOW_RATIO * r.grad_histogram.numel[r.grad_histogram.layers.index(worst)])
    assert f[0].step == first
    assert a.healthy  # advice, not a problem: the verdict is unchanged
    # the global series is the logged total ratio
    s = next(s for s in a.signals.series if s.metric == "underflow_ratio")
    tot = recs[-1].grad_histogram.total()
    assert s.glob.last[-1, 0] == pytest.approx(tot.underflow[0] / tot.numel[0], rel=1e-12)
    assert s.layers == recs[-1].grad_histogram.layers
    z = next(s for s in a.signals.series if s.metric == "zero_ratio")
    assert z.glob.last[-1, 0] == pytest.approx(tot.zeros[0] / tot.numel[0], rel=1e-12)
    np.testing.assert_allclose(z.per_layer.last[-1], list(recs[-1].grad_histogram.zero_ratio().values()), rtol=1e-12)


def test_no_underflow_finding_in_fp32(tmp_path):
    path = run(tmp_path, steps=12, histogram={"enabled": True})
    hit, _, _ = expected_underflow(records(path))
    assert hit == []
    a = analyze(path)
    assert a.signals.findings == [] and a.signals.signals() == ["grad_histogram", "optimizer_signals"]  # Adam: default on


def hist_record(step: int, under: list[int], numel: int = 1000, dtype: str = "bf16") -> SimpleNamespace:
    """A record with only a histogram part (the accumulator reads ``step`` and the part)."""
    L = len(under)
    h = GradHistogram(dtype, 2.0 ** -126, -64, 16, 0.0, [f"l{i}" for i in range(L)], [[0] * 80 for _ in range(L)],
                      [0] * L, [0] * L, [0] * L, list(under), [0] * L, [numel] * L)
    return SimpleNamespace(step=step, grad_histogram=GradHistogram.from_dict(h.to_dict()))


@pytest.mark.parametrize("at,fires", [(sig.UNDERFLOW_RATIO, True), (sig.UNDERFLOW_RATIO - 0.001, False)])
def test_underflow_rule_threshold(at, fires):
    acc = sig.SignalsAccumulator(max_points=8)
    n = 1000
    k = round(at * n)
    # the median over the last WINDOW records decides; earlier records (0) do not count
    for s in range(5):
        acc.add(hist_record(s, [0, 0], n))
    for s in range(5, 5 + sig.WINDOW):
        acc.add(hist_record(s, [0, k if s % 2 else k + 1], n))  # median = k / n
    f = acc.result().findings
    assert bool(f) == fires
    if fires:
        assert f[0].layer == "l1" and f[0].step == 5 and "bf16" in f[0].detail and "vanishing" in f[0].detail


# ---------------------------------------------------------------- end to end
def test_report_end_to_end(tmp_path):
    path = run(tmp_path, x_scale=1e-6, histogram={"enabled": True, "dtype": "fp16"})
    out = tmp_path / "rep"
    assert main(["report", str(path), "-o", str(out), "--max-points", "8"]) == 0
    png = out / "signal_grad_histogram.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "report.html").read_text()
    assert 'id="finding-underflow"' in html and "signal_grad_histogram.png" in html
    text = (out / "summary.txt").read_text()
    assert "FINDINGS (1; advice, not problems)" in text
    linked = set(re.findall(r"docs/runbook\.md#([a-z0-9-]+)", text))
    assert linked and linked <= anchors()
    # every rule kind has its runbook section
    assert {"signal-underflow", "signal-noise-scale"} <= anchors()


def test_report_end_to_end_noise_scale(tmp_path):
    path = run_gns(tmp_path, 20.0, 2)
    out = tmp_path / "rep"
    assert main(["report", str(path), "-o", str(out)]) == 0
    assert (out / "signal_noise_scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "summary.txt").read_text()
    assert "Gradient noise scale: noise_scale = " in text and "larger batches would be efficient" in text
    assert 'id="finding-noise_scale"' in (out / "report.html").read_text()


# ---------------------------------------------------------------- noise scale
def run_gns(tmp_path: Path, noise: float, micro: int, gas: int = 4, steps: int = 40) -> Path:
    """Linear regression on a teacher with label noise ``noise``, ``gas`` micro-batches of
    ``micro`` samples per step (mean losses), the noise scale on; every step sampled."""
    torch.manual_seed(0)
    net = nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    path = tmp_path / f"gns{noise}.jsonl"
    inst = distgrad.instrument(net, optimizer=opt, exporter={"enabled": False}, sinks={"jsonl": {"path": str(path)}},
                               noise_scale={"enabled": True, "micro_batch_size": micro})
    g = torch.Generator().manual_seed(2)
    teacher = torch.randn(8, generator=g) * 3
    for _ in range(steps):
        for _ in range(gas):
            x = torch.randn(micro, 8, generator=g)
            y = x @ teacher + noise * torch.randn(micro, generator=g)
            ((net(x).squeeze(-1) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert inst.counters["internal_errors"] == 0
    inst.close()
    return path


def expected_noise(recs: list[StepRecord]) -> tuple[str | None, float, float, int]:
    """The rule on the logged noise-scale parts: (case, median B_simple, batch, first step)."""
    ok = [r for r in recs if r.noise_scale is not None and r.noise_scale.noise_scale is not None
          and r.noise_scale.ema_steps >= sig.NOISE_MIN_STEPS][-sig.WINDOW:]
    b = float(np.median([r.noise_scale.noise_scale for r in ok]))
    batch = ok[-1].noise_scale.big_batch
    case = "larger" if b >= sig.NOISE_FACTOR * batch else "past" if b <= batch / sig.NOISE_FACTOR else None
    return case, b, batch, int(ok[0].step)


@pytest.mark.parametrize("noise,micro,case", [(20.0, 2, "larger"), (0.0, 16, "past")])
def test_noise_scale_finding_from_real_runs(tmp_path, noise, micro, case):
    path = run_gns(tmp_path, noise, micro)
    recs = records(path)
    want, b, batch, first = expected_noise(recs)
    assert want == case  # each run lands on the side it is built for
    assert batch == 4 * micro
    f = [x for x in analyze(path).signals.findings if x.kind == "noise_scale"]
    assert len(f) == 1 and f[0].step == first and f[0].layer is None
    assert f"B_simple ~ {b:.4g} samples" in f[0].detail and f"batch of {batch:.4g}" in f[0].detail
    assert ("larger batches would be efficient" in f[0].detail) == (case == "larger")
    assert ("past the critical batch size" in f[0].detail) == (case == "past")
    assert "docs/runbook.md#signal-noise-scale" in f[0].detail


def gns_record(step: int, b: float | None, batch: float, ema_steps: int) -> SimpleNamespace:
    from distgrad.signals.noise_scale import GradientNoiseScale

    return SimpleNamespace(step=step, noise_scale=GradientNoiseScale.Part(micro_batches=4, small_batch=batch / 4, big_batch=batch,
                                                             noise_scale=b, ema_steps=ema_steps))


@pytest.mark.parametrize("b,fires", [(2 * 64.0, True), (2 * 64.0 - 1, False), (32.0, True), (33.0, False)])
def test_noise_scale_rule_threshold(b, fires):
    acc = sig.SignalsAccumulator(max_points=8)
    for s in range(sig.NOISE_MIN_STEPS - 1):  # before the averages have seen NOISE_MIN_STEPS: ignored
        acc.add(gns_record(s, 1e6, 64.0, s + 1))
    for s in range(sig.NOISE_MIN_STEPS - 1, sig.NOISE_MIN_STEPS - 1 + sig.WINDOW):
        acc.add(gns_record(s, b, 64.0, s + 1))
    f = acc.result().findings
    assert bool(f) == fires
    if fires:
        assert f[0].step == sig.NOISE_MIN_STEPS - 1


# ---------------------------------------------------------------- curvature
def run_curvature(tmp_path: Path, shift_at: int | None, steps: int = 40) -> Path:
    """Full-batch gradient descent on a fixed least-squares problem (a quadratic: along the
    steps the curvature only drifts down as the large-eigenvalue directions converge), curvature
    on; from step ``shift_at`` the pipeline stops normalising the inputs (x2), which multiplies
    the Hessian by 4."""
    torch.manual_seed(0)
    net = nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    path = tmp_path / f"curv{shift_at}.jsonl"
    inst = distgrad.instrument(net, optimizer=opt, exporter={"enabled": False}, sinks={"jsonl": {"path": str(path)}},
                               curvature={"enabled": True})
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(64, 8, generator=g)
    y = x0 @ torch.randn(8, generator=g)
    for step in range(steps):
        x = x0 * 2.0 if shift_at is not None and step >= shift_at else x0
        ((net(x).squeeze(-1) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert inst.counters["internal_errors"] == 0
    inst.close()
    return path


def expected_rise(recs: list[StepRecord], total=lambda r: r.curvature.total if r.curvature else None,
                  layer=lambda r: r.curvature.layer if r.curvature else {}) -> tuple[int, str | None, float] | None:
    """The rise rule recomputed from the logged values (default: the curvature): first record
    where the median of the last WINDOW values over the median of the WINDOW before is >=
    RISE_FACTOR (both > 0), for the total or a layer; the key of largest ratio then."""
    W = sig.WINDOW
    layers = sorted({k for r in recs for k in layer(r)})
    for i in range(2 * W - 1, len(recs)):
        win = recs[i - 2 * W + 1:i + 1]
        best = None
        for key in [None] + layers:
            vals = [total(r) if key is None else layer(r).get(key) for r in win]
            vals = [np.nan if v is None else v for v in vals]
            a, b = np.nanmedian(vals[:W]), np.nanmedian(vals[W:])
            if a > 0 and b > 0 and b / a >= sig.RISE_FACTOR and (best is None or b / a > best[2]):
                best = (int(recs[i].step), key, b / a)
        if best is not None:
            return best
    return None


def test_curvature_rise_from_a_real_run(tmp_path):
    recs = [r for r in records(run_curvature(tmp_path, shift_at=20)) if r.curvature is not None]
    want = expected_rise(recs)
    assert want is not None  # the run does what it is meant to
    f = [x for x in analyze(tmp_path / "curv20.jsonl").signals.findings if x.kind == "curvature_rise"]
    assert len(f) == 1
    assert (f[0].step, f[0].layer) == want[:2]
    assert f"rose {want[2]:.3g}x" in f[0].detail and "docs/runbook.md#signal-curvature-rise" in f[0].detail
    # without the shift: no finding, and the rule recomputed agrees
    recs = [r for r in records(run_curvature(tmp_path, shift_at=None)) if r.curvature is not None]
    assert expected_rise(recs) is None
    a = analyze(tmp_path / "curvNone.jsonl")
    assert not [x for x in a.signals.findings if x.kind == "curvature_rise"]
    s = next(s for s in a.signals.series if s.signal == "curvature")
    assert s.glob.last[-1, 0] == pytest.approx(recs[-1].curvature.total, rel=1e-12)


@pytest.mark.parametrize("after,fires", [(3.0, True), (2.99, False)])
def test_rise_rule_threshold(after, fires):
    from distgrad.signals.curvature import Curvature

    acc = sig.SignalsAccumulator(max_points=8)
    W = sig.WINDOW
    for s in range(2 * W):
        v = 1.0 if s < W else after
        acc.add(SimpleNamespace(step=s, curvature=Curvature.Part(layer={"a": 1.0, "b": v}, total=1.0)))
    f = acc.result().findings
    assert bool(f) == fires
    if fires:
        assert f[0].kind == "curvature_rise" and f[0].layer == "b" and f[0].step == 2 * W - 1


# ---------------------------------------------------------------- optimizer (Adam) signals
def run_adam(tmp_path: Path, shift_at: int | None, steps: int = 150) -> Path:
    """Adam (default betas) on a noisy linear teacher through Net; from step ``shift_at`` the
    pipeline stops normalising the inputs (x10): the gradients outgrow Adam's second moment,
    which follows them only at the rate 1 - beta2. ``optimizer_signals.every: 1``: the report's
    rules count their windows in records carrying the Adam part, and this 150-step run needs
    every step's (with the default 8 the window spans 8x the steps; docs/performance.md)."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    path = tmp_path / f"adam{shift_at}.jsonl"
    inst = distgrad.instrument(net, optimizer=opt, exporter={"enabled": False}, sinks={"jsonl": {"path": str(path)}},
                               optimizer_signals={"every": 1})
    g = torch.Generator().manual_seed(4)
    teacher = torch.randn(8, generator=g)
    for step in range(steps):
        x = torch.randn(32, 8, generator=g)
        y = x @ teacher + 0.1 * torch.randn(32, generator=g)
        if shift_at is not None and step >= shift_at:
            x = x * 10.0
        net(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert inst.counters["internal_errors"] == 0
    inst.close()
    return path


def expected_excursion(recs: list[StepRecord]) -> tuple[int, str | None] | None:
    """The excursion rule recomputed from the logged parts: first record from step
    ADAM_MIN_STEP whose last WINDOW records have a median update RMS > UPDATE_RMS_MAX or spike
    fraction > SPIKE_FRACTION_MAX; and that record's layer of largest update RMS."""
    ok = [r for r in recs if r.optimizer_signals is not None]
    for i in range(sig.WINDOW - 1, len(ok)):
        if ok[i].step < sig.ADAM_MIN_STEP:
            continue
        win = [r.optimizer_signals for r in ok[i - sig.WINDOW + 1:i + 1]]
        if np.median([o.update_rms for o in win]) > sig.UPDATE_RMS_MAX or \
                np.median([o.spike_fraction for o in win]) > sig.SPIKE_FRACTION_MAX:
            lay = ok[i].optimizer_signals.layer_update_rms
            return int(ok[i].step), max(lay, key=lay.get)
    return None


def test_adam_findings_from_real_runs(tmp_path):
    recs = records(run_adam(tmp_path, shift_at=120))
    want = expected_excursion(recs)
    assert want is not None and want[0] >= 120  # the run does what it is meant to
    a = analyze(tmp_path / "adam120.jsonl")
    f = {x.kind: x for x in a.signals.findings}
    assert (f["adam_excursion"].step, f["adam_excursion"].layer) == want
    assert "docs/runbook.md#signal-adam-excursion" in f["adam_excursion"].detail
    # the update RMS also rose (rise rule recomputed on the logged values, global and per layer)
    withp = [r for r in recs if r.optimizer_signals is not None]  # the first step has no optimizer state yet
    rise = expected_rise(withp, lambda r: r.optimizer_signals.update_rms, lambda r: r.optimizer_signals.layer_update_rms)
    assert rise is not None and rise[0] >= 120
    assert (f["update_rms_rise"].step, f["update_rms_rise"].layer) == rise[:2]
    assert f"rose {rise[2]:.3g}x" in f["update_rms_rise"].detail
    # healthy: neither rule holds, recomputed, and no finding
    recs = records(run_adam(tmp_path, shift_at=None))
    assert expected_excursion(recs) is None
    assert expected_rise([r for r in recs if r.optimizer_signals is not None], lambda r: r.optimizer_signals.update_rms,
                         lambda r: r.optimizer_signals.layer_update_rms) is None
    a = analyze(tmp_path / "adamNone.jsonl")
    assert a.signals.findings == []
    s = next(s for s in a.signals.series if s.metric == "fisher_trace")
    assert s.glob.last[-1, 0] == pytest.approx(recs[-1].optimizer_signals.fisher_trace, rel=1e-12)
    assert set(s.layers) == set(recs[-1].optimizer_signals.layer_fisher_trace)


def adam_record(step: int, rms: float, frac: float):
    from distgrad.signals.adam import OptimizerSignals

    return SimpleNamespace(step=step, optimizer_signals=OptimizerSignals(
        update_rms=rms, spike_fraction=frac, layer_update_rms={"a": rms, "b": 1.0}, layer_spike_fraction={"a": frac},
        layer_grad_momentum_cosine={}, layer_exp_avg_norm={}, layer_exp_avg_sq_norm={}, layer_fisher_trace={}))


@pytest.mark.parametrize("rms,frac,first,fires", [
    (sig.UPDATE_RMS_MAX * 1.01, 0.0, sig.ADAM_MIN_STEP, True),
    (sig.UPDATE_RMS_MAX, 0.0, 0, False),
    (1.0, sig.SPIKE_FRACTION_MAX * 1.01, sig.ADAM_MIN_STEP, True),
    (1.0, sig.SPIKE_FRACTION_MAX, 0, False),
    (sig.UPDATE_RMS_MAX * 2, 0.0, sig.ADAM_MIN_STEP - 50, True),  # excursion before step 100: only from 100
])
def test_adam_excursion_threshold(rms, frac, first, fires):
    acc = sig.SignalsAccumulator(max_points=8)
    for s in range(first, sig.ADAM_MIN_STEP + 2 * sig.WINDOW):
        acc.add(adam_record(s, rms, frac))
    f = [x for x in acc.result().findings if x.kind == "adam_excursion"]
    assert bool(f) == fires
    if fires:
        assert f[0].step == max(first + sig.WINDOW - 1, sig.ADAM_MIN_STEP) and f[0].layer == "a"


# ---------------------------------------------------------------- applied update geometry
def run_update(tmp_path: Path, jump_at: int | None, steps: int = 40) -> Path:
    """SGD with momentum on a fixed least-squares problem through Net, update geometry on; from
    step ``jump_at`` the learning rate is 10x (a schedule restarted at its peak)."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    path = tmp_path / f"update{jump_at}.jsonl"
    inst = distgrad.instrument(net, optimizer=opt, exporter={"enabled": False}, sinks={"jsonl": {"path": str(path)}},
                               update_geometry={"enabled": True})
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, generator=g)
    for step in range(steps):
        if jump_at is not None and step == jump_at:
            opt.param_groups[0]["lr"] *= 10.0
        net(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert inst.counters["internal_errors"] == 0
    inst.close()
    return path


def test_update_ratio_rise_from_a_real_run(tmp_path):
    def total(r):
        return r.update_geometry.update_ratio if r.update_geometry else None

    def layer(r):
        return r.update_geometry.layer_update_ratio if r.update_geometry else {}

    recs = [r for r in records(run_update(tmp_path, jump_at=20)) if r.update_geometry is not None]
    want = expected_rise(recs, total, layer)
    assert want is not None  # the run does what it is meant to
    a = analyze(tmp_path / "update20.jsonl")
    f = [x for x in a.signals.findings if x.kind == "update_ratio_rise"]
    assert len(f) == 1
    assert (f[0].step, f[0].layer) == want[:2] and f[0].step > 20
    assert f"rose {want[2]:.3g}x" in f[0].detail and "docs/runbook.md#signal-update-ratio-rise" in f[0].detail
    s = next(s for s in a.signals.series if s.signal == "update_geometry" and s.metric == "update_ratio")
    assert s.glob.last[-1, 0] == pytest.approx(recs[-1].update_geometry.update_ratio, rel=1e-12)
    # without the jump: no finding, and the rule recomputed agrees
    recs = [r for r in records(run_update(tmp_path, jump_at=None)) if r.update_geometry is not None]
    assert expected_rise(recs, total, layer) is None
    assert not [x for x in analyze(tmp_path / "updateNone.jsonl").signals.findings if x.kind == "update_ratio_rise"]


def test_every_finding_kind_is_in_the_docs_table_and_the_runbook():
    """The finding kinds the report's module documents (its docstring's ``* ``kind``:`` list)
    are the rows of docs/signals.md's "In the offline report" table and the runbook's
    ``signal-<kind>`` sections the findings link to: a user reading either finds every finding.
    (The table had lost four of them: update_ratio_rise, router_collapse, duplicate_data,
    replica_weights.)"""
    from distgrad.report import signals as sig

    root = Path(__file__).resolve().parent.parent
    code = set(re.findall(r"^\* ``([a-z_]+)``:", sig.__doc__, re.M))
    assert {"underflow", "attention_logit_rise", "replica_weights"} <= code  # the list is read
    text = (root / "docs" / "signals.md").read_text()
    table = text.split("## In the offline report", 1)[1]
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", table, re.M))
    runbook = set(re.findall(r"^### signal-([a-z-]+)$", (root / "docs" / "runbook.md").read_text(), re.M))
    assert rows == code, (sorted(code - rows), sorted(rows - code))
    assert {k.replace("_", "-") for k in code} == runbook


def test_adaptive_clipping_has_a_report_section():
    """The offline report plots and summarises adaptive clipping (the opt-in action's record part):
    per sampled step the smallest factor applied (NaN where it did not act), the clipped-step
    count and ZClip's z, equal to the records'; the summary names the section. (It had none: a
    run with adaptive_clip.mode on showed nothing of it in the report.)"""
    from distgrad.diagnostics.adaptive_clip import AdaptiveClip
    from distgrad.report import signals as sig

    parts = [AdaptiveClip.Part(mode="zclip", acted=False, warmup=True, reason="warmup"),
             AdaptiveClip.Part(mode="zclip", acted=True, clipped=False, factor=1.0, z=0.3, clipped_steps=0),
             AdaptiveClip.Part(mode="zclip", acted=True, clipped=True, factor=0.25, z=4.1, clipped_steps=1,
                               tensors_clipped=7, threshold=2.0),
             AdaptiveClip.Part(mode="zclip", acted=True, clipped=False, factor=1.0, z=-0.5, clipped_steps=1)]
    acc = sig.SignalsAccumulator(max_points=64)
    for s, p in enumerate(parts):
        acc.add(SimpleNamespace(step=s, adaptive_clip=p))
    res = acc.result()
    series = {s.metric: s for s in res.series if s.signal == "adaptive_clip"}
    assert set(series) == {"factor", "clipped_steps", "z"}
    factor = series["factor"].glob.last[:, 0]
    assert np.isnan(factor[0]) and list(factor[1:]) == [1.0, 0.25, 1.0]
    assert list(series["clipped_steps"].glob.last[:, 0]) == [float(p.clipped_steps) for p in parts]
    assert np.isnan(series["z"].glob.last[0, 0]) and list(series["z"].glob.last[1:, 0]) == [0.3, 4.1, -0.5]
    assert any(line.strip().startswith("Adaptive clipping: clipped_steps = 1") for line in sig.summary_lines(res))
