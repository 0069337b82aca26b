"""Multi-rank driver for tests/test_kernel_cache.py (one torchrun launch, 2 gloo CPU ranks): the
ranks meet at a barrier and then build distgrad's three native kernels at the same moment, as
ranks starting together do; each reports, per kernel, whether it is available, whether this
process compiled it and the cached library's path. Rank 0 writes the gathered reports as JSON
to the path given by --out. The kernel cache and the compiler come from the environment
(``DISTGRAD_KERNEL_CACHE``, ``CC``)."""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    from distgrad.signals import adam_native, histogram_native
    from distgrad.stats import native

    dist.barrier()
    mine = {}
    for name, kernel in (("dg_stats", native._kernel), ("dg_hist", histogram_native._kernel),
                         ("dg_adam", adam_native._kernel)):
        fn = kernel()
        mine[name] = None if fn is None else {"path": fn._path, "built": bool(fn._built)}
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, mine)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(reports, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
