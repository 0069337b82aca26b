"""The optional per-step collectives of the :class:`~distgrad.Instrument`, beyond the two of every
sampled step: the update-ratio SUM all-reduce (option ``update_ratio``) and the non-finite
provenance all-gather (made only on steps whose *reduced* statistics are non-finite, so every
rank makes it). With asynchronous records the all-reduce is enqueued at the step and read at
the next boundary, where the all-gather also happens (see ``distgrad.instrument``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from distgrad.core.dist import dist_ready
from distgrad.record import RankCount

if TYPE_CHECKING:
    from distgrad.core.instrument import Instrument


def weight_pieces(inst: Instrument) -> list[torch.Tensor | None]:
    """This rank's pieces of the (master) weights, aligned with the gradient pieces: per
    parameter a 1-D tensor or None (replicated pieces: this rank's share, ``inst.own``)."""
    return inst.own.take(inst.pieces(inst.source.local_param_pieces()))


def update_ratio_sums(inst: Instrument, n_params: int) -> torch.Tensor:
    """Update-to-weight ratio ``||w_after - w_before|| / ||w_before||`` per parameter, step 1 of
    2: from the weight pieces ``inst._weights_before`` copied in ``Instrument.collect`` and the
    current ones, the all-reduced float64 ``[P + 1, 2]`` sums (last row: the failure flag, set
    by a rank without its copy), on the device; one SUM all-reduce, no host read. Every rank
    must call it. Source: CS231n's update/weight ratio (see :class:`health.UpdateRatioTracker`)."""
    from distgrad.diagnostics.health import UpdateRatioTracker

    before, inst._weights_before = inst._weights_before, None
    device = inst.source.device()
    sums = torch.zeros((n_params + 1, 2), dtype=torch.float64, device=device)
    try:
        if before is None:
            raise RuntimeError("no weight copy from before the step")
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        after = weight_pieces(inst)
        sums[:-1] = UpdateRatioTracker().local_sums([b if b is not None else empty for b in before],
                                                    [a if a is not None else empty for a in after]).to(device)
    except Exception:  # noqa: BLE001
        if before is not None:
            inst.count_error("update ratio")
        sums.zero_()
        sums[-1, 0] = 1.0
    if dist_ready() and inst.world_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=inst.group)
    return sums


def update_ratio_values(host: np.ndarray, names: list[str], step_applied: bool) -> dict[str, float] | None:
    """Step 2 of 2: the ratios per parameter name from the sums on the host (float64
    ``[P + 1, 2]``); None when a rank flagged a failure. A skipped step has ratio 0."""
    from distgrad.diagnostics.health import UpdateRatioTracker

    if host[-1, 0] > 0:
        return None
    ratios = UpdateRatioTracker.ratios(host[:-1])
    return {n: (float(r) if step_applied else 0.0) for n, r in zip(names, ratios)}


def provenance(inst: Instrument, names: list[str], local_nonfinite: torch.Tensor) -> list[RankCount]:
    """Per-rank non-finite counts per parameter: one all-gather of every rank's float64
    ``[P, 2]`` NaN/Inf counts of the step (``local_nonfinite``) and one host read; one
    :class:`~distgrad.record.RankCount` per non-zero (rank, parameter)."""
    local = local_nonfinite.reshape(-1)
    if dist_ready() and inst.world_size > 1:
        out = torch.empty(inst.world_size * local.numel(), dtype=local.dtype, device=local.device)
        # all_gather_single replaces the deprecated all_gather_into_tensor in torch >= 2.13
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local.contiguous(), group=inst.group)
    else:
        out = local
    per = out.cpu().numpy().reshape(inst.world_size, len(names), 2)
    rows = []
    for r in range(inst.world_size):
        for i in np.nonzero(per[r].sum(axis=1))[0]:
            rows.append(RankCount(names[i], r, int(per[r, i, 0]), int(per[r, i, 1]), int(per[r, i].sum())))
    return rows
