"""Small facts the instrument's modules share, below all of them in the import order: whether a
default process group is up, and the dtype names exported as the ``dtype`` label."""

from __future__ import annotations

import torch
import torch.distributed as dist

#: torch dtype -> the short name exported in ``distgrad_info{dtype}`` and the record's
#: ``grad_dtype``; other dtypes are exported as ``str(dtype)``
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def dist_ready() -> bool:
    """Whether ``torch.distributed`` is available and its default process group initialised."""
    return dist.is_available() and dist.is_initialized()
