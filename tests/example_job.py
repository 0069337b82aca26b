"""Running the example job (launch/train.py) under the deepspeed launcher from tests, and
scraping its /metrics: shared by the example-job and end-to-end monitoring tests."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent


def start_example(port: int, *args: str, nproc: int = 2, log: Path | None = None,
                  launcher: str = "deepspeed") -> subprocess.Popen:
    """Start ``launch/train.py --port <port> ...`` on ``nproc`` CPU ranks under ``launcher``:
    ``deepspeed`` (``deepspeed --num_gpus``), ``torchrun`` (``--nproc_per_node``) or ``mpirun``
    (``-np``, loopback only, as root where needed)."""
    from tests.helpers import free_port

    bindir = Path(sys.executable).parent
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PATH=f"{bindir}:{os.environ.get('PATH', '')}")
    script = [str(ROOT / "launch" / "train.py"), "--port", str(port), *args]
    if launcher == "deepspeed":
        cmd = [str(bindir / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), *script]
    elif launcher == "torchrun":
        cmd = [str(bindir / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *script]
    elif launcher == "mpirun":
        cmd = ["mpirun", "-np", str(nproc), "--oversubscribe", "--mca", "btl", "self,vader",
               "--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo",
               "-x", "PATH", "-x", "DS_ACCELERATOR", "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED",
               *(["--allow-run-as-root"] if os.geteuid() == 0 else []), sys.executable, *script]
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    else:
        raise ValueError(launcher)
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Terminate the launcher and its ranks (its own process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, 9)
            proc.wait(10)


def scrape(port: int) -> dict[tuple[str, tuple], float] | None:
    """Parse http://127.0.0.1:<port>/metrics with prometheus_client's parser; None if not up."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except (urllib.error.URLError, ConnectionError, OSError):
        return None
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wait_for(pred, proc: subprocess.Popen, timeout: float, what: str, log: Path | None = None):
    """Poll ``pred()`` (returns a truthy value when done) every 0.2 s until ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if proc.poll() is not None and proc.returncode != 0:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise AssertionError(f"example job exited with {proc.returncode} while waiting for {what}\n{tail}")
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tail}")


def value(m: dict, name: str, **labels: str) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def step_at_least(port: int, n: int):
    def pred():
        m = scrape(port)
        if m and ("distgrad_optimizer_step", ()) in m and m[("distgrad_optimizer_step", ())] >= n:
            return m
        return None
    return pred


def finite(x: float) -> bool:
    return math.isfinite(x)
