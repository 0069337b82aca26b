"""Plain helpers shared by test modules (import ``from tests.helpers import ...``): the repository
paths, a free loopback port, and the launcher of the multi-rank drivers in ``tests/dist``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from launch.dist_env import free_port  # a port below the ephemeral range: see its docstring

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "tests" / "dist"


def example_train(name: str = "example_train"):
    """The example job's script launch/train.py imported as a module named ``name`` (not put in
    ``sys.modules``), for the tests of its model (``GPT``, ``to_float8``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "launch" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def example_step(model, opt, dg, handles: list, batch: int):
    """One training step of the example job's ``GPT`` (launch/train.py, vocabulary 256, block 16)
    instrumented by ``dg``: tokens and targets int64 ``[batch, 16]`` in [0, 256) drawn from torch's
    global generator, forward (the model returns the loss), backward, ``opt.step()``; then the
    test's own hooks ``handles`` are removed and ``dg`` closed. Returns the step's record
    (:class:`distgrad.record.StepRecord`); AssertionError unless exactly one was recorded."""
    import torch

    recs: list = []
    dg.add_hook(recs.append)
    idx = torch.randint(0, 256, (batch, 16))
    model(idx, torch.randint(0, 256, (batch, 16))).backward()
    opt.step()
    for h in handles:
        h.remove()
    dg.close()
    (rec,) = recs
    return rec


def launch(script: str, out: Path, *args: str, nproc: int = 2, timeout: int = 900,
           launcher: str = "torchrun", env: dict | None = None) -> dict:
    """Run the driver ``tests/dist/<script>`` (``"ds_cases.py"`` or ``"ds_cases"``) on ``nproc``
    CPU ranks (gloo) as the module ``tests.dist.<name>`` (``torchrun -m`` from the repository
    root, so the driver imports ``tests.dist.common`` like any test module, without editing
    ``sys.path``) and return the JSON it wrote to ``out``.

    Raises AssertionError with the tail of the output when the launch fails; ValueError for a
    launcher other than torchrun."""
    e = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
             MASTER_ADDR="127.0.0.1")
    e.update(env or {})
    module = "tests.dist." + script.removesuffix(".py")
    bindir = Path(sys.executable).parent
    if launcher == "torchrun":
        cmd = [str(bindir / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", module, "--out", str(out), *args]
    else:
        raise ValueError(launcher)
    p = subprocess.run(cmd, env=e, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 or not out.exists():
        raise AssertionError(f"{script} failed (rc={p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return json.loads(out.read_text())
