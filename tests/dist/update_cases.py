"""Multi-rank driver of the update-geometry tests (tests/test_update_geometry_multirank.py)
under ``torchrun --nproc_per_node 2``, gloo, CPU: a two-layer model (``layers.0``: 6 -> 12,
``layers.1``: 12 -> 5), each rank its own batch per step, STEPS steps, update geometry on with the
spectral norm, under DDP (AdamW, SGD with momentum, Muon, Adafactor), FSDP2 (AdamW, SGD with
momentum, Muon; rows sharded per layer; torch's Adafactor itself fails on FSDP2's DTensors: an
in-place pow_ on a _NormPartial placement) and DeepSpeed ZeRO-2 (its own torch AdamW; client SGD
with momentum and Adafactor, which ZeRO-2 steps on flat fp32 partitions that cut rows, so Adafactor
keeps an unfactored second moment there).
Per step the full weights (DDP: the parameters; FSDP2: ``full_tensor()``; ZeRO-2: the fp32 module
weights DeepSpeed copies back from the master partitions) before and after each optimizer step,
and distgrad's :class:`~distgrad.signals.update.UpdateGeometry.Part` of each record. Rank 0 writes
the JSON."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

import distgrad
from distgrad import stats
from tests.dist.common import BoundaryCounter, driver_args, run_cases
from tests.reference import adafactor_trace
from tests.dist.engines import adamw, build_ddp, build_deepspeed, build_fsdp2, init_distributed, sgd, trainable

STEPS = 5
CFG = {"exporter": {"enabled": False}, "statistics": {"async_records": "off"},
       "update_geometry": {"enabled": True, "spectral": True}}


class TwoLayers(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 12, bias=bias), nn.Linear(12, 5, bias=bias)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers[1](torch.tanh(self.layers[0](x))), y)


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g)


OPTIMS = {"adamw": adamw(1e-2, weight_decay=0.1), "sgd": sgd(5e-2, momentum=0.9),
          "muon": functools.partial(torch.optim.Muon, lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
          "adafactor": functools.partial(torch.optim.Adafactor, lr=1e-2)}


def run(key: str, rank: int, world: int) -> dict:
    engine_name, opt_name = key.split("-")
    torch.manual_seed(0)
    model = TwoLayers(bias=opt_name != "muon")
    if engine_name == "ddp":
        w, opt = build_ddp(model, optim=OPTIMS[opt_name])
        inst = distgrad.instrument(w, CFG, optimizer=opt)

        def full():
            return {n: p.detach().double().clone() for n, p in model.named_parameters()}

        def train(step):
            w(*data(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    elif engine_name == "fsdp2":
        w, opt = build_fsdp2(model, model.layers, optim=OPTIMS[opt_name])
        inst = distgrad.instrument(w, CFG, optimizer=opt)

        def full():
            return {n: p.full_tensor().detach().double().clone() for n, p in model.named_parameters()}

        def train(step):
            w(*data(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    else:
        client = None if opt_name == "adamw" else OPTIMS[opt_name](trainable(model))  # ZeRO-2 wraps it
        w, _ = build_deepspeed(model, 2, micro_batch=4, lr=1e-2, adamw_params={"weight_decay": 0.1}, optimizer=client,
                               zero_allow_untested_optimizer=True)
        inst = distgrad.instrument(w, CFG)

        def full():
            return {n: p.detach().double().clone() for n, p in w.module.named_parameters()}

        def train(step):
            w.backward(w(*data(step, rank)))
            w.step()
    recs: list = []
    inst.add_hook(recs.append)
    weights, traces = [full()], []
    counter = BoundaryCounter(inst)
    for step in range(STEPS):
        if step < 3:
            counter.around(lambda s=step: train(s))
        else:
            train(step)
        weights.append(full())
        if key == "ddp-adafactor":
            traces.append(adafactor_trace(opt))
        elif key == "z2-adafactor":  # unfactored on the flat partitions: the sum over both ranks' partitions
            t = torch.tensor([adafactor_trace(w.optimizer.optimizer)], dtype=torch.float64)
            torch.distributed.all_reduce(t)
            traces.append(float(t))
    counter.restore()
    inst.close()
    return {"records": [None if r.update_geometry is None else r.update_geometry.to_dict() for r in recs],
            "steps": [r.step for r in recs], "internal_errors": inst.counters["internal_errors"],
            "counts": counter.counts, "weights": [{k: v.tolist() for k, v in x.items()} for x in weights],
            "traces": traces}


def main() -> None:
    args = driver_args(cases="all")
    rank, world = init_distributed()
    stats.stats_table([torch.ones(3)], torch.device("cpu"))  # one-time kernel set-up (its syncs not counted)
    keys = ["ddp-adamw", "ddp-sgd", "ddp-muon", "ddp-adafactor", "fsdp2-adamw", "fsdp2-sgd", "fsdp2-muon",
            "z2-adamw", "z2-sgd", "z2-adafactor"]
    run_cases([(k, functools.partial(run, k)) for k in keys], args.cases, args.out, rank, world, "update_cases",
              gather=False)


if __name__ == "__main__":
    main()
