"""The example job under the other launchers: torchrun with DDP, FSDP1 and FSDP2, and mpirun
(ranks discovered from MPI by launch/dist_env.py) with DeepSpeed. Each serves /metrics from rank
0 with the right engine label, world size 2, and finite pre-clip gradient norms."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import free_port
from tests.example_job import finite, start_example, step_at_least, stop, value, wait_for

pytestmark = pytest.mark.multirank
SMALL = ["--layers", "2", "--width", "64", "--heads", "2", "--block", "32", "--log-every", "2", "--hold", "60"]


@pytest.mark.parametrize("launcher,engine,label", [
    ("torchrun", "ddp", "ddp"), ("torchrun", "fsdp1", "fsdp1"), ("torchrun", "fsdp2", "fsdp2"),
    ("mpirun", "deepspeed", "deepspeed"),
])
def test_example_trains_and_serves_under_launcher(tmp_path, launcher, engine, label):
    if launcher == "mpirun" and shutil.which("mpirun") is None:
        pytest.fail("mpirun is missing: scripts/setup_env.sh installs openmpi-bin")
    port, log = free_port(), tmp_path / "train.log"
    proc = start_example(port, "--engine", engine, "--steps", "8", *SMALL, log=log, launcher=launcher)
    try:
        m = wait_for(step_at_least(port, 5), proc, 240, "step 5", log)
        info = [dict(k[1]) for k in m if k[0] == "distgrad_info"]
        assert info and info[0]["engine"] == label, info
        assert value(m, "distgrad_world_size") == 2
        g = value(m, "distgrad_grad_norm")
        assert finite(g) and g > 0
        # read before clipping (clip at 1.0 in the config): the ratio says how much was cut
        clip = value(m, "distgrad_clip_ratio")
        assert 0 < clip <= 1 and clip == pytest.approx(min(1.0, 1.0 / (g + 1e-6)), rel=1e-6)
        assert value(m, "distgrad_internal_errors_total") == 0
        assert value(m, "distgrad_nonfinite_steps_total") == 0
        assert finite(value(m, "distgrad_loss"))
    finally:
        stop(proc)
    text = log.read_text()
    assert "world 2 (mpi)" in text if launcher == "mpirun" else "world 2 (env)" in text


def test_example_trains_fsdp2_with_tensor_parallel_on_4_ranks(tmp_path):
    """``torchrun --nproc_per_node 4 launch/train.py --engine fsdp2 --tp 2``: a (dp, tp) mesh with
    the MLPs column/row parallel. distgrad serves the whole model, and its pre-clip global norm
    equals the norm the example's own clipping computes from the DTensor placements (printed as
    "clip norm" on every logged step)."""
    import re

    port, log = free_port(), tmp_path / "train.log"
    proc = start_example(port, "--engine", "fsdp2", "--tp", "2", "--steps", "6", *SMALL[:-2], "--log-every", "1",
                         "--hold", "60", log=log, launcher="torchrun", nproc=4)
    try:
        m = wait_for(step_at_least(port, 3), proc, 300, "step 3", log)
        assert value(m, "distgrad_world_size") == 4
        assert value(m, "distgrad_internal_errors_total") == 0
        assert value(m, "distgrad_replica_mismatch_total") == 0
        assert finite(value(m, "distgrad_grad_norm"))
    finally:
        stop(proc)
    text = log.read_text()
    assert "FSDP2 fp32 x TP 2, world 4 (env)" in text
    pairs = re.findall(r"grad_norm ([0-9.]+) \(clip norm ([0-9.e+-]+)\)", text)
    assert len(pairs) >= 3, text[-3000:]
    for ours, theirs in pairs:
        assert float(ours) == pytest.approx(float(theirs), rel=1e-4, abs=6e-5)  # ours printed with 4 decimals
