"""The metric catalogue (distgrad/export/metrics.py) and the exposition agree: with the features that
enable a metric it is served, without them it is not, every served metric is declared with the
type and labels it is served with; docs/metrics.md is the catalogue's rendering; the series
budget's constants equal the series a scrape actually holds per parameter / layer / kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from distgrad.export import metrics
from distgrad.naming import grouping
from distgrad.config import DistgradConfig
from distgrad.diagnostics.detectors import DETECTOR_LABELS
from distgrad.diagnostics import Diagnostics
from distgrad.loss.tracker import rank_stats
from distgrad.signals.noise_scale import GradientNoiseScale
from distgrad.signals.router import RouterHealth
from distgrad.signals.curvature import Curvature
from distgrad.signals.underflow import Underflow
from distgrad.record.action import ActionPart
from distgrad.record import Culprit, LossComponents, ParamStats, RankCount, ScalerState, StepRecord, TokenLossStats
from distgrad.signals.histogram import GradHistogram
from distgrad.record.culprit import CulpritModule
from distgrad.signals.adam import OptimizerSignals
from distgrad.signals.logits import LogitStats
from distgrad.signals.duplicate_data import DuplicateDataSignal
from distgrad.signals.fp8 import Fp8Signal
from distgrad.signals.weight_hash import WeightHash
from distgrad.diagnostics.rerun import RerunAttribution
from distgrad.signals.update import UpdateGeometry
from distgrad.diagnostics.adaptive_clip import AdaptiveClip
from distgrad.loss.token import EDGES
from distgrad.export.prometheus import PrometheusSink
from distgrad.record.incidents import KINDS, Incident

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
NAMES = ["blocks.0.attn.qkv.weight", "blocks.1.mlp.fc.weight"]
ALL = set(metrics.CONDITIONS)


def _sink(features: set[str]) -> PrometheusSink:
    """A sink (no HTTP) fed as the instrument would feed it in a run with ``features``
    (keys of metrics.CONDITIONS)."""
    f = features
    sink = PrometheusSink("127.0.0.1", 0, {"engine": "deepspeed", "version": "0"}, 2, serve=False,
                          has_loss_scaler="loss_scaler" in f, has_samples="samples" in f)
    for s in ("prometheus", "jsonl"):
        sink.collector.inc_labeled("distgrad_sink_errors", {"sink": s}, 0)
    for reason in metrics.LABELS["reason"].values or ():  # as distgrad.core.startup does
        sink.collector.inc_labeled("distgrad_refused_steps", {"reason": reason}, 0)
    if "action" in f:  # an opt-in action configured: its counter from the start, as distgrad.core.startup does
        for cause in metrics.LABELS["cause"].values or ():
            sink.collector.inc_labeled("distgrad_action_skipped_steps", {"cause": cause}, 0)
    if "step" in f:
        sink.collector.step_time = 1.0
    if "sample" not in f:
        return sink
    cfg = DistgradConfig(clip={"max_grad_norm": 1.0 if "clip" in f else None}, statistics={"per_param": "per_param" in f, "update_ratio": "update_ratio" in f})
    diag = Diagnostics(cfg, NAMES)
    bad = "nonfinite" in f
    p = ParamStats(NAMES, numel=[4, 4], sum=[0.0, np.nan if bad else 1.0], sumsq=[4.0, np.nan if bad else 2.0],
                   nan=[0, int(bad)], inf=[0, 0], zeros=[0, 1], min=[-1.0, np.nan if bad else 0.0],
                   max=[1.0, np.nan if bad else 1.0])
    parts: dict = {"headroom": [1e-5, np.nan]}
    if "update_ratio" in f:
        parts["update_ratio"] = {NAMES[0]: 1e-3}
    if "replicated" in f:
        parts["replica_mismatch_rank"] = -1
    if "loss_scaler" in f:
        parts["scaler"] = ScalerState(consecutive_overflow_steps=0, loss_scale_at_minimum=False)
    if "action" in f:
        parts["action"] = ActionPart(cause="nonfinite", mode="skip", skipped=True) if bad else ActionPart()
    if bad:
        parts["nonfinite_params"] = [RankCount(param=NAMES[1], rank=1, nan=1, inf=0, count=1)]
        parts["culprits"] = [Culprit(rank=1, loss=True, grad=True)]  # rank 1 made it
        # its forward replay named the module
        parts["culprit_module"] = CulpritModule(step=3, outcome="found", rank=1, module="blocks.1.mlp.fc", micro_batch=0)
    rec = StepRecord(3, 3, 1.0, 2, p, float(np.sqrt(p.sumsq.sum())), loss=2.0 if "loss" in f else None,
                     loss_scale=1024.0 if "loss_scaler" in f else None,
                     overflow=False if "loss_scaler" in f else None,
                     counters={"samples": 12} if "samples" in f else {}, **parts)
    # per-rank attribution: loss values only with a loss, data times only when known
    loss = "loss" in f
    rec.ranks = rank_stats(np.array([[2.0 * loss, float(loss), 2.5 * loss, 0.0, 0.5, 0.1 if "data_time" in f else np.nan, 0],
                                     [2.0 * loss, float(loss), 1.5 * loss, 0.0, 0.5, 0.2 if "data_time" in f else np.nan, 0]]))
    if "components" in f:
        rec.loss_components = LossComponents(["aux", "lm"], [0.5, 2.0], [0.01, 1.0], [0.0025, 0.9975], [4, 4])
    if "tokens" in f:
        rec.token_loss = TokenLossStats(tokens=10.0, mean=2.0, perplexity=float(np.exp(2.0)), above_fraction=0.1,
                                        threshold=10.0, edges=list(EDGES), hist=[1.0] * 10 + [0.0] * 6, max=12.0,
                                        sources={"web": {"mean": 1.0, "above_fraction": 0.0},
                                                 "other": {"mean": 3.0, "above_fraction": 0.2}})
    if "histogram" in f:
        rec.grad_histogram = GradHistogram("fp16", 2.0 ** -14, -2, 2, 0.0, ["0", "1"], [[0, 1, 2, 0], [1, 0, 0, 0]],
                                           [1, 0], [0, 0], [0, 1], [1, 0], [0, 1], [4, 3])
    if "noise_scale" in f:
        rec.noise_scale = GradientNoiseScale.Part(micro_batches=4, small_batch=8.0, big_batch=32.0, grad_sq_small=2.0,
                                     grad_sq_big=1.0, true_grad_sq=0.7, noise_trace=10.0, ema_true_grad_sq=0.7,
                                     ema_noise_trace=10.0, noise_scale=10.0 / 0.7, ema_steps=1)
    if "curvature" in f:
        rec.curvature = Curvature.Part(layer={"0": 0.5, "1": -0.1}, total=0.3, update_sq=1e-4)
    if "underflow" in f:
        rec.underflow = Underflow.Part(step=0, lost={"0": 0.8, "1": 0.7}, zero={"0": 0.0},
                                       total_lost=0.6, total_zero_low=0.7, total_zero_ref=0.1, worst=["0", "1"])
    if "adam" in f:
        rec.optimizer_signals = OptimizerSignals(
            optimizer="AdamW", spike_threshold=50.0, elements=8.0, update_rms=0.9, spike_fraction=0.0,
            grad_momentum_cosine=0.5, exp_avg_norm=0.1, exp_avg_sq_norm=0.01, fisher_trace=0.02,
            layer_update_rms={"0": 0.8, "1": 1.0}, layer_spike_fraction={"0": 0.0, "1": 0.0},
            layer_grad_momentum_cosine={"0": 0.4, "1": 0.6}, fisher_top_layers=["1", "0"])  # cosine: JSONL only
    if "logits" in f:
        rec.logits = LogitStats(attention_max={"0": 12.0, "1": 30.0}, attention_head_max={"0": [12.0, 3.0]},
                                output_abs_max=9.0, z_mean=4.5, z_sq_mean=20.5, z_max=6.0, positions=16)
    if "router" in f:
        rec.router = RouterHealth.Part(tokens={"0": [3.0, 5.0, 0.0, 4.0], "1": [3.0, 3.0, 3.0, 3.0]},
                                       imbalance={"0": 5 / 3, "1": 1.0}, cv={"0": 0.6, "1": 0.0},
                                       entropy={"0": 1.2, "1": 1.3}, routed={"0": 6, "1": 6}, dead={"0": [2], "1": []},
                                       aux_loss=1.1)
    if "duplicate_data" in f:
        rec.duplicate_data = DuplicateDataSignal.Part(streak=3, groups=[[0, 1]], ranks=[0, 1], first_step=3)
    if "update_geometry" in f:  # the Muon / Adafactor / spectral gauges only where their condition holds
        rec.update_geometry = UpdateGeometry.Part(
            step=2, optimizer="Muon", update_rms=2e-4, update_ratio=1e-3, layer_update_rms={"0": 1e-4, "1": 3e-4},
            layer_update_ratio={"0": 8e-4, "1": 1.2e-3},
            layer_update_spectral={"0": 0.01, "1": 0.02} if "update_geometry_spectral" in f else {},
            muon_rms_per_lr=0.18 if "update_geometry_muon" in f else None,
            adafactor_trace=0.5 if "update_geometry_adafactor" in f else None)
    if "fp8" in f:  # a float8 layer per block, tensor parallel (the disagreement is served)
        st = dict(observed=4.0, elements=64.0, underflow=1.0, saturated=0.0, amax_min=2.0, amax_max=3.0,
                  scale_min=448 / 3, scale_max=224.0, amax_disagreement=1.5)
        rec.fp8 = Fp8Signal.Part(tp_size=2, layers={f"blocks.{i}.up": str(i) for i in (0, 1)},
                                 stats={f"blocks.{i}.up": {r: dict(st) for r in ("input", "weight", "grad_output")}
                                        for i in (0, 1)})
    if "replica_weights" in f:
        rec.replica_weights = WeightHash.Part(interval=10, hash_step=0, checked_ranks=[0, 1])
    if "rerun" in f:  # a rerun said rank 1's device is at fault
        rec.rerun = RerunAttribution.Part(step=3, trigger="nonfinite", verdict="device", culprit_rank=1, other_rank=0,
                                          quarantine_rank=1, quarantine_host="node-7",
                                          totals={"data": 0, "transient": 0, "device": 1, "inconclusive": 0})
    diag.on_record(rec)
    if "adaptive_clip" in f:  # set after the diagnostics (the test's config has it off)
        rec.adaptive_clip = AdaptiveClip.Part(mode="zclip", acted=True, clipped=True, factor=0.2, tensors_clipped=2,
                                              clipped_steps=1)
    if "incident" in f:  # the policy opened one (a bad batch naming its rank and a component)
        rec.incidents.total["bad_batch"] = 1
        rec.incidents.last = [Incident("bad_batch", 3, 2.0, "rank_loss", 3, level=0.5, rank=1, component="aux")]
    sink.write(rec)
    return sink


def _families(sink: PrometheusSink) -> dict[str, list]:
    """Served sample name -> [(family type, labels of each sample)] (families without samples
    are not served)."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(generate_latest(sink.registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((fam.type, s.labels))
    return out


def test_docs_metrics_md_is_generated_from_the_catalogue():
    assert DOC.read_text() == metrics.markdown(), \
        "docs/metrics.md is stale: python -m distgrad.export.metrics --markdown > docs/metrics.md"


@pytest.mark.parametrize("features", [
    ALL,
    {"always"},
    {"always", "step"},
    {"always", "step", "sample"},
    {"always", "step", "sample", "loss", "per_param"},
    *[ALL - {c} for c in sorted(ALL - {"always", "step", "sample"})],
], ids=lambda f: "all" if f == ALL else "-".join(sorted(ALL - f)) if len(f) > len(ALL) / 2 else "+".join(sorted(f)))
def test_served_exactly_what_the_catalogue_declares_for_the_features(features):
    if "per_param" not in features:  # update ratios are per-parameter series
        features = features - {"update_ratio"}
    if "update_geometry" not in features:  # its optimizer extras are parts of its record part
        features = features - {"update_geometry_spectral", "update_geometry_muon", "update_geometry_adafactor"}
    served = _families(_sink(features))
    assert sorted(served) == sorted(metrics.names(when=features))
    for name, samples in served.items():
        m = metrics.by_name(name)
        for typ, labels in samples:
            assert typ == m.type, name
            if name != "distgrad_info":  # run-constant labels: those of the static dict
                assert set(labels) == set(m.labels), (name, labels)
            for lab, v in labels.items():
                if lab in metrics.LABELS and metrics.LABELS[lab].values is not None:
                    assert v in metrics.LABELS[lab].values, (name, lab, v)
        if m.max_series is not None:
            assert len(samples) <= m.max_series


def test_declared_detector_values_are_the_detectors():
    assert metrics.LABELS["detector"].values == DETECTOR_LABELS


def _per_scope(served: dict[str, list]) -> dict[str, dict[str, int]]:
    per: dict[str, dict[str, int]] = {scope: {} for scope in metrics.SCOPES}
    for name, samples in served.items():
        m = metrics.by_name(name)
        if m.scope is not None:
            for _, labels in samples:
                per[m.scope][labels[m.scope]] = per[m.scope].get(labels[m.scope], 0) + 1
    return per


def test_series_budget_constants_count_what_a_scrape_holds():
    """PARAM_SERIES / LAYER_SERIES / KIND_SERIES = series served per parameter, layer, kind."""
    served = _families(_sink(ALL - {"update_ratio"}))
    per = _per_scope(served)
    assert per["param"] == {n: grouping.PARAM_SERIES for n in NAMES}
    assert set(per["layer"].values()) == {grouping.LAYER_SERIES} and len(per["layer"]) == 2
    assert set(per["module_kind"].values()) == {grouping.KIND_SERIES} and len(per["module_kind"]) == 2
    ratio = _per_scope(_families(_sink(ALL)))["param"]  # the ratio of NAMES[0] only is known
    assert ratio == {NAMES[0]: grouping.PARAM_SERIES + grouping.UPDATE_RATIO_SERIES, NAMES[1]: grouping.PARAM_SERIES}
    # the fixed part: scope-less metrics at their cap, plus the reserve
    fixed = metrics.series_per(None)
    assert grouping.GLOBAL_SERIES == fixed + grouping.GLOBAL_RESERVE
    assert 0 < sum(len(v) for k, v in served.items() if metrics.by_name(k).scope is None) <= fixed


def test_series_budget_of_a_configuration_holds_its_scrape():
    """With a configuration, the budget counts the families it switches on (metrics.SWITCHES):
    a sink fed with exactly those features serves no family the configuration switches off,
    and no more series than series_count(..., config=) says; with everything on, the count is
    that of every declared family."""
    for cfg in (DistgradConfig(), DistgradConfig(router={"enabled": True}, statistics={"update_ratio": True}),
                DistgradConfig(incidents={"enabled": False}, optimizer_signals={"enabled": "off"})):
        on = ALL - metrics.switched_off(cfg)
        served = _families(_sink(on))
        off = {n for n in served if metrics.by_name(n).when not in on}
        assert not off, off
        counted = grouping.series_count(len(NAMES), 2, 2, len(NAMES), update_ratio=cfg.statistics.update_ratio,
                                        config=cfg)
        assert 0 < sum(len(v) for v in served.values()) <= counted
        assert counted < grouping.series_count(len(NAMES), 2, 2, len(NAMES), update_ratio=True)
    assert metrics.switched_off(DistgradConfig()) >= {"router", "fp8", "logits", "underflow", "rerun", "update_ratio"}


def test_describe_names_every_servable_family_and_name_filter_answers():
    sink = _sink(ALL)
    described = {m.name for m in sink.collector.describe()}
    assert described == {metrics.by_name(n).family for n in metrics.names()}
    no_fp16 = _sink(ALL - {"loss_scaler", "samples"})
    assert {m.name for m in no_fp16.collector.describe()} == {
        metrics.by_name(n).family for n in metrics.names(when=ALL - {"loss_scaler", "samples"})}
    # prometheus_client's own name[] path routes by describe(): a filtered page holds the data
    text = generate_latest(sink.registry.restricted_registry(["distgrad_grad_norm"])).decode()
    assert "distgrad_grad_norm " in text and "distgrad_loss " not in text


def test_catalogue_rejects_bad_declarations():
    with pytest.raises(ValueError, match="_total"):
        metrics.Metric("distgrad_x", "counter", (), "1", "x")
    with pytest.raises(ValueError, match="undeclared label"):
        metrics.Metric("distgrad_x", "gauge", ("nope",), "1", "x")
    with pytest.raises(ValueError, match="when="):
        metrics.Metric("distgrad_x", "gauge", (), "1", "x", when="sometimes")
    with pytest.raises(KeyError, match="distgrad_nope"):
        metrics.by_name("distgrad_nope")
    assert metrics.by_name("distgrad_sink_errors") is metrics.by_name("distgrad_sink_errors_total")


def test_incident_label_values_are_the_policy_kinds():
    assert metrics.LABELS["incident"].values == KINDS
