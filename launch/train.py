"""distgrad's example training job: a small GPT-style byte-level decoder trained with DeepSpeed
(ZeRO stage from a config in configs/) on real text, with distgrad attached in one line and its
metrics served from rank 0 while it trains.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/train.py --ds-config configs/ds_zero2_fp32.json
    torchrun --nproc_per_node 2 launch/train.py --engine fsdp2          # or ddp, fsdp1
    torchrun --nproc_per_node 4 launch/train.py --engine fsdp2 --tp 2   # FSDP2 x tensor parallel
    mpirun -np 2 python launch/train.py                                 # rank discovery: launch/dist_env.py

Data: the source files of the Python standard library found on this machine (``sysconfig``),
or any text file passed with ``--data``; bytes are tokens (vocabulary 256). Each rank draws its
own random windows, seeded by (seed, rank, step), so runs are reproducible.

Model: the decoder of Radford et al. 2019 (GPT-2), written with torch.nn in the style of Karpathy's
nanoGPT: token + learned position embeddings, pre-LayerNorm blocks of causal self-attention and
a 4x GELU MLP, final LayerNorm, untied linear head. Default size ~3.3M parameters.

Fault injection (for testing alerts and the flight recorder), at ``--inject-step``:
``--inject nan`` makes the NaN in the *forward* pass of one rank (``--inject-rank``), in the module
that owns ``--inject-param`` (default ``blocks.2.mlp.fc``, a linear layer of block 2): its output
goes through a naive ``log(softmax(y / T))`` with a collapsed temperature, whose underflowed
entries are ``log(0) = -inf`` and turn into NaN in the next GELU, as a real numerical fault in a
model's forward would. distgrad finds it with its own machinery: that rank's loss and gradients
are non-finite before the reduction (the culprit rank) and the forward replay of the step names
the module. ``inf`` sets one gradient element to +Inf during backward, before the reduction but
after distgrad's pre-reduction check has seen it (the loss stays finite, the replay comes out
finite and no culprit rank is seen, as for a corruption in the reduction); ``spike``
multiplies every gradient by 100 on every rank; ``zero`` zeroes ``--inject-param``'s gradient from
then on. The same GPU/NCCL run works unchanged: nothing here assumes a CPU beyond the launcher's
defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from distgrad.signals.logits import observe_attention

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# model
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # distgrad's hook point for the maximum attention logit (logits.attention, with
        # logits.attention_modules selecting these modules); a no-op unless watched on a sampled step
        observe_attention(self, q, k, is_causal=True)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT. forward(idx [B, T] int64, targets [B, T] int64) -> mean cross-entropy
    (0-d float32 tensor, nats per byte)."""

    def __init__(self, n_layer: int = 4, d: int = 256, n_head: int = 4, block: int = 128,
                 vocab: int = 256) -> None:
        super().__init__()
        self.block = block
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def to_float8(model: nn.Module) -> nn.Module:
    """``--fp8``: the blocks' linears become torchao ``Float8Linear`` s in place
    (``convert_to_float8_training``, torchao's default dynamic tensorwise scaling; emulated on
    CPU); the embeddings and the head stay in high precision. Returns ``model``."""
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, module_filter_fn=lambda m, name: name.startswith("blocks."))


class LoRALinear(nn.Module):
    """``base_layer(x) + (alpha / r) * lora_B(lora_A(x))`` (Hu et al. 2021, LoRA), PEFT's
    parameter names: ``base_layer.weight`` frozen, ``lora_A.weight`` [r, in] random,
    ``lora_B.weight`` [out, r] zero, so the adapter starts as the identity. With B = 0,
    A's gradient is exactly 0 at first: watch ``distgrad_layer_grad_norm{layer="N/lora_A"}``."""

    def __init__(self, base: nn.Linear, r: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base_layer = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.scale * self.lora_B(self.lora_A(x))


def add_lora(model: GPT, r: int) -> None:
    """Freeze every weight and put rank-``r`` adapters on each block's four linear layers."""
    for p in model.parameters():
        p.requires_grad_(False)
    for b in model.blocks:
        b.attn.qkv, b.attn.proj = LoRALinear(b.attn.qkv, r), LoRALinear(b.attn.proj, r)
        b.mlp.fc, b.mlp.proj = LoRALinear(b.mlp.fc, r), LoRALinear(b.mlp.proj, r)


# ----------------------------------------------------------------------------------------------
# data
def load_corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    """Bytes of ``path``, or of the standard library's .py files, as a uint8 tensor [N]."""
    if path:
        data = Path(path).read_bytes()[:max_bytes]
    else:
        chunks, total = [], 0
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            if "site-packages" in f.parts or "test" in f.parts:
                continue
            try:
                b = f.read_bytes()
            except OSError:
                continue
            chunks.append(b)
            total += len(b)
            if total >= max_bytes:
                break
        data = b"\n".join(chunks)[:max_bytes]
    if len(data) < 4096:
        raise SystemExit(f"training text too small ({len(data)} bytes): pass a larger file with --data")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def get_batch(data: torch.Tensor, batch: int, block: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(data) - block - 1, (batch,), generator=g)
    x = torch.stack([data[i:i + block] for i in ix.tolist()]).long()
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix.tolist()]).long()
    return x.to(device), y.to(device)


# ----------------------------------------------------------------------------------------------
# fault injection
class Injector:
    """Makes a fault at one optimizer step, as a real one would arise.

    kinds: ``nan`` makes ``param``'s module on ``rank`` at ``step`` pass its output, for the
    step's last micro-batch (``batch`` of :meth:`arm`), through ``log(softmax(y / T))``, ``T`` =
    1e-4: the softmax underflows to 0 for all but the largest entries and the log of 0 is -inf (a
    forward fault: the module's output is the first non-finite value of the forward pass; the
    loss, and then every gradient of that rank, go NaN). The fault is tied to that micro-batch (a
    forward pre-hook on the root module compares its input with it) and stays armed until
    :meth:`disarm`, which the loop calls after the step's ``optimizer.step()`` /
    ``engine.step()``: distgrad's forward replay at the step boundary meets it again on that
    micro-batch, and on no other. ``inf`` sets one element of ``param``'s gradient on ``rank`` at
    ``step`` during backward (a backward fault): the first element that ``rank``'s shard holds
    after the reduction (``offset``, from distgrad's adapter), so the fault lands in that rank's
    shard as if it had arisen there; ``spike`` multiplies every gradient by 100 on every rank at
    ``step``; ``zero`` zeroes ``param``'s gradient on every rank from ``step`` on (a frozen /
    dead layer)."""

    #: the temperature of the naive log-softmax the ``nan`` fault applies (float32 ``exp``
    #: underflows below about -103, so entries more than ~0.01 below the largest underflow)
    TEMPERATURE = 1e-4

    def __init__(self, model: nn.Module, kind: str | None, step: int, param: str, rank: int,
                 my_rank: int, offset: int = 0) -> None:
        self.kind, self.step, self.rank, self.my_rank, self.offset = kind, step, rank, my_rank, offset
        self.model = model
        self.params = dict(model.named_parameters())
        if kind and kind != "spike" and param not in self.params:
            raise SystemExit(f"--inject-param {param!r} is not a parameter; e.g. {list(self.params)[:4]}")
        self.param = param
        #: the module whose output the ``nan`` fault makes non-finite: the one owning ``param``
        self.module_name = param.rpartition(".")[0]
        self.module = model.get_submodule(self.module_name) if kind == "nan" else None
        self.handles: list = []
        self._patched = False

    def arm(self, step: int, batch: torch.Tensor | None = None) -> None:
        """Arm the fault of ``step`` (if any) for the coming micro-batch, whose input is ``batch``."""
        self.disarm()
        k = self.kind
        if not k:
            return
        if k == "nan" and step == self.step and self.my_rank == self.rank:
            self._arm_forward_fault(batch)
        elif k == "inf" and step == self.step and self.my_rank == self.rank:
            def poison(g: torch.Tensor) -> torch.Tensor:
                g = g.clone()
                g.view(-1)[self.offset] = float("inf")
                return g
            self.handles.append(self.params[self.param].register_hook(poison))
        elif k == "spike" and step == self.step:
            self.handles += [p.register_hook(lambda g: g * 100.0) for p in self.params.values() if p.requires_grad]
        elif k == "zero" and step >= self.step:
            self.handles.append(self.params[self.param].register_hook(lambda g: torch.zeros_like(g)))

    def _arm_forward_fault(self, batch: torch.Tensor) -> None:
        bad = batch.detach().clone()
        state = {"on": False}

        def root_pre_hook(module: nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            state["on"] = isinstance(x, torch.Tensor) and x.shape == bad.shape and \
                torch.equal(x.detach().to(bad.device), bad)

        forward, module, temperature = type(self.module).forward, self.module, self.TEMPERATURE

        def faulty_forward(*args, **kwargs):
            y = forward(module, *args, **kwargs)
            if not state["on"]:
                return y
            # a naive log-softmax (log of softmax instead of log_softmax) at a collapsed
            # temperature: exp underflows to 0, log(0) = -inf
            return torch.log(torch.softmax(y / temperature, dim=-1))
        self.handles.append(self.model.register_forward_pre_hook(root_pre_hook))
        module.forward = faulty_forward  # an instance attribute: nn.Module.__call__ calls it
        self._patched = True

    def disarm(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if self._patched:
            del self.module.forward  # the class's forward again
            self._patched = False


# ----------------------------------------------------------------------------------------------
def skip_cpu_shm_op() -> None:
    """On CPU, DeepSpeed's init_distributed JIT-compiles a shared-memory all-reduce extension
    (``deepspeed_shm_comm``, 20-30 s here, redone whenever the launcher environment changes).
    It serves DeepSpeed's inference all-reduce only; training collectives go through
    torch.distributed (gloo). Mark it unavailable so a CPU run starts in seconds."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def quiet_deepspeed_noise() -> None:
    """Silence, in this example only, two messages DeepSpeed 0.19 prints on every CPU run that
    say nothing about the run (the library installs no filter; README, "The example job"):

    - ``FutureWarning: torch.distributed.all_gather_into_tensor is deprecated`` (and, under ZeRO-3,
      ``reduce_scatter_tensor``), once per rank: ZeRO's all-gather of the updated partitions and
      ZeRO-3's reduce-scatter call them (``deepspeed/comm/torch.py``);
      distgrad's own all-gathers use ``all_gather_single``;
    - ``Attempting to get learning rate from scheduler before it has started``, once per rank:
      ``WarmupLR.__init__`` calls its own ``get_lr()`` before its first step.
    """
    import logging
    import warnings

    from deepspeed.utils import logger as ds_logger

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_scatter_tensor` is deprecated",
                            category=FutureWarning)  # the same, from ZeRO-3's reduce-scatter

    class _DropLrNotStarted(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "get learning rate from scheduler before it has started" not in record.getMessage()

    ds_logger.addFilter(_DropLrNotStarted())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["deepspeed", "ddp", "fsdp1", "fsdp2"], default="deepspeed",
                    help="deepspeed (deepspeed launcher or mpirun), or a PyTorch wrapper (torchrun or mpirun)")
    ap.add_argument("--ds-config", default=str(ROOT / "configs" / "ds_zero2_fp32.json"),
                    help="DeepSpeed config JSON (configs/ds_zero{1,2,3}_{fp32,bf16}.json)")
    ap.add_argument("--distgrad-config", default=str(ROOT / "configs" / "distgrad.yaml"),
                    help="distgrad YAML config")
    ap.add_argument("--data", default=None, help="text file to train on (default: Python stdlib sources)")
    ap.add_argument("--max-bytes", type=int, default=8 << 20)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--port", type=int, default=None, help="metrics port (overrides the distgrad config)")
    ap.add_argument("--interval", type=int, default=None, help="sample every N optimizer steps")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hold", type=float, default=0.0,
                    help="keep serving metrics this many seconds after training ends")
    ap.add_argument("--inject", choices=["nan", "inf", "spike", "zero"], default=None,
                    help="nan: a NaN made in the forward of --inject-param's module on --inject-rank; inf: an "
                         "Inf written into that parameter's gradient in the backward; spike: every gradient x100; "
                         "zero: that parameter's gradient zeroed from --inject-step on")
    ap.add_argument("--inject-step", type=int, default=20)
    ap.add_argument("--inject-param", default="blocks.2.mlp.fc.weight")
    ap.add_argument("--inject-rank", type=int, default=1)
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="train rank-R LoRA adapters on the block linears, base weights frozen")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel degree (--engine fsdp2 only): a (dp, tp) device mesh; each block's MLP "
                         "column/row parallel over tp, FSDP2 over dp")
    ap.add_argument("--fp8", action="store_true",
                    help="train the block linears in float8 with torchao (convert_to_float8_training, dynamic "
                         "tensorwise scaling; emulated on CPU): the model for fp8.enabled (pip install "
                         "'distgrad[fp8]')")
    ap.add_argument("--no-distgrad", action="store_true", help="train without distgrad (baseline)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a distgrad config key (YAML value), e.g. --set flight_recorder.dir=runs/fr")
    ap.add_argument("--summary-json", default=None, help="write timing summary here (rank 0)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return ap.parse_args(argv)


class DeepSpeedRunner:
    """The model under ``deepspeed.initialize`` (ZeRO stage, precision, batch sizes and clipping
    from the DeepSpeed config)."""

    def __init__(self, model: GPT, ds_cfg: dict) -> None:
        import deepspeed

        trainable = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_cfg)
        e = self.engine
        self.gas, self.mb, self.device = e.gradient_accumulation_steps(), e.train_micro_batch_size_per_gpu(), e.device
        dtype = "bf16" if e.bfloat16_enabled() else "fp16" if e.fp16_enabled() else "fp32"
        self.describe = f"DeepSpeed ZeRO-{e.zero_optimization_stage()} {dtype}"

    def instrument(self, distgrad, cfg, **overrides):
        return distgrad.instrument(self.engine, cfg, **overrides)

    def start(self) -> None:
        """Nothing to do: DeepSpeed clips inside its step, after distgrad has read."""

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()  # DeepSpeed applies the update on the accumulation boundary itself
        return loss


class TorchRunner:
    """The model wrapped in DDP, FSDP1 (``FullyShardedDataParallel``, one unit per block,
    ``use_orig_params=True``) or FSDP2 (``fully_shard`` per block and at the root), with AdamW,
    gradient accumulation under ``no_sync`` / ``set_requires_gradient_sync(False)`` and global
    grad-norm clipping; batch sizes, learning rate, clipping and bf16 from the DeepSpeed config so
    that every engine trains the same job."""

    def __init__(self, model: GPT, ds_cfg: dict, engine: str, device: torch.device, tp: int = 1) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.kind, self.device, self.tp = engine, device, tp
        self.dp_rank, self.dp_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.gas = int(ds_cfg.get("gradient_accumulation_steps", 1))
        self.mb = int(ds_cfg.get("train_micro_batch_size_per_gpu", 8))
        self.clip = float(ds_cfg.get("gradient_clipping", 0.0))
        bf16 = bool(ds_cfg.get("bf16", {}).get("enabled", False))
        model.to(device)
        if engine == "ddp":
            self.model = DDP(model, device_ids=[device] if device.type == "cuda" else None)
        elif engine == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
            self.model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                              mixed_precision=mp, device_id=device)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
                else MixedPrecisionPolicy()
            mesh = self._tensor_parallel(model) if tp > 1 else None
            for b in model.blocks:
                fully_shard(b, mp_policy=mp, mesh=mesh)
            self.model = fully_shard(model, mp_policy=mp, mesh=mesh)
        p = ds_cfg.get("optimizer", {}).get("params", {})
        self.optimizer = torch.optim.AdamW([q for q in self.model.parameters() if q.requires_grad],
                                           lr=p.get("lr", 1e-3), betas=tuple(p.get("betas", (0.9, 0.95))),
                                           weight_decay=p.get("weight_decay", 0.0))
        self.describe = f"{engine.upper()} {'bf16' if bf16 else 'fp32'}" + (f" x TP {tp}" if tp > 1 else "")
        self.engine = self.model

    def _tensor_parallel(self, model: GPT):
        """A ``(dp, tp)`` mesh; each block's MLP column-parallel (``fc``) then row-parallel
        (``proj``) over ``tp`` (Megatron-LM's MLP split); attention, norms and embeddings stay
        replicated over ``tp``. Ranks of one TP group read the same batch. Returns the ``dp``
        sub-mesh for FSDP2."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.dp_size % self.tp:
            raise SystemExit(f"--tp {self.tp} does not divide the world size {self.dp_size}")
        mesh = init_device_mesh(self.device.type, (self.dp_size // self.tp, self.tp), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
        self.dp_rank, self.dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        return mesh["dp"]

    def instrument(self, distgrad, cfg, **overrides):
        if "clip" not in overrides:  # a clip section from --set wins
            overrides.setdefault("clip.max_grad_norm", self.clip or None)
        return distgrad.instrument(self.model, cfg, optimizer=self.optimizer, **overrides)

    def start(self) -> None:
        """Clip inside ``optimizer.step()``, in a step pre-hook registered after distgrad's:
        pre-hooks run in registration order, so distgrad reads the gradient before clipping
        (the grad norm DeepSpeed users see too) and reports the clip ratio."""
        if self.clip > 0:
            self.optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._clip())

    def _clip(self) -> None:
        if self.kind == "fsdp1":
            self.model.clip_grad_norm_(self.clip)
        elif self.tp > 1:
            self._clip_tp()
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)

    def _clip_tp(self) -> None:
        """Global-norm clipping with parameters on the 2-D mesh and on its ``dp`` sub-mesh: each
        local block's sum of squares divided by its number of copies (``Replicate`` dimensions,
        and the ``tp`` ranks for sub-mesh parameters), one all-reduce, then scale in place."""
        world = torch.distributed.get_world_size()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        for g in grads:
            mesh = g.device_mesh
            copies = world // mesh.size()
            for d, pl in enumerate(g.placements):
                copies *= mesh.size(d) if pl.is_replicate() else 1
            total += g.to_local().double().pow(2).sum() / copies
        torch.distributed.all_reduce(total)
        self.clip_norm = float(total.sqrt())  # printed beside distgrad's grad_norm (a cross-check)
        coef = torch.clamp(self.clip / (total.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.to_local().mul_(coef.to(g.dtype))

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        import contextlib

        if self.kind == "fsdp2":
            self.model.set_requires_gradient_sync(last)
            ctx = contextlib.nullcontext()
        else:
            ctx = contextlib.nullcontext() if last else self.model.no_sync()
        with ctx:
            loss = self.model(x, y)
            (loss / self.gas).backward()
        if last:
            self.optimizer.step()  # pre-hooks: distgrad reads the reduced gradients, then clipping
            self.optimizer.zero_grad(set_to_none=True)
        return loss


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dist_env

    import distgrad

    t_start = time.time()
    launcher = dist_env.discover()  # torchrun / deepspeed set the env; mpirun is discovered
    use_cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu"
    if args.engine == "deepspeed":
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        quiet_deepspeed_noise()
        acc = get_accelerator()
        if acc.device_name() == "cpu":
            skip_cpu_shm_op()
        deepspeed.init_distributed(dist_backend=acc.communication_backend_name()
                                   if acc.device_name() != "cpu" else "gloo")
    else:
        if use_cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with open(args.ds_config) as f:
        ds_cfg = json.load(f)
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.width, args.heads, args.block)
    if args.lora:
        add_lora(model, args.lora)
    if args.fp8:
        to_float8(model)
    injector = Injector(model, args.inject, args.inject_step, args.inject_param, args.inject_rank, rank)
    if args.engine == "deepspeed":
        runner = DeepSpeedRunner(model, ds_cfg)
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        if args.inject not in (None, "nan") and args.engine.startswith("fsdp"):
            raise SystemExit(f"--inject {args.inject} works with --engine deepspeed or ddp (FSDP's autograd sees "
                             "flat/unsharded parameters, not the hooks of the user's parameters); --inject nan "
                             "(a forward fault) works with every engine")
        if args.tp > 1 and args.engine != "fsdp2":
            raise SystemExit("--tp works with --engine fsdp2 (FSDP2 + tensor parallel on a (dp, tp) mesh)")
        runner = TorchRunner(model, ds_cfg, args.engine, device, args.tp)
    overrides = {k: v for k, v in (("exporter.port", args.port), ("sampling.interval", args.interval))
                 if v is not None}
    import yaml

    for kv in args.set:
        key, _, val = kv.partition("=")
        overrides[key.strip()] = yaml.safe_load(val)
    dg = None if args.no_distgrad else runner.instrument(distgrad, args.distgrad_config, **overrides)
    runner.start()
    # under ZeRO-3 a parameter's own tensor is an empty shard: DeepSpeed keeps the full count in ds_numel
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    n_trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    data = load_corpus(args.data, args.max_bytes)
    if rank == 0:
        where = f"http://{dg.config.exporter.host}:{dg.port}/metrics" if dg and dg.port else "off"
        print(f"[train] {n_params / 1e6:.2f}M params ({n_trainable / 1e6:.2f}M trainable), {runner.describe}, "
              f"world {world} ({launcher}), {len(data) / 1e6:.1f} MB text, metrics: {where}", flush=True)
    if dg is not None and args.inject == "inf" and args.inject_param in dg.source.names:
        off = dg.source.local_offsets()[dg.source.names.index(args.inject_param)]
        if off is None and rank == args.inject_rank:
            print(f"[train] warning: rank {rank} holds no shard of {args.inject_param} after the reduction; "
                  f"the injected value lands in the shard of the rank that owns element 0", flush=True)
        injector.offset = off[0] if off else 0
    gas, mb = runner.gas, runner.mb
    data_rank, data_world = getattr(runner, "dp_rank", rank), getattr(runner, "dp_size", world)
    tokens_per_step = mb * gas * args.block * data_world
    step_times: list[float] = []
    t_first = None
    for step in range(args.steps):
        t0 = time.perf_counter()
        for micro in range(gas):
            x, y = get_batch(data, mb, args.block, hash((args.seed, data_rank, step, micro)) & 0x7FFFFFFF,
                             runner.device)
            last = micro == gas - 1
            if last:
                injector.arm(step, x)
            loss = runner.micro_step(x, y, last)
            injector.disarm()
        step_times.append(time.perf_counter() - t0)
        if t_first is None:
            t_first = time.time() - t_start
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            rec = dg.last_record if dg else None
            gn = f"{rec.grad_norm:.4f}" if rec else "n/a"
            if rec and rec.step != step:  # asynchronous records (CUDA default): one step late
                gn += f" (of step {rec.step})"
            elif getattr(runner, "clip_norm", None) is not None:
                gn += f" (clip norm {runner.clip_norm:.6g})"
            ls = f"{rec.loss:.4f}" if rec and rec.loss is not None else f"{loss.item():.4f}"
            recent = step_times[-args.log_every:]
            print(f"[train] step {step:5d}  loss {ls}  grad_norm {gn}  "
                  f"{tokens_per_step * len(recent) / sum(recent):,.0f} tok/s  "
                  f"{len(recent) / sum(recent):.2f} steps/s", flush=True)
    if rank == 0:
        med = sorted(step_times)[len(step_times) // 2]
        summary = {"start_to_first_step_s": t_first, "median_step_s": med, "steps": args.steps,
                   "steps_per_s": 1.0 / med, "tokens_per_s": tokens_per_step / med, "params": n_params}
        print(f"[train] done: first step after {t_first:.1f}s, median step {med * 1e3:.0f} ms "
              f"({1 / med:.2f} steps/s)", flush=True)
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps(summary))
    if args.hold > 0:
        if rank == 0:
            print(f"[train] holding metrics for {args.hold:.0f}s", flush=True)
        time.sleep(args.hold)
    torch.distributed.barrier()
    if dg:
        dg.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
