"""docs/metrics.md and the exposition agree: every documented metric name appears in a scrape of
a record that exercises every feature (fp16 loss scale, clipping, update ratio, a non-finite
streak, a failing sink), and every name in that scrape is documented."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from distgrad.config import DistgradConfig
from distgrad.diagnostics import Diagnostics
from distgrad.record import ParamStats, StepRecord
from distgrad.sinks.prometheus import PrometheusSink

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def _documented() -> set[str]:
    names = set()
    for line in DOC.read_text().splitlines():
        if line.startswith("| `distgrad_"):
            first = line.split("|")[1]
            names |= set(re.findall(r"`(distgrad_[a-z0-9_]+)`", first))
            # "`distgrad_param_grad_min` / `_max`": suffix shorthand
            for short in re.findall(r"/ `(_[a-z0-9_]+)`", first):
                base = re.findall(r"`(distgrad_[a-z0-9_]+?)_[a-z]+`", first)[0]
                names.add(base + short)
    return names


def _scraped() -> set[str]:
    names = ["blocks.0.attn.qkv.weight", "blocks.1.mlp.fc.weight"]
    cfg = DistgradConfig(max_grad_norm=1.0)
    diag = Diagnostics(cfg, names)
    sink = PrometheusSink("127.0.0.1", 0, {"engine": "deepspeed"}, 2, serve=False)
    sink.collector.inc_labeled("distgrad_sink_errors", {"sink": "jsonl"}, 0)
    sink.collector.step_time = 1.0
    p = ParamStats(names, numel=[4, 4], sum=[0.0, np.nan], sumsq=[4.0, np.nan], nan=[0, 1], inf=[0, 0],
                   zeros=[0, 0], min=[-1.0, np.nan], max=[1.0, np.nan])
    rec = StepRecord(3, 3, 1.0, 2, p, float("nan"), loss=2.0, loss_scale=1024.0, overflow=False,
                     counters={"samples": 12},
                     extra={"headroom": [1e-5, np.nan], "update_ratio": {names[0]: 1e-3},
                            "replica_mismatch_rank": -1, "consecutive_overflow_steps": 0,
                            "loss_scale_at_minimum": 0,
                            "nonfinite_params": [{"param": names[1], "rank": 1, "nan": 1, "inf": 0, "count": 1}]})
    diag.on_record(rec)
    sink.write(rec)
    out = set()
    for fam in text_string_to_metric_families(generate_latest(sink.registry).decode()):
        out |= {s.name for s in fam.samples}
    return out


def test_documented_names_are_exported_and_exported_names_documented():
    doc, got = _documented(), _scraped()
    assert len(doc) > 40
    assert sorted(doc - got) == []  # documented but never exported
    assert sorted(got - doc) == []  # exported but not documented
