"""DeepSpeed mixture of experts (``deepspeed.moe.layer.MoE`` with ``ep_size`` > 1): names and
holders of the expert parameters, so that the job-wide list of :mod:`distgrad.core.job` counts every
expert once under its global index.

Facts relied on (read in ``deepspeed/moe/experts.py``, ``moe/layer.py``, ``utils/groups.py`` of
deepspeed 0.19; measured with 4 gloo ranks, ``ep_size`` 2, ZeRO-2, pinned by
tests/test_deepspeed_layouts.py):

- ``Experts`` holds ``num_local_experts = num_experts / ep_size`` experts in
  ``deepspeed_experts`` (a ``ModuleList``): every rank names its own experts
  ``...deepspeed_experts.0``, ``.1``, ..., whatever their global index. The global index of
  local expert ``l`` on expert-parallel rank ``r`` is ``r * num_local_experts + l`` (the
  all-to-all dispatches expert chunks in expert-parallel rank order).
- Expert parameters carry ``allreduce = False`` and ``group_name = "ep_size_<k>"``; their
  gradients are reduced only over the expert-data-parallel group of that name
  (``groups._get_expert_data_parallel_group_ranks``), and ZeRO 1/2 partitions them over that
  group (``real_dp_process_group`` of their parameter group), so ``_hp_mapping`` fragments of
  the holders are disjoint and cover the expert, as for the dense parameters over all ranks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

_EXPERT = re.compile(r"^(?:(.*)\.)?deepspeed_experts\.(\d+)\.(.+)$")


def expert_layout(engine: Any, raw_names: Sequence[str], params: Sequence[Any],
                  zero_stage: int) -> tuple[list[str], list[tuple[int, ...]]] | None:
    """Per parameter, its name with the expert's global index and the global ranks holding it
    (the expert-data-parallel group for experts, every rank otherwise); None without expert
    parallelism (no expert parameter, or ``ep_size`` 1 everywhere: experts then behave as dense
    parameters).

    Raises:
        ValueError: expert parallelism on a ZeRO stage other than 1 or 2, or an expert
            parameter whose name or module distgrad cannot map (named in the message)."""
    experts = [p for p in params if getattr(p, "allreduce", True) is False]
    if not experts:
        return None
    from deepspeed.utils import groups

    group_names = {getattr(p, "group_name", None) for p in experts}
    if all(g is not None and groups._get_expert_parallel_world_size(g) == 1 for g in group_names):
        return None
    if zero_stage not in (1, 2):
        raise ValueError(
            f"DeepSpeed MoE with expert parallelism ({sorted(map(str, group_names))}) is supported under ZeRO "
            f"stage 1 or 2, not {zero_stage}: each rank holds different experts whose gradients are reduced "
            "over their expert-data-parallel group only, and distgrad locates them for ZeRO 1/2 fragments "
            "(tested with ZeRO-2). Use ZeRO-2, or ep_size 1")
    local_counts = {prefix: int(m.num_local_experts) for prefix, m in engine.module.named_modules()
                    if hasattr(m, "deepspeed_experts") and hasattr(m, "num_local_experts")}
    world = tuple(range(dist.get_world_size()))
    names, holders = [], []
    for n, p in zip(raw_names, params):
        if getattr(p, "allreduce", True) is not False:
            names.append(n)
            holders.append(world)
            continue
        m = _EXPERT.match(n)
        prefix = m.group(1) or "" if m else None
        if m is None or prefix not in local_counts or p.group_name is None:
            raise ValueError(f"expert parameter {n!r} is not inside a deepspeed.moe Experts module "
                             "(deepspeed_experts.<i>.<name>); distgrad cannot give it its global expert index")
        g = p.group_name
        index = int(m.group(2)) + groups._get_expert_parallel_rank(g) * local_counts[prefix]
        names.append(f"{prefix + '.' if prefix else ''}deepspeed_experts.{index}.{m.group(3)}")
        holders.append(tuple(int(r) for r in groups._get_expert_data_parallel_group_ranks(g)))
    return names, holders
