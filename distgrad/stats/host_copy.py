"""A device-to-host copy that does not block the calling thread: the asynchronous record mode.

On CUDA the tensor is copied with ``non_blocking=True`` into pinned (page-locked) host memory
on the current stream, and a CUDA event is recorded after the copy; :meth:`HostCopy.ready`
asks the event without waiting, :meth:`HostCopy.wait` waits for it (normally already
complete: the instrument reads a sampled step's copy only at the next optimizer-step boundary,
one step of GPU work later). On CPU the data already is in host memory: no copy, always ready.
"""

from __future__ import annotations

import numpy as np
import torch


class HostCopy:
    """The float64 result of a sampled step on its way to host memory.

    Args:
        t: any tensor (the packed reduced blocks: float64 ``[sum_size + max_size]``). On CUDA
            it may be reused or freed by the caller afterwards (the caching allocator keeps its
            memory for the queued copy).
    """

    def __init__(self, t: torch.Tensor) -> None:
        self.event = None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t.detach()

    def ready(self) -> bool:
        """Whether the copy has completed (never waits)."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> np.ndarray:
        """The host array (a numpy view of the host copy); waits for the copy if it has not
        completed yet (``cudaEventSynchronize``)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()
