"""A tiny, steady training job for the lifecycle paging test (tests/monitoring/test_lifecycle_paging.py).

``python lifecycle_run.py RUN_NAME TARGETS_DIR STOP_FILE`` (one process, a plain module), or
under ``torchrun`` (DDP over gloo, any number of nodes): instruments the model with the exporter
on a free port of 127.0.0.1 and ``exporter.file_sd_path = TARGETS_DIR/`` (rank 0 registers its
own scrape target, labelled ``run=RUN_NAME``), trains on one fixed batch with a small learning
rate (a smoothly falling loss: nothing for the spike detectors) every 0.2 s until STOP_FILE
exists, then ends cleanly with ``close()``. The test ends it that way, or with ``kill -9``.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import distgrad as dg


def main(run: str, targets: str, stop: str) -> int:
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    inst = dg.instrument(model, optimizer=opt, exporter={
        "port": 0, "host": "127.0.0.1", "file_sd_path": targets.rstrip("/") + "/", "run_name": run})
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    while not os.path.exists(stop):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        inst.observe_loss(loss)
        loss.backward()
        opt.step()
        time.sleep(0.2)
        if distributed:  # every rank stops at the same step
            flag = torch.tensor([float(os.path.exists(stop))])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
    if inst.prometheus is not None:  # what the test reads in the log when the final scrape is missing
        t0 = time.monotonic()
        scraped = inst.prometheus.finish()
        print(f"lifecycle_run {run}: finished state scraped={scraped} after {time.monotonic() - t0:.2f} s; "
              f"served (version, pages, last, gap)={inst.prometheus.server.served()}, "
              f"head version={inst.prometheus.collector.head_version}", flush=True)
    inst.close()
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
