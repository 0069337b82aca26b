"""Loss components, the per-token loss distribution and the loss trend on 2 gloo ranks
(DeepSpeed ZeRO-1 and FSDP2, 2 micro-batches per step; tests/dist/common.py loss_analysis_loop).

Reference: each micro-batch's loss and components as every rank's loop computed them, and its
per-token losses recomputed in float64 (from the logits, for the FSDP2 run that passes logits;
the token losses themselves for the DeepSpeed run that passes them), gathered from all ranks;
the bins are numpy's ``searchsorted`` over the same edges. The trend is checked against
``numpy.polyfit`` on the served loss series."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distgrad.loss.trend import TrendTracker, ols_slope
from distgrad.record import StepRecord
from distgrad.loss.token import EDGES

from tests.dist.common import LA_SOURCES, LA_STEPS, LA_ZW

ENGINES = ["deepspeed", "fsdp2"]
THRESHOLD = 10.0  # loss.token_threshold default


@pytest.fixture(params=ENGINES)
def analysis(request):
    if request.param == "deepspeed":
        c = request.getfixturevalue("ds_results")["special"]["loss_analysis"]
    else:
        c = request.getfixturevalue("torch_results")["cases"]["loss-analysis-fsdp2"]
    assert "error" not in c, c.get("traceback")
    recs = [StepRecord.from_dict(r) for r in c["records"]]
    assert [r.step for r in recs] == list(range(LA_STEPS))
    return request.param, c, recs


def _micro_batches(c, step):
    return [m for per_rank in c["seen"] for m in per_rank if m["step"] == step]


@pytest.mark.multirank
def test_components_equal_float64_reference(analysis):
    engine, c, recs = analysis
    for rec in recs:
        mbs = _micro_batches(c, rec.step)
        assert len(mbs) == 4  # 2 ranks x 2 micro-batches
        lc = rec.loss_components
        assert lc is not None and lc.names == ["lm", "z"] and lc.error is None
        total = math.fsum(m["loss"] for m in mbs)
        for i, (name, w) in enumerate((("lm", 1.0), ("z", LA_ZW))):
            vals = [m["comps"][name] for m in mbs]
            assert lc.mean[i] == pytest.approx(math.fsum(vals) / len(vals), rel=1e-12)
            assert lc.weight[i] == pytest.approx(w, rel=1e-15)
            assert lc.share[i] == pytest.approx(w * math.fsum(vals) / total, rel=1e-12)
            assert lc.count[i] == 4
        assert sum(lc.share) == pytest.approx(1.0, rel=1e-6)  # the loss is lm + w * z, added in fp32
        # the loss counted once per micro-batch (DeepSpeed's own capture was switched off)
        assert rec.loss == pytest.approx(total / 4, rel=1e-12)


def _hist(x):
    return np.bincount(np.searchsorted(np.asarray(EDGES), x, side="left"), minlength=len(EDGES) + 1)


@pytest.mark.multirank
def test_token_loss_histogram_perplexity_and_sources_equal_float64_reference(analysis):
    engine, c, recs = analysis
    rtol = 1e-12 if engine == "deepspeed" else 1e-5  # FSDP2: distgrad computes the cross-entropy in fp32
    for rec in recs:
        t = rec.token_loss
        toks, by_src = [], {}
        for m in _micro_batches(c, rec.step):
            for seq, src in zip(m["tokens"], m["sources"]):
                toks += seq
                by_src.setdefault(src if src in LA_SOURCES else "other", []).extend(seq)
        x = np.asarray(toks, dtype=np.float64)
        assert t.tokens == len(x)
        assert t.mean == pytest.approx(x.mean(), rel=rtol)
        assert t.perplexity == pytest.approx(math.exp(x.mean()), rel=rtol)
        assert t.above_fraction == np.mean(x > THRESHOLD)
        assert t.max == pytest.approx(x.max(), rel=rtol)
        assert t.hist == _hist(x).tolist()
        assert sorted(t.sources) == sorted(by_src)
        for src, vals in by_src.items():
            v = np.asarray(vals)
            s = t.sources[src]
            assert s["tokens"] == len(v) and s["mean"] == pytest.approx(v.mean(), rel=rtol)
            assert s["hist"] == _hist(v).tolist()


@pytest.mark.multirank
def test_trend_slope_matches_least_squares_fit_of_the_served_series(analysis):
    engine, c, recs = analysis
    steps = np.array([r.step for r in recs], dtype=np.float64)
    losses = np.array([r.loss for r in recs])
    coef, cov = np.polyfit(steps, losses, 1, cov=True)  # cov scaled by SSE / (n - 2)
    tr = recs[-1].loss_trend
    assert tr.points == LA_STEPS and tr.window == 1000
    assert tr.slope_per_1k == pytest.approx(1000 * coef[0], rel=1e-9)
    assert tr.stderr_per_1k == pytest.approx(1000 * math.sqrt(cov[0, 0]), rel=1e-9)
    assert not tr.plateau  # the window (1000 steps) is not covered by 12 steps
    assert tr.slope_per_1k < 0  # TinyLM learns: the loss goes down


@pytest.mark.multirank
def test_components_and_token_losses_add_no_collective_and_no_host_sync(analysis):
    """Still 2 collectives and 1 host copy per sampled step with components and per-token
    losses observed (step 0 of a process may load and check the statistics kernel)."""
    engine, c, recs = analysis
    assert [n["collectives"] for n in c["counts"]] == [2] * LA_STEPS
    assert c["counts"][1:] == [{"collectives": 2, "syncs": 1}] * (LA_STEPS - 1)


def test_ols_slope_and_plateau_flag():
    rng = np.random.default_rng(0)
    x = np.arange(0, 400, 4, dtype=np.float64)
    flat = 2.0 + 0.05 * rng.standard_normal(len(x))
    falling = 3.0 - 2e-3 * x + 0.05 * rng.standard_normal(len(x))
    for y in (flat, falling):
        slope, se = ols_slope(x, y)
        coef, cov = np.polyfit(x, y, 1, cov=True)
        assert slope == pytest.approx(coef[0], rel=1e-10) and se == pytest.approx(math.sqrt(cov[0, 0]), rel=1e-10)
    for y, plateau in ((flat, True), (falling, False)):
        tr = TrendTracker(window=400, plateau_z=2.0)
        outs = [tr.update(int(s), float(v)) for s, v in zip(x, y)]
        assert outs[-1].plateau is plateau
        assert not any(o.plateau for o in outs[:80])  # the window is not yet covered
    # points older than the window leave it; non-finite losses are not added
    tr = TrendTracker(window=10)
    for s in range(30):
        out = tr.update(s, float("nan") if s == 25 else float(s))
    assert out.points == 9 and out.slope_per_1k == pytest.approx(1000.0)
    assert math.isnan(ols_slope(np.array([1.0, 2.0]), np.array([1.0, 2.0]))[0])


def test_bad_components_and_token_inputs_are_counted_and_the_loss_still_counts(caplog):
    """One process: a component set other than the declared one, a mask of the wrong shape and
    sources without [B, T] token losses are each refused with one error naming the argument,
    counted, and the loss of those calls still counts."""
    import logging

    import torch

    import distgrad
    from tests.dist.common import TinyLM, lm_batch, lm_losses

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False})
    losses = []
    with caplog.at_level(logging.ERROR, logger="distgrad"):
        for micro in range(4):
            tokens, labels, sources = lm_batch(0, micro, 0)
            loss, comps, tok, mask = lm_losses(model(tokens), labels)
            losses.append(float(loss))
            if micro == 0:
                inst.observe_loss(loss, components=comps, token_losses=tok, token_mask=mask)
                counted = int(mask.sum())
            elif micro == 1:
                inst.observe_loss(loss, components={"lm": comps["lm"]}, token_losses=tok, token_mask=mask[:1])
            elif micro == 2:
                inst.observe_loss(loss, components=comps, token_losses=tok.reshape(-1), sources=sources)
            else:
                inst.observe_loss(loss, components={"lm": comps["lm"], "other_name": 1.0})
            loss.backward()
        opt.step()
    rec = inst.last_record
    inst.close()
    assert rec.loss == pytest.approx(sum(losses) / 4, rel=1e-6)
    assert rec.loss_components.count == [2.0, 2.0]  # micro-batches 0 and 2
    assert rec.token_loss.tokens == counted  # micro-batch 0's only
    errors = [m for m in caplog.messages if "observe_loss" in m]
    assert len(errors) == 2, errors  # one per kind (components, token inputs), not one per call
    assert any("declared at first use" in m for m in errors) and any("token_mask" in m for m in errors)
    assert inst.counters["internal_errors"] == 4  # micro-batch 1 twice, 2 and 3 once each


def test_report_shows_components_token_distribution_and_trend(tmp_path):
    """One process, TinyLM, 30 steps logged to JSONL: the report's loss analysis equals what the
    records hold (histogram summed over the run, last components and trend), its summary names
    them and the page embeds the loss-analysis plot."""
    import torch

    import distgrad
    from tests.dist.common import TinyLM, lm_batch, lm_losses
    from distgrad.report import analyze, write_report
    from distgrad.export.jsonl import read_jsonl

    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    log = tmp_path / "run.jsonl"
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, sinks={"jsonl": {"path": str(log)}},
                               loss={"sources": LA_SOURCES, "trend_window": 20})
    for s in range(30):
        tokens, labels, sources = lm_batch(s, 0, 0)
        loss, comps, tok, mask = lm_losses(model(tokens), labels)
        inst.observe_loss(loss, components=comps, weights={"z": LA_ZW}, token_losses=tok, token_mask=mask,
                          sources=sources)
        loss.backward()
        opt.step()
        opt.zero_grad()
    inst.close()
    recs = list(read_jsonl(log))
    assert len(recs) == 30
    rep = analyze(log).loss
    assert rep.tokens == sum(r.token_loss.tokens for r in recs)
    assert rep.token_hist == np.sum([r.token_loss.hist for r in recs], axis=0).tolist()
    assert rep.components == ["lm", "z"]
    np.testing.assert_allclose(rep.component_share.last[-1], recs[-1].loss_components.share, rtol=1e-12)
    assert rep.trend["slope_per_1k"] == recs[-1].loss_trend.slope_per_1k
    res = write_report(log, tmp_path / "report")
    text = (tmp_path / "report" / "summary.txt").read_text()
    assert "loss trend at step 29" in text and "loss components" in text and "token losses" in text
    assert "source web" in text and "source other" in text
    assert any(p.name == "loss_analysis.png" for p in res.pngs)


def test_token_loss_keeps_no_token_memory_and_counts_nan_and_masked_tokens():
    """TokenLoss keeps only its histogram block (no reference to the token losses), leaves masked
    tokens out entirely (a masked NaN does not poison the sum), counts kept NaN tokens apart and
    lets them make the sum NaN; reference: numpy over the kept tokens."""
    import gc
    import weakref

    import torch

    from distgrad.loss.token import TOKEN_COLS, TokenLoss

    tl = TokenLoss(["a"], threshold=1.0)
    vals = [[0.005, 0.3, float("nan"), 25.0], [2.0, 1.5, 0.5, float("nan")]]
    keep = [[True, True, True, False], [True, True, False, False]]
    x = torch.tensor(vals, dtype=torch.float32)
    ref = weakref.ref(x)
    tl.add(x, torch.tensor(keep), ["a", "not-configured"])
    del x
    gc.collect()
    assert ref() is None  # nothing per-token is kept
    assert tl.block.shape == (2, len(TOKEN_COLS))
    s, m = tl.take(torch.device("cpu"))
    b = tl.unpack(s.numpy(), m.numpy())
    assert b.sources == ["a", "other"]
    for row, seq in zip(b.rows, range(2)):
        kept = np.array([np.float32(v) for v, k in zip(vals[seq], keep[seq]) if k], dtype=np.float64)
        fin = kept[~np.isnan(kept)]
        assert row[0] == len(kept) and row[3] == np.isnan(kept).sum() and row[2] == (fin > 1.0).sum()
        assert (math.isnan(row[1]) and np.isnan(kept).any()) or row[1] == pytest.approx(kept.sum(), rel=1e-15)
        assert row[4:].tolist() == _hist(fin).tolist()
    assert math.isnan(b.max_token_loss)  # a kept NaN token


def test_loss_spike_report_names_the_batch_samples_and_sources(tmp_path):
    """One process: a batch whose logits are scaled 40x at step 6 is a loss spike; the report
    written next to the flight-recorder reports holds the micro-batch's sample indices and its
    sequences' data sources as the loop passed them, and no other step writes one."""
    import json

    import torch

    import distgrad
    from tests.dist.common import TinyLM, lm_batch, lm_losses

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    inst = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False},
                               **{"flight_recorder.dir": str(tmp_path), "spikes.ema_warmup": 3,
                                  "spikes.ema_z": 10.0, "loss.sources": LA_SOURCES})
    for s in range(8):
        tokens, labels, sources = lm_batch(s, 0, 0)
        logits = model(tokens) * (40.0 if s == 6 else 1.0)
        loss, comps, tok, mask = lm_losses(logits, labels)
        inst.observe_loss(loss, samples=[10 * s + i for i in range(3)], token_losses=tok, token_mask=mask,
                          sources=sources)
        loss.backward()
        opt.step()
        opt.zero_grad()
    inst.close()
    files = sorted(p.name for p in tmp_path.glob("lossspike-*.json"))
    assert files == ["lossspike-step6-rank0.json"]
    doc = json.loads((tmp_path / files[0]).read_text())
    assert doc["samples"] == [60, 61, 62] and doc["sources"] == lm_batch(6, 0, 0)[2] and doc["micro_batch"] == 0
