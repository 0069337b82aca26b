"""Lost to underflow vs genuinely zero (distgrad/signals/underflow.py), single process: a tiny
decoder under fp16 autocast on CPU without loss scaling loses most of its decoder layers'
weight-gradient elements to exact zeros; the signal's per-layer lost and zero ratios equal a
float64 recomputation compared element by element with the gradient the training backward
produced; the worst layers are the decoder layers, not the final norm (whose gradient is fp16
subnormal, the histogram's underflow ratio, and not lost); with a GradScaler the lost fraction
drops. The 2-rank DDP case: tests/dist/underflow_cases.py."""

from __future__ import annotations

import collections
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import distgrad
from distgrad.naming.grouping import group_keys
from distgrad.record import StepRecord
from distgrad.report import analyze
from distgrad.report import signals as sig
from tests.underflow_models import Decoder, clone

RUNBOOK = Path(__file__).resolve().parents[1] / "docs" / "runbook.md"


def anchors() -> set[str]:
    return {m.group(1) for m in re.finditer(r"^#+ (\S+)\s*$", RUNBOOK.read_text(), re.M)}


def reference(model, ids, labels, low_grads):
    """Per layer ``[lost, genuinely zero, elements]`` from the float64 recomputation of one
    micro-batch (a float64 copy of ``model``, autocast off) against ``low_grads`` (the training
    backward's gradients, name -> tensor)."""
    m64 = clone(model).double()
    m64(ids, labels).backward()
    names = [n for n, _ in m64.named_parameters()]
    rows = collections.defaultdict(lambda: [0, 0, 0])
    for key, (n, p) in zip(group_keys(names, "layer"), m64.named_parameters()):
        g64, low = p.grad, low_grads[n]
        r = rows[key]
        r[0] += int(((low == 0) & (g64 != 0)).sum())
        r[1] += int((g64 == 0).sum())
        r[2] += p.numel()
    return rows


def run(scaler=None, steps=2, interval=1, jsonl=None, sampling=1):
    torch.manual_seed(0)
    model = Decoder(loss_weight=1e-5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sinks = {"jsonl": {"path": str(jsonl)}} if jsonl else {}
    dg = distgrad.instrument(model, optimizer=opt, scaler=scaler, exporter={"enabled": False},
                             statistics={"async_records": "off"}, histogram={"enabled": True, "dtype": "fp16"},
                             underflow={"enabled": True, "interval": interval}, sinks=sinks,
                             sampling={"interval": sampling})
    recs, refs = [], []
    dg.add_hook(recs.append)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids, labels = torch.randint(0, 48, (8, 32), generator=g), torch.randint(0, 64, (8, 32), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(ids, labels)
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        refs.append(reference(model, ids, labels, {n: p.grad.clone() for n, p in model.named_parameters()}))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    errors = dg.counters["internal_errors"]
    dg.close()
    return recs, refs, errors


def test_lost_to_underflow_equals_float64_recomputation_and_names_the_decoder_layers():
    recs, refs, errors = run()
    assert errors == 0 and [r.step for r in recs] == [0, 1]
    for rec, ref in zip(recs, refs):
        u = rec.underflow
        assert u.step == rec.step and u.loss_scale == 1.0
        assert set(u.lost) == set(ref)
        for layer, (lost, zero, n) in ref.items():
            assert u.lost[layer] == lost / n, layer
            assert u.zero[layer] == zero / n, layer
        tot = [sum(r[i] for r in ref.values()) for i in range(3)]
        assert u.total_lost == pytest.approx(tot[0] / tot[2], rel=1e-12)
        assert u.total_zero_ref == pytest.approx(tot[1] / tot[2], rel=1e-12)
        # the decoder layers lose most of their elements; the norm, head and embedding nothing
        assert u.lost["0"] > 0.5 and u.lost["1"] > 0.5
        assert u.lost["norm"] == u.lost["head"] == u.lost["other"] == 0.0
        assert sorted(u.worst) == ["0", "1"]
        # the unused embedding rows (ids < 48 of 64, at least 16 rows) are genuinely zero, not lost
        assert u.zero["other"] >= 16 / 64
        # the histogram's underflow ratio (non-zero, below fp16's smallest normal) names another layer:
        # the norm / head are all subnormal in fp16 terms, and lose nothing
        h = rec.grad_histogram.underflow_ratio()
        assert max(h, key=h.get) in ("norm", "head") and h["norm"] > 0.9
        # the exact zeros the zero ratio sees are the lost ones plus the genuine ones
        assert u.total_zero_low == pytest.approx(u.total_lost + u.total_zero_ref, rel=1e-12)
        assert StepRecord.from_dict(rec.to_dict()).underflow == u


def test_a_loss_scaler_recovers_the_lost_elements():
    plain, _, _ = run()
    recs, refs, errors = run(scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 16))
    assert errors == 0 and len(recs) == 2
    for rec, ref in zip(recs, refs):
        u = rec.underflow
        assert u.loss_scale == 2.0 ** 16
        for layer, (lost, _, n) in ref.items():
            assert u.lost[layer] == lost / n, layer
    assert recs[0].underflow.total_lost < 0.01 < 0.5 < plain[0].underflow.total_lost


def test_interval_serves_the_last_measurement_until_the_next_and_the_report_names_the_lost_layers(tmp_path):
    path = tmp_path / "run.jsonl"
    recs, refs, errors = run(steps=3, interval=2, jsonl=path)
    assert errors == 0
    assert [r.underflow.step for r in recs] == [0, 0, 2]
    # the offline report: the lost_to_underflow finding names the decoder layers, with the cause; the
    # histogram's finding (the norm / head: subnormal in fp16) says they are kept, not lost
    a = analyze(path)
    lost = [f for f in a.signals.findings if f.kind == "lost_to_underflow"]
    assert len(lost) == 1 and lost[0].step == 0
    med = {k: float(np.median([refs[s][k][0] / refs[s][k][2] for s in (0, 2)])) for k in refs[0]}
    worst = max(med, key=med.get)
    assert worst in ("0", "1") and lost[0].layer == worst
    assert f"{worst} ({100 * med[worst]:.1f}%)" in lost[0].detail and "lost to underflow" in lost[0].detail
    assert "2 layer(s)" in lost[0].detail and "no loss scaling" in lost[0].detail
    hist = [f for f in a.signals.findings if f.kind == "underflow"]
    assert len(hist) == 1 and hist[0].layer in ("norm", "head") and "subnormal" in hist[0].detail
    assert {"signal-lost-to-underflow", "signal-underflow"} <= anchors()
    s = next(s for s in a.signals.series if s.metric == "lost_ratio")
    assert s.glob.last[-1, 0] == recs[-1].underflow.total_lost


def test_recomputation_steps_follow_the_step_number_with_sampling_interval():
    recs, refs, errors = run(steps=5, interval=2, sampling=2)
    assert errors == 0
    # sampled steps 0, 2, 4 (indices 0, 1, 2): recomputed at 0 and 4 (indices 0 and 2), served at 2
    assert [(r.step, r.underflow.step) for r in recs] == [(0, 0), (2, 0), (4, 4)]
    for layer, (lost, _, n) in refs[4].items():  # step 4's first micro-batch, not a leftover of step 3
        assert recs[2].underflow.lost[layer] == lost / n


def _part(step, lost, scale=1.0):
    from distgrad.signals.underflow import Underflow

    return SimpleNamespace(step=step, underflow=Underflow.Part(step=step, lost=lost, zero={}, total_lost=0.0,
                                                                loss_scale=scale))


@pytest.mark.parametrize("at,fires", [(sig.UNDERFLOW_RATIO, True), (sig.UNDERFLOW_RATIO - 0.001, False)])
def test_lost_rule_threshold_over_recomputations(at, fires):
    acc = sig.SignalsAccumulator(max_points=8)
    for s in range(4):  # early recomputations (0) do not count once WINDOW later ones are in
        acc.add(_part(s, {"a": 0.0, "b": 0.0}))
    for s in range(4, 4 + sig.WINDOW):
        for _ in range(2):  # each measurement served on two sampled steps: counted once
            acc.add(_part(s, {"a": 0.0, "b": at if s % 2 else at + 1e-4}, scale=1024.0))  # median ~ at
    f = acc.result().findings
    assert bool(f) == fires
    if fires:
        assert f[0].kind == "lost_to_underflow" and f[0].layer == "b" and f[0].step == 4
        assert "1024" in f[0].detail and "1 layer(s)" in f[0].detail


def test_a_forward_without_loss_measures_nothing_and_never_breaks_the_loop(caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))  # returns outputs, not a loss
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             underflow={"enabled": True, "interval": 1})
    recs = []
    dg.add_hook(recs.append)
    sig = next(s for s in dg.signals.signals if s.name == "underflow")
    kept = []
    for _ in range(4):
        model(torch.randn(3, 4)).square().mean().backward()
        kept.append(sig._kept is not None)  # the micro-batch held for this step's recomputation
        opt.step()
        opt.zero_grad()
    errors = dg.counters["internal_errors"]
    dg.close()
    assert [r.step for r in recs] == [0, 1, 2, 3] and all(r.underflow is None for r in recs)
    # a property of the model: flagged once (the first recomputation step's failure counted, so
    # DistgradInternalErrors does not fire on every later step of a healthy run), then nothing kept
    assert errors == 1 and kept == [True, False, False, False]
    msgs = [r.getMessage() for r in caplog.records if "returns no loss" in r.getMessage()]
    assert len(msgs) == 1 and "pass labels" in msgs[0] and "underflow.enabled off" in msgs[0]  # once, with the fix
    assert all(r.params is not None for r in recs)  # the steps' other statistics kept


@pytest.mark.parametrize("engine,stage,job", [("fsdp1", None, None), ("ddp", None, object())])
def test_refused_where_no_rank_holds_every_parameter(engine, stage, job):
    from distgrad.config import ConfigError, DistgradConfig
    from distgrad.signals.underflow import Underflow

    cfg = DistgradConfig().with_overrides({"underflow": {"enabled": True}})
    inst = SimpleNamespace(config=cfg, source=SimpleNamespace(engine_name=engine, zero_stage=stage), job=job)
    with pytest.raises(ConfigError, match="underflow.enabled"):
        Underflow.build(inst)
    ok = SimpleNamespace(config=cfg, source=SimpleNamespace(engine_name="deepspeed", zero_stage=2), job=None)
    assert Underflow.build(ok) is not None
    off = SimpleNamespace(config=DistgradConfig(), source=ok.source, job=None)
    assert Underflow.build(off) is None
    assert Underflow.build(ok).sharded == ""


@pytest.mark.parametrize("engine,stage", [("fsdp2", None), ("deepspeed", 3)])
def test_sharded_engines_built_with_the_parameter_gather(engine, stage):
    """FSDP2 and ZeRO-3 (refused before the parameter gather existed) build the signal in its
    gathering mode, with the configured bound; the layout and the bound are checked at attach
    (tests/test_underflow_multirank.py, cases fsdp2 and z3)."""
    from distgrad.config import DistgradConfig
    from distgrad.signals.underflow import Underflow

    cfg = DistgradConfig().with_overrides({"underflow": {"enabled": True, "max_gather_bytes": 1234}})
    sig = Underflow.build(SimpleNamespace(config=cfg, source=SimpleNamespace(engine_name=engine, zero_stage=stage),
                                          job=None))
    assert sig is not None and sig.sharded == ("fsdp2" if engine == "fsdp2" else "zero3")
    assert sig.max_gather_bytes == 1234
    assert DistgradConfig().underflow.max_gather_bytes == 4 * 2**30


class CheckpointedDecoder(Decoder):
    """:class:`Decoder` with each block under activation checkpointing (reentrant or not)."""

    def __init__(self, reentrant: bool, **kw) -> None:
        super().__init__(**kw)
        self.reentrant = reentrant

    def forward(self, ids, labels):
        from torch.utils.checkpoint import checkpoint

        x = self.embed(ids)
        for blk in self.layers:
            x = checkpoint(blk, x, use_reentrant=self.reentrant)
        with torch.autocast(x.device.type, enabled=False):
            logits = self.lm_head(self.norm(x.float()))
        return self.loss_weight * torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_recomputes_with_the_copies_and_leaves_the_gradients(reentrant):
    plain, _, _ = run(steps=1)  # the same weights and micro-batch without checkpointing
    torch.manual_seed(0)
    model = CheckpointedDecoder(reentrant, loss_weight=1e-5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             underflow={"enabled": True, "interval": 1})
    seen = {}
    opt.register_step_pre_hook(lambda o, a, k: seen.update({n: p.grad.clone() for n, p in model.named_parameters()}))
    recs = []
    dg.add_hook(recs.append)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 48, (8, 32), generator=g), torch.randint(0, 64, (8, 32), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(ids, labels)
    loss.backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()  # distgrad's boundary (and the recomputation) runs before the hook above
    errors = dg.counters["internal_errors"]
    dg.close()
    assert errors == 0
    assert all(torch.equal(before[n], seen[n]) for n in before)  # the training gradients untouched
    assert all(p.requires_grad for p in model.parameters())
    assert recs[0].underflow.lost == plain[0].underflow.lost and recs[0].underflow.zero == plain[0].underflow.zero
