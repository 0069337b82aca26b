"""The ``naming.rules`` key reaches classification: a YAML rule labels the layer and module-kind
series that Diagnostics computes, Prometheus serves and TensorBoard writes. Values are checked
against a float64 root-sum-square of the parameters' sums of squares, computed here."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from distgrad.config import DistgradConfig
from distgrad.diagnostics import Diagnostics
from distgrad.record import ParamStats, StepRecord
from distgrad.export.prometheus import PrometheusSink

NAMES = ["encoder.stages.0.conv.weight", "encoder.stages.0.conv.bias", "encoder.stages.1.conv.weight",
         "encoder.stages.1.proj.weight", "classifier.weight"]
SUMSQ = np.array([4.0, 0.25, 9.0, 16.0, 1.0])
YAML = r"""
naming:
  rules:
    - {pattern: '^encoder\.stages\.(\d+)\.', layer: '\1', module_kind: stage}
"""


def _rec(step: int) -> StepRecord:
    n = len(NAMES)
    p = ParamStats(NAMES, numel=[4] * n, sum=[0.0] * n, sumsq=SUMSQ, nan=[0] * n, inf=[0] * n, zeros=[0] * n,
                   min=[-1.0] * n, max=[1.0] * n)
    return StepRecord(step, step, float(step), 2, p, float(np.sqrt(SUMSQ.sum())))


def _series(sink, name):
    out = {}
    for fam in text_string_to_metric_families(generate_latest(sink.registry).decode()):
        out.update({tuple(sorted(s.labels.items())): s.value for s in fam.samples if s.name == name})
    return out


def _reference(layer_of: dict[str, str]) -> dict[str, float]:
    acc: dict[str, float] = {}
    for name, ss in zip(NAMES, SUMSQ.tolist()):
        acc[layer_of[name]] = acc.get(layer_of[name], 0.0) + ss
    return {k: math.sqrt(v) for k, v in acc.items()}


def test_yaml_naming_rule_labels_the_layer_and_kind_series(tmp_path):
    path = tmp_path / "distgrad.yaml"
    path.write_text(YAML)
    cfg = DistgradConfig.load(path)
    assert cfg.naming.tuples == ((r"^encoder\.stages\.(\d+)\.", r"\1", "stage"),)

    with_rules = {"encoder.stages.0.conv.weight": "0", "encoder.stages.0.conv.bias": "0",
                  "encoder.stages.1.conv.weight": "1", "encoder.stages.1.proj.weight": "1",
                  "classifier.weight": "head"}
    for config, layer_of in ((cfg, with_rules), (DistgradConfig(), {n: "other" for n in NAMES[:4]}
                                                  | {"classifier.weight": "head"})):
        diag = Diagnostics(config, NAMES)
        sink = PrometheusSink("127.0.0.1", 0, {}, 2, serve=False)
        rec = _rec(1)
        diag.on_record(rec)
        sink.write(rec)
        ref = _reference(layer_of)
        assert rec.aggregates.layer_norm == pytest.approx(ref, rel=1e-12)
        served = {dict(k)["layer"]: v for k, v in _series(sink, "distgrad_layer_grad_norm").items()}
        assert served == pytest.approx(ref, rel=1e-12)
    # the module kind from the rule: all four encoder parameters in one "stage" group
    diag = Diagnostics(cfg, NAMES)
    rec = _rec(2)
    diag.on_record(rec)
    assert rec.aggregates.module_kind_norm["stage"] == pytest.approx(math.sqrt(SUMSQ[:4].sum()), rel=1e-12)


def test_naming_rules_reach_the_tensorboard_layers(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator as ea

    from distgrad.export.tensorboard import TensorBoardSink

    cfg = DistgradConfig.load({"naming": {"rules": [[r"^encoder\.stages\.(\d+)\.", r"\1", "stage"]]}})
    sink = TensorBoardSink(tmp_path / "tb", naming_rules=cfg.naming.tuples, histograms=False)
    sink.write(_rec(3))
    sink.close()
    acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    got = {t.split("/", 1)[1]: acc.Scalars(t)[-1].value for t in acc.Tags()["scalars"]
           if t.startswith("layer_grad_norm/")}
    ref = {"0": math.sqrt(4.25), "1": math.sqrt(25.0), "head": 1.0}
    assert got == pytest.approx(ref, rel=1e-6)  # TensorBoard stores float32
