"""Shared test helpers: launching multi-rank drivers once per session."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "tests" / "dist"


def load_grafana(name: str):
    """The module ``grafana.<name>`` of the monitoring mixin (build, alerts, config, queries,
    dashboards...): a package at the repository root, not part of the installed distgrad."""
    import importlib

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"grafana.{name}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, out: Path, *args: str, nproc: int = 2, timeout: int = 900,
           launcher: str = "torchrun", env: dict | None = None) -> dict:
    """Run ``tests/dist/<script>`` on ``nproc`` CPU ranks (gloo) and return its JSON output.

    Raises AssertionError with the tail of the output when the launch fails."""
    e = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
             MASTER_ADDR="127.0.0.1")
    e.update(env or {})
    bindir = Path(sys.executable).parent
    if launcher == "torchrun":
        cmd = [str(bindir / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(DIST / script), "--out", str(out), *args]
    else:
        raise ValueError(launcher)
    p = subprocess.run(cmd, env=e, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 or not out.exists():
        raise AssertionError(f"{script} failed (rc={p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def ds_results(tmp_path_factory):
    """All DeepSpeed reference cases, run once in one 2-rank launch."""
    out = tmp_path_factory.mktemp("ds") / "ds_cases.json"
    return launch("ds_cases.py", out)


@pytest.fixture(scope="session")
def torch_results(tmp_path_factory):
    """All DDP / FSDP1 / FSDP2 reference cases, run once in one 2-rank launch."""
    out = tmp_path_factory.mktemp("torch") / "torch_cases.json"
    return launch("torch_cases.py", out)


@pytest.fixture(scope="session")
def diag_results(tmp_path_factory):
    """The diagnostics cases (faults, fp16 overflow, bf16), one 2-rank launch."""
    out = tmp_path_factory.mktemp("diag") / "diag.json"
    return launch("diag_cases.py", out)
