"""Multi-rank driver for the Hugging Face integration tests (tests/test_integrations_hf.py), all
cases in one ``torchrun --nproc_per_node 2`` launch.

Each case trains a random-init 2-layer ``LlamaForCausalLM`` (hidden 64, vocab 256, built from a
config: no download) with the real ``transformers.Trainer`` for 2 optimizer steps, gradient
accumulation 2, the Trainer's clipping on (``max_grad_norm`` below the step-0 gradient norm, so
clipping is active), ``distgrad.integrations.hf.attach(trainer)``, and records on
rank 0: distgrad's record of every step, the Trainer's logged ``loss`` / ``grad_norm``, and a
float64 reference of step 0: every rank's step-0 micro-batches (recorded inside
``training_step``) are gathered and the float64 copy of the initial model computes the step's
loss (mean cross entropy over every scored token of them; the Trainer's data pads 0-4 labels per
sequence with -100, so that differs from a mean of micro-batch means) and its gradient, which is
the pre-clip reduced gradient the optimizer receives.

Cases: DeepSpeed ZeRO-0 and ZeRO-1 in fp32, ZeRO-2 and ZeRO-3 in fp32, bf16 and fp16 (dynamic
loss scaling), ZeRO-2 + PEFT LoRA, FSDP2, FSDP1, DDP, and plain Accelerate loops with the
DeepSpeed plugin and with DDP; ZeRO-2 with the gradient noise scale on (accumulation 3, every
label scored; :func:`gns_reference`); DDP and ZeRO-2 also with ``underflow`` on, recording whether
rank 0's recomputed training-precision gradient equals its training backward's
(:class:`tests.underflow_models.TrainingPassSpy`); the one-process cases run in the pytest process
(``run_case("single", "single")``, and with the noise scale ``run_case("single_gns", "single",
ga=3, gns=True)``).

Making these frameworks run on CPU at all (not distgrad's business): a gloo ``PartialState``
before ``TrainingArguments(accelerator_config={"use_configured_state": True})``; FSDP needs
the state labelled MULTI_GPU, DDP a ``cpu=True`` state (MULTI_CPU, which accelerate wraps in
DDP); bf16 and fp16 need the two CPU refusals lifted (:func:`allow_half_precision_on_cpu`). Writes JSON to --out.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tests.dist.common import driver_args, full_stats, run_cases
from tests.dist.engines import init_distributed

SEQ, VOCAB, BATCH, GA = 16, 256, 2, 2


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def dataset(n: int = 64, ignored: bool = False) -> list[dict]:
    """``n`` random sequences of SEQ tokens, labels = inputs; ``ignored``: the last 0-4 labels of
    each sequence are -100 (padding), so micro-batches hold different numbers of scored tokens
    and the Trainer's ``num_items_in_batch`` normalisation differs from a mean of micro-batch
    means."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        if ignored and i % 5:
            labels[SEQ - i % 5:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def make_state(kind: str) -> None:
    """A gloo accelerate state for DeepSpeed, FSDP (1 or 2) or DDP on CPU; or one process
    without torch.distributed (``"single"``, what tests/test_integrations_hf.py runs in-process)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    reset_accelerate()
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true" if kind == "deepspeed" else "false"
    os.environ["ACCELERATE_USE_FSDP"] = "true" if kind.startswith("fsdp") else "false"
    if kind == "single":  # one process, no torch.distributed: DistributedType.NO
        PartialState(cpu=True)
        return
    state = PartialState(backend="gloo", cpu=kind == "ddp")  # cpu: MULTI_CPU, accelerate wraps in DDP
    if kind.startswith("fsdp"):
        state.distributed_type = DistributedType.MULTI_GPU


def allow_half_precision_on_cpu() -> None:
    """bf16 / fp16 under DeepSpeed on CPU: transformers refuses bf16 without a bf16 GPU
    (``TrainingArguments``: "Your setup doesn't support bf16/gpu") and DeepSpeed refuses fp16
    without mkldnn fp16 (``Type fp16 is not supported on your device``); both checks are about
    speed on this machine, not correctness, and are lifted here (docs/engines.md)."""
    import transformers.training_args as ta
    from deepspeed.accelerator import get_accelerator

    ta.is_torch_bf16_gpu_available = lambda: True
    type(get_accelerator()).is_fp16_supported = lambda self: True


def run_case(name: str, kind: str, stage: int = 2, lora: bool = False, max_norm: float = 1.0,
             dtype: str = "fp32", ga: int = GA, gns: bool = False, underflow: bool = False) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from distgrad.integrations.hf import attach

    make_state(kind)
    model = tiny_llama(1234)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(99)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False, lora_dropout=0.0))
    # bf16 / fp16: DeepSpeed trains the low-precision copy of the weights; so does the reference
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    ref_model = (copy.deepcopy(model).to(low) if low is not None else copy.deepcopy(model)).double()
    extra: dict = {}
    if dtype != "fp32":
        allow_half_precision_on_cpu()
        extra[dtype] = True
    if kind == "deepspeed":
        extra["deepspeed"] = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                              "zero_optimization": {"stage": stage},
                              # read by attach(trainer) (config=None): a non-default to see it
                              "distgrad": {"sampling": {"interval": 1}, "spikes": {"window": 64}},
                              "bf16": {"enabled": "auto"},
                              # a small initial loss scale: no overflow-skipped step in 2 steps
                              "fp16": {"enabled": "auto", "initial_scale_power": 8}}
    elif kind == "fsdp2":
        extra["fsdp"] = "full_shard"
        extra["fsdp_config"] = {"version": 2, "reshard_after_forward": True,
                                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    elif kind == "fsdp1":
        extra["fsdp"] = "full_shard"
        extra["fsdp_config"] = {"version": 1, "sync_module_states": False, "use_orig_params": True,
                                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    args = TrainingArguments(
        output_dir=f"/tmp/distgrad_hf_{name}_{os.getpid()}", per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ga, max_steps=2, logging_steps=1, report_to=[], save_strategy="no",
        learning_rate=1e-3, max_grad_norm=max_norm, seed=5, data_seed=5, dataloader_num_workers=0,
        accelerator_config={"use_configured_state": True}, disable_tqdm=True, **extra)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    logs: list[dict] = []
    records: list[dict] = []

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.state.global_step == 0:
                seen.append((inputs["input_ids"].detach().cpu().clone(), inputs["labels"].detach().cpu().clone()))
            return super().training_step(model, inputs, num_items_in_batch)

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:  # the per-step training logs (grad_norm: None under ZeRO-0 fp32)
                trainer_logs.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    trainer_logs = logs
    # gns: every sequence fully scored (equal tokens per micro-batch, the estimator's assumption)
    trainer = Recording(model=model, args=args, train_dataset=dataset(ignored=not gns),
                        callbacks=[Logs()])
    cb = attach(trainer, exporter={"enabled": False}, **({"noise_scale": {"enabled": True}} if gns else {}),
                **({"underflow": {"enabled": True, "interval": 1}} if underflow else {}))
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: warned.append(r.getMessage())  # distgrad's own warnings
    logging.getLogger("distgrad").addHandler(handler)
    orig_on_train_begin = cb.on_train_begin

    def on_train_begin(*a, **kw):
        orig_on_train_begin(*a, **kw)
        cb.instrument.add_hook(lambda rec: records.append(rec.to_dict()))
    cb.on_train_begin = on_train_begin
    spy = None
    with contextlib.ExitStack() as stack:
        if underflow:  # the recomputation's training-precision gradient vs this rank's training backward's
            from tests.underflow_models import TrainingPassSpy

            mp = stack.enter_context(pytest.MonkeyPatch.context())
            spy = stack.enter_context(TrainingPassSpy(model, mp))
        try:
            trainer.train()
        finally:
            logging.getLogger("distgrad").removeHandler(handler)
    inst = cb.instrument
    out = {"args_max_grad_norm": max_norm, "records": records, "logs": logs, "engine": inst.source.engine_name,
           "zero_stage": inst.source.zero_stage, "loss_reduction": inst.loss_reduction, "dtype": dtype,
           "spike_window": inst.config.spikes.window, "warnings": warned,
           "refusals": dict(inst.boundary.refusals.counts) if getattr(inst, "boundary", None) is not None
           and hasattr(inst.boundary, "refusals") else {},
           "max_grad_norm": inst.config.clip.max_grad_norm if inst.config.clip.max_grad_norm is not None else
           (inst.diagnostics.max_norm if inst.diagnostics is not None else None)}
    if spy is not None:
        out["underflow_mismatches"] = spy.mismatches()
        out["underflow_compared"] = len(spy.training)
    out.update(reference(ref_model, seen))  # float64, on every rank (rank 0 writes it)
    if gns:
        out["gns_ref"] = gns_reference(ref_model, seen, BATCH)
    del trainer
    if dist.is_initialized():
        dist.barrier()
    return out


def run_accelerate(name: str, kind: str) -> dict:
    """A plain Accelerate loop (accumulation 2 with ``accelerator.accumulate``, clipping 1.0):
    with the DeepSpeed plugin (ZeRO-2; ``accelerator.prepare`` returns the engine, which clips;
    its ``get_global_grad_norm()`` is the framework's norm), or DDP (``kind="ddp"``: the loop
    clips with ``accelerator.clip_grad_norm_``, whose return value is the framework's norm, and
    passes ``max_grad_norm`` to distgrad). ``instrument_accelerate`` in both, with ``underflow`` on:
    rank 0's recomputed training-precision gradient vs its training backward's (DeepSpeed:
    ``engine.backward``'s 1/GA; DDP: ``accelerator.backward``'s)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from distgrad.integrations.hf import instrument_accelerate

    make_state(kind)
    if kind == "deepspeed":
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=GA,
                                                           gradient_clipping=1.0))
    else:
        acc = Accelerator(gradient_accumulation_steps=GA)
    model = net = tiny_llama(1234)
    ref_model = copy.deepcopy(model).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    dg = instrument_accelerate(acc, model, opt, exporter={"enabled": False},
                               underflow={"enabled": True, "interval": 1},
                               **({} if kind == "deepspeed" else {"clip": {"max_grad_norm": 1.0}}))
    records: list[dict] = []
    dg.add_hook(lambda rec: records.append(rec.to_dict()))
    seen, norms = [], []
    from tests.underflow_models import TrainingPassSpy

    with pytest.MonkeyPatch.context() as mp, TrainingPassSpy(net, mp) as spy:
        _accelerate_loop(acc, model, opt, loader, kind, seen, norms)
    out = {"args_max_grad_norm": 1.0, "records": records, "engine": dg.source.engine_name,
           "zero_stage": dg.source.zero_stage, "loss_reduction": dg.loss_reduction,
           "max_grad_norm": dg.config.clip.max_grad_norm if dg.config.clip.max_grad_norm is not None else
           (dg.diagnostics.max_norm if dg.diagnostics is not None else None),
           "refusals": dict(dg.boundary.refusals.counts) if hasattr(getattr(dg, "boundary", None), "refusals")
           else {}, "logs": [{"grad_norm": g} for g in norms],
           "underflow_mismatches": spy.mismatches(), "underflow_compared": len(spy.training)}
    dg.close()
    out.update(reference(ref_model, seen))
    dist.barrier()
    return out


def _accelerate_loop(acc, model, opt, loader, kind: str, seen: list, norms: list) -> None:
    """:func:`run_accelerate`'s loop: 2 optimizer steps of GA micro-batches."""
    for i, batch in enumerate(loader):
        if i == 2 * GA:
            break
        with acc.accumulate(model):
            if i < GA:
                seen.append((batch["input_ids"].detach().cpu().clone(), batch["labels"].detach().cpu().clone()))
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            acc.backward(loss)
            if kind != "deepspeed" and acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
        if kind == "deepspeed" and (i + 1) % GA == 0:
            norms.append(float(model.get_global_grad_norm()))


def reference(ref_model, seen: list) -> dict:
    """Every rank's step-0 micro-batches ``(input_ids, labels)`` gathered; float64 loss and
    gradient of the step: the mean cross entropy over every scored token of the step (labels
    -100 ignored), i.e. what the Trainer's ``num_items_in_batch`` normalisation computes."""
    mine = [(i.tolist(), lab.tolist()) for i, lab in seen]
    everything: list = [mine]
    if dist.is_initialized():
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, mine)
    ids = torch.tensor([row for per_rank in everything for batch, _ in per_rank for row in batch])
    labels = torch.tensor([row for per_rank in everything for _, lab in per_rank for row in lab])
    ref_model.train()
    ref_model.zero_grad()
    with torch.no_grad():  # what a mean of the micro-batches' own mean losses would give instead
        means = [ref_model(input_ids=torch.tensor(b), labels=torch.tensor(lab)).loss.item()
                 for per_rank in everything for b, lab in per_rank]
    loss = ref_model(input_ids=ids, labels=labels).loss
    loss.backward()
    return {"n_sequences_step0": int(ids.shape[0]), "ref_loss_step0": loss.item(),
            "ref_loss_mean_of_micro_means": sum(means) / len(means),
            "ref_fp64_step0": full_stats({n: p.grad.detach().reshape(-1)
                                          for n, p in ref_model.named_parameters() if p.requires_grad}),
            "frozen": [n for n, p in ref_model.named_parameters() if not p.requires_grad]}


def gns_reference(ref_model, seen: list, b: int) -> dict:
    """The gradient noise scale's per-step estimates of step 0 from every rank's step-0
    micro-batches, in float64: each micro-batch's gradient ``g_m`` of its own mean loss (mean
    cross entropy over its scored tokens), recomputed one by one; ``|G_small|^2`` = the mean of
    ``|g_m|^2``, ``|G_big|^2`` = ``|mean of g_m|^2``, and McCandlish et al.'s Appendix A.1 with
    ``B_small = b``, ``B_big = N b`` (N micro-batches of all ranks)."""
    mine = [(i.tolist(), lab.tolist()) for i, lab in seen]
    everything: list = [mine]
    if dist.is_initialized():
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, mine)
    grads = []
    for per_rank in everything:
        for ids, lab in per_rank:
            ref_model.zero_grad()
            ref_model(input_ids=torch.tensor(ids), labels=torch.tensor(lab)).loss.backward()
            grads.append(torch.cat([p.grad.detach().reshape(-1).double()
                                    for p in ref_model.parameters() if p.requires_grad]))
    n = len(grads)
    small = sum(float(g.dot(g)) for g in grads) / n
    mean = torch.stack(grads).mean(0)
    big = float(mean.dot(mean))
    B = n * b
    return {"micro_batches": n, "grad_sq_small": small, "grad_sq_big": big,
            "true_grad_sq": (B * big - b * small) / (B - b), "noise_trace": (small - big) / (1 / b - 1 / B)}


CASES = {
    "ds_z0": dict(kind="deepspeed", stage=0),
    "ds_z1": dict(kind="deepspeed", stage=1),
    "ds_z2": dict(kind="deepspeed", stage=2, underflow=True),
    "ds_z3": dict(kind="deepspeed", stage=3),
    "ds_z2_lora": dict(kind="deepspeed", stage=2, lora=True, max_norm=0.1),
    "ds_z2_bf16": dict(kind="deepspeed", stage=2, dtype="bf16"),
    "ds_z3_bf16": dict(kind="deepspeed", stage=3, dtype="bf16"),
    "ds_z2_fp16": dict(kind="deepspeed", stage=2, dtype="fp16"),
    "ds_z3_fp16": dict(kind="deepspeed", stage=3, dtype="fp16"),
    "ds_z2_gns": dict(kind="deepspeed", stage=2, ga=3, gns=True),  # noise scale: b from the Trainer's "auto"
    "fsdp2": dict(kind="fsdp2"),
    "fsdp1": dict(kind="fsdp1"),
    "ddp": dict(kind="ddp", underflow=True),
    "accelerate_ds": dict(kind="accelerate"),
    "accelerate_ddp": dict(kind="accelerate_ddp"),
}


def main() -> None:
    a = driver_args(cases="all")
    rank, world = init_distributed()

    def job(name: str, kw: dict) -> Callable[[int, int], dict]:
        if kw["kind"] == "accelerate":
            return lambda rank, world: run_accelerate(name, "deepspeed")
        if kw["kind"] == "accelerate_ddp":
            return lambda rank, world: run_accelerate(name, "ddp")
        return lambda rank, world: run_case(name, **kw)

    run_cases([(name, job(name, kw)) for name, kw in CASES.items()], a.cases, a.out, rank, world, "hf_cases",
              gather=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
