"""The packed-signal framework (distgrad.signals) on one process: a signal's parts ride in the
step's collectives and come back to its ``finish`` exactly, a signal whose local part raises is
dropped for that step (counted) without disturbing the core statistics or the other signals,
and synchronous and asynchronous records give the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import distgrad
from distgrad.signals import FACTORIES, PackedSignal


class _AbsSum(PackedSignal):
    """Test signal: per parameter sum |g| (SUM) and max |g| (MAX), unscaled."""

    name = "test_abs"

    def __init__(self, n: int, fail_at: set[int]) -> None:
        self.n, self.fail_at, self.calls, self.out = n, fail_at, 0, {}

    @property
    def sum_size(self) -> int:
        return self.n

    @property
    def max_size(self) -> int:
        return self.n

    def local(self, inst, pieces, device):
        self.calls += 1
        if self.calls in self.fail_at:
            raise RuntimeError("injected")
        s = torch.stack([p.detach().double().abs().sum() if p is not None else torch.zeros((), dtype=torch.float64)
                         for p in pieces])
        m = torch.stack([p.detach().double().abs().max() if p is not None and p.numel()
                         else torch.tensor(-float("inf"), dtype=torch.float64) for p in pieces])
        return s.to(device), m.to(device)

    def finish(self, inst, rec, sum_part, max_part, grad_scale):
        self.out[rec.step] = (sum_part / grad_scale, max_part / grad_scale)


@pytest.fixture
def abs_signal():
    made: list[_AbsSum] = []

    def factory(inst):
        sig = _AbsSum(len(inst.names), fail_at={2})
        made.append(sig)
        return sig

    FACTORIES.append(("test_abs", factory))
    try:
        yield made
    finally:
        FACTORIES.remove(("test_abs", factory))


@pytest.mark.parametrize("async_records", ["off", "on"])
def test_signal_parts_round_trip_and_a_failing_signal_is_dropped(abs_signal, async_records):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": async_records})
    sig = abs_signal[-1]
    expected = {}
    recs = []
    dg.add_hook(recs.append)
    for step in range(4):  # distgrad's optimizer steps count from 0
        loss = m(torch.randn(6, 4)).pow(2).mean()
        loss.backward()
        expected[step] = [p.grad.detach().double().abs() for p in m.parameters()]
        opt.step()
        opt.zero_grad()
    dg.close()
    assert sorted(r.step for r in recs) == [0, 1, 2, 3]  # the core record of every step, step 1 included
    assert sorted(sig.out) == [0, 2, 3]  # step 1 (2nd call, failing) is dropped for this signal only
    for step, (s, mx) in sig.out.items():
        np.testing.assert_allclose(s, [g.sum().item() for g in expected[step]], rtol=1e-12)
        np.testing.assert_allclose(mx, [g.max().item() for g in expected[step]], rtol=1e-12)
    assert dg.counters["internal_errors"] == 1


class _Lifecycle(PackedSignal):
    """Test signal recording its attach / skip / local / after_step calls."""

    name = "test_lifecycle"

    def __init__(self) -> None:
        self.calls: list = []

    @property
    def sum_size(self) -> int:
        return 1

    def attach(self, inst, module):
        self.calls.append(("attach", type(module).__name__))
        return lambda: self.calls.append(("undo",))

    def skip(self, inst, step):
        self.calls.append(("skip", step))

    def local(self, inst, pieces, device):
        self.calls.append(("local",))
        return torch.zeros(1, dtype=torch.float64, device=device), None

    def after_step(self, inst, step_applied):
        self.calls.append(("after_step",))

    def finish(self, inst, rec, sum_part, max_part, grad_scale):
        self.calls.append(("finish", rec.step))


def test_signal_attach_gets_the_module_skip_runs_on_unsampled_steps_and_the_undo_at_close():
    made: list[_Lifecycle] = []

    def factory(inst):
        made.append(_Lifecycle())
        return made[-1]

    FACTORIES.append(("test_lifecycle", factory))
    try:
        m = nn.Sequential(nn.Linear(3, 2))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, sampling={"interval": 2},
                                 statistics={"async_records": "off"})
        for _ in range(3):
            m(torch.randn(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        dg.close()
    finally:
        FACTORIES.remove(("test_lifecycle", factory))
    assert made[-1].calls == [("attach", "Sequential"), ("local",), ("after_step",), ("finish", 0), ("skip", 1),
                              ("local",), ("after_step",), ("finish", 2), ("undo",)]
