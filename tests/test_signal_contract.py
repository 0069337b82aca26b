"""The contract of a packed signal (distgrad/signals/__init__.py): what a signal class declares
(its nested Config, Part, METRICS and samples) reaches the configuration, the record, the
catalogue and the Prometheus sink without being named there; and the one pack/split routine of
the step's blocks (distgrad/stats/layout.py) against slices computed by hand.

The curvature signal (distgrad/signals/curvature.py) is the worked example: it is declared only
in its module. Nothing here defines a new signal class (that would register it for the whole
test process)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from distgrad.config import DistgradConfig
from distgrad.config.sections import SECTIONS, Section, register_section
from distgrad.export import metrics
from distgrad.naming import grouping
from distgrad.record import StepRecord
from distgrad.record.base import PLUGIN_PARTS, register_part
from distgrad.signals import FACTORIES
from distgrad.signals.curvature import Curvature
from distgrad.stats.layout import SUM_COLS, StepBlocks, pack_blocks, split_blocks
from distgrad.export.prometheus import PrometheusSink
from distgrad.record import ParamStats
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


def test_pack_and_split_blocks_are_inverse():
    rng = np.random.default_rng(0)
    sizes = [(7, 3), (4, 0), (0, 0), (5, 2), (0, 6)]
    blocks = [(torch.from_numpy(rng.normal(size=s)), torch.from_numpy(rng.normal(size=m))) for s, m in sizes]
    s, m = pack_blocks(blocks)
    host = torch.cat([s, m]).numpy()
    # reference: the SUM parts one after the other, then the MAX parts, sliced by hand
    off_s, off_m = 0, sum(a for a, _ in sizes)
    for (bs, bm), (a, b), (gs, gm) in zip(blocks, sizes, split_blocks(host, sizes)):
        np.testing.assert_array_equal(gs, host[off_s:off_s + a])
        np.testing.assert_array_equal(gm, host[off_m:off_m + b])
        np.testing.assert_array_equal(gs, bs.numpy())
        np.testing.assert_array_equal(gm, bm.numpy())
        off_s, off_m = off_s + a, off_m + b
    with pytest.raises(ValueError, match="blocks"):
        split_blocks(host[:-1], sizes)



def test_step_blocks_pack_and_split_by_name():
    class Block:
        def __init__(self, name, sum_size, max_size):
            self.name, self.sum_size, self.max_size = name, sum_size, max_size

    blocks = StepBlocks([Block("a", 3, 1), Block("b", 0, 0), Block("c", 2, 4)])
    assert blocks.sizes() == [(3, 1), (0, 0), (2, 4)]
    parts = {"c": (torch.arange(2.0, dtype=torch.float64), torch.arange(10.0, 14.0, dtype=torch.float64)),
             "a": (torch.arange(20.0, 23.0, dtype=torch.float64), torch.tensor([30.0], dtype=torch.float64))}
    s, m = blocks.pack(parts)  # "b" (empty) absent; the order is the blocks', not the dict's
    assert s.tolist() == [20.0, 21.0, 22.0, 0.0, 1.0] and m.tolist() == [30.0, 10.0, 11.0, 12.0, 13.0]
    got = blocks.split(torch.cat([s, m]).numpy())
    assert list(got) == ["a", "b", "c"]
    for name, (ps, pm) in parts.items():
        np.testing.assert_array_equal(got[name][0], ps.numpy())
        np.testing.assert_array_equal(got[name][1], pm.numpy())
    assert got["b"][0].size == got["b"][1].size == 0
    with pytest.raises(ValueError, match="same name"):
        StepBlocks([Block("a", 1, 0), Block("a", 0, 1)])


def test_an_instrument_packs_and_splits_its_declared_blocks():
    """One process, interval 2, the histogram on: the reduced array of each sampled step is the
    declared blocks in order; their parts, taken apart by name, hold the float64 sums of the
    gradients (core), the signal's counts (signals) and the unsampled step's NaN flag."""
    import distgrad

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, sampling={"interval": 2},
                               histogram={"enabled": True})
    assert [b.name for b in inst.blocks.blocks] == ["core", "loss", "signals", "unsampled"]
    hosts: list[np.ndarray] = []
    split = inst.split_reduced
    inst.split_reduced = lambda host: (hosts.append(np.array(host)), split(host))[1]
    recs: list[StepRecord] = []
    inst.add_hook(recs.append)
    grads = []
    for step in range(4):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        saved = [p.detach().clone() for p in model.parameters()]
        if step == 1:  # an unsampled step with a NaN gradient: flagged in the next sampled step
            with torch.no_grad():
                next(model.parameters()).grad[0, 0] = float("nan")
        grads.append([p.grad.detach().double().numpy().ravel().copy() for p in model.parameters()])
        opt.step()
        if step == 1:  # keep the weights finite
            with torch.no_grad():
                for p, w in zip(model.parameters(), saved):
                    p.copy_(w)
        opt.zero_grad()
    inst.close()
    assert [r.step for r in recs] == [0, 2] and len(hosts) == 2 and inst.counters["internal_errors"] == 0
    sizes = inst.block_sizes()
    assert sizes[0] == (inst.layout.sum_size, inst.layout.max_size) and sizes[3] == (0, 2)
    for host, rec, g in zip(hosts, recs, (grads[0], grads[2])):
        assert len(host) == sum(a + b for a, b in sizes)
        parts = inst.blocks.split(host)
        # core: per parameter [numel, sum, sumsq, nan, inf, zeros]; float64 reference
        core = parts["core"][0][: inst.layout.rank_offset].reshape(-1, len(SUM_COLS))
        np.testing.assert_array_equal(core[:, 0], [x.size for x in g])
        np.testing.assert_allclose(core[:, 2], [float(np.dot(x, x)) for x in g], rtol=1e-6)
        # signals: the histogram's failure slot, then its counts, decoded into the record's part
        sig_sum = parts["signals"][0]
        assert sig_sum[0] == 0
        assert inst.signals.signals[0].decode(sig_sum[1:], 1.0) == rec.grad_histogram
        assert sum(rec.grad_histogram.numel) == sum(x.size for x in g)
    # unsampled flags (MAX only): [gradient flag, loss flag] of step 1, set in step 2's array
    np.testing.assert_array_equal(inst.blocks.split(hosts[0])["unsampled"][1], [0.0, 0.0])
    np.testing.assert_array_equal(inst.blocks.split(hosts[1])["unsampled"][1], [1.0, 0.0])
    assert recs[1].unsampled_nonfinite is not None and recs[1].unsampled_nonfinite.grad == [1]


def test_curvature_is_declared_only_in_its_module():
    # configuration: the section and its key, default off, validated like every section
    assert SECTIONS["curvature"] is Curvature.Config
    assert DistgradConfig.model_fields["curvature"].annotation is Curvature.Config
    assert DistgradConfig().curvature.enabled is False
    assert DistgradConfig(curvature={"enabled": True}).curvature.enabled is True
    assert DistgradConfig.from_dict({"curvature.enabled": True}).to_dict()["curvature"] == {"enabled": True}
    # record part: the StepRecord attribute, None when not set, read back as its class
    assert PLUGIN_PARTS["curvature"] is Curvature.Part
    # catalogue: its metrics and their condition; the per-layer one counts in the layer budget
    assert {m.name for m in Curvature.METRICS} <= set(metrics.names(["curvature"]))
    assert grouping.LAYER_SERIES == sum(m.series() for m in metrics.CATALOGUE if m.scope == "layer")
    # factory
    assert ("curvature", Curvature.build) in FACTORIES


NAMES = ["blocks.0.attn.qkv.weight", "blocks.1.mlp.fc.weight"]


def _record() -> StepRecord:
    p = ParamStats(NAMES, numel=[4, 4], sum=[0.0, 1.0], sumsq=[4.0, 2.0], nan=[0, 0], inf=[0, 0], zeros=[0, 1],
                   min=[-1.0, 0.0], max=[1.0, 1.0])
    return StepRecord(3, 3, 1.0, 2, p, float(np.sqrt(6.0)))


def _served(rec: StepRecord) -> dict[str, dict[tuple, float]]:
    sink = PrometheusSink("127.0.0.1", 0, {"engine": "local", "version": "0"}, 1, serve=False,
                          has_loss_scaler=False, has_samples=False)
    sink.write(rec)
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(generate_latest(sink.registry).decode()):
        for smp in fam.samples:
            out.setdefault(smp.name, {})[tuple(sorted(smp.labels.items()))] = smp.value
    return out


def test_curvature_part_round_trips_and_is_served():
    part = Curvature.Part(layer={"0": 0.5, "1": -0.1}, total=0.3, update_sq=1e-4)
    rec = _record()
    assert rec.curvature is None and rec.to_dict()["curvature"] is None
    served = _served(rec)  # no part: no series
    assert "distgrad_curvature" not in served and "distgrad_layer_curvature" not in served
    rec.curvature = part
    # JSON round trip through the record: the part comes back as its class, equal
    back = StepRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert isinstance(back.curvature, Curvature.Part) and back.curvature == part
    # the Prometheus sink serves samples() of the part: the values written, one series per layer
    served = _served(back)
    assert served["distgrad_curvature"] == {(): pytest.approx(0.3)}
    assert served["distgrad_layer_curvature"] == {(("layer", "0"),): pytest.approx(0.5),
                                                  (("layer", "1"),): pytest.approx(-0.1)}
    # nothing moved: the global value is absent, the layers that moved stay
    back.curvature = Curvature.Part(layer={"0": 0.5}, total=None, update_sq=0.0)
    served = _served(back)
    assert "distgrad_curvature" not in served and set(served["distgrad_layer_curvature"]) == {(("layer", "0"),)}


def test_a_second_declaration_is_refused_without_changing_the_registries():
    class Other(Section):
        section_key = "curvature"

    n_sections, n_parts, n_cat = len(SECTIONS), len(PLUGIN_PARTS), len(metrics.CATALOGUE)
    with pytest.raises(ValueError, match="declared twice"):
        register_section(Other)
    with pytest.raises(ValueError, match="declared twice"):
        register_part("curvature", type("P", (Curvature.Part,), {"__annotations__": {}}))
    with pytest.raises(ValueError, match="declared twice"):
        metrics.register(Curvature.METRICS, "curvature", Curvature.samples)
    assert (len(SECTIONS), len(PLUGIN_PARTS), len(metrics.CATALOGUE)) == (n_sections, n_parts, n_cat)
    assert SECTIONS["curvature"] is Curvature.Config


_DIAGNOSTIC = r'''
import json, math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from pydantic import Field

from distgrad.config import DistgradConfig
from distgrad.config.sections import Section
from distgrad.diagnostics import Diagnostics
from distgrad.diagnostics.base import Diagnostic, register
from distgrad.export import metrics
from distgrad.export.metrics import Metric, condition
from distgrad.record import ParamStats, StepRecord
from distgrad.record.base import _Part


@register
class NormRatio(Diagnostic):
    """A toy diagnostic: the grad norm over its running maximum."""

    name = "norm_ratio"

    class Config(Section):
        """Norm over running maximum."""

        section_key: ClassVar[str] = "norm_ratio"
        enabled: bool = Field(False, description="Compute it.")

    @dataclass
    class Part(_Part):
        ratio: float = 0.0
        peak: float = 0.0

    _when = condition("norm_ratio", "`norm_ratio.enabled: true`")
    METRICS = (Metric("distgrad_norm_ratio", "gauge", (), "ratio", "Grad norm over its running maximum.", _when),)

    @staticmethod
    def samples(part):
        return {"distgrad_norm_ratio": part.ratio}

    @classmethod
    def create(cls, ctx):
        return cls(ctx) if ctx.config.norm_ratio.enabled else None

    def __init__(self, ctx):
        super().__init__(ctx)
        self.peak = 0.0

    def on_record(self, rec):
        self.peak = max(self.peak, rec.grad_norm)
        rec.norm_ratio = NormRatio.Part(ratio=rec.grad_norm / self.peak, peak=self.peak)

    def state_dict(self):
        return {"peak": self.peak}


names = ["a.weight", "b.weight"]
cfg = DistgradConfig(norm_ratio={"enabled": True})
assert DistgradConfig().norm_ratio.enabled is False
diag = Diagnostics(cfg, names)
out = []
for step, norm in enumerate([2.0, 4.0, 1.0], 1):
    p = ParamStats(names, numel=[1, 1], sum=[norm, 0.0], sumsq=[norm * norm, 0.0], nan=[0, 0], inf=[0, 0],
                   zeros=[0, 1], min=[norm, 0.0], max=[norm, 0.0])
    rec = StepRecord(step, step, 0.0, 1, p, norm)
    diag.on_record(rec)
    back = StepRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    out.append([back.norm_ratio.ratio, back.norm_ratio.peak, type(back.norm_ratio).__qualname__])

from distgrad.export.prometheus import PrometheusSink
from prometheus_client import generate_latest
sink = PrometheusSink("127.0.0.1", 0, {"engine": "local", "version": "0"}, 1, serve=False,
                      has_loss_scaler=False, has_samples=False)
sink.write(back)
text = generate_latest(sink.registry).decode()
served = [float(l.split()[-1]) for l in text.splitlines() if l.startswith("distgrad_norm_ratio ")]
print(json.dumps({"records": out, "served": served, "state": diag.state_dict()["plugins"]["norm_ratio"],
                  "in_catalogue": "distgrad_norm_ratio" in metrics.names(["norm_ratio"]),
                  "in_docs": "norm_ratio:" in __import__("distgrad.config.generate", fromlist=["x"]).render_yaml()}))
'''


def test_a_diagnostic_declares_its_section_part_and_metrics_in_its_module(tmp_path):
    """A diagnostic defined in one file (a fresh process, so that its registration does not
    reach the other tests) gets its config key, its record part and its served metric."""
    import os
    import subprocess
    import sys

    script = tmp_path / "norm_ratio.py"
    script.write_text(_DIAGNOSTIC)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    # reference: the running maximum of 2, 4, 1 and each norm over it, by hand
    assert got["records"] == [[1.0, 2.0, "NormRatio.Part"], [1.0, 4.0, "NormRatio.Part"], [0.25, 4.0, "NormRatio.Part"]]
    assert got["served"] == [0.25]
    assert got["state"] == {"peak": 4.0}
    assert got["in_catalogue"] and got["in_docs"]


def test_a_holding_plugin_must_declare_its_step_gauge():
    """``Declares.hold`` (metrics.register(..., hold=True)) needs the gauge
    ``distgrad_<part>_step`` among the plug-in's metrics; without it the registration is refused
    and nothing is registered. AdamSignal holds and names its step gauge."""
    from distgrad.signals.adam import AdamSignal

    assert AdamSignal.hold and metrics.PLUGIN_HOLD["optimizer_signals"] == "distgrad_optimizer_signals_step"
    assert metrics.by_name("distgrad_optimizer_signals_step").name in {m.name for m in AdamSignal.METRICS}
    n, held = len(metrics.CATALOGUE), dict(metrics.PLUGIN_HOLD)
    entry = metrics.Metric("distgrad_test_hold_value", "gauge", (), "1", "A test gauge.", "always")
    with pytest.raises(ValueError, match="distgrad_test_hold_step"):
        metrics.register((entry,), "test_hold", lambda part: {}, hold=True)
    assert len(metrics.CATALOGUE) == n and metrics.PLUGIN_HOLD == held


def test_signal_pack_calls_exchange_on_every_sampled_step_pieces_or_not():
    """PackedSignal.exchange (a signal's own collectives, e.g. the underflow recomputation's FSDP2
    parameter all-gather) runs before local() on a step with pieces AND on a refused/failed step
    (pieces None, local() not called), so every rank makes the same collectives; a raising
    exchange is counted and the step's local() still runs. A duck-typed stand-in, not a
    PackedSignal subclass (no class is registered)."""
    from types import SimpleNamespace

    from distgrad.signals import SignalPack

    calls: list[str] = []

    class Spy:
        name, sum_size, max_size, fail = "spy", 1, 0, False

        def exchange(self, inst, device):
            calls.append("exchange")
            if self.fail:
                raise RuntimeError("boom")

        def local(self, inst, pieces, device):
            calls.append("local")
            return torch.ones(1, dtype=torch.float64), None

    errors: list[str] = []
    inst = SimpleNamespace(_internal_error=errors.append)
    spy = Spy()
    pack = SignalPack([spy])
    s, _ = pack.block(inst, None, torch.device("cpu"))
    assert calls == ["exchange"] and s.tolist() == [0.0, 0.0]  # identities, no failure flag
    calls.clear()
    s, _ = pack.block(inst, [torch.zeros(2)], torch.device("cpu"))
    assert calls == ["exchange", "local"] and s.tolist() == [0.0, 1.0]
    calls.clear()
    spy.fail = True
    s, _ = pack.block(inst, [torch.zeros(2)], torch.device("cpu"))
    assert calls == ["exchange", "local"] and errors == ["signal spy exchange"] and s.tolist() == [0.0, 1.0]
    # the caller's error path calls block() a second time in the same sampled step (after a
    # failure inside the first call): the exchange is not issued again on this rank alone
    spy.fail = False
    calls.clear()
    inst.sampled_step = 7
    pack.block(inst, [torch.zeros(2)], torch.device("cpu"))
    pack.block(inst, None, torch.device("cpu"))
    assert calls == ["exchange", "local"]
    inst.sampled_step = 8  # the next sampled step exchanges again
    pack.block(inst, None, torch.device("cpu"))
    assert calls == ["exchange", "local", "exchange"]
