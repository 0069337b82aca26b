"""The main job: the example training run under the deepspeed launcher (2 CPU ranks, ZeRO-2)
serves the metric catalogue from rank 0; scrapes taken mid-run parse and show finite, moving
values; a NaN made in one rank's forward is counted and attributed to that rank and module."""

from __future__ import annotations

import json
from html import unescape

import pytest

from tests.helpers import free_port
from tests.example_job import ROOT, finite, scrape, start_example, step_at_least, stop, value, wait_for

CATALOGUE = [
    "distgrad_grad_norm", "distgrad_param_grad_norm", "distgrad_param_grad_mean", "distgrad_param_grad_std",
    "distgrad_param_grad_min", "distgrad_param_grad_max", "distgrad_param_grad_abs_max",
    "distgrad_param_grad_nonfinite", "distgrad_param_grad_zero_ratio", "distgrad_nonfinite_steps_total",
    "distgrad_optimizer_step", "distgrad_last_sample_timestamp_seconds", "distgrad_world_size", "distgrad_info",
    "distgrad_loss", "distgrad_internal_errors_total",
]
PARAMS = ["tok_emb.weight", "pos_emb.weight", "blocks.0.attn.qkv.weight", "blocks.3.mlp.proj.bias",
          "ln_f.weight", "head.weight"]


@pytest.mark.multirank
def test_example_serves_finite_moving_metrics_mid_run(tmp_path):
    port, log = free_port(), tmp_path / "train.log"
    proc = start_example(port, "--steps", "40", "--log-every", "5", log=log)
    try:
        a = wait_for(step_at_least(port, 2), proc, 240, "step 2 on /metrics", log)
        b = wait_for(step_at_least(port, value(a, "distgrad_optimizer_step") + 3), proc, 120, "3 more steps", log)
        names = {k[0] for k in b}
        missing = [n for n in CATALOGUE if n not in names]
        assert not missing, missing
        assert value(b, "distgrad_info", engine="deepspeed", zero_stage="2", dtype="fp32", version="0.1.0") == 1
        assert value(b, "distgrad_world_size") == 2
        assert value(b, "distgrad_nonfinite_steps_total") == 0
        assert value(b, "distgrad_internal_errors_total") == 0
        for m in (a, b):
            assert finite(value(m, "distgrad_grad_norm")) and value(m, "distgrad_grad_norm") > 0
            assert finite(value(m, "distgrad_loss")) and 0 < value(m, "distgrad_loss") < 10
            for p in PARAMS:  # user's own names, no "module." prefix
                for stat in ("norm", "mean", "std", "min", "max", "abs_max", "zero_ratio"):
                    assert finite(value(m, f"distgrad_param_grad_{stat}", param=p)), (p, stat)
                assert value(m, "distgrad_param_grad_nonfinite", param=p, kind="nan") == 0
        # moving: a later optimizer step with different values and a later timestamp
        assert value(b, "distgrad_optimizer_step") > value(a, "distgrad_optimizer_step")
        assert value(b, "distgrad_grad_norm") != value(a, "distgrad_grad_norm")
        assert value(b, "distgrad_loss") != value(a, "distgrad_loss")
        assert value(b, "distgrad_last_sample_timestamp_seconds") > value(a, "distgrad_last_sample_timestamp_seconds")
        proc.wait(300)
        assert proc.returncode == 0, log.read_text()[-3000:]
    finally:
        stop(proc)


@pytest.mark.multirank
def test_example_injected_nan_is_counted_named_recorded_and_reported(tmp_path):
    """One run with a NaN made at step 3 in the forward of ``blocks.2.mlp.fc`` on rank 1 (the
    example's ``--inject nan``: a naive log-softmax that underflows, on the step's last
    micro-batch): distgrad's own machinery finds where it started, and every view says the same:
    /metrics (the inputs of the NaN page's text: origin step, culprit rank, culprit module), the
    JSONL record (equal to what /metrics served for the last step), the flight recorder, rank 0's
    one log line of the event and `distgrad report`'s verdict; the parameter last in forward order
    (`head.weight`, where the backward met the NaN first) is exported under its own name only."""
    port, log = free_port(), tmp_path / "train.log"
    jsonl, fr = tmp_path / "run.jsonl", tmp_path / "flightrec"
    param, module = "blocks.2.mlp.fc.weight", "blocks.2.mlp.fc"
    gas = json.loads((ROOT / "configs" / "ds_zero2_fp32.json").read_text())["gradient_accumulation_steps"]
    proc = start_example(port, "--steps", "8", "--inject", "nan", "--inject-step", "3",
                         "--inject-param", param, "--inject-rank", "1", "--hold", "60", "--log-every", "1",
                         "--set", f"sinks.jsonl.path={jsonl}", "--set", f"flight_recorder.dir={fr}", log=log)
    try:
        m = wait_for(step_at_least(port, 7), proc, 240, "the last step", log)
        assert value(m, "distgrad_nonfinite_steps_total") == 1
        # where it started, as the NaN page reads it: the step, the rank, the module
        assert value(m, "distgrad_nonfinite_origin_step") == 3
        culprits = sorted(k[1] for k in m if k[0] == "distgrad_nonfinite_culprit")
        assert culprits == [(("rank", "1"), ("source", "grad")), (("rank", "1"), ("source", "loss"))], culprits
        assert [dict(k[1]) for k in m if k[0] == "distgrad_nonfinite_culprit_module"] == [
            {"rank": "1", "module": module}]
        assert value(m, "distgrad_nonfinite_culprit_module", rank="1", module=module) == 1
        assert value(m, "distgrad_nonfinite_replay_outcome", outcome="found") == 1
        # the weaker view under its own name: a forward NaN makes every gradient NaN, and the
        # backward meets it first in the head
        assert value(m, "distgrad_nonfinite_last_param_in_forward_order", param="head.weight", layer="head") == 3
        assert not [k for k in m if k[0] == "distgrad_nonfinite_origin_step" and k[1]]  # no labels: no 2nd answer
        # the shard view: rank 1's NaN reached every rank's shard through the reduction
        rows = {dict(k[1])["rank"] for k in m if k[0] == "distgrad_nonfinite_params"}
        assert rows and rows <= {"0", "1"}, rows
        assert finite(value(m, "distgrad_grad_norm"))  # later healthy steps are reported as healthy
    finally:
        stop(proc)
    text = log.read_text()
    # rank 0 logs the event once, naming the culprit rank and module; the culprit rank its own line
    events = [ln for ln in text.splitlines() if "distgrad: step 3: non-finite gradients" in ln]
    assert len(events) == 1, events
    assert "before the reduction: 1 (loss+grad); first non-finite forward output in module " \
           f"'{module}' on rank 1, micro-batch {gas - 1}" in events[0], events[0]
    assert len([ln for ln in text.splitlines() if "distgrad: step 3: nonfinite_loss on rank 1" in ln]) == 1
    # and nothing else about the step: one line from rank 0, one from the culprit rank, whatever the world size
    assert len([ln for ln in text.splitlines() if ln.startswith("distgrad: step 3:")]) == 2, text[-3000:]

    from distgrad.record import Culprit
    from distgrad.export.jsonl import read_jsonl

    recs = list(read_jsonl(jsonl))
    assert [r.step for r in recs] == list(range(8))
    last = recs[-1]  # the step /metrics was serving at the scrape (training had ended)
    assert last.step == value(m, "distgrad_optimizer_step")
    assert last.grad_norm == value(m, "distgrad_grad_norm")
    assert last.loss == value(m, "distgrad_loss")
    p = last.params
    for i, name in enumerate(p.names):
        for stat, arr in (("norm", p.norm), ("mean", p.mean), ("std", p.std), ("min", p.min), ("max", p.max),
                          ("abs_max", p.abs_max), ("zero_ratio", p.zero_ratio)):
            assert value(m, f"distgrad_param_grad_{stat}", param=name) == pytest.approx(arr[i], rel=1e-12, abs=0)
    bad = recs[3]
    assert bad.nonfinite and [r.step for r in recs if r.nonfinite] == [3]
    assert bad.culprits == [Culprit(rank=1, loss=True, grad=True)]
    cm = bad.culprit_module
    # the fault is on the step's last micro-batch only: the replay finds it there, not before
    assert (cm.outcome, cm.rank, cm.module, cm.micro_batch) == ("found", 1, module, gas - 1)
    assert bad.params.nan[p.names.index(param)] > 0

    dumps = sorted(fr.glob("flightrec-*.json"))
    assert len(dumps) == 1 and "step3" in dumps[0].name
    summary = dumps[0].with_suffix(".txt").read_text()
    assert "culprit rank(s), whose own loss / gradient was non-finite before the reduction: 1 (loss+grad)" in summary
    assert f"first non-finite forward output in module '{module}' on rank 1" in summary
    assert "non-finite parameter last in forward order: head.weight (not the origin" in summary

    from distgrad.cli import main as cli

    assert cli(["report", str(jsonl), "-o", str(tmp_path / "report")]) == 0
    html = (tmp_path / "report" / "report.html").read_text()
    verdict = html[html.index('id="verdict"'):]
    verdict = unescape(verdict[verdict.index(">") + 1:verdict.index("</p>")])
    # the verdict's headline is the replay's module on the culprit rank; the head's parameter
    # comes last, named for what it is
    assert verdict.startswith(f"PROBLEM at step 3: non-finite gradient made in the forward pass: first non-finite "
                              f"forward output in module '{module}' on rank 1, micro-batch {gas - 1}"), verdict[:1000]
    assert "culprit rank(s) [1]" in verdict
    assert verdict.index(module) < verdict.index("head.weight")


@pytest.mark.multirank
def test_example_lora_shows_a_and_b_per_layer(tmp_path):
    """LoRA run: per layer, the A and B adapters are their own series side by side; frozen base
    weights are never read (no series); A's gradient is exactly 0 at step 0 (B starts at 0)."""
    port, log = free_port(), tmp_path / "train.log"
    jsonl = tmp_path / "run.jsonl"
    proc = start_example(port, "--steps", "30", "--lora", "4", "--layers", "2", "--width", "64",
                         "--heads", "2", "--block", "32", "--hold", "60", "--set", f"sinks.jsonl.path={jsonl}", log=log)
    try:
        m = wait_for(step_at_least(port, 5), proc, 240, "step 5", log)
        from distgrad.export.jsonl import read_jsonl

        first = next(iter(read_jsonl(jsonl)))
        assert first.step == 0
        for layer in ("0", "1"):
            assert first.aggregates.layer_norm[f"{layer}/lora_A"] == 0.0
            assert first.aggregates.layer_norm[f"{layer}/lora_B"] > 0.0
            assert value(m, "distgrad_layer_grad_norm", layer=f"{layer}/lora_A") > 0.0
            assert value(m, "distgrad_layer_grad_norm", layer=f"{layer}/lora_B") > 0.0
        params = {dict(k[1])["param"] for k in m if k[0] == "distgrad_param_grad_norm"}
        assert params and all(".lora_A." in p or ".lora_B." in p for p in params), params
        assert len(params) == 2 * 4 * 2  # 2 blocks x 4 adapted linears x (A, B)
    finally:
        stop(proc)
