"""TensorBoardSink: event files read back by TensorBoard's EventAccumulator."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("torch.utils.tensorboard")

from tensorboard.backend.event_processing import event_accumulator as ea  # noqa: E402

from distgrad.record import ParamStats, StepRecord  # noqa: E402
from distgrad.report import layer_of  # noqa: E402
from distgrad.export.tensorboard import TensorBoardSink  # noqa: E402

NAN_STEP = 5
NAMES = ["model.embed_tokens.weight"] + [
    f"model.layers.{i}.{m}.weight" for i in range(3) for m in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj")
] + ["model.norm.weight", "lm_head.weight"]
NAN_PARAM = "model.layers.1.mlp.up_proj.weight"


def make_record(step: int, rng: np.random.Generator) -> StepRecord:
    P = len(NAMES)
    numel = rng.integers(10, 1000, P).astype(np.float64)
    sumsq = rng.uniform(1e-4, 4.0, P)
    nan = np.zeros(P)
    if step == NAN_STEP:
        j = NAMES.index(NAN_PARAM)
        nan[j] = 2
        sumsq[j] = np.nan
    ps = ParamStats(names=list(NAMES), numel=numel, sum=rng.standard_normal(P), sumsq=sumsq, nan=nan,
                    inf=np.zeros(P), zeros=np.zeros(P), min=-np.ones(P), max=np.ones(P))
    return StepRecord(step=step, micro_step=2 * step, timestamp=1.7e9 + step, world_size=2, params=ps,
                      grad_norm=float(np.sqrt(sumsq.sum())), loss=3.0 - 0.01 * step, loss_scale=2.0 ** (16 - step % 3),
                      overflow=step % 4 == 3, counters={"sampled_steps": step + 1, "overflow_steps": step // 4})


def read_events(log_dir) -> ea.EventAccumulator:
    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0})
    acc.Reload()
    return acc


def test_scalars_and_histograms_read_back(tmp_path):
    rng = np.random.default_rng(7)
    recs = [make_record(t, rng) for t in range(12)]
    sink = TensorBoardSink(tmp_path / "tb")
    for r in recs:
        sink.write(r)
    sink.close()
    sink.close()  # idempotent
    with pytest.raises(ValueError):
        sink.write(recs[0])

    acc = read_events(tmp_path / "tb")
    tags = acc.Tags()

    def values(tag):
        ev = acc.Scalars(tag)
        assert [e.step for e in ev] == [r.step for r in recs], tag
        return [e.value for e in ev]

    def close(a, b):  # scalars are stored as float32
        if math.isnan(b):
            return math.isnan(a)
        return a == pytest.approx(b, rel=1e-6, abs=1e-30)

    gn = values("grad/norm")
    assert all(close(a, r.grad_norm) for a, r in zip(gn, recs))
    assert math.isnan(gn[NAN_STEP]) and not any(math.isnan(v) for i, v in enumerate(gn) if i != NAN_STEP)
    assert all(close(a, r.loss) for a, r in zip(values("train/loss"), recs))
    assert all(close(a, r.loss_scale) for a, r in zip(values("train/loss_scale"), recs))
    assert values("train/overflow") == [1.0 if r.overflow else 0.0 for r in recs]
    assert values("counters/sampled_steps") == [float(r.step + 1) for r in recs]
    assert values("counters/overflow_steps") == [float(r.step // 4) for r in recs]
    assert values("grad/nonfinite_elements") == [2.0 if r.step == NAN_STEP else 0.0 for r in recs]

    # per-layer norms: root-sum-square of the layer's parameter norms
    layers: dict[str, list[int]] = {}
    for i, n in enumerate(NAMES):
        layers.setdefault(layer_of(n), []).append(i)
    assert len(layers) >= 4
    nan_layer = layer_of(NAN_PARAM)
    for layer, members in layers.items():
        got = values(f"layer_grad_norm/{layer}")
        want = [float(np.sqrt(r.params.sumsq[members].sum())) for r in recs]
        assert all(close(a, b) for a, b in zip(got, want)), layer
        nf = values(f"layer_grad_nonfinite/{layer}")
        assert nf[NAN_STEP] == (2.0 if layer == nan_layer else 0.0)

        # histogram of the layer's per-parameter norms, from the recorded statistics
        hists = acc.Histograms(f"layer_param_norms/{layer}")
        assert [h.step for h in hists] == [r.step for r in recs]
        for h, r in zip(hists, recs):
            norms = np.sqrt(r.params.sumsq[members])
            finite = norms[np.isfinite(norms)]
            hv = h.histogram_value
            assert hv.num == finite.size
            assert sum(hv.bucket) == finite.size
            assert len(hv.bucket) == len(hv.bucket_limit)
            assert hv.min == pytest.approx(finite.min()) and hv.max == pytest.approx(finite.max())
            assert hv.sum == pytest.approx(finite.sum())
            assert hv.sum_squares == pytest.approx(float(np.dot(finite, finite)))
            assert hv.bucket_limit[-1] == pytest.approx(finite.max())
    assert set(tags["histograms"]) == {f"layer_param_norms/{layer}" for layer in layers}


def test_options_disable_layer_output(tmp_path):
    rng = np.random.default_rng(1)
    with_none = TensorBoardSink(tmp_path / "tb", histograms=False, layer_scalars=False)
    for t in range(3):
        with_none.write(make_record(t, rng))
    with_none.close()
    tags = read_events(tmp_path / "tb").Tags()
    assert tags["histograms"] == []
    assert not any(t.startswith("layer_") for t in tags["scalars"])
    assert "grad/norm" in tags["scalars"]
