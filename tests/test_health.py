import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from distgrad.diagnostics.health import (
    HealthReport,
    LayerHealth,
    UpdateRatioTracker,
    clip_ratio,
    post_clip_norm,
)

NAMES = ["embed.weight", "h.0.w", "h.1.w", "head.weight"]


def test_vanishing_after_patience_not_before():
    lh = LayerHealth(vanish_threshold=1e-8, explode_threshold=1e2, patience=3)
    healthy = np.array([1.0, 0.5, 0.5, 1.0])
    lh.update(NAMES, healthy)
    for k in range(1, 6):
        rep = lh.update(NAMES, np.array([1.0, 1e-9, 0.0, 1.0]))
        if k < 3:
            assert rep.vanishing == [], k
        else:
            assert rep.vanishing == ["h.0.w", "h.1.w"], k
        assert rep.exploding == [] and rep.n_vanishing == len(rep.vanishing)
    # one normal sample unflags, and the streak restarts from zero
    rep = lh.update(NAMES, np.array([1.0, 1e-3, 0.0, 1.0]))
    assert rep.vanishing == ["h.1.w"]
    lh.update(NAMES, np.array([1.0, 0.0, 0.0, 1.0]))
    rep = lh.update(NAMES, np.array([1.0, 0.0, 0.0, 1.0]))
    assert rep.vanishing == ["h.1.w"]
    rep = lh.update(NAMES, np.array([1.0, 0.0, 0.0, 1.0]))
    assert rep.vanishing == ["h.0.w", "h.1.w"]


def test_threshold_is_strict():
    lh = LayerHealth(vanish_threshold=1e-8, explode_threshold=10.0, patience=1)
    rep = lh.update(["a", "b"], np.array([1e-8, 10.0]))
    assert rep.vanishing == [] and rep.exploding == []
    rep = lh.update(["a", "b"], np.array([np.nextafter(1e-8, 0), np.nextafter(10.0, 11)]))
    assert rep.vanishing == ["a"] and rep.exploding == ["b"]


def test_exploding_and_nonfinite_are_separate():
    lh = LayerHealth(explode_threshold=100.0, patience=2)
    seq = [
        [1.0, 500.0, 1.0, 1.0],
        [1.0, np.nan, np.inf, 1.0],  # non-finite: neither extends nor resets
        [1.0, 500.0, 1.0, 1.0],
    ]
    reps = [lh.update(NAMES, np.array(s)) for s in seq]
    assert reps[0].exploding == [] and reps[1].exploding == []
    assert reps[1].nonfinite == ["h.0.w", "h.1.w"]
    assert reps[2].exploding == ["h.0.w"]
    assert reps[2].nonfinite == []
    assert reps[2].nonfinite_total == {"h.0.w": 1, "h.1.w": 1}
    json.dumps(reps[2].to_dict())
    # explode disabled
    lh2 = LayerHealth(explode_threshold=None, patience=1)
    assert lh2.update(["a"], np.array([1e30])).exploding == []


def test_names_change_and_absent_param_drops_streak():
    lh = LayerHealth(patience=2)
    lh.update(["a", "b", "c"], np.array([0.0, 0.0, 1.0]))
    # reordered, 'b' absent this sample, new 'd'
    rep = lh.update(["c", "a", "d"], np.array([1.0, 0.0, 0.0]))
    assert rep.vanishing == ["a"]
    rep = lh.update(["a", "b", "c", "d"], np.array([0.0, 0.0, 1.0, 0.0]))
    assert rep.vanishing == ["a", "d"]  # 'b' restarted from 0
    with pytest.raises(ValueError):
        lh.update(["a", "a"], np.array([0.0, 0.0]))
    with pytest.raises(ValueError):
        lh.update(["a"], np.array([0.0, 0.0]))


def test_health_state_roundtrip():
    lh = LayerHealth(patience=3)
    for _ in range(2):
        lh.update(NAMES, np.array([1.0, 0.0, np.nan, 1.0]))
    lh2 = LayerHealth(patience=3)
    lh2.load_state_dict(json.loads(json.dumps(lh.state_dict())))
    a = lh.update(NAMES, np.array([1.0, 0.0, 1.0, 1.0]))
    b = lh2.update(NAMES, np.array([1.0, 0.0, 1.0, 1.0]))
    assert a == b and a.vanishing == ["h.0.w"]
    assert isinstance(a, HealthReport)


def test_clip_ratio_values():
    assert clip_ratio(2.0, 1.0) == 0.5
    assert clip_ratio(0.5, 1.0) == 1.0
    assert clip_ratio(1.0, 1.0) == 1.0
    assert clip_ratio(0.0, 1.0) == 1.0
    assert clip_ratio(0.0, 1.0, eps=1e-6) == 1.0
    assert math.isnan(clip_ratio(float("nan"), 1.0))
    assert math.isnan(clip_ratio(float("inf"), 1.0))
    assert post_clip_norm(4.0, 1.0) == 1.0
    assert post_clip_norm(0.25, 1.0) == 0.25
    assert math.isnan(post_clip_norm(float("inf"), 1.0))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            clip_ratio(1.0, bad)
    with pytest.raises(ValueError):
        clip_ratio(-1.0, 1.0)


@pytest.mark.parametrize("scale", [0.1, 3.0, 1e4])
def test_clip_ratio_matches_torch_clip_grad_norm(scale):
    torch.manual_seed(0)
    ps = [
        nn.Parameter(torch.zeros(17, dtype=torch.float64)),
        nn.Parameter(torch.zeros(5, 3, dtype=torch.float64)),
    ]
    for p in ps:
        p.grad = torch.randn_like(p) * scale
    before = torch.sqrt(sum((p.grad**2).sum() for p in ps))
    norm = torch.nn.utils.clip_grad_norm_(ps, max_norm=1.0)
    after = torch.sqrt(sum((p.grad**2).sum() for p in ps))
    assert float(norm) == pytest.approx(float(before), rel=1e-15)
    r = clip_ratio(float(norm), 1.0, eps=1e-6)
    assert float(after / before) == pytest.approx(r, rel=1e-12)
    assert post_clip_norm(float(norm), 1.0, eps=1e-6) == pytest.approx(float(after), rel=1e-12)


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def test_update_ratio_matches_float64_reference_adam():
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    params = list(m.parameters())
    tr = UpdateRatioTracker(chunk_numel=7)  # exercise chunking
    for _ in range(3):
        x = torch.randn(16, 6)
        loss = m(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        tr.capture(params)
        ref_before = [p.detach().clone() for p in params]
        opt.step()
        sums = tr.local_sums_since_capture(params)
        assert not tr.captured
        assert sums.dtype == torch.float64 and sums.shape == (len(params), 2)
        got = tr.ratios(sums.numpy())
        ref = np.array(
            [
                (torch.norm((a.detach().double() - b.double())) / torch.norm(b.double())).item()
                for a, b in zip(params, ref_before)
            ]
        )
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0)
        assert np.all(got > 0)


def test_update_ratio_sharded_sums_reduce_exactly():
    """Two 'ranks' each holding half of every flattened parameter (ZeRO-style flat shards)."""
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(4, 6)).sum().backward()
    full_before = [p.detach().clone().reshape(-1) for p in m.parameters()]
    opt.step()
    full_after = [p.detach().reshape(-1) for p in m.parameters()]
    tr = UpdateRatioTracker()
    shards = []
    for r in range(2):
        b = [t.tensor_split(2)[r] for t in full_before]
        a = [t.tensor_split(2)[r] for t in full_after]
        shards.append(tr.local_sums(b, a))
    reduced = (shards[0] + shards[1]).numpy()
    full = tr.local_sums(full_before, full_after).numpy()
    np.testing.assert_allclose(reduced, full, rtol=1e-14)
    ref = np.array([
        float(torch.norm(a.double() - b.double()) / torch.norm(b.double()))
        for a, b in zip(full_after, full_before)
    ])
    np.testing.assert_allclose(tr.ratios(torch.from_numpy(reduced)), ref, rtol=1e-12)


def test_update_ratio_bf16_exact_difference_and_edges():
    b = torch.tensor([1.0, 2.0, -3.0], dtype=torch.bfloat16)
    a = b.clone()
    a[0] = torch.nextafter(a[0].float(), torch.tensor(2.0)).bfloat16()  # one bf16 ulp
    s = UpdateRatioTracker().local_sums([b, torch.zeros(0)], [a, torch.zeros(0)])
    d = float(a[0].double() - b[0].double())
    assert s[0, 0].item() == d * d and s[0, 1].item() == 14.0
    assert s[1].tolist() == [0.0, 0.0]
    r = UpdateRatioTracker.ratios(np.array([[1.0, 0.0], [0.0, 0.0], [4.0, 1.0]]))
    assert math.isinf(r[0]) and math.isnan(r[1]) and r[2] == 2.0
    assert UpdateRatioTracker().local_sums([], []).shape == (0, 2)
    with pytest.raises(RuntimeError):
        UpdateRatioTracker().local_sums_since_capture([b])
    with pytest.raises(ValueError):
        UpdateRatioTracker().local_sums([b], [])
    with pytest.raises(ValueError):
        UpdateRatioTracker().local_sums([b], [torch.zeros(2)])
    with pytest.raises(ValueError):
        UpdateRatioTracker.ratios(np.zeros((3,)))
