"""Driver for tests/test_integrations_checkpoint.py: a run checkpointed and resumed through the
framework's own checkpoint (the Hugging Face Trainer, Accelerate's ``save_state`` /
``load_state``, Lightning's ``ModelCheckpoint`` and ``fit(ckpt_path=...)``), against the same run
without interruption.

Each case trains the random-init 2-layer Llama of tests/dist/hf_cases.py for ``STEPS`` optimizer
steps with distgrad attached through the integration (spike detectors' warm-ups and windows of 3
samples, so that they test by the checkpoint), checkpointing after step ``CUT``; then a new
Trainer / loop with a model built from another seed resumes from that checkpoint to ``STEPS``.
Each rank returns its records of both runs (:func:`slim`) and the instrument's final state;
the 2-rank launch (``trainer_ddp``, ``trainer_ds``: DeepSpeed ZeRO-2, ``accelerate_ddp``,
``lightning_ddp``) gathers them on rank 0,
which writes the JSON. The one-process cases run in the pytest process (``run_case(name,
"single", directory)``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from tests.dist.common import driver_args, run_cases
from tests.dist.engines import init_distributed
from tests.dist.hf_cases import dataset, make_state, reset_accelerate, tiny_llama

STEPS, CUT, BATCH = 8, 4, 2
#: short warm-ups and windows: the detectors are testing (finite z-scores) by the checkpoint
KNOBS = {"exporter": {"enabled": False}, "spikes": {"ema_warmup": 3, "window": 3, "robust_warmup": 3, "robust_window": 3}}


def knobs(async_records: bool) -> dict:
    """:data:`KNOBS`, with asynchronous records (``statistics.async_records: on``; the default
    only for CUDA gradients) when ``async_records``: a sampled step's record is then built at
    the next boundary, so the integration must build the last one before the state is saved."""
    return {**KNOBS, "statistics": {"async_records": "on" if async_records else "off"}}


def slim(rec, inst) -> dict:
    """The record's detector inputs and outputs; the counters are the instrument's (a hook runs
    before the record's ``counters`` are filled in)."""
    return {"step": rec.step, "grad_norm": rec.grad_norm, "loss": rec.loss, "spikes": rec.spikes.to_dict(),
            "health": rec.health.to_dict(), "counters": dict(inst.counters)}


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def train_trainer(kind: str, out: str, seed: int, resume: str | None = None, steps: int = STEPS,
                  save_steps: int = CUT, with_distgrad: bool = True, async_records: bool = False, **extra) -> dict:
    """The Trainer (``kind``: "single", "ddp" or "deepspeed": ZeRO-2) for ``steps`` steps, saving
    every ``save_steps``, resumed from ``resume`` if given. Returns this rank's records and final
    distgrad state."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from distgrad.integrations.hf import DistgradState, attach

    make_state(kind)
    if kind == "deepspeed":
        extra["deepspeed"] = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                              "zero_optimization": {"stage": 2}}
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, max_steps=steps,
        save_strategy="steps", save_steps=save_steps, logging_steps=1, report_to=[], learning_rate=1e-3, seed=5,
        data_seed=5, dataloader_num_workers=0, accelerator_config={"use_configured_state": True},
        disable_tqdm=True, **extra)
    trainer = Trainer(model=tiny_llama(seed), args=args, train_dataset=dataset())
    records: list[dict] = []
    if not with_distgrad:
        trainer.train(resume_from_checkpoint=resume)
        return {"records": records, "state": None}
    cb = attach(trainer, **knobs(async_records))

    class Record(TrainerCallback):  # added after distgrad's: its instrument exists here
        def on_train_begin(self, *a, **kw):
            cb.instrument.add_hook(lambda rec: records.append(slim(rec, cb.instrument)))

    trainer.add_callback(Record())
    trainer.train(resume_from_checkpoint=resume)
    holders = [c for c in trainer.callback_handler.callbacks if isinstance(c, DistgradState)]
    return {"records": records, "state": cb.instrument.state_dict(),
            "holder_linked": len(holders) == 1 and holders[0].instrument is cb.instrument}


def train_accelerate(kind: str, seed: int, steps: range, save: str | None = None, load: str | None = None,
                     async_records: bool = False) -> dict:
    """A plain Accelerate loop (``kind``: "single" or "ddp"), ``accelerator.save_state(save)``
    after step ``CUT - 1``, or ``accelerator.load_state(load)`` before the first step."""
    from accelerate import Accelerator

    from distgrad.integrations.hf import instrument_accelerate

    make_state(kind)
    acc = Accelerator()
    data, rank = dataset(), acc.process_index
    model = tiny_llama(seed)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    dg = instrument_accelerate(acc, model, opt, **knobs(async_records))
    if load is not None:
        acc.load_state(load)
    records: list[dict] = []
    dg.add_hook(lambda rec: records.append(slim(rec, dg)))
    for step in steps:
        first = BATCH * (step * acc.num_processes + rank)
        rows = data[first:first + BATCH]
        acc.backward(model(**{k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}).loss)
        opt.step()
        opt.zero_grad()
        if save is not None and step + 1 == CUT:
            acc.save_state(save)
    state = dg.state_dict()
    dg.close()
    return {"records": records, "state": state}


def train_lightning(strategy: str, out: str, seed: int, ckpt_path: str | None = None,
                    async_records: bool = False) -> dict:
    """Lightning (``strategy``: "single" or "ddp") for ``STEPS // CUT`` epochs of ``CUT`` steps,
    ``ModelCheckpoint`` at the end of each epoch (``step=<n>.ckpt``), resumed from ``ckpt_path``."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from distgrad.integrations.lightning import DistgradCallback

    data = dataset(n=BATCH * CUT * world())  # one epoch = CUT steps: the checkpoint is at its end

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_llama(seed)

        def training_step(self, batch, batch_idx):
            return self.net(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    cb = DistgradCallback(**knobs(async_records))
    records: list[dict] = []

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            cb.instrument.add_hook(lambda rec: records.append(slim(rec, cb.instrument)))

    saver = ModelCheckpoint(dirpath=out, filename="{step}", every_n_epochs=1, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=world(), max_epochs=STEPS // CUT, logger=False,
                        strategy="auto" if strategy == "single" else DDPStrategy(process_group_backend="gloo"),
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, Record(), saver])
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False), ckpt_path=ckpt_path)
    return {"records": records, "state": cb.instrument.state_dict()}


def run_case(name: str, kind: str, directory: str, async_records: bool = False) -> dict:
    """The uninterrupted run (checkpointing at ``CUT`` and ``STEPS``) and the run resumed from its
    step-``CUT`` checkpoint, in ``directory`` (shared by the ranks). Returns this rank's
    ``straight``, ``resumed`` (records), ``straight_state``, ``resumed_state`` and, where the
    framework's checkpoint files store, read back: ``saved_cut`` (the state in the first run's
    step-``CUT`` checkpoint) and, but for Accelerate, ``saved`` (in the step-``STEPS`` checkpoints
    of both runs).
    ``async_records``: with asynchronous records (:func:`knobs`)."""
    a, b = os.path.join(directory, name, "a"), os.path.join(directory, name, "b")
    out: dict = {}
    if name.startswith("trainer"):
        from distgrad.integrations.hf import STATE_KEY

        straight = train_trainer(kind, a, 1234, async_records=async_records)
        resumed = train_trainer(kind, b, 99, resume=os.path.join(a, f"checkpoint-{CUT}"), async_records=async_records)

        def saved(run: str, step: int):
            with open(os.path.join(run, f"checkpoint-{step}", "trainer_state.json")) as f:
                return json.load(f)["stateful_callbacks"][STATE_KEY]["instrument"]
        out["holder_linked"] = [straight["holder_linked"], resumed["holder_linked"]]
    elif name.startswith("accelerate"):
        straight = train_accelerate(kind, 1234, range(STEPS), save=a, async_records=async_records)
        resumed = train_accelerate(kind, 99, range(CUT, STEPS), load=a, async_records=async_records)
        saved = None  # one checkpoint, at the cut (the first object registered: distgrad's)
        out["saved_cut"] = torch.load(os.path.join(a, "custom_checkpoint_0.pkl"), weights_only=True)
    else:
        straight = train_lightning(kind, a, 1234, async_records=async_records)
        resumed = train_lightning(kind, b, 99, ckpt_path=os.path.join(a, f"step={CUT}.ckpt"),
                                  async_records=async_records)

        def saved(run: str, step: int):
            return torch.load(os.path.join(run, f"step={step}.ckpt"), weights_only=True)["callbacks"]["DistgradCallback"]
    out.update({"straight": straight["records"], "resumed": resumed["records"],
                "straight_state": straight["state"], "resumed_state": resumed["state"]})
    if saved is not None:
        out["saved_cut"] = saved(a, CUT)
        out["saved"] = {"a": saved(a, STEPS), "b": saved(b, STEPS)}
    if dist.is_initialized():
        dist.barrier()
    return out


CASES = {"trainer_ddp": "ddp", "trainer_ds": "deepspeed", "accelerate_ddp": "ddp", "lightning_ddp": "ddp"}


def main() -> None:
    a = driver_args(cases="all")
    rank, world = init_distributed()
    directory = os.path.join(os.path.dirname(os.path.abspath(a.out)), "ckpt")

    def job(name: str, kind: str) -> Callable[[int, int], dict]:
        def run(rank: int, world: int) -> dict:
            try:
                return run_case(name, kind, directory)
            finally:
                reset_accelerate()
        return run

    run_cases([(name, job(name, kind)) for name, kind in CASES.items()], a.cases, a.out, rank, world, "ckpt_cases")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
