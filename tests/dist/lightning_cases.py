"""Multi-rank driver for the Lightning integration tests (tests/test_integrations_lightning.py),
all cases in one ``torchrun --nproc_per_node 2`` launch.

Each case trains a random-init 2-layer ``LlamaForCausalLM`` (as tests/dist/hf_cases.py) inside a
LightningModule for 2 optimizer steps with ``DistgradCallback`` and records on rank 0 distgrad's
record of every step and a float64 reference of step 0 (every rank's step-0 micro-batches are
recorded in ``training_step``, gathered, and the float64 copy of the initial model computes the
step's mean loss and its gradient). Cases: FSDP (FSDP1) and DDP under automatic optimization
with ``accumulate_grad_batches=2`` and ``gradient_clip_val`` below the step-0 norm (clipping
active), FSDP under manual optimization, DeepSpeed ZeRO-2 with accumulation 1 and 2 (Lightning
divides the loss by ``accumulate_grad_batches`` and ``engine.backward`` divides it again, so with
accumulation the gradient DeepSpeed applies is the step's mean-loss gradient divided by it: the
reference gradient is computed from that loss), and FSDP2 (``ModelParallelStrategy`` with
``fully_shard`` in ``configure_model``) under automatic optimization. The one-device case
(``run_case("single_auto", "single", ...)``) runs in the pytest process. ``deepspeed_ga2`` and
``single_auto`` also run the gradient noise scale with ``micro_batch_size`` from the loader
(reference: :func:`hf_cases.gns_reference`). ``ddp_auto`` and ``deepspeed_ga2`` also run the
underflow signal and record whether rank 0's recomputed training-precision gradient equals its
training backward's (:class:`tests.underflow_models.TrainingPassSpy`); ``training_step`` computes
the loss through the LightningModule's ``forward`` (``self(...)``), which underflow recomputes.

Making Lightning run these strategies on CPU at all (not distgrad's business): small strategy
subclasses that skip the CUDA-only checks and use gloo. Writes JSON to --out.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from tests.dist.common import driver_args, full_stats
from tests.dist.hf_cases import dataset, gns_reference, tiny_llama

BATCH = 2


def strategies():
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
    from lightning.fabric.utilities.seed import reset_seed

    class CPUDeepSpeed(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        @property
        def root_device(self) -> torch.device:  # DeepSpeed wants a device index
            return torch.device("cpu", self.local_rank)

        def setup_distributed(self) -> None:
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

    class CPUFSDP(FSDPStrategy):
        pass

    return CPUDeepSpeed, CPUFSDP, DDPStrategy


class Warnings(logging.Handler):
    """Collects the messages distgrad logs at WARNING and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_case(name: str, strategy: str, ga: int, clip: float | None, manual: bool = False,
             gns: bool = False, underflow: bool = False) -> dict:
    import lightning as L
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from distgrad.integrations.lightning import DistgradCallback

    CPUDeepSpeed, CPUFSDP, DDPStrategy = strategies()
    net = tiny_llama(1234)
    ref_model = copy.deepcopy(net).double()
    seen: list[torch.Tensor] = []
    engine_norms: list = []
    fsdp_norms: list = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 0:
                seen.append(batch["input_ids"].detach().cpu().clone())
            loss = self(batch["input_ids"], batch["labels"])  # through forward: what underflow recomputes
            if manual:
                opt = self.optimizers()
                self.manual_backward(loss)
                opt.step()
                opt.zero_grad()
                return None
            return loss

        def forward(self, input_ids, labels):
            return self.net(input_ids=input_ids, labels=labels).loss

        def configure_model(self):
            # FSDP1 on CPU needs device_id=cpu, which FSDPStrategy cannot pass: wrap here (Lightning
            # keeps a model already wrapped in configure_model)
            if strategy == "model_parallel":  # FSDP2: fully_shard over the data-parallel mesh
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.net.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)
            if strategy == "fsdp" and not isinstance(self.net, FSDP):
                self.net = FSDP(self.net, device_id=torch.device("cpu"), use_orig_params=True,
                                auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            if strategy == "fsdp" and clip:  # FSDPPrecision refuses norm clipping: FSDP1's own method
                fsdp_norms.append(float(self.net.clip_grad_norm_(clip)))
            else:
                super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            eng = self.trainer.model  # DeepSpeed's own norm of each optimizer step (after the step)
            if hasattr(eng, "get_global_grad_norm") and (batch_idx + 1) % ga == 0:
                gn = eng.get_global_grad_norm()
                engine_norms.append(None if gn is None else float(gn))

    if strategy == "deepspeed":
        strat = CPUDeepSpeed(stage=2, process_group_backend="gloo")
    elif strategy == "fsdp":
        strat = CPUFSDP(process_group_backend="gloo")
    elif strategy == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strat = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
    elif strategy == "single":  # one process, no torch.distributed (run in the pytest process)
        strat = "auto"
    else:
        strat = DDPStrategy(process_group_backend="gloo")
    records: list[dict] = []
    warnings = Warnings()
    logging.getLogger("distgrad").addHandler(warnings)
    # FSDP: Lightning's gradient_clip_val cannot clip by norm; the module clips, distgrad is told
    cb = DistgradCallback(exporter={"enabled": False}, **({"clip": {"max_grad_norm": clip}} if strategy == "fsdp" and clip else {}),
                          **({"noise_scale": {"enabled": True}} if gns else {}),  # b: the loader's batch_size
                          **({"underflow": {"enabled": True, "interval": 1}} if underflow else {}))

    class Hook(L.Callback):
        def on_train_start(self, trainer, pl_module):
            cb.instrument.add_hook(lambda rec: records.append(rec.to_dict()))

    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=1 if strategy == "single" else 2, strategy=strat, max_steps=2, accumulate_grad_batches=ga,
                        gradient_clip_val=None if manual or strategy == "fsdp" else clip, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, Hook()])
    module = Module()
    spy = None
    with contextlib.ExitStack() as stack:
        if underflow:  # the recomputation's training-precision gradient vs this rank's training backward's
            from tests.underflow_models import TrainingPassSpy

            spy = stack.enter_context(TrainingPassSpy(module, stack.enter_context(pytest.MonkeyPatch.context())))
        try:
            trainer.fit(module, loader)
        finally:
            logging.getLogger("distgrad").removeHandler(warnings)
    inst = cb.instrument
    out = {"records": records, "engine": inst.source.engine_name, "loss_reduction": inst.loss_reduction,
           "clip": clip, "engine_grad_norms": engine_norms, "fsdp_clip_norms": fsdp_norms, "ga": ga,
           "warnings": warnings.messages,
           "max_grad_norm": inst.diagnostics.max_norm if inst.diagnostics is not None else None,
           "refusals": dict(getattr(getattr(inst, "boundary", None), "refusals", None).counts)
           if getattr(inst, "boundary", None) is not None else {}}
    if spy is not None:
        out["underflow_mismatches"] = spy.mismatches()
        out["underflow_compared"] = len(spy.training)
    everything: list = [[t.tolist() for t in seen]]
    if dist.is_initialized():
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, [t.tolist() for t in seen])
    ids = torch.tensor([row for per_rank in everything for batch in per_rank for row in batch])
    out["n_sequences_step0"] = int(ids.shape[0])
    ref_model.train()
    loss = ref_model(input_ids=ids, labels=ids).loss
    # the gradient the optimizer receives: of the step's mean loss, except under DeepSpeed with
    # accumulation, where Lightning and engine.backward both divide by it (module docstring)
    divided = ga if strategy == "deepspeed" and not manual else 1
    (loss / divided).backward()
    out["ref_loss_step0"] = loss.item()
    out["ref_divided_by"] = divided
    # Lightning's names start at the LightningModule ("net." + the model's own names)
    out["ref_fp64_step0"] = full_stats({"net." + n: p.grad.detach().reshape(-1)
                                        for n, p in ref_model.named_parameters() if p.requires_grad})
    if gns:  # per-micro-batch float64 gradients of each micro-batch's mean loss
        out["gns_ref"] = gns_reference(ref_model, [(t, t) for t in seen], BATCH)
    if dist.is_initialized():
        dist.barrier()
    return out


CASES = {
    "fsdp_auto": dict(strategy="fsdp", ga=2, clip=1.0),
    "ddp_auto": dict(strategy="ddp", ga=2, clip=1.0, underflow=True),
    "fsdp2_auto": dict(strategy="model_parallel", ga=2, clip=1.0),
    "fsdp_manual": dict(strategy="fsdp", ga=1, clip=None, manual=True),
    "deepspeed": dict(strategy="deepspeed", ga=1, clip=1.0),
    # below the applied (halved) norm; the noise scale on (its terms are divided by 2^2 too)
    "deepspeed_ga2": dict(strategy="deepspeed", ga=2, clip=0.5, gns=True, underflow=True),
}


def main() -> None:
    a = driver_args(only="")
    results: dict = {}
    for name, kw in CASES.items():
        if a.only and name not in a.only.split(","):
            continue
        try:
            results[name] = run_case(name, **kw)
        except Exception as e:  # noqa: BLE001 - reported by the test with the traceback
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            traceback.print_exc()
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"cases": results}, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
