"""The Hugging Face fine-tuning example (launch/hf_finetune.py) as the README starts it: 2 ranks
under torchrun, LoRA on a random-init Llama, metrics served by rank 0 while it holds; with the
logit precursors switched on by its --set, served under their documented names with the values
of the JSONL record of the served step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.multirank


def test_hf_finetune_example_serves_lora_metrics(tmp_path):
    port = free_port()
    jsonl = tmp_path / "records.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "launch/hf_finetune.py", "--steps", "3", "--port", str(port),
           "--jsonl", str(jsonl), "--hold", "60",
           # an opt-in family through the example's --set (README, "The example job"): served by name
           "--set", "logits.attention=true", "--set", "logits.output=true"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text, deadline = "", time.monotonic() + 400
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if jsonl.exists() and len(jsonl.read_text().splitlines()) >= 3:
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                    break
                except OSError:
                    pass
            time.sleep(1)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert text, f"no metrics served:\n{out[-4000:]}"
    assert "distgrad_loss " in text and "distgrad_grad_norm " in text
    params = {line.split('param="', 1)[1].split('"', 1)[0] for line in text.splitlines()
              if line.startswith("distgrad_param_grad_norm{")}
    assert params and all(".lora_A." in p or ".lora_B." in p for p in params)  # frozen base weights: none
    assert 'distgrad_clip_ratio' in text  # max_grad_norm from TrainingArguments
    step = next(float(line.split()[1]) for line in text.splitlines() if line.startswith("distgrad_optimizer_step "))
    rec = next(json.loads(line) for line in jsonl.read_text().splitlines() if json.loads(line)["step"] == step)
    served = {line.split('layer="', 1)[1].split('"', 1)[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("distgrad_layer_attention_logit_max{")}
    assert served == pytest.approx(rec["logits"]["attention_max"], rel=1e-12) and set(served) == {"0", "1"}
    for name, key in (("distgrad_output_logit_abs_max", "output_abs_max"), ("distgrad_output_logsumexp_mean", "z_mean")):
        value = next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))
        assert value == pytest.approx(rec["logits"][key], rel=1e-12)


def test_hf_finetune_example_moe_option_feeds_router_health(tmp_path):
    """``--moe 4`` (a Mixtral-style model, top-2 routing) with ``--set router.enabled=true`` on one
    process: every MoE layer's token counts add up to top-2 x the step's tokens (2 micro-batches of
    2 x 16 tokens: 64 routed, 128 assignments), the imbalance is max/mean of those counts, and the
    auxiliary loss is reported."""
    jsonl = tmp_path / "moe.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "launch/hf_finetune.py", "--steps", "2", "--batch", "2", "--accum", "2", "--block", "16",
           "--moe", "4", "--port", str(free_port()), "--jsonl", str(jsonl), "--set", "router.enabled=true"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        router = r["router"]
        assert set(router["tokens"]) == {"0", "1"}
        for layer, tokens in router["tokens"].items():
            assert router["routed"][layer] == 2 * 2 * 16 and sum(tokens) == 2 * 2 * 2 * 16
            assert router["imbalance"][layer] == pytest.approx(max(tokens) / (sum(tokens) / 4), rel=1e-12)
        assert router["aux_loss"] > 0
        assert r["counters"]["internal_errors"] == 0
