"""Where the optimizer's per-element state (Adam's ``exp_avg`` / ``exp_avg_sq``) sits next to the
gradient pieces each engine adapter reads: one :class:`OptimizerSlot` per parameter, whose
:meth:`OptimizerSlot.piece` cuts a state tensor exactly as the adapter cuts the gradient (same
elements, same order), so that ``local_state_pieces(key)[i]`` and ``local_pieces()[i]`` are
aligned element by element (see :meth:`distgrad.engines.base.GradSource.optimizer_slots`).

Facts relied on (torch 2.13, deepspeed 0.19; pinned by ``tests/test_optimizer_signals.py`` and
the multi-rank driver ``tests/dist/adam_cases.py``):

- ``torch.optim.Adam`` / ``AdamW`` keep ``state[p] = {"step", "exp_avg", "exp_avg_sq"}`` (and
  ``max_exp_avg_sq`` with ``amsgrad``) keyed by the parameter object, created at the first
  ``step()``; ``step`` is the number of updates already applied (a tensor; on the device with
  ``capturable`` / ``fused``). Under FSDP2 the state tensors are DTensors with the parameter's
  placement (``torch.zeros_like(p)``); under FSDP1 they have the shape of the local flat shard
  (``use_orig_params=False``: keyed by the ``FlatParameter``; ``True``: by each original
  parameter's 1-D shard view).
- DeepSpeed ZeRO-1/2 (and ``BF16_Optimizer``): the wrapped torch optimizer's parameters are the
  fp32 flat partitions (``single_partition_of_fp32_groups[i]`` / ``fp32_groups_flat_partition[i]``);
  a parameter's fragment sits at ``_hp_mapping.hp_fragment_address`` (start, numel) of the
  partition of its group ``_hp_mapping.param_group_index``, the same elements as its gradient
  fragment at ``lp_fragment_address`` (``deepspeed/utils/tensor_fragment.py``). ZeRO-3: the fp32
  flat ``fp32_partitioned_groups_flat[g]`` with the parameter at ``grad_position[id]`` =
  ``(g, offset, numel)`` (``stage3.py``, ``_get_fp32_opt_state_partition``); the last ranks'
  partitions carry padding, cut like the gradient partition.
- DeepSpeed ``FusedAdam`` keeps its step count in the param group (``group["step"]``), not in
  the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass
class OptimizerSlot:
    """The optimizer entry holding one parameter's local piece.

    Attributes:
        optimizer: the ``torch.optim.Optimizer`` that steps it (the torch optimizer inside
            DeepSpeed's ZeRO wrapper).
        group: its ``param_groups`` entry (hyperparameters: ``betas``, ``eps``, ``lr``, ...).
        key: the tensor the optimizer's ``state`` is keyed by (the parameter, a FlatParameter,
            a DeepSpeed fp32 flat partition).
        cut: maps a state tensor of ``key``'s shape to this rank's 1-D piece of the parameter,
            aligned with the adapter's gradient piece (a view, no copy).
    """

    optimizer: Any
    group: dict
    key: torch.Tensor
    cut: Callable[[torch.Tensor], torch.Tensor]

    @property
    def state(self) -> dict:
        """The optimizer's state of :attr:`key` (empty before its first step)."""
        return self.optimizer.state.get(self.key, {})

    def piece(self, name: str) -> torch.Tensor | None:
        """This rank's 1-D piece of state ``name`` (e.g. ``"exp_avg_sq"``), or None when the
        state has no such tensor yet (before the first optimizer step)."""
        t = self.state.get(name)
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return None
        return self.cut(t)

    def step_count(self) -> Any:
        """Updates already applied to this entry: ``state["step"]`` (a tensor or a number), else
        ``group["step"]`` (DeepSpeed FusedAdam), else None (never stepped)."""
        s = self.state.get("step")
        return s if s is not None else self.group.get("step")


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D view (the whole local tensor)."""
    return t.reshape(-1)


def narrow(start: int, numel: int, keep: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A cut taking elements ``[start, start + numel)`` of the flattened tensor, then the first
    ``keep`` of them (padding dropped) when given."""
    n = numel if keep is None else keep

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).narrow(0, start, n)
    return cut


def group_of(optimizer: Any, key: torch.Tensor) -> dict | None:
    """The ``param_groups`` entry of ``optimizer`` holding ``key`` (by identity), or None."""
    for g in optimizer.param_groups:
        if any(p is key for p in g["params"]):
            return g
    return None


def torch_slots(optimizer: Any, entries: list[tuple[torch.Tensor, Callable] | None]) -> list[OptimizerSlot | None]:
    """Slots of a plain ``torch.optim.Optimizer`` for ``entries`` (per parameter: the state key
    and its cut, or None where the rank holds no piece); a parameter the optimizer does not
    step gets None."""
    index = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out: list[OptimizerSlot | None] = []
    for e in entries:
        g = None if e is None else index.get(id(e[0]))
        out.append(None if g is None or e is None else OptimizerSlot(optimizer, g, e[0], e[1]))
    return out
