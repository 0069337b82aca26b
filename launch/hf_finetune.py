"""Fine-tuning example on the Hugging Face stack with distgrad in one line.

A random-init small ``LlamaForCausalLM`` built from a config (no download), LoRA adapters via
PEFT, byte-level tokens (vocabulary 256) from the Python standard library's sources (as
launch/train.py), trained with ``transformers.Trainer``; ``distgrad.integrations.hf.attach``
serves the metrics from rank 0 (default http://127.0.0.1:9400/metrics).

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 launch/hf_finetune.py      # 2 CPU ranks (DDP, gloo)
    .venv/bin/accelerate launch --num_processes 2 --cpu launch/hf_finetune.py           # the same via Accelerate
    .venv/bin/python launch/hf_finetune.py --steps 20                                     # one process

Opt-in distgrad signals: ``--set KEY=VALUE`` (a YAML value; repeatable) or ``--distgrad-config
FILE``, as for launch/train.py, e.g. ``--set logits.attention=true --set logits.output=true``;
``--moe 4 --set router.enabled=true``: a Mixtral-style MoE model whose routers are watched.

On GPUs the same script runs under ``accelerate launch --use_deepspeed`` / ``--use_fsdp`` or
with ``--deepspeed CONFIG.json`` (ZeRO 0-3); the callback finds the engine itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Windows(torch.utils.data.Dataset):
    """Fixed-length byte windows of a corpus: ``input_ids`` = ``labels`` (the model shifts)."""

    def __init__(self, data: torch.Tensor, block: int, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - block - 1, (n,), generator=g)
        self.data, self.block = data, block

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        s = int(self.starts[i])
        ids = self.data[s: s + self.block].long()
        return {"input_ids": ids, "labels": ids.clone()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4, help="per-device micro-batch")
    ap.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--moe", type=int, default=0, metavar="E",
                    help="a Mixtral-style MoE model with E experts per layer (top-2 routing, auxiliary loss) "
                         "instead of the dense Llama: the model for router.enabled")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--port", type=int, default=9400)
    ap.add_argument("--deepspeed", default=None, help="DeepSpeed JSON config (GPU machines)")
    ap.add_argument("--data", default=None, help="a text file (default: the stdlib sources)")
    ap.add_argument("--out", default="/tmp/distgrad_hf_finetune")
    ap.add_argument("--jsonl", default=None, help="also write distgrad's records here (rank 0)")
    ap.add_argument("--hold", type=float, default=0.0, help="keep serving metrics this many seconds after training")
    ap.add_argument("--distgrad-config", default=None, help="distgrad YAML config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a distgrad config key (YAML value), as launch/train.py's --set, "
                         "e.g. --set logits.attention=true")
    a, _ = ap.parse_known_args(argv)

    from peft import LoraConfig, get_peft_model
    from train import load_corpus
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from distgrad.integrations.hf import attach

    dims = dict(hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                num_attention_heads=4, num_key_value_heads=4, vocab_size=256, max_position_embeddings=a.block)
    torch.manual_seed(0)
    if a.moe:
        from transformers import MixtralConfig, MixtralForCausalLM

        base = MixtralForCausalLM(MixtralConfig(**dims, num_local_experts=a.moe, num_experts_per_tok=2,
                                                output_router_logits=True))
    else:
        base = LlamaForCausalLM(LlamaConfig(**dims))
    model = get_peft_model(base, LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, lora_dropout=0.0,
                                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    data = load_corpus(a.data, 4_000_000)
    cpu = not torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.accum, learning_rate=2e-3, max_grad_norm=a.max_grad_norm,
        logging_steps=10, report_to=[], save_strategy="no", use_cpu=cpu, deepspeed=a.deepspeed,
        # gloo on CPU for a multi-process launch only: given to one process, Accelerate takes the
        # backend for a distributed run and asks for a process group nobody initialised
        ddp_backend="gloo" if cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0, disable_tqdm=True)
    class Hold(TrainerCallback):  # runs before distgrad's on_train_end, which stops the exporter
        def on_train_end(self, *args, **kwargs):
            if a.hold > 0:
                if int(os.environ.get("RANK", "0")) == 0:  # the rank that serves them
                    print(f"[hf_finetune] holding metrics on port {dg.instrument.port} for {a.hold:g}s", flush=True)
                time.sleep(a.hold)

    trainer = Trainer(model=model, args=args, callbacks=[Hold()],
                      train_dataset=Windows(data, a.block, a.steps * a.batch * a.accum * 8, seed=1))
    overrides = {"exporter.port": a.port, "sinks.jsonl.path": a.jsonl}
    for kv in a.set:
        key, _, val = kv.partition("=")
        overrides[key.strip()] = yaml.safe_load(val)
    dg = attach(trainer, a.distgrad_config, **overrides)  # <- the one line: every rank, before train()
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[hf_finetune] done; metrics were served on 127.0.0.1:{dg.instrument.port}/metrics", flush=True)


if __name__ == "__main__":
    main()
