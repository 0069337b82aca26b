"""Synthetic parameter layouts and step records (no training), shared by test modules: a
LLaMA-70B-shaped name/shape list, and random full-precision records with their exact
comparison."""

from __future__ import annotations

import math

import numpy as np

from distgrad.record import STAT_FIELDS, Health, ParamStats, StepRecord


def llama70b_layout(hidden: int = 8, n_layers: int = 80):
    """LLaMA-2/3-70B tensor names and shapes, widths scaled by hidden/8192.

    70B: hidden 8192, 64 query heads, 8 KV heads (KV width hidden/8), MLP 28672 (3.5 x hidden),
    vocab scaled to 4 x hidden. 80 x 9 + 3 = 723 tensors.
    """
    kv, ffn, vocab = hidden // 8, hidden * 7 // 2, 4 * hidden
    names, shapes = ["model.embed_tokens.weight"], [(vocab, hidden)]
    for i in range(n_layers):
        for m, s in [
            ("self_attn.q_proj", (hidden, hidden)),
            ("self_attn.k_proj", (kv, hidden)),
            ("self_attn.v_proj", (kv, hidden)),
            ("self_attn.o_proj", (hidden, hidden)),
            ("mlp.gate_proj", (ffn, hidden)),
            ("mlp.up_proj", (ffn, hidden)),
            ("mlp.down_proj", (hidden, ffn)),
            ("input_layernorm", (hidden,)),
            ("post_attention_layernorm", (hidden,)),
        ]:
            names.append(f"model.layers.{i}.{m}.weight")
            shapes.append(s)
    names += ["model.norm.weight", "lm_head.weight"]
    shapes += [(hidden,), (vocab, hidden)]
    return names, shapes


#: the step whose record counts a non-finite step (``make_record``'s counters)
NAN_STEP = 7


def param_names(n_layers: int = 3) -> list[str]:
    """LLaMA-style parameter names: embedding, per layer a q projection and an MLP up
    projection, final norm and head (3 + 2 x ``n_layers`` names)."""
    out = ["model.embed_tokens.weight"]
    for i in range(n_layers):
        out += [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"]
    return out + ["model.norm.weight", "lm_head.weight"]


def make_record(step: int, names: list[str], rng: np.random.Generator, nan_param: str | None = None) -> StepRecord:
    """A synthetic record with full-precision random floats; NaN injected in ``nan_param``."""
    P = len(names)
    numel = rng.integers(10, 10_000, P).astype(np.float64)
    sumsq = numel * rng.uniform(1e-8, 1e-2, P)
    s = rng.standard_normal(P) * 1e-3
    nan = np.zeros(P)
    inf = np.zeros(P)
    mn = -rng.uniform(0, 1, P)
    mx = rng.uniform(0, 1, P)
    mn[0] = -0.0  # signed zero must survive too
    ranks: list[int] = []
    if nan_param is not None:
        j = names.index(nan_param)
        nan[j] = 5.0
        sumsq[j] = s[j] = mn[j] = mx[j] = np.nan
        ranks = [1]
    ps = ParamStats(names=list(names), numel=numel, sum=s, sumsq=sumsq, nan=nan, inf=inf,
                    zeros=np.floor(numel * rng.uniform(0, 0.1, P)), min=mn, max=mx)
    return StepRecord(
        step=step, micro_step=4 * step + 3, timestamp=1.7e9 + step * 0.123456789, world_size=4, params=ps,
        grad_norm=float(np.sqrt(sumsq.sum())), loss=None if step == 0 else float(2.5 + rng.standard_normal() * 0.1),
        loss_scale=2.0 ** 15, overflow=False, step_applied=True,
        counters={"sampled_steps": step + 1, "nonfinite_steps": int(step >= NAN_STEP)},
        nonfinite_ranks=ranks,
        update_ratio={names[0]: float(rng.uniform(1e-4, 1e-2))}, grad_scale=np.float32(1.5),
        health=Health(n_vanishing=np.int64(3), vanishing=["a", "b", "c"]),
    )


def assert_same(a: StepRecord, b: StepRecord) -> None:
    """Assert that ``b`` (read back) equals ``a`` field by field, the per-parameter statistics
    bit-exact (NaN and -0.0 included) and float64."""
    for f in ("step", "micro_step", "timestamp", "world_size", "loss", "loss_scale", "overflow", "step_applied",
              "counters", "replica_mismatch_ranks", "nonfinite_ranks"):
        assert getattr(a, f) == getattr(b, f), f
    assert math.isnan(a.grad_norm) == math.isnan(b.grad_norm)
    if not math.isnan(a.grad_norm):
        assert a.grad_norm == b.grad_norm
    assert a.params.names == b.params.names
    for f in STAT_FIELDS:
        x, y = getattr(a.params, f), getattr(b.params, f)
        assert y.dtype == np.float64
        # bit-exact, NaN and -0.0 included
        assert x.tobytes() == y.tobytes(), f
