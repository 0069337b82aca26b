"""Issue 25, "Done when": the router and float8 cases each page with the right layer named.

The realistic cases of tests/test_router.py (a tiny DeepSeek-V3 whose layer 1 balancing-bias
update has the wrong sign collapses onto one expert), tests/test_fp8.py (a float8 model whose
input becomes all zeros at step 2: amax 0) and tests/dist/fp8_fsdp_cases.py (FSDP2 with torchao's
float8 all-gather, 2 ranks, ``precompute_float8_dynamic_scale_for_fsdp`` called once at set-up:
the growing weights of layer 1 saturate), each with its healthy twin (the right sign; the normal
input; the precompute call after each optimizer step), and the starved-experts case of
tests/test_router.py (layer 1's balancing bias restored with experts 2 and 3 at -0.5: they get no
token; the right-sign run is its healthy twin), write distgrad's JSONL log; the SHIPPED
rule file is evaluated over every record of the seven logs (grafana/rule_replay.py
``evaluate_jsonl``: distgrad's exporter renders each record, promtool backfills, a real
Prometheus evaluates each rule with ``for:`` applied), and the firing alert's annotations are
rendered by Prometheus' template engine
(``rule_replay.render_alerts``: a ``promtool test rules`` run over the same series), i.e. the
text the page carries.

Time axis: one sampled step every DT = 30 s (``sampling.interval`` 1 and a 30 s optimizer step
of a large MoE model), so DistgradRouterCollapse's ``for: 5m`` is 10 consecutive sampled steps
and DistgradFp8Saturation's ``for: 1m`` 2. The expected firing steps and layers are computed
from the records themselves (the served samples, against the thresholds in grafana/config.py),
not hard-coded.
"""

from __future__ import annotations

import math

import pytest
import torch

from grafana import config as gconfig
from grafana import rule_replay
from grafana.build import RULES_PATH

pytestmark = [pytest.mark.monitoring]

DT = 30.0


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    from tests.test_fp8 import _batch, _run
    from tests.test_router import STARVED, STARVED_STEPS, _balancing_run

    tmp = tmp_path_factory.mktemp("precursor_paging")
    paths = {name: tmp / f"{name}.jsonl" for name in ("router_flipped", "router_ok", "router_starved", "fp8_zero",
                                                       "fp8_ok")}
    _balancing_run(flipped_layer=1, jsonl=str(paths["router_flipped"]))
    _balancing_run(flipped_layer=None, jsonl=str(paths["router_ok"]))
    starved_counts: list = []  # float64 tokens per expert recomputed from the routers' own inputs
    _balancing_run(flipped_layer=None, steps=STARVED_STEPS, jsonl=str(paths["router_starved"]), init_bias=STARVED,
                   reference=starved_counts)

    def zero_at_2(s, micro):
        x, y = _batch()(s, micro)
        return (torch.zeros_like(x) if s == 2 else x), y

    _run(3, zero_at_2, jsonl=str(paths["fp8_zero"]))
    _run(3, _batch(), jsonl=str(paths["fp8_ok"]))
    # FSDP2 float8 all-gather on 2 ranks, the stale precomputed scale and the documented placement
    # (tests/dist/fp8_fsdp_cases.py; the launch is shared with tests/test_fp8.py): rank 0's log
    from tests.fp8_models import fsdp_cases

    res = fsdp_cases()
    for name in ("fp8_stale", "fp8_fresh"):
        r0 = res["cases"][name]["ranks"][0]
        assert "error" not in r0, r0.get("traceback")
        paths[name] = tmp / f"{name}.jsonl"
        paths[name].write_text(r0["jsonl"])
    try:
        ev = rule_replay.evaluate_jsonl(paths, RULES_PATH, dt=DT)
    except FileNotFoundError as e:
        pytest.skip(f"monitoring binaries missing: {e}")
    return {"ev": ev, "recs": {n: rule_replay.read_records(p) for n, p in paths.items()},
            "starved_counts": starved_counts}


def test_router_collapse_pages_naming_layer_1_and_the_balanced_run_fires_nothing(replay):
    from distgrad.signals.router import RouterHealth

    recs = replay["recs"]["router_flipped"]
    rule = next(r for r in rule_replay.alerting_rules(RULES_PATH) if r["alert"] == "DistgradRouterCollapse")
    threshold = gconfig.ALERTS["DistgradRouterCollapse"]["threshold"]
    imb = [RouterHealth.samples(r.router)["distgrad_router_load_imbalance"] for r in recs]
    over = [max(x.values()) > threshold for x in imb]
    # the episode that pages: the last run of consecutive steps above the threshold, held for `for:`
    start = next(i for i in range(len(over)) if all(over[i:]))
    need = math.ceil(rule_replay.parse_duration(rule["for"]) / DT)
    assert start + need < len(recs), (start, need, imb)  # the case runs long enough to page
    fire = recs[start + need].step
    ev = replay["ev"]["router_flipped"]
    assert ev.pages("critical") == [("DistgradRouterCollapse", fire)], ev.pages()
    ((labels, ann),) = rule_replay.render_alerts(recs, "router_flipped", RULES_PATH, "DistgradRouterCollapse", fire, DT)
    assert labels["severity"] == "critical" and labels["run"] == "router_flipped"
    named = {k: v for k, v in imb[start + need].items() if v > threshold}
    assert set(named) == {"1"}, imb[start + need]  # layer 0 keeps its right sign and stays balanced
    assert f"in layer(s) 1 ({named['1']:.2f})." in ann["description"], ann["description"]
    assert f"at sampled step {fire})" in ann["description"], ann["description"]
    assert "router_flipped" in ann["summary"]
    # not firing one step earlier (for: not yet elapsed)
    assert rule_replay.render_alerts(recs, "router_flipped", RULES_PATH, "DistgradRouterCollapse", fire - 1, DT) == []
    print(f"router collapse: above {threshold} from step {recs[start].step}, page at step {fire}: "
          + ann["description"])
    # the healthy twin: nothing fires, of any severity
    assert replay["ev"]["router_ok"].pages() == []


def test_fp8_amax_zero_pages_naming_its_layer_and_the_normal_run_fires_nothing(replay):
    from distgrad.signals.fp8 import Fp8Signal

    recs = replay["recs"]["fp8_zero"]
    amin = [Fp8Signal.samples(r.fp8)["distgrad_fp8_amax_min"] for r in recs]
    zero = {(s, k) for s, a in zip((r.step for r in recs), amin) for k, v in a.items() if v == 0}
    assert {s for s, _ in zero} == {2} and (2, ("0", "input")) in zero, zero  # the all-zero input's step
    ev = replay["ev"]["fp8_zero"]
    assert ev.pages("critical") == [("DistgradFp8AmaxZero", 2)], ev.pages()
    fired = rule_replay.render_alerts(recs, "fp8_zero", RULES_PATH, "DistgradFp8AmaxZero", 2, DT)
    assert {(lab["layer"], lab["tensor"]) for lab, _ in fired} == {k for _, k in zero}
    for lab, ann in fired:
        assert lab["severity"] == "critical"
        assert f"FP8 amax of 0 in layer {lab['layer']} ({lab['tensor']})" in ann["summary"], ann
        assert "At sampled step 2 of distgrad run fp8_zero" in ann["description"], ann
        assert f"of layer {lab['layer']} was all zeros" in ann["description"], ann
    print("fp8 amax zero: page at step 2: " + "; ".join(a["summary"] for _, a in fired))
    assert rule_replay.render_alerts(recs, "fp8_zero", RULES_PATH, "DistgradFp8AmaxZero", 1, DT) == []
    assert replay["ev"]["fp8_ok"].pages() == []


def test_fp8_stale_precomputed_scale_saturation_pages_naming_layer_1_and_the_documented_placement_fires_nothing(
        replay):
    """The float8 saturation case of issue #25 item 6: the FSDP2 float8 all-gather run whose
    scale was precomputed once (tests/dist/fp8_fsdp_cases.py ``fp8_stale``) pages
    DistgradFp8Saturation naming layer 1 (the layer whose weights grow; layer 0's learning rate
    is 100x smaller and it does not saturate), once the served saturation ratio has held above
    the threshold for the rule's ``for:``; the run with the call after each optimizer step
    (``fp8_fresh``) fires nothing."""
    from distgrad.signals.fp8 import Fp8Signal

    recs = replay["recs"]["fp8_stale"]
    rule = next(r for r in rule_replay.alerting_rules(RULES_PATH) if r["alert"] == "DistgradFp8Saturation")
    threshold = gconfig.ALERTS["DistgradFp8Saturation"]["threshold"]
    sat = [Fp8Signal.samples(r.fp8)["distgrad_fp8_layer_saturation_ratio"] for r in recs]
    over = [{k for k, v in x.items() if v > threshold} for x in sat]
    start = next(i for i in range(len(over)) if all(over[i:]))
    need = math.ceil(rule_replay.parse_duration(rule["for"]) / DT)
    assert start + need < len(recs), (start, need, sat)
    fire = recs[start + need].step
    assert over[start + need] == {"1"}, sat  # layer 0 never saturates
    ev = replay["ev"]["fp8_stale"]
    assert ev.pages("critical") == [("DistgradFp8Saturation", fire)], ev.pages()
    fired = rule_replay.render_alerts(recs, "fp8_stale", RULES_PATH, "DistgradFp8Saturation", fire, DT)
    assert [lab["layer"] for lab, _ in fired] == ["1"], fired
    ((lab, ann),) = fired
    assert lab["severity"] == "critical" and lab["run"] == "fp8_stale"
    assert "FP8 saturation in layer 1 of" in ann["summary"], ann
    assert f"(now {sat[start + need]['1']:.3g} at sampled step {fire})" in ann["description"], ann
    assert "precompute_float8_dynamic_scale_for_fsdp" in ann["description"], ann
    print(f"fp8 saturation: above {threshold} from step {recs[start].step}, page at step {fire}: "
          + ann["summary"] + " " + ann["description"])
    assert rule_replay.render_alerts(recs, "fp8_stale", RULES_PATH, "DistgradFp8Saturation", fire - 1, DT) == []
    assert replay["ev"]["fp8_fresh"].pages() == []


def test_dead_experts_page_naming_the_starved_layer_and_the_balanced_run_fires_nothing(replay):
    """DistgradRouterDeadExperts fires at the first step where the float64 recomputation
    (tests/test_router.py ``dead_from_counts``) has an expert without a token for
    router.dead_after steps, names layer 1 (not the healthy layer 0) with its number of dead
    experts, and is the only alert of the run; the balanced run fires nothing."""
    from tests.test_router import dead_from_counts

    recs = replay["recs"]["router_starved"]
    dead = dead_from_counts(replay["starved_counts"])
    assert len(dead) == len(recs)
    first = next(i for i, d in enumerate(dead) if any(d.values()))
    named = {lay: len(e) for lay, e in dead[first].items() if e}
    assert named == {"1": 2}, dead[first]  # experts 2 and 3 of layer 1; layer 0 keeps every expert
    fire = recs[first].step
    ev = replay["ev"]["router_starved"]
    assert ev.pages() == [("DistgradRouterDeadExperts", fire)], ev.pages()  # a ticket, and nothing else
    ((labels, ann),) = rule_replay.render_alerts(recs, "router_starved", RULES_PATH, "DistgradRouterDeadExperts",
                                                 fire, DT)
    assert labels["severity"] == gconfig.ALERTS["DistgradRouterDeadExperts"]["severity"] == "warning"
    assert labels["run"] == "router_starved" and "layer" not in labels
    assert ann["description"].startswith("2 expert(s) of distgrad run router_starved"), ann["description"]
    assert f"(sampled step {fire}), in MoE layer(s) 1 (2 dead)." in ann["description"], ann["description"]
    assert rule_replay.render_alerts(recs, "router_starved", RULES_PATH, "DistgradRouterDeadExperts", fire - 1,
                                     DT) == []
    print(f"dead experts: page at step {fire}: " + ann["description"])
    assert replay["ev"]["router_ok"].pages() == []
