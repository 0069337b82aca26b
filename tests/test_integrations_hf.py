"""Hugging Face Trainer integration (``distgrad.integrations.hf.attach``) on 2 gloo ranks with the
real transformers / accelerate / deepspeed / peft: one launch of tests/dist/hf_cases.py.

Every case runs gradient accumulation 2 with the Trainer's clipping active (``max_grad_norm``
below the step-0 norm), so a boundary after clipping would report 1.0, and a loss taken as handed
to backward without accounting for the Trainer's scaling would be 1/2 or 1/4 of the true one.
The one-process Trainer runs in this process (no launch). The Trainer's data has padded labels
(-100) of different lengths, so its ``num_items_in_batch`` normalisation (the mean over every
scored token of the step) differs from a mean of micro-batch means. The DDP and ZeRO-2 cases also
run the underflow signal and compare its training-precision recomputation with the training
backward's gradient (the Trainer's loss scaling, docs/signals.md "The loss factor").

Tolerances against the float64 reference: 1e-5 relative in fp32; bf16 / fp16 runs compare norms
and the loss at 3e-2 / 1e-2 relative, the precision of their arithmetic in forward and backward
(the rationale of tests/test_deepspeed_reference.py); the Trainer's own logged values come from
the same low-precision gradients and agree at 1e-5 in every dtype.
"""

from __future__ import annotations

import math

import pytest

from distgrad.record import StepRecord
from tests.helpers import launch
from tests.reference import case, check_against

LOW = ["ds_z2_bf16", "ds_z3_bf16", "ds_z2_fp16", "ds_z3_fp16"]
TRAINER = ["ds_z0", "ds_z1", "ds_z2", "ds_z3", "ds_z2_lora", *LOW, "fsdp2", "fsdp1", "ddp", "single"]
CASES = TRAINER + ["accelerate_ds", "accelerate_ddp"]  # plain Accelerate loops: DeepSpeed plugin, DDP
RTOL = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}  # against the float64 reference


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory, monkeypatch_module):
    res = launch("hf_cases.py", tmp_path_factory.mktemp("hf") / "hf.json")
    res["cases"]["single"] = _single_process_case(monkeypatch_module)
    res["cases"]["single_gns"] = _single_process_case(monkeypatch_module, "single_gns", ga=3, gns=True)
    return res


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _single_process_case(mp, name: str = "single", **kw) -> dict:
    """The Trainer on one process without torch.distributed (distgrad's local engine), run here."""
    import traceback

    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        mp.delenv(var, raising=False)
    mp.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # make_state sets both; restored afterwards
    mp.setenv("ACCELERATE_USE_FSDP", "false")
    from tests.dist import hf_cases

    try:
        return hf_cases.run_case(name, "single", **kw)
    except Exception as e:  # noqa: BLE001 - reported by case() with the traceback
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    finally:
        hf_cases.reset_accelerate()


def _n_ranks(key: str) -> int:
    return 1 if key == "single" else 2


@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_pre_clip_gradient_equals_float64_reference(hf_results, key):
    c = case(hf_results, key)
    rec = StepRecord.from_dict(c["records"][0])
    assert rec.step == 0
    dtype = c.get("dtype", "fp32")
    gref = math.sqrt(sum(v["norm"] ** 2 for v in c["ref_fp64_step0"].values()))
    if dtype == "fp32":
        # per-parameter norm, mean, std, extrema and the global norm: float64 recomputation
        check_against(rec, c["ref_fp64_step0"], rtol=RTOL[dtype], exact=False)
    else:  # low precision: norms only (extrema of single elements move more)
        assert set(rec.params.names) == set(c["ref_fp64_step0"])
        for i, n in enumerate(rec.params.names):
            assert rec.params.norm[i] == pytest.approx(c["ref_fp64_step0"][n]["norm"], rel=RTOL[dtype]), n
    assert gref > c["args_max_grad_norm"], "clipping must be active for this test to tell pre- from post-clip"
    assert rec.grad_norm == pytest.approx(gref, rel=RTOL[dtype])
    assert c.get("refusals", {}) == {}


@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_micro_step_counts_micro_batches(hf_results, key):
    """``StepRecord.micro_step`` means one thing under every integration and engine: the
    micro-batches processed up to the step's boundary, this step's included, i.e. accumulation
    (2 in every case) x (step + 1). The Trainer and Accelerate with DeepSpeed call
    ``engine.step()`` only at the boundary, so DeepSpeed's own ``micro_steps`` counts optimizer
    steps there (0, 1, ...); the PyTorch engines count forward passes (2, 4, ...)."""
    recs = case(hf_results, key)["records"]
    assert recs
    assert [r["micro_step"] for r in recs] == [2 * (r["step"] + 1) for r in recs]


@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_loss_is_the_steps_mean_loss(hf_results, key):
    c = case(hf_results, key)
    # the Trainer hands backward a pre-scaled loss; an Accelerate loop under DeepSpeed the
    # micro-batch loss, which DeepSpeed divides itself
    assert c["loss_reduction"] == ("mean" if key == "accelerate_ds" else "sum")
    assert c["n_sequences_step0"] == _n_ranks(key) * 2 * 2  # ranks x accumulation x per-device batch
    rec = StepRecord.from_dict(c["records"][0])
    dtype = c.get("dtype", "fp32")
    assert rec.loss == pytest.approx(c["ref_loss_step0"], rel=1e-6 if dtype == "fp32" else RTOL[dtype])
    if key in TRAINER and dtype == "fp32":  # padded labels: the step's token mean is not a mean of
        # micro-batch means, by far more than the tolerance above (a random-init model's losses differ little)
        assert abs(c["ref_loss_mean_of_micro_means"] - c["ref_loss_step0"]) > 20 * 1e-6 * c["ref_loss_step0"]
    if key in TRAINER:  # and the Trainer's own logged loss of each step
        assert [r["loss"] for r in c["records"]] == pytest.approx([lg["loss"] for lg in c["logs"]], rel=1e-6)


@pytest.mark.multirank
@pytest.mark.parametrize("key", CASES)
def test_logged_grad_norm_and_clip_ratio_agree(hf_results, key):
    # the Trainer's logged grad_norm; for the Accelerate loops engine.get_global_grad_norm() under
    # DeepSpeed, accelerator.clip_grad_norm_'s return value under DDP
    c = case(hf_results, key)
    assert len(c["records"]) == len(c["logs"]) == 2
    if key == "ds_z0":  # DeepSpeed computes no global norm at ZeRO-0 fp32 (get_global_grad_norm()
        # is None; docs/engines.md), so the Trainer logs none: the float64 reference instead
        assert [lg.get("grad_norm") for lg in c["logs"]] == [None, None]
        gn = math.sqrt(sum(v["norm"] ** 2 for v in c["ref_fp64_step0"].values()))
    else:
        for r, lg in zip(c["records"], c["logs"]):
            assert r["grad_norm"] == pytest.approx(lg["grad_norm"], rel=1e-5)
        gn = c["logs"][0]["grad_norm"]
    rec = StepRecord.from_dict(c["records"][0])
    m = c["args_max_grad_norm"]
    # the Trainer: TrainingArguments.max_grad_norm; Accelerate loops: the engine's clipping, max_grad_norm=
    assert c["max_grad_norm"] == m
    assert rec.clip.ratio == pytest.approx(m / (gn + 1e-6), rel=1e-5)
    assert rec.clip.post_clip_norm == pytest.approx(m * gn / (gn + 1e-6), rel=1e-5)


@pytest.mark.multirank
def test_engines_and_frozen_lora_base_weights(hf_results):
    assert {k: (case(hf_results, k)["engine"], case(hf_results, k)["zero_stage"]) for k in CASES} == {
        "ds_z0": ("deepspeed", 0), "ds_z1": ("deepspeed", 1), "ds_z2": ("deepspeed", 2), "ds_z3": ("deepspeed", 3),
        "ds_z2_lora": ("deepspeed", 2),
        "ds_z2_bf16": ("deepspeed", 2), "ds_z3_bf16": ("deepspeed", 3), "ds_z2_fp16": ("deepspeed", 2),
        "ds_z3_fp16": ("deepspeed", 3), "fsdp2": ("fsdp2", None),
        "fsdp1": ("fsdp1", None), "ddp": ("ddp", None), "single": ("torch", None),
        "accelerate_ds": ("deepspeed", 2), "accelerate_ddp": ("ddp", None)}
    # the low-precision runs really held bf16 / loss-scaled fp16 gradients (2^initial_scale_power)
    low = {k: StepRecord.from_dict(case(hf_results, k)["records"][0]) for k in LOW}
    assert {k: (r.grad_dtype, r.loss_scale, r.grad_scale) for k, r in low.items()} == {
        "ds_z2_bf16": ("bf16", None, 1.0), "ds_z3_bf16": ("bf16", None, 1.0),
        "ds_z2_fp16": ("fp16", 256.0, 256.0), "ds_z3_fp16": ("fp16", 256.0, 256.0)}
    # settings: the DeepSpeed config's "distgrad" section under DeepSpeed (spike_window 64 there),
    # the defaults elsewhere; max_grad_norm from TrainingArguments (test_logged_grad_norm_...)
    assert {k: case(hf_results, k)["spike_window"] for k in TRAINER} == {
        k: 64 if k.startswith("ds_") else 128 for k in TRAINER}
    lora = case(hf_results, "ds_z2_lora")
    names = StepRecord.from_dict(lora["records"][0]).params.names
    assert lora["frozen"] and not set(lora["frozen"]) & set(names)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["single_gns", "ds_z2_gns"])
def test_noise_scale_small_batch_from_the_trainer_equals_float64_reference(hf_results, key):
    # noise_scale.enabled without micro_batch_size: the Trainer's per_device_train_batch_size
    # (2), filled by the integration on one process and by the Trainer's DeepSpeed "auto" under
    # ZeRO-2; accumulation 3. The Trainer's loss scaling (sum over tokens / num_items_in_batch of
    # the step) against each micro-batch's own mean loss, its gradient recomputed in float64
    c = case(hf_results, key)
    ref = c["gns_ref"]
    assert ref["micro_batches"] == 3 * _n_ranks(key.replace("_gns", ""))
    rec = StepRecord.from_dict(c["records"][0])
    ns = rec.noise_scale
    assert ns is not None and rec.step == 0 and c.get("refusals", {}) == {}
    assert (ns.small_batch, ns.micro_batches, ns.big_batch) == (2, ref["micro_batches"], 2 * ref["micro_batches"])
    # |G|^2 is a difference of the two (a random-init model on random tokens: near zero, may be
    # negative): its tolerance is on the scale of the terms it comes from
    for field in ("grad_sq_small", "grad_sq_big", "true_grad_sq", "noise_trace"):
        assert getattr(ns, field) == pytest.approx(ref[field], rel=1e-5, abs=1e-5 * ref["grad_sq_small"]), field
    assert ref["noise_trace"] > 0
    # one step: the bias-corrected EMAs are the step's estimates; no ratio for |G|^2 <= 0
    assert (ns.ema_true_grad_sq, ns.ema_noise_trace) == pytest.approx((ns.true_grad_sq, ns.noise_trace), rel=1e-12)
    if ns.true_grad_sq > 0:
        assert ns.noise_scale == pytest.approx(ns.noise_trace / ns.true_grad_sq, rel=1e-12)
    else:
        assert ns.noise_scale is None
    assert StepRecord.from_dict(c["records"][1]).noise_scale.ema_steps == 2
    # the Trainer's num_items_in_batch token weighting (a Llama takes loss kwargs): said once on
    # rank 0, only with the noise scale on
    assert len([m for m in c["warnings"] if "num_items_in_batch" in m]) == 1
    assert not [m for k in ("single", "ds_z2") for m in case(hf_results, k)["warnings"] if "num_items_in_batch" in m]


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["ddp", "ds_z2", "accelerate_ddp", "accelerate_ds"])
def test_underflow_replays_the_trainers_scaling_on_two_ranks(hf_results, key):
    # 2 ranks, num_items_in_batch (padded labels) and average_tokens_across_devices (the default):
    # the Trainer multiplies the forward's loss by the 2 processes and does not divide by GA=2; under
    # DeepSpeed it calls engine.backward(..., scale_wrt_gas=False), so DeepSpeed's own 1/GA (the raw
    # engine's automatic factor) must not be applied. The plain Accelerate loops (accelerate_*):
    # accelerator.backward divides by GA=2 (DeepSpeed: engine.backward does). Rank 0's
    # training-precision pass gradient equals its training backward's for the recomputed
    # micro-batch, element for element
    from tests.dist.hf_cases import tiny_llama

    c = case(hf_results, key)
    assert c["underflow_compared"] == len(list(tiny_llama(0).parameters()))  # every parameter compared
    assert c["underflow_mismatches"] == []
    assert [StepRecord.from_dict(r).underflow.step for r in c["records"]] == [0, 1]


def test_micro_batch_size_from_the_framework_unless_the_user_sets_it(recwarn):
    from distgrad.config import ConfigError, DistgradConfig
    from distgrad.integrations import with_micro_batch_size as w

    on = {"noise_scale": {"enabled": True}}
    assert w(None, on, 8, "x") == {**on, "noise_scale.micro_batch_size": 8}
    assert w(on, {}, 8, "x") == {"noise_scale.micro_batch_size": 8}
    assert w(None, {"noise_scale.enabled": True}, 8, "x")["noise_scale.micro_batch_size"] == 8
    assert w(None, {}, 8, "x") == w(None, {}, None, "x") == {}  # off (the default): nothing, no error
    for user in ({"noise_scale": {"enabled": True, "micro_batch_size": 3}},
                 {"noise_scale.enabled": True, "noise_scale.micro_batch_size": 3}):
        assert w(None, user, 8, "x") == user
        assert w(user, {}, 8, "x") == {}
        assert w(user, {}, None, "x") == {}
    assert w(DistgradConfig.model_validate({"noise_scale": {"enabled": True, "micro_batch_size": 3}}), {}, 8, "x") == {}
    for unknown in (None, 0, True, 2.5):
        with pytest.raises(ConfigError, match=r"noise_scale\.micro_batch_size.*the loader's"):
            w(None, on, unknown, "the loader's batch_size")


def test_clip_threshold_from_the_framework_unless_the_user_sets_it(recwarn):
    # the Trainer's max_grad_norm / Lightning's gradient_clip_val reach distgrad as
    # clip.max_grad_norm (no deprecation warning for a key the user never wrote), and a threshold
    # the user gives in any spelling, in the overrides or the config, wins
    from distgrad.config import DistgradConfig
    from distgrad.integrations import with_clip_threshold as w

    assert w(None, {"exporter": {"enabled": False}}, 1.0) == {"exporter": {"enabled": False},
                                                              "clip.max_grad_norm": 1.0}
    for user in ({"clip.max_grad_norm": 2.0}, {"clip": {"max_grad_norm": 2.0}}):
        assert w(None, user, 1.0) == user
        assert w(user, {}, 1.0) == {}
    assert w(DistgradConfig.model_validate({"clip": {"max_grad_norm": 2.0}}), {}, 1.0) == {}
    assert w(DistgradConfig(), {}, 1.0) == {"clip.max_grad_norm": 1.0}
    assert w(None, {}, 0.0) == w(None, {}, None) == {}  # clipping off in the framework
    assert not [x for x in recwarn if issubclass(x.category, FutureWarning)]


def _single_process_state(mp) -> None:
    """Accelerate's state for one plain CPU process (no launcher variables, no DeepSpeed or FSDP
    plugin), as tests/dist/hf_cases.py's make_state("single"); undone by ``mp`` and the caller's
    hf_cases.reset_accelerate()."""
    from tests.dist import hf_cases

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        mp.delenv(var, raising=False)
    mp.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    mp.setenv("ACCELERATE_USE_FSDP", "false")
    hf_cases.make_state("single")


def _trainer_underflow_run(mp, accepts_loss_kwargs: bool | None = None, **trainer_kw):
    """One process, the Trainer on tests/dist/hf_cases.py's tiny Llama for one optimizer step of
    GA=2 micro-batches (padded labels: ``num_items_in_batch`` differs from a micro-batch count),
    ``underflow`` recomputing step 0; returns the spy (:class:`tests.underflow_models.TrainingPassSpy`)
    and the step records."""
    from transformers import Trainer, TrainingArguments

    from distgrad.integrations.hf import attach
    from tests.dist import hf_cases
    from tests.underflow_models import TrainingPassSpy

    _single_process_state(mp)
    try:
        model = hf_cases.tiny_llama(1234)
        args = TrainingArguments(output_dir="/tmp/distgrad_hf_underflow", per_device_train_batch_size=hf_cases.BATCH,
                                 gradient_accumulation_steps=hf_cases.GA, max_steps=1, report_to=[],
                                 save_strategy="no", learning_rate=1e-3, seed=5, data_seed=5, disable_tqdm=True,
                                 dataloader_num_workers=0, accelerator_config={"use_configured_state": True})
        trainer = Trainer(model=model, args=args, train_dataset=hf_cases.dataset(8, ignored=True), **trainer_kw)
        if accepts_loss_kwargs is not None:
            trainer.model_accepts_loss_kwargs = accepts_loss_kwargs
        cb = attach(trainer, exporter={"enabled": False}, sampling={"interval": 1},
                    underflow={"enabled": True, "interval": 1})
        records: list = []
        orig = cb.on_train_begin

        def on_train_begin(*a, **kw):
            orig(*a, **kw)
            cb.instrument.add_hook(records.append)
        cb.on_train_begin = on_train_begin
        with TrainingPassSpy(model, mp) as spy:
            trainer.train()
        return spy, records
    finally:
        hf_cases.reset_accelerate()


def test_underflow_replays_the_trainers_loss_scaling(monkeypatch):
    # the underflow signal's training-precision pass must give, element for element, the gradient
    # the Trainer's backward produced for the recomputed micro-batch. Without num_items_in_batch
    # the Trainer divides the forward's loss by GA=2 (a factor 1 there would double every
    # element); with it (Llama accepts loss kwargs) the forward's loss is already the step's
    # token share and the Trainer does not divide
    for accepts in (False, None):
        spy, records = _trainer_underflow_run(monkeypatch, accepts_loss_kwargs=accepts)
        assert records and records[0].underflow is not None and records[0].underflow.step == 0
        assert spy.mismatches() == [], accepts


def test_underflow_refused_where_the_trainer_computes_the_loss_outside_the_forward(monkeypatch):
    from distgrad.config import ConfigError

    with pytest.raises(ConfigError, match=r"underflow\.enabled.*compute_loss_func"):
        _trainer_underflow_run(monkeypatch, compute_loss_func=lambda out, labels, num_items_in_batch=None: out.loss)


def test_underflow_replays_accelerates_division(monkeypatch):
    # a plain Accelerate loop: accelerator.backward divides the loss by gradient_accumulation_steps
    # (2) before backward; the recomputation must do the same
    import torch
    from accelerate import Accelerator

    import distgrad.integrations.hf as dhf
    from tests.dist import hf_cases
    from tests.underflow_models import TrainingPassSpy

    _single_process_state(monkeypatch)
    try:
        acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
        model = hf_cases.tiny_llama(1234)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        inst = dhf.instrument_accelerate(acc, model, opt, exporter={"enabled": False}, sampling={"interval": 1},
                                         underflow={"enabled": True, "interval": 1}, checkpointing=False)
        records: list = []
        inst.add_hook(records.append)
        data = hf_cases.dataset(4, ignored=True)
        with TrainingPassSpy(model, monkeypatch) as spy:
            for i in range(2):
                with acc.accumulate(model):
                    batch = {k: torch.stack([d[k] for d in data[2 * i:2 * i + 2]]) for k in data[0]}
                    acc.backward(model(**batch).loss)
                    opt.step()
                    opt.zero_grad()
        inst.close()
        assert records and records[0].underflow is not None
        assert spy.mismatches() == []
    finally:
        hf_cases.reset_accelerate()
