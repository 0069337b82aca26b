"""One builder per engine for the multi-rank drivers: DeepSpeed, DDP, FSDP1 and FSDP2 on CPU
(gloo), each returning ``(engine or wrapped model, optimizer)``, so that a driver says only what
its case differs in (stage, dtype, wrapping, optimizer) instead of repeating the set-up.

The optimizer of the torch engines is made by a factory applied to the wrapped model's trainable
parameters (``requires_grad``): :func:`adamw` (default, lr 1e-3) or :func:`sgd`; ``optim=None``
builds none (the second element is then None). DeepSpeed's comes from its config
(:func:`ds_config`: AdamW with ``torch_adam``, the only one that runs on CPU) or ``optimizer=``.
Every builder is a collective: every rank calls it, in the same order.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

CPU = torch.device("cpu")

#: makes the optimizer from a list of parameters
OptimFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def adamw(lr: float = 1e-3, **kw: Any) -> OptimFactory:
    """``torch.optim.AdamW(params, lr=lr, **kw)`` as a factory for the builders' ``optim=``."""
    return functools.partial(torch.optim.AdamW, lr=lr, **kw)


def sgd(lr: float, **kw: Any) -> OptimFactory:
    """``torch.optim.SGD(params, lr=lr, **kw)`` as a factory for the builders' ``optim=``."""
    return functools.partial(torch.optim.SGD, lr=lr, **kw)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that require a gradient, in ``parameters()`` order."""
    return [p for p in model.parameters() if p.requires_grad]


def _optimizer(model: nn.Module, optim: OptimFactory | None) -> torch.optim.Optimizer | None:
    return None if optim is None else optim(trainable(model))


# -- DeepSpeed ---------------------------------------------------------------------------------

#: DeepSpeed's fp16 section of the tests: dynamic loss scaling starting at 2**8 (small enough
#: that the tiny models do not overflow on the first steps), never lowered below 1
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "min_loss_scale": 1}


def ds_config(stage: int, dtype: str = "fp32", gas: int = 1, *, micro_batch: int = 3, lr: float = 1e-3,
              adamw_params: dict | None = None, **sections: Any) -> dict:
    """A DeepSpeed config: ZeRO ``stage`` (0-3), ``dtype`` "fp32", "bf16" or "fp16" (:data:`FP16`),
    ``gas`` micro-batches per optimizer step of ``micro_batch`` samples, AdamW (``torch_adam``:
    DeepSpeed's fused CPU Adam is not built here) with ``lr`` and ``adamw_params`` (betas, eps,
    weight_decay...), no periodic prints. ``sections``: further top-level keys; a dict is merged
    into the section of that name (``zero_optimization={"stage3_param_persistence_threshold":
    0}``), anything else replaces it. Raises ValueError for another dtype."""
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(dtype)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True, **(adamw_params or {})}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = dict(FP16)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def build_deepspeed(model: nn.Module, stage: int = 0, dtype: str = "fp32", gas: int = 1, *,
                    config: dict | None = None, optimizer: torch.optim.Optimizer | None = None,
                    lr_scheduler: Any = None, **config_kw: Any):
    """``deepspeed.initialize`` of ``model`` over its trainable parameters with ``config`` (else
    :func:`ds_config` of ``stage``, ``dtype``, ``gas`` and ``config_kw``); ``optimizer``: a client
    optimizer (then the config's own is dropped), ``lr_scheduler``: a client scheduler (the
    engine steps it: ``engine.lr_scheduler``). Returns ``(engine, engine.optimizer)``: the latter
    is DeepSpeed's wrapper (ZeRO optimizer, fp16/bf16 optimizer) or the bare optimizer."""
    import deepspeed

    cfg = dict(config) if config is not None else ds_config(stage, dtype, gas, **config_kw)
    if optimizer is not None:
        cfg.pop("optimizer", None)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=cfg)
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable(model), lr_scheduler=lr_scheduler,
                                          config=cfg)
    return engine, engine.optimizer


# -- torch: DDP, FSDP1, FSDP2 ------------------------------------------------------------------

def build_ddp(model: nn.Module, *, optim: OptimFactory | None = adamw(), **ddp_kw: Any):
    """``DistributedDataParallel(model, **ddp_kw)`` (``process_group=``,
    ``find_unused_parameters=``...) and its optimizer. Returns ``(ddp, optimizer)``."""
    from torch.nn.parallel import DistributedDataParallel

    w = DistributedDataParallel(model, **ddp_kw)
    return w, _optimizer(w, optim)


def blocks_and_frozen(model: nn.Module) -> Callable[[nn.Module], bool]:
    """FSDP1 auto-wrap predicate for ``tests.dist.common.TinyModel``: each block (an
    ``nn.Sequential``) and the frozen layer are units of their own."""
    frozen = model.frozen
    return lambda m: isinstance(m, nn.Sequential) or m is frozen


def build_fsdp1(model: nn.Module, *, wrap: Callable[[nn.Module], bool] | None = None, orig_params: bool = True,
                optim: OptimFactory | None = adamw(), **fsdp_kw: Any):
    """``FullyShardedDataParallel`` on CPU: ``wrap`` (a module predicate, e.g.
    :func:`blocks_and_frozen`) makes those submodules units of their own (lambda auto-wrap),
    ``orig_params`` is ``use_orig_params`` (False: flat parameters), ``fsdp_kw`` go to FSDP
    (``sharding_strategy=``, ``mixed_precision=``, ``device_mesh=``, another
    ``auto_wrap_policy=`` instead of ``wrap``...). Returns ``(fsdp, optimizer)``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    if wrap is not None:
        fsdp_kw["auto_wrap_policy"] = functools.partial(lambda_auto_wrap_policy, lambda_fn=wrap)
    w = FSDP(model, use_orig_params=orig_params, device_id=CPU, **fsdp_kw)
    return w, _optimizer(w, optim)


def build_fsdp2(model: nn.Module, shard: Iterable[nn.Module] = (), *, optim: OptimFactory | None = adamw(),
                **shard_kw: Any):
    """``fully_shard`` each module of ``shard`` (e.g. the blocks), then ``model``, with
    ``shard_kw`` (``mesh=``, ``mp_policy=``...). Returns ``(model, optimizer)``: FSDP2 shards in
    place, its parameters are DTensors."""
    from torch.distributed.fsdp import fully_shard

    for m in shard:
        fully_shard(m, **shard_kw)
    fully_shard(model, **shard_kw)
    return model, _optimizer(model, optim)


def init_distributed(fp16: bool = False) -> tuple[int, int]:
    """Start a driver's gloo process group (from torchrun's environment) through
    ``deepspeed.init_distributed``, which DeepSpeed's engines need and the torch engines share,
    with DeepSpeed's shared-memory collective op off (not built here; as launch/train.py's
    ``skip_cpu_shm_op``). ``fp16``: lift DeepSpeed's refusal of fp16 on CPU
    (``CPU_Accelerator.is_fp16_supported()`` is False; the arithmetic works, see docs/engines.md).
    Returns ``(rank, world size)``."""
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    if fp16:
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
    return dist.get_rank(), dist.get_world_size()
