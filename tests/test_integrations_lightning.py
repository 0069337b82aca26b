"""PyTorch Lightning integration (``distgrad.integrations.lightning.DistgradCallback``) on 2 gloo
ranks with the real lightning / deepspeed: one launch of tests/dist/lightning_cases.py.

FSDP1, FSDP2 (ModelParallelStrategy) and DDP run automatic optimization with
``accumulate_grad_batches=2`` and clipping active: Lightning runs forward and backward inside ``optimizer.step(closure)``, after the optimizer's
step pre-hooks, so a pre-hook boundary would read the previous step's gradients (step 0: none);
a boundary after clipping would report the clip threshold.

DeepSpeed with ``accumulate_grad_batches=2``: Lightning divides the loss by 2 and
``engine.backward`` divides it by 2 again, so the gradient DeepSpeed clips and applies is half the
gradient of the step's mean loss. distgrad reports the gradient as applied (equal to DeepSpeed's
own ``get_global_grad_norm()``), the loss as the step's mean loss, and warns once about the factor.
"""

from __future__ import annotations

import math

import pytest

from distgrad.record import StepRecord
from tests.helpers import launch
from tests.reference import case, check_against

pytestmark = pytest.mark.multirank

CASES = ["fsdp_auto", "ddp_auto", "fsdp2_auto", "fsdp_manual", "deepspeed", "deepspeed_ga2", "single_auto"]


@pytest.fixture(scope="module")
def lightning_results(tmp_path_factory):
    res = launch("lightning_cases.py", tmp_path_factory.mktemp("lightning") / "lightning.json")
    res["cases"]["single_auto"] = _single_process_case()
    return res


def _single_process_case() -> dict:
    """One device, no torch.distributed (automatic optimization, accumulation 2, clipping 1.0),
    run in this process (distgrad's local engine)."""
    import traceback

    from tests.dist import lightning_cases

    try:
        return lightning_cases.run_case("single_auto", "single", ga=2, clip=1.0, gns=True)
    except Exception as e:  # noqa: BLE001 - reported by case() with the traceback
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


@pytest.mark.parametrize("key", CASES)
def test_gradient_and_loss_equal_float64_reference(lightning_results, key):
    c = case(lightning_results, key)
    assert len(c["records"]) == 2 and [r["step"] for r in c["records"]] == [0, 1]
    assert c["refusals"] == {}
    rec = StepRecord.from_dict(c["records"][0])
    check_against(rec, c["ref_fp64_step0"], rtol=1e-5, exact=False)
    gref = math.sqrt(sum(v["norm"] ** 2 for v in c["ref_fp64_step0"].values()))
    assert rec.grad_norm == pytest.approx(gref, rel=1e-5)
    if c["clip"]:
        assert gref > c["clip"], "clipping must be active for this test to tell pre- from post-clip"
        assert c["max_grad_norm"] == c["clip"]
        assert rec.clip.ratio == pytest.approx(c["clip"] / (gref + 1e-6), rel=1e-5)
    assert c["loss_reduction"] == "sum"
    assert rec.loss == pytest.approx(c["ref_loss_step0"], rel=1e-6)


def test_engines_and_accumulation(lightning_results):
    got = {k: (case(lightning_results, k)["engine"], case(lightning_results, k)["n_sequences_step0"])
           for k in CASES}
    # ranks x accumulate_grad_batches x batch
    assert got == {"fsdp_auto": ("fsdp1", 8), "ddp_auto": ("ddp", 8), "fsdp2_auto": ("fsdp2", 8),
                   "fsdp_manual": ("fsdp1", 4),
                   "deepspeed": ("deepspeed", 4), "deepspeed_ga2": ("deepspeed", 8),
                   "single_auto": ("torch", 4)}


def test_framework_norms_agree(lightning_results):
    fsdp = case(lightning_results, "fsdp_auto")  # FSDP1's clip_grad_norm_ returns the pre-clip norm
    assert [r["grad_norm"] for r in fsdp["records"]] == pytest.approx(fsdp["fsdp_clip_norms"], rel=1e-5)
    for key in ("deepspeed", "deepspeed_ga2"):  # engine.get_global_grad_norm() after each step
        ds = case(lightning_results, key)
        assert len(ds["engine_grad_norms"]) == 2
        assert [r["grad_norm"] for r in ds["records"]] == pytest.approx(ds["engine_grad_norms"], rel=1e-5)


@pytest.mark.parametrize("key", ["single_auto", "deepspeed_ga2"])
def test_noise_scale_small_batch_from_the_loader_equals_float64_reference(lightning_results, key):
    # noise_scale.enabled without micro_batch_size: the train dataloader's batch_size (2). The
    # reference: each step-0 micro-batch's own mean-loss gradient in float64. Under DeepSpeed with
    # accumulation 2 Lightning and engine.backward both divide the loss by 2, so every gradient,
    # and with them both terms, are 1/2^2 of the reference's; their ratio, the noise scale, is not
    c = case(lightning_results, key)
    ref, f = c["gns_ref"], c["ref_divided_by"] ** 2
    assert ref["micro_batches"] == (4 if key == "deepspeed_ga2" else 2) and f == (4 if key == "deepspeed_ga2" else 1)
    ns = StepRecord.from_dict(c["records"][0]).noise_scale
    assert (ns.small_batch, ns.micro_batches, ns.big_batch) == (2, ref["micro_batches"], 2 * ref["micro_batches"])
    for field in ("grad_sq_small", "grad_sq_big", "true_grad_sq", "noise_trace"):
        assert getattr(ns, field) * f == pytest.approx(ref[field], rel=1e-5, abs=1e-5 * ref["grad_sq_small"]), field
    if ns.true_grad_sq > 0:
        assert ns.noise_scale == pytest.approx(ns.noise_trace / ns.true_grad_sq, rel=1e-12)
    else:
        assert ns.noise_scale is None
    assert StepRecord.from_dict(c["records"][1]).noise_scale.ema_steps == 2


@pytest.mark.parametrize("key", ["ddp_auto", "deepspeed_ga2"])
def test_underflow_replays_lightnings_scaling_on_two_ranks(lightning_results, key):
    # DDP and DeepSpeed, accumulate_grad_batches=2: Lightning calls training_step through the
    # wrapper's forward (its forward redirection, not kept: the nested self(...) is), divides the
    # loss by 2, and under DeepSpeed engine.backward divides it by 2 again (1/4, where the raw
    # engine's automatic factor alone is 1/2). Rank 0's training-precision pass gradient equals its
    # training backward's for the recomputed micro-batch, element for element, on both steps' runs
    from tests.dist.hf_cases import tiny_llama

    c = case(lightning_results, key)
    assert c["underflow_compared"] == len(list(tiny_llama(0).parameters()))  # every parameter compared
    assert c["underflow_mismatches"] == []
    assert [StepRecord.from_dict(r).underflow.step for r in c["records"]] == [0, 1]


def test_loader_batch_size_or_a_config_error_naming_the_key():
    from types import SimpleNamespace

    import torch

    from distgrad.config import ConfigError
    from distgrad.integrations import with_micro_batch_size
    from distgrad.integrations.lightning import _loader_batch_size

    data = torch.utils.data.TensorDataset(torch.zeros(8, 1))
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), 4, False)

    class NotLoaded:
        @property
        def train_dataloader(self):
            raise RuntimeError("no loader yet")

    assert _loader_batch_size(SimpleNamespace(train_dataloader=torch.utils.data.DataLoader(data, batch_size=3))) == 3
    for unknown in (SimpleNamespace(train_dataloader=torch.utils.data.DataLoader(data, batch_sampler=sampler)),
                    SimpleNamespace(train_dataloader=[torch.utils.data.DataLoader(data, batch_size=3)] * 2),
                    SimpleNamespace(train_dataloader=None), NotLoaded()):
        assert _loader_batch_size(unknown) is None
        with pytest.raises(ConfigError, match=r"noise_scale\.micro_batch_size"):
            with_micro_batch_size(None, {"noise_scale": {"enabled": True}}, _loader_batch_size(unknown), "x")


def _about_double_division(c):
    return [m for m in c["warnings"] if "accumulate_grad_batches" in m and "divides it by" in m]


def test_deepspeed_accumulation_gradient_is_divided_twice_and_said_once(lightning_results):
    c = case(lightning_results, "deepspeed_ga2")
    # the reference of the other tests is the gradient of (step's mean loss / 2) ...
    assert c["ref_divided_by"] == 2 and c["ga"] == 2
    # ... which is what DeepSpeed itself measures (test_framework_norms_agree), and half the norm
    # of the mean-loss gradient the same data gives under DDP with accumulation 2
    ddp = case(lightning_results, "ddp_auto")
    rec, rec_ddp = StepRecord.from_dict(c["records"][0]), StepRecord.from_dict(ddp["records"][0])
    assert ddp["ref_divided_by"] == 1 and c["n_sequences_step0"] == ddp["n_sequences_step0"]
    assert rec.grad_norm == pytest.approx(rec_ddp.grad_norm / 2, rel=1e-5)
    assert rec.loss == pytest.approx(rec_ddp.loss, rel=1e-6)  # the loss is the step's mean loss
    msgs = _about_double_division(c)
    assert len(msgs) == 1 and "accumulate_grad_batches=2" in msgs[0] and "get_global_grad_norm" in msgs[0]
    assert not any(_about_double_division(case(lightning_results, k)) for k in CASES if k != "deepspeed_ga2")


@pytest.mark.parametrize("manual,fp16", [(False, False), (True, False), (False, True)])
def test_underflow_replays_lightnings_loss_scaling(monkeypatch, manual, fp16):
    # one device (no launch), accumulate_grad_batches=2: under automatic optimization Lightning divides
    # training_step's loss by 2 before backward, under manual optimization manual_backward does
    # not; the underflow signal's training-precision pass must give, element for element, the
    # gradient the training backward produced for the recomputed micro-batch (the first). fp16:
    # "16-mixed" (CPU autocast to float16) with a GradScaler (scale 2^10) in the precision
    # plugin, which multiplies the divided loss by its scale before backward
    import lightning as L
    import torch

    from distgrad.integrations.lightning import DistgradCallback
    from tests.dist.hf_cases import BATCH, dataset, tiny_llama
    from tests.underflow_models import TrainingPassSpy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_llama(1234)
            self.automatic_optimization = not manual

        def forward(self, input_ids, labels):  # the forward underflow recomputes returns the loss
            return self.net(input_ids=input_ids, labels=labels).loss

        def training_step(self, batch, batch_idx):
            loss = self(batch["input_ids"], batch["labels"])
            if manual:
                self.manual_backward(loss)
                if batch_idx % 2 == 1:
                    self.optimizers().step()
                    self.optimizers().zero_grad()
                return None
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    records: list = []
    cb = DistgradCallback(exporter={"enabled": False}, sampling={"interval": 1},
                          underflow={"enabled": True, "interval": 1})

    class Hook(L.Callback):
        def on_train_start(self, trainer, pl_module):
            cb.instrument.add_hook(records.append)

    module = Module()
    loader = torch.utils.data.DataLoader(dataset(8, ignored=True), batch_size=BATCH, shuffle=False)
    plugins = []
    if fp16:
        from lightning.pytorch.plugins import MixedPrecision

        plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=1 if manual else 2,
                        plugins=plugins, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb, Hook()])
    with TrainingPassSpy(module, monkeypatch) as spy:
        trainer.fit(module, loader)
    assert records and records[0].underflow is not None and records[0].underflow.step == 0
    assert records[0].underflow.loss_scale == (2.0**10 if fp16 else 1.0)
    assert spy.mismatches() == []
