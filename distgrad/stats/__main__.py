"""``python -m distgrad.stats --prebuild``: compile distgrad's native CPU kernels into the kernel
cache (:func:`distgrad.stats.cbuild.cache_dir`, relocated with ``$DISTGRAD_KERNEL_CACHE``) and
self-check them, e.g. at install time or once per node image, so that training processes load
them without compiling. Prints one line per kernel (cache path, built or already cached);
exit status 0 when every kernel is available, 1 otherwise."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distgrad.stats",
                                description="Build distgrad's native CPU kernels into the kernel cache.")
    p.add_argument("--prebuild", action="store_true", required=True,
                   help="compile (if not cached) and self-check every native kernel")
    p.parse_args(argv)
    from distgrad.signals import adam_native, histogram_native
    from distgrad.stats import cbuild, native

    print(f"kernel cache: {cbuild.cache_dir()}")
    ok = True
    for name, kernel in (("dg_stats", native._kernel), ("dg_hist", histogram_native._kernel),
                         ("dg_adam", adam_native._kernel)):
        fn = kernel()
        if fn is None:
            ok = False
            print(f"{name}: unavailable (see the warning above); the torch path is used")
        else:
            where = fn._path or "temporary directory (cache not writable)"
            print(f"{name}: {where} ({'built' if fn._built else 'cached'}), self-check passed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
