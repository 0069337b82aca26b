"""Rank discovery for the example job under the three launchers it supports.

- ``deepspeed`` launcher and ``torchrun`` set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``: used as they are.
- ``mpirun`` (Open MPI, MPICH): the ranks are discovered with mpi4py (``COMM_WORLD`` rank and
  size; the local rank from a split by shared-memory node), falling back to Open MPI's
  ``OMPI_COMM_WORLD_*`` variables. ``MASTER_ADDR`` is 127.0.0.1 when every rank runs on one host
  (so nothing leaves loopback) and rank 0's host name otherwise; ``MASTER_PORT`` is agreed on
  by a broadcast from rank 0 (or ``MASTER_PORT`` if set). DeepSpeed's own
  ``init_distributed(auto_mpi_discovery=True)`` would take the address from ``hostname -I``,
  which is not loopback on a single host.
"""

from __future__ import annotations

import os
import socket


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux
    ``/proc/sys/net/ipv4/ip_local_port_range``; IANA's 49152-65535 elsewhere)."""
    try:
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nobody listens on now, chosen *outside* the ephemeral range.

    Binding to port 0 would return a port from the ephemeral range, and until the caller binds it
    again any outgoing connection (a gloo pair, a TCPStore client, a scrape) may take it as its
    local port: a launched job then fails with "Address already in use". A random port below
    that range (and away from the launchers' default 29500) is never handed out that way; one
    that is taken now is skipped. Raises OSError if no port in the range can be bound."""
    import random

    lo, hi = _ephemeral_range()
    start, stop = (20000, min(lo, 65536)) if lo > 21000 else (max(hi + 1, 1024), 65536)
    candidates = [p for p in range(start, stop) if not 29400 <= p < 29600]
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port on {host} in {start}-{stop - 1}")


def discover() -> str:
    """Fill the torch.distributed environment variables; returns the launcher's name
    (``"env"`` when they were already set, ``"mpi"`` when discovered from MPI, ``"single"``)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", "0")
        return "env"
    if any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        try:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
            rank, size = comm.Get_rank(), comm.Get_size()
            local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
            hosts = comm.allgather(socket.gethostname())
            port = comm.bcast(int(os.environ.get("MASTER_PORT", 0)) or free_port(), root=0)
        except ImportError:  # mpi4py missing: Open MPI's variables
            rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
            size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
            local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
            hosts = [socket.gethostname()] if int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)) == size \
                else ["?", "??"]
            port = int(os.environ.get("MASTER_PORT", 29500))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local), MASTER_PORT=str(port))
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        return "mpi"
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    return "single"
