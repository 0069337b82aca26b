"""Hugging Face Trainer integration (``distgrad.integrations.hf.attach``) on 2 gloo ranks with the
real transformers / accelerate / deepspeed / peft: one launch of tests/dist/hf_cases.py.

Every case runs gradient accumulation 2 with the Trainer's clipping active (``max_grad_norm``
below the step-0 norm), so a boundary after clipping would report 1.0, and a loss taken as handed
to backward without accounting for the Trainer's scaling would be 1/2 or 1/4 of the true one.
"""

from __future__ import annotations

import math

import pytest

from distgrad.record import StepRecord
from tests.conftest import launch
from tests.reference import case, check_against

pytestmark = pytest.mark.multirank

TRAINER = ["ds_z2", "ds_z3", "ds_z2_lora", "fsdp2"]
CASES = TRAINER + ["accelerate_ds"]  # a plain Accelerate loop with the DeepSpeed plugin


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory):
    return launch("hf_cases.py", tmp_path_factory.mktemp("hf") / "hf.json")


@pytest.mark.parametrize("key", CASES)
def test_pre_clip_gradient_equals_float64_reference(hf_results, key):
    c = case(hf_results, key)
    rec = StepRecord.from_dict(c["records"][0])
    assert rec.step == 0
    # per-parameter norm, mean, std, extrema and the global norm: float64 recomputation, fp32 run
    check_against(rec, c["ref_fp64_step0"], rtol=1e-5, exact=False)
    gref = math.sqrt(sum(v["norm"] ** 2 for v in c["ref_fp64_step0"].values()))
    assert gref > c["args_max_grad_norm"], "clipping must be active for this test to tell pre- from post-clip"
    assert rec.grad_norm == pytest.approx(gref, rel=1e-5)


@pytest.mark.parametrize("key", CASES)
def test_loss_is_the_steps_mean_loss(hf_results, key):
    c = case(hf_results, key)
    # the Trainer hands backward a pre-scaled loss; an Accelerate loop under DeepSpeed the
    # micro-batch loss, which DeepSpeed divides itself
    assert c["loss_reduction"] == ("mean" if key == "accelerate_ds" else "sum")
    assert c["n_sequences_step0"] == 2 * 2 * 2  # ranks x accumulation x per-device batch
    rec = StepRecord.from_dict(c["records"][0])
    assert rec.loss == pytest.approx(c["ref_loss_step0"], rel=1e-6)
    if key in TRAINER:  # and the Trainer's own logged loss of each step
        assert [r["loss"] for r in c["records"]] == pytest.approx([lg["loss"] for lg in c["logs"]], rel=1e-6)


@pytest.mark.parametrize("key", CASES)
def test_logged_grad_norm_and_clip_ratio_agree(hf_results, key):
    # the Trainer's logged grad_norm; for the Accelerate loop engine.get_global_grad_norm()
    c = case(hf_results, key)
    assert len(c["records"]) == len(c["logs"]) == 2
    for r, lg in zip(c["records"], c["logs"]):
        assert r["grad_norm"] == pytest.approx(lg["grad_norm"], rel=1e-5)
    rec = StepRecord.from_dict(c["records"][0])
    m = c["args_max_grad_norm"]
    assert c["max_grad_norm"] == m  # from TrainingArguments.max_grad_norm
    gn = c["logs"][0]["grad_norm"]
    assert rec.extra["clip_ratio"] == pytest.approx(m / (gn + 1e-6), rel=1e-5)
    assert rec.extra["post_clip_norm"] == pytest.approx(m * gn / (gn + 1e-6), rel=1e-5)


def test_engines_and_frozen_lora_base_weights(hf_results):
    assert {k: (case(hf_results, k)["engine"], case(hf_results, k)["zero_stage"]) for k in CASES} == {
        "ds_z2": ("deepspeed", 2), "ds_z3": ("deepspeed", 3), "ds_z2_lora": ("deepspeed", 2),
        "fsdp2": ("fsdp2", None), "accelerate_ds": ("deepspeed", 2)}
    lora = case(hf_results, "ds_z2_lora")
    names = StepRecord.from_dict(lora["records"][0]).params.names
    assert lora["frozen"] and not set(lora["frozen"]) & set(names)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
