"""PyTorch-native adapters: where ``DistributedDataParallel``, FSDP1
(``FullyShardedDataParallel``), FSDP2 (``fully_shard``) and a plain ``nn.Module`` keep the reduced
gradient when ``optimizer.step()`` starts, and the optimizer-step boundary that reads it.

Facts relied on (measured on torch 2.13.0+cpu with 2 gloo ranks, ``docs/engines.md``,
and pinned by ``tests/test_torch_reference.py``):

- ``torch.optim.Optimizer.register_step_pre_hook`` fires once per ``optimizer.step()``, after
  DDP's all-reduce, FSDP1's and FSDP2's reduce-scatter have completed and gradients of all
  micro-batches are accumulated (``no_sync()`` / ``set_requires_gradient_sync(False)``
  micro-batches included). Per-micro-batch hooks (DDP comm hooks, FSDP2
  ``set_all_reduce_hook``) fire before accumulation and are not used.
- DDP: ``p.grad`` is the full gradient averaged over ranks, identical on every rank
  (``replicated``: the core reads a 1/W slice per rank and compares per-rank fingerprints).
- FSDP1 ``use_orig_params=True``: ``p.grad`` of each original parameter is this rank's 1-D
  slice of its flattened gradient, or None when the rank holds none of it
  (``FlatParamHandle._use_sharded_grad_views``, torch/distributed/fsdp/_flat_param.py).
- FSDP1 ``use_orig_params=False``: only the ``FlatParameter`` of each unit is a parameter; its
  ``.grad`` is this rank's padded 1-D shard. Original parameter ``i`` of the unit is
  ``grad[offset_in_shard : offset_in_shard + numel_in_shard]`` when
  ``_shard_param_infos[i].in_shard``; the last ``_shard_numel_padded`` elements are padding
  (private API: ``_fqns``, ``_numels``, ``_param_infos``, ``_shard_param_infos``,
  ``_shard_numel_padded``; checked at ``instrument()`` time, see :func:`_check_flat_layout`).
- FSDP2: ``p.grad`` is a ``DTensor`` with placements ``(Shard(0),)`` on a 1-D mesh;
  ``to_local()`` is this rank's unpadded chunk (never ``full_tensor()``: a collective).
- ``torch.amp.GradScaler.step`` (torch/amp/grad_scaler.py) unscales the gradients in place
  (``unscale_``, unless the user already called it) *before* calling ``optimizer.step()``,
  and does not call ``optimizer.step()`` at all when it found Inf/NaN. Optimizers with
  ``_step_supports_amp_scaling`` (``fused=True``) are called on every step with the gradients
  still scaled and ``optimizer.grad_scale`` / ``optimizer.found_inf`` set for the duration of
  the call. The boundary therefore wraps ``scaler.step`` when a scaler is given.
"""

from __future__ import annotations

from typing import Any

from distgrad.engines.ddp import DDPSource
from distgrad.engines.fsdp1 import FSDP1Source
from distgrad.engines.fsdp2 import FSDP2Source
from distgrad.engines.local import LocalSource
from distgrad.engines.optimizer_boundary import OptimizerBoundary, attach_torch, check_boundary_args
from distgrad.engines.torch_base import SUPPORTED, TorchSource, is_ddp, is_fsdp1, is_fsdp2, is_torch_module


def torch_source(model: Any) -> TorchSource:
    """The adapter for ``model``: DDP, then FSDP2, then FSDP1, then a plain module.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (the message lists supported types).
        ValueError / RuntimeError: from the adapters (unsupported configurations).
    """
    if is_ddp(model):
        return DDPSource(model)
    if is_fsdp2(model):
        return FSDP2Source(model)
    if is_fsdp1(model):
        return FSDP1Source(model)
    if is_torch_module(model):
        return LocalSource(model)
    raise TypeError(f"not a torch.nn.Module: {type(model).__name__}; supported: {SUPPORTED}")


__all__ = ["SUPPORTED", "TorchSource", "DDPSource", "FSDP1Source", "FSDP2Source", "LocalSource", "OptimizerBoundary",
           "torch_source", "attach_torch", "check_boundary_args", "is_ddp", "is_fsdp1", "is_fsdp2", "is_torch_module"]
