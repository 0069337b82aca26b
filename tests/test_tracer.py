import json
import math

import pytest
import torch
from torch import nn

from distgrad.diagnostics.tracer import OverflowTracer, render_report


class Tiny(nn.Module):
    def __init__(self, huge: float = 1e38):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 2)
        with torch.no_grad():
            self.fc1.weight.fill_(0.5)
            self.fc1.bias.zero_()
            self.fc2.weight.fill_(huge)  # 8 * 2.0 * 1e38 overflows float32
            self.fc2.bias.zero_()

    def forward(self, x):
        return self.fc3(self.fc2(self.act(self.fc1(x))))


def all_hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_finds_first_module_producing_inf():
    m = Tiny()
    x = torch.ones(3, 4)
    tr = OverflowTracer(m, max_micro_batches=4).arm()
    y = m(x)
    assert not torch.isfinite(y).all()
    rep = tr.report()
    ev = rep["event"]
    assert ev["kind"] == "nonfinite_output"
    assert ev["module"] == "fc2" and ev["type"] == "Linear"
    assert ev["micro_batch"] == 0 and ev["call"] == 2 and ev["where"] == "output"
    assert ev["nonfinite"] == 3 * 8 and math.isinf(ev["abs_max"])
    # frames: children complete in order fc1, act, fc2; frozen at the event
    assert [f["module"] for f in rep["frames"]] == ["fc1", "act", "fc2"]
    # the event disarms the tracer at the end of that micro-batch, hooks removed
    assert not tr.armed and rep["micro_batches_traced"] == 1 and all_hooks(m) == 0
    # values against direct computation
    f1 = rep["frames"][0]
    w = {e["where"]: e for e in f1["weights"]}
    assert w["weight"]["abs_min"] == 0.5 and w["weight"]["abs_max"] == 0.5
    assert w["bias"]["abs_max"] == 0.0 and w["weight"]["nonfinite"] == 0
    out1 = m.fc1(x)
    assert f1["outputs"][0]["abs_max"] == pytest.approx(out1.abs().max().item())
    assert f1["outputs"][0]["abs_min"] == pytest.approx(out1.abs().min().item())
    assert f1["inputs"][0]["where"] == "input[0]" and f1["inputs"][0]["shape"] == [3, 4]
    text = tr.render()
    assert "nonfinite_output in fc2 (Linear)" in text and "fc1 Linear" in text
    json.dumps(rep)  # NaN/inf allowed by json


def test_disarms_after_k_micro_batches():
    m = Tiny(huge=0.1)
    tr = OverflowTracer(m, max_micro_batches=3, max_frames=5)
    tr.arm()
    n_hooks = all_hooks(m)
    assert tr.armed and n_hooks == len(list(m.modules())) + 1
    for i in range(5):
        m(torch.randn(2, 4))
        assert tr.armed == (i < 2)
    rep = tr.report()
    assert rep["event"] is None and rep["micro_batches_traced"] == 3
    assert all_hooks(m) == 0
    # 5 frames per micro-batch (fc1, act, fc2, fc3, root) -> 15, keep last 5
    assert len(rep["frames"]) == 5 and rep["frames_dropped"] == 10
    assert [f["module"] for f in rep["frames"]] == ["fc1", "act", "fc2", "fc3", "<root>"]
    assert {f["micro_batch"] for f in rep["frames"]} == {2}
    assert "no non-finite" in render_report(rep)
    tr.disarm()  # idempotent


def test_abs_max_limit_and_nonfinite_weight():
    m = Tiny(huge=1e3)
    tr = OverflowTracer(m, max_micro_batches=1, abs_max_limit=1e4).arm()
    m(torch.ones(1, 4))
    ev = tr.report()["event"]
    assert ev["kind"] == "abs_max_output" and ev["module"] == "fc2"
    assert ev["abs_max"] == pytest.approx(8 * 2.0 * 1e3)
    m2 = Tiny(huge=0.1)
    with torch.no_grad():
        m2.fc3.weight[0, 0] = float("nan")
    with OverflowTracer(m2, max_micro_batches=2) as tr2:
        m2(torch.ones(1, 4))
    ev2 = tr2.report()["event"]
    assert ev2["module"] == "fc3" and ev2["kind"] == "nonfinite_output"
    assert all_hooks(m2) == 0


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.inner = Inner()

    def forward(self, x, mask=None, flag=True):
        h = self.lin(x)
        out = self.inner(h, scale=torch.tensor(float("inf")), tag="t")
        return {"logits": out[0], "aux": out[1], "n": 3}


class Inner(nn.Module):
    def forward(self, h, scale, tag):
        return (h * 1.0, {"y": h * scale, "meta": None}), [torch.arange(3)]


def test_tuple_dict_outputs_and_non_tensors():
    m = Structured()
    tr = OverflowTracer(m, max_micro_batches=1).arm()
    m(torch.ones(2, 3), mask=torch.ones(2, dtype=torch.bool), flag=False)
    rep = tr.report()
    ev = rep["event"]
    assert ev["module"] == "inner" and ev["where"] == "output[0][1].y"
    inner = [f for f in rep["frames"] if f["module"] == "inner"][0]
    wheres = [e["where"] for e in inner["outputs"]]
    assert wheres == ["output[0][0]", "output[0][1].y", "output[0][1].meta", "output[1][0]"]
    meta = inner["outputs"][2]
    assert meta["type"] == "NoneType"
    ints = inner["outputs"][3]
    assert ints["dtype"] == "int64" and "abs_max" not in ints
    in_w = [e["where"] for e in inner["inputs"]]
    assert in_w == ["input[0]", "input.scale", "input.tag"]
    text = tr.render()
    assert "not a tensor" in text and "inner Inner" in text


def test_exception_in_forward_and_calls_outside_root():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.fail = True

        def forward(self, x):
            y = self.lin(x)
            if self.fail:
                raise RuntimeError("boom")
            return y

    m = Boom()
    tr = OverflowTracer(m, max_micro_batches=2).arm()
    with pytest.raises(RuntimeError):
        m(torch.ones(1, 2))
    assert tr.micro_batches == 1 and tr.armed
    m.lin(torch.ones(1, 2))  # outside the root forward (e.g. recomputation): not recorded
    frames = tr.report()["frames"]
    assert [f["module"] for f in frames] == ["lin", "<root>"]
    assert frames[1]["error"] == "RuntimeError: boom"
    assert frames[1]["outputs"][0]["type"] == "NoneType"
    assert "forward raised RuntimeError: boom" in tr.render()
    m.fail = False
    m(torch.ones(1, 2))
    assert not tr.armed and tr.micro_batches == 2
    assert [f["module"] for f in tr.report()["frames"]] == ["lin", "<root>", "lin", "<root>"]
    assert "error" not in tr.report()["frames"][-1]
    # re-arming starts a fresh trace
    tr.arm(max_micro_batches=1)
    assert tr.report()["frames"] == [] and tr.armed
    m(torch.ones(1, 2))
    assert not tr.armed
    with pytest.raises(ValueError):
        OverflowTracer(m, max_micro_batches=0)
