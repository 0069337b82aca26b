"""The logit-growth case (issue 25, item 6) of the logit precursors (distgrad/signals/logits.py):
the precursor alert's threshold is crossed before the loss-divergence incident opens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import distgrad


def test_attention_logit_growth_crosses_its_threshold_before_the_loss_diverges():
    """The realistic case (issue 25, item 6): a copy task with 20% label noise (the loss floor is
    far from 0) on a 2-layer attention model without QK-norm; after 100 steps at Adam lr 1e-2
    the learning rate of the q/k projections grows 4% per step. The maximum attention logit
    crosses DistgradAttentionLogitHigh's threshold (100) before the detection policy opens the
    divergence incident that DistgradLossDivergence pages on (docs/signals.md gives the measured
    gap)."""
    from grafana import config as gconfig
    from tests.logits_models import PositionalModel

    threshold = gconfig.ALERTS["DistgradAttentionLogitHigh"]["threshold"]
    torch.manual_seed(0)
    m = PositionalModel()
    qk = [p for n, p in m.named_parameters() if ".qk." in n]
    opt = torch.optim.Adam([{"params": qk, "lr": 1e-2},
                            {"params": [p for n, p in m.named_parameters() if ".qk." not in n], "lr": 1e-2}])
    dg = distgrad.instrument(m, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             logits={"attention": True, "attention_modules": r"^blocks\.\d+$"})
    g = torch.Generator().manual_seed(1)
    first_high = first_div = None
    for s in range(GROWTH_STEPS):
        if s >= 100:
            opt.param_groups[0]["lr"] = 1e-2 * 1.04 ** (s - 100)
        a = torch.randint(0, 16, (16, 6), generator=g)
        ids = torch.cat([a, a], 1)
        tgt = ids[:, 6:].clone()
        flip = torch.rand(tgt.shape, generator=g) < 0.2
        tgt[flip] = torch.randint(0, 16, (int(flip.sum()),), generator=g)
        loss = F.cross_entropy(m(ids[:, :-1])[:, 5:].flatten(0, 1), tgt.flatten())
        dg.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rec = dg.last_record
        assert rec.step == s and rec.logits is not None
        if first_high is None and max(rec.logits.attention_max.values()) > threshold:
            first_high = s
        if first_div is None and rec.incidents is not None and rec.incidents.total.get("divergence", 0):
            first_div = s
        if first_div is not None:
            break
    dg.close()
    assert first_high is not None and first_div is not None, (first_high, first_div)
    assert first_high < first_div, (first_high, first_div)
    print(f"attention logit above {threshold} at step {first_high}; divergence incident at step {first_div}")


GROWTH_STEPS = 300
