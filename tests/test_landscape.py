"""distgrad.report.landscape on one process: slices of a quadratic against the closed form, filter
normalisation against a direct per-row computation, bit-identical restore (also after an error),
and the CLI. The multi-rank cases (DDP, FSDP2, ZeRO-3 against the one-process slice) are in
tests/test_landscape_multirank.py."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

from distgrad.report import landscape as ls
from distgrad.cli import main as cli_main


class Quadratic(nn.Module):
    """theta = (W [3, 4], b [3], C [2, 3, 2]) flattened (27 float64); the loss of batch (A, c) is
    0.5 theta^T A theta + c^T theta, so over batches the Hessian is mean(A) and the gradient
    mean(A) theta + mean(c)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.W = nn.Parameter(torch.randn(3, 4, generator=g, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(3, generator=g, dtype=torch.float64))
        self.C = nn.Parameter(torch.randn(2, 3, 2, generator=g, dtype=torch.float64) * 3)
        self.C.data[1] *= 0.01  # filters of very different norms

    def theta(self) -> torch.Tensor:
        return torch.cat([self.W.reshape(-1), self.b, self.C.reshape(-1)])


def quad_loss(model: Quadratic, batch) -> torch.Tensor:
    a, c = batch
    t = model.theta()
    return 0.5 * t @ a @ t + c @ t


def quad_batches(n: int = 3) -> list:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        m = torch.randn(27, 27, generator=g, dtype=torch.float64)
        out.append((m @ m.T / 27 - 0.3 * torch.eye(27, dtype=torch.float64), torch.randn(27, generator=g, dtype=torch.float64)))
    return out


def direct_direction(model: Quadratic, seed: int, k: int, one_d: str) -> torch.Tensor:
    """The filter-normalised direction computed row by row (Li et al.'s loop), flattened as theta."""
    parts = []
    for name, p in model.named_parameters():
        w = p.detach()
        if w.dim() <= 1:
            parts.append(torch.zeros_like(w) if one_d == "zero" else w.clone())
            continue
        d = ls.raw_direction(name, w.shape, seed, k)
        for j in range(w.shape[0]):
            d[j] = d[j] * (w[j].norm() / (d[j].norm() + 1e-10))
        parts.append(d.reshape(-1))
    return torch.cat(parts)


def snapshot(model: nn.Module) -> list[bytes]:
    return [p.detach().numpy().tobytes() for p in model.parameters()]


@pytest.mark.parametrize("one_d", ["zero", "weights"])
def test_filter_normalisation_matches_direct(one_d):
    model = Quadratic()
    land = ls.Landscape(model, seed=5, n_dirs=2, one_d=one_d)
    for k in range(2):
        got = torch.cat([pieces[0].reshape(-1) for pieces in land.dirs[k]])
        want = direct_direction(model, 5, k, one_d)
        torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
        # each filter of a >= 2-D parameter has its weight filter's norm
        W = got[:12].reshape(3, 4)
        torch.testing.assert_close(W.norm(dim=1), model.W.detach().norm(dim=1), rtol=1e-9, atol=0)  # the 1e-10 guard
    d0 = torch.cat([p[0].reshape(-1) for p in land.dirs[0]])
    d1 = torch.cat([p[0].reshape(-1) for p in land.dirs[1]])
    assert not torch.allclose(d0[:12], d1[:12])  # two different directions
    # another seed gives another direction; the same seed the same one
    other = ls.Landscape(model, seed=6, n_dirs=1, one_d=one_d)
    assert not torch.allclose(torch.cat([p[0].reshape(-1) for p in other.dirs[0]])[:12], d0[:12])
    again = ls.Landscape(model, seed=5, n_dirs=1, one_d=one_d)
    assert torch.equal(torch.cat([p[0].reshape(-1) for p in again.dirs[0]]), d0)


@pytest.mark.parametrize("one_d", ["zero", "weights"])
def test_slice_1d_matches_closed_form(one_d):
    model = Quadratic()
    batches = quad_batches()
    before = snapshot(model)
    res = ls.slice_1d(model, quad_loss, batches, steps=9, span=2.0, seed=7, one_d=one_d)
    assert snapshot(model) == before
    H = torch.stack([a for a, _ in batches]).mean(0)
    c = torch.stack([c for _, c in batches]).mean(0)
    t = model.theta().detach()
    L0 = (0.5 * t @ H @ t + c @ t).item()
    g = H @ t + c
    d = direct_direction(model, 7, 0, one_d)
    want = L0 + res.alphas * (g @ d).item() + res.alphas ** 2 / 2 * (d @ H @ d).item()
    np.testing.assert_allclose(res.alphas, np.linspace(-2, 2, 9))
    np.testing.assert_allclose(res.loss, want, rtol=1e-12, atol=1e-12)
    assert res.center == pytest.approx(L0, rel=1e-13)
    assert res.betas is None and res.meta["dims"] == 1 and res.meta["seed"] == 7


def test_slice_2d_matches_closed_form():
    model = Quadratic()
    batches = quad_batches(2)
    before = snapshot(model)
    res = ls.slice_2d(model, quad_loss, batches, steps=(5, 4), span=(1.0, 0.5), seed=1)
    assert snapshot(model) == before
    H = torch.stack([a for a, _ in batches]).mean(0)
    c = torch.stack([c for _, c in batches]).mean(0)
    t = model.theta().detach()
    g = H @ t + c
    d1, d2 = direct_direction(model, 1, 0, "zero"), direct_direction(model, 1, 1, "zero")
    a, b = np.meshgrid(res.alphas, res.betas, indexing="ij")
    want = ((0.5 * t @ H @ t + c @ t).item() + a * (g @ d1).item() + b * (g @ d2).item()
            + 0.5 * (a * a * (d1 @ H @ d1).item() + 2 * a * b * (d1 @ H @ d2).item() + b * b * (d2 @ H @ d2).item()))
    assert res.loss.shape == (5, 4)
    np.testing.assert_allclose(res.loss, want, rtol=1e-12, atol=1e-12)
    d = res.to_dict()
    assert len(d["loss"]) == 5 and len(d["loss"][0]) == 4 and d["dims"] == 2


def test_restores_bit_identical_after_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 2)).to(torch.bfloat16)
    before = snapshot(model.float())  # float copy of the bf16 values is exact
    model = model.to(torch.bfloat16)
    calls = []

    def loss_fn(m, x):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return m(x).float().pow(2).mean()

    with pytest.raises(RuntimeError, match="boom"):
        ls.slice_1d(model, loss_fn, [torch.randn(3, 5, dtype=torch.bfloat16)], steps=5, span=0.5)
    assert snapshot(model.float()) == before


def test_bad_arguments():
    model = Quadratic()
    with pytest.raises(ValueError, match="one_d"):
        ls.slice_1d(model, quad_loss, quad_batches(1), one_d="keep")
    with pytest.raises(ValueError, match="steps"):
        ls.slice_1d(model, quad_loss, quad_batches(1), steps=0)
    with pytest.raises(ValueError, match="no batches"):
        ls.slice_1d(model, quad_loss, [], steps=3)


def test_cli_writes_json_and_png(tmp_path, monkeypatch):
    mod = tmp_path / "lsfactory.py"
    mod.write_text(
        "import torch, torch.nn as nn\n"
        "def build(checkpoint=None):\n"
        "    torch.manual_seed(0)\n"
        "    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))\n"
        "    if checkpoint: m.load_state_dict(torch.load(checkpoint))\n"
        "    g = torch.Generator().manual_seed(1)\n"
        "    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]\n"
        "    return m, (lambda model, b: nn.functional.cross_entropy(model(b[0]), b[1])), batches\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("lsfactory", None)
    import lsfactory

    m, loss_fn, batches = lsfactory.build()
    for p in m.parameters():
        p.data.mul_(1.5)  # a "trained" checkpoint that differs from the factory's initial weights
    torch.save(m.state_dict(), tmp_path / "ckpt.pt")
    want = ls.slice_1d(m, loss_fn, batches, steps=7, span=0.8, seed=3)
    out = tmp_path / "out"
    rc = cli_main(["landscape", "lsfactory:build", "--checkpoint", str(tmp_path / "ckpt.pt"), "-o", str(out),
                   "--steps", "7", "--span", "0.8", "--seed", "3"])
    assert rc == 0
    got = json.loads((out / "landscape.json").read_text())
    np.testing.assert_allclose(got["loss"], want.loss, rtol=1e-12)
    assert got["center"] == pytest.approx(want.center, rel=1e-12)
    assert (out / "landscape.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc = cli_main(["landscape", "lsfactory:build", "-o", str(out), "--2d", "--steps", "4", "--span", "0.5"])
    assert rc == 0
    got = json.loads((out / "landscape.json").read_text())
    assert np.asarray(got["loss"]).shape == (4, 4) and got["dims"] == 2
    assert cli_main(["landscape", "lsfactory:nothing", "-o", str(out)]) == 1


def test_cli_console_script_imports_the_factory_from_the_working_directory(tmp_path):
    """What a user types: the installed ``distgrad`` console script, run in the directory that
    holds the factory's package (a console script's sys.path lacks that directory)."""
    import os
    import subprocess
    from pathlib import Path

    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "landscape.py").write_text(
        "import torch, torch.nn as nn\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    m = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))\n"
        "    g = torch.Generator().manual_seed(2)\n"
        "    batches = [torch.randn(6, 3, generator=g) for _ in range(2)]\n"
        "    return m, (lambda model, b: model(b).pow(2).mean()), batches\n")
    script = Path(sys.executable).parent / "distgrad"
    assert script.exists(), script
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    p = subprocess.run([str(script), "landscape", "mypkg.landscape:build", "-o", "out", "--steps", "5", "--span", "0.5"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    g = torch.Generator().manual_seed(2)
    want = ls.slice_1d(m, lambda model, b: model(b).pow(2).mean(), [torch.randn(6, 3, generator=g) for _ in range(2)],
                       steps=5, span=0.5, seed=0)
    got = json.loads((tmp_path / "out" / "landscape.json").read_text())
    np.testing.assert_allclose(got["loss"], want.loss, rtol=1e-12)
