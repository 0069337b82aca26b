"""Statistics core: per-parameter sufficient statistics of local gradient pieces, packed into
two float64 tensors and combined across ranks with exactly two collectives (one SUM, one MAX),
then copied to the host once.

Knows nothing about engines: an engine adapter (``distgrad.engines``) hands it, per trainable
parameter, the 1-D piece of the reduced gradient that this rank holds (or None).

Kernels (chosen per piece; ``DISTGRAD_STATS_KERNEL=auto|native|compile|eager|triton``, default
auto; :func:`kernel_use` counts the pieces each one computed):

- ``triton`` (auto on CUDA, ``distgrad.stats.triton_kernel``): one fused Triton kernel for all
  contiguous fp32/bf16/fp16 pieces of a step (one launch per dtype present plus one combine
  launch), reading a table of piece addresses, fp32 lanes combined in float64 in a fixed order
  (results independent of the launch grid). Checked against float64 on first use per device;
  without triton (``pip install distgrad[gpu]``), or if the check or a launch fails, the eager
  kernel is used (logged once). On CPU tensors only under ``TRITON_INTERPRET=1`` (tests).

- ``native`` (auto on CPU for fp32 and bf16 pieces): one C function, compiled once per machine
  with the system C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``; about 0.2 s) into the kernel
  cache (``distgrad.stats.cbuild``; ranks starting together compile once) and loaded with ctypes, reads every piece
  once and produces all statistics in that single pass, for all pieces in one call (threads:
  ``torch.get_num_threads()``, results independent of the thread count). It is checked
  against float64 references on load; if there is no compiler, compilation fails or the check fails,
  the eager kernel is used (logged once). Accuracy: fp32 lane accumulators over chunks of 2048
  elements (128 additions per lane: worst case ~8e-6 relative on a sum of squares; measured 2e-8
  to 5e-8 on gradients and on heavy-tailed data), chunks and blocks combined in float64.
- ``compile``: the same statistics as one ``torch.compile``-d reduction per piece (Triton on
  CUDA, C++ on CPU), eager on any compilation failure. Not the default anywhere yet: it has
  only been measured on CPU, where ``native`` is faster (see docs/performance.md).
- ``eager`` (auto for fp64 and non-contiguous pieces, and on CUDA without triton): about ten
  torch kernels per piece. fp32
  ``torch._foreach_norm`` / ``vector_norm`` reach ~1e-3 relative error on 13M elements on this
  project's CPU build (``docs/engines.md``), so they are not used: the sum uses torch's
  cascade ``sum`` in fp32 (~1e-8 relative to sum |g|) and the sum of squares fp32 dot products
  over chunks of 2**16 elements accumulated in float64 (~4e-8 to 3e-7 relative on gradients,
  up to ~1e-5 on heavy-tailed data).

Extrema and counts are exact in every kernel. All partial results are float64 from the packing
on, and integer counts are exact below 2**53.
"""

from distgrad.stats.checksum import replica_checksum  # noqa: F401
from distgrad.stats.core import (  # noqa: F401
                                 Reduced,
                                 error_blocks,
                                 global_norm,
                                 pack_local,
                                 reduce_blocks,
                                 reduce_blocks_async,
                                 replica_outliers,
                                 unpack,
)
from distgrad.stats.eager import _piece_stats_eager, sum_of_squares  # noqa: F401
from distgrad.stats.host_copy import HostCopy  # noqa: F401
from distgrad.stats.kernels import _KERNELS, kernel_use, piece_stats, set_stats_kernel, stats_kernel, stats_table  # noqa: F401
from distgrad.stats.layout import CULPRIT_GRAD, CULPRIT_LOSS, MAX_COLS, RANK_COLS, SUM_COLS, TAIL_COLS, Layout  # noqa: F401
from distgrad.stats.native import _call_native, _native  # noqa: F401

__all__ = ["SUM_COLS", "MAX_COLS", "RANK_COLS", "TAIL_COLS", "CULPRIT_LOSS", "CULPRIT_GRAD", "replica_checksum",
           "Layout", "Reduced", "sum_of_squares",
           "piece_stats", "stats_table", "set_stats_kernel", "stats_kernel", "kernel_use", "pack_local", "error_blocks",
           "reduce_blocks", "reduce_blocks_async", "HostCopy", "unpack", "global_norm", "replica_outliers"]
