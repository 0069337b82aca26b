"""Logit precursors (distgrad/signals/logits.py) on one process, against float64 recomputations
made another way: for a tiny Hugging Face Llama (grouped keys, rotary, a padding mask; eager
and sdpa kernels) the queries and keys are rebuilt from the q_proj / k_proj outputs and the
layer's rotary cos/sin in float64, masked causally and by the padding mask, and maxed; the z
statistics from the model's returned logits in float64; for a plain SDPA model through
observe_attention, the scores from the projections in float64. Also: only sampled steps are
computed (interval 2), and the logit-growth case (a high learning rate on q/k makes the maximum
attention logit grow until the loss spikes): the precursor crosses its threshold before the loss
spike detector fires."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import distgrad
from distgrad.config import ConfigError
from distgrad.record import StepRecord
from distgrad.signals import logits as L
from tests.logits_models import SDPAModel as _SDPAModel


def _llama(impl: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attn_implementation=impl)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _reference_llama(model, ids, mask):
    """Per layer per head max of q.k/sqrt(d) (float64, from the projections and the rotary
    cos/sin, causal + padding mask), and the float64 z statistics of the returned logits."""
    from transformers.models.llama.modeling_llama import rotate_half

    cap, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        handles.append(a.q_proj.register_forward_hook(lambda m, x, y, i=i: cap.__setitem__(("q", i), y.double())))
        handles.append(a.k_proj.register_forward_hook(lambda m, x, y, i=i: cap.__setitem__(("k", i), y.double())))
        handles.append(a.register_forward_pre_hook(
            lambda m, args, kw, i=i: cap.__setitem__(("pe", i), kw["position_embeddings"]), with_kwargs=True))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    c = model.config
    d = c.hidden_size // c.num_attention_heads
    b, t = ids.shape
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    heads = {}
    for i in range(c.num_hidden_layers):
        q = cap[("q", i)].view(b, t, -1, d).transpose(1, 2)
        k = cap[("k", i)].view(b, t, -1, d).transpose(1, 2)
        cos, sin = (x.double()[:, None] for x in cap[("pe", i)])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(c.num_attention_heads // c.num_key_value_heads, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        s = s.masked_fill(~allowed, -math.inf)
        heads[str(i)] = s.transpose(0, 1).reshape(c.num_attention_heads, -1).amax(1)
    lg = out.logits.double()
    z = torch.logsumexp(lg, -1).reshape(-1)
    return heads, dict(abs_max=lg.abs().max().item(), z_mean=z.mean().item(), z_sq_mean=(z * z).mean().item(),
                       z_max=z.max().item(), n=z.numel())


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_llama_attention_and_output_logits_equal_float64_recomputation(impl):
    model = _llama(impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             logits={"attention": True, "output": True})
    recs = []
    dg.add_hook(recs.append)
    g = torch.Generator().manual_seed(1)
    refs = []
    for step in range(2):
        ids = torch.randint(0, 61, (2, 2, 9), generator=g)  # 2 micro-batches of 2 sequences
        mask = torch.ones(2, 2, 9, dtype=torch.long)
        mask[step, 1, :3] = 0  # left padding in one sequence of one micro-batch
        mb = [_reference_llama(model, ids[j], mask[j]) for j in range(2)]
        refs.append(mb)
        for j in range(2):
            model(input_ids=ids[j], attention_mask=mask[j], labels=ids[j]).loss.backward()
        opt.step()
        opt.zero_grad()
    dg.close()
    assert [r.step for r in recs] == [0, 1]
    for rec, mb in zip(recs, refs):
        lg = rec.logits
        assert sorted(lg.attention_max) == ["0", "1"]
        for layer in ("0", "1"):
            ref = torch.stack([m[0][layer] for m in mb]).amax(0)
            assert lg.attention_head_max[layer] == pytest.approx(ref.tolist(), rel=1e-5, abs=1e-6)
            assert lg.attention_max[layer] == pytest.approx(ref.max().item(), rel=1e-5)
        outs = [m[1] for m in mb]
        n = sum(o["n"] for o in outs)
        assert lg.positions == n == 2 * 2 * 9  # padding positions included (documented)
        assert lg.output_abs_max == pytest.approx(max(o["abs_max"] for o in outs), rel=1e-6)
        assert lg.z_max == pytest.approx(max(o["z_max"] for o in outs), rel=1e-6)
        assert lg.z_mean == pytest.approx(sum(o["z_mean"] * o["n"] for o in outs) / n, rel=1e-6)
        assert lg.z_sq_mean == pytest.approx(sum(o["z_sq_mean"] * o["n"] for o in outs) / n, rel=1e-6)
        assert StepRecord.from_dict(rec.to_dict()).logits == lg
    assert dg.counters["internal_errors"] == 0
    # undone at close(): the attention interface is transformers' own again
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert "get_interface" not in vars(ALL_ATTENTION_FUNCTIONS) and not L._MODULES


def _sdpa_reference(model, ids):
    cap, hs = {}, []
    for i, blk in enumerate(model.blocks):
        hs.append(blk.qk.register_forward_hook(lambda m, x, y, i=i: cap.__setitem__(i, y.double())))
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    b, t = ids.shape
    out = {}
    for i, blk in enumerate(model.blocks):
        q, k = cap[i].view(b, t, 2, blk.num_heads, -1).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
        out[f"blocks.{i}"] = s.transpose(0, 1).reshape(blk.num_heads, -1).amax(1)
    return out


def test_plain_sdpa_model_through_observe_attention_and_only_sampled_steps():
    torch.manual_seed(0)
    model = _SDPAModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             sampling={"interval": 2}, logits={"attention": True, "attention_modules": r"^blocks\.\d+$",
                                                               "output": True, "output_module": "head"})
    sig = next(s for s in dg.signals.signals if s.name == "logits")
    calls = []
    orig = L.attention_head_max
    L.attention_head_max = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
    recs, refs = [], {}
    dg.add_hook(recs.append)
    try:
        for step in range(4):
            ids = torch.randint(0, 23, (3, 7))
            refs[step] = _sdpa_reference(model, ids)
            n0 = len(calls)
            F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
            assert len(calls) - n0 == (2 if step % 2 == 0 else 0)  # computed on sampled steps only
            opt.step()
            opt.zero_grad()
    finally:
        L.attention_head_max = orig
    dg.close()
    assert [r.step for r in recs] == [0, 2]
    assert sig.layers == ["0", "1"]
    for rec in recs:
        for i in range(2):
            ref = refs[rec.step][f"blocks.{i}"]
            assert rec.logits.attention_head_max[str(i)] == pytest.approx(ref.tolist(), rel=1e-5, abs=1e-6)
    assert dg.counters["internal_errors"] == 0


def test_logits_off_by_default_and_clear_errors():
    model = _SDPAModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False})
    assert "logits" not in {s.name for s in dg.signals.signals}
    dg.close()
    with pytest.raises(ConfigError, match="logits.attention"):
        distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, logits={"attention": True})
    with pytest.raises(ConfigError, match="logits.output"):
        distgrad.instrument(model, optimizer=opt, exporter={"enabled": False},
                            logits={"output": True, "output_module": "nope"})
    assert not L._MODULES


@pytest.mark.parametrize("modules,silent", [(r"^blocks\.\d+\.qk$", False), (r"^blocks\.\d+$", True)])
def test_watched_modules_that_never_report_are_named_once(modules, silent, caplog):
    """A user selecting attention modules that do not call observe_attention (here the q/k
    projections, which are not attention code) gets no attention series: one warning names the
    modules and the hook point, instead of silence. Modules that report get no warning, and the
    output head is served either way (its z mean against the float64 logsumexp of the logits)."""
    torch.manual_seed(0)
    model = _SDPAModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             logits={"attention": True, "attention_modules": modules,
                                     "output": True, "output_module": "head"})
    recs, zs = [], []
    dg.add_hook(recs.append)
    with caplog.at_level("WARNING", logger="distgrad"):
        for _ in range(3):
            ids = torch.randint(0, 23, (3, 7))
            out = model(ids)
            zs.append(torch.logsumexp(out.detach().double(), -1).mean().item())
            F.cross_entropy(out.flatten(0, 1), ids.flatten()).backward()
            opt.step()
            opt.zero_grad()
    dg.close()
    warned = [r.getMessage() for r in caplog.records if "reported its logits" in r.getMessage()]
    assert [r.logits.z_mean for r in recs] == pytest.approx(zs, rel=1e-6)
    assert all(bool(r.logits.attention_max) == silent for r in recs)
    if silent:
        assert not warned
    else:
        assert len(warned) == 1, warned  # once, not per step
        assert "observe_attention" in warned[0] and "up to step 1" in warned[0]  # after two sampled steps
    assert dg.counters["internal_errors"] == 0


@pytest.mark.parametrize("base,after,fires", [(10.0, 3.0, True), (10.0, 2.99, False), (0.26, 8.0, False),
                                               (3.4, 3.0, True), (3.0, 3.3, False)])
def test_report_attention_logit_rise_rule_and_series(base, after, fires):
    """The offline report (distgrad/report/signals.py): the series of the maximum attention logit
    is the max over layers, and the rise rule fires at 3x the previous window's median, naming
    the layer that rose (layer 1: base -> base x after; the max over layers only 20 -> 30), once
    the later median reaches 10: a rise among small logits (0.26 -> 2.1, the example job's first
    steps from its small initialisation, healthy; 3 -> 9.9) is not a finding; 3.4 -> 10.2 is."""
    from types import SimpleNamespace

    from distgrad.signals.logits import LogitStats
    from distgrad.report import signals as sig

    acc = sig.SignalsAccumulator(max_points=64)
    W = sig.WINDOW
    for s in range(2 * W):
        v = base if s < W else base * after
        acc.add(SimpleNamespace(step=s, logits=LogitStats(attention_max={"0": 20.0, "1": v}, z_mean=3.0, z_max=4.0,
                                                          output_abs_max=7.0, positions=8)))
    res = acc.result()
    f = [x for x in res.findings if x.kind == "attention_logit_rise"]
    assert bool(f) == fires
    if fires:
        assert f[0].layer == "1" and f[0].step == 2 * W - 1 and "docs/runbook.md#signal-attention-logit-rise" in f[0].detail
    s = next(s for s in res.series if s.signal == "logits" and s.metric == "attention_max")
    assert s.glob.last[-1, 0] == max(20.0, base * after) and s.layers == ["0", "1"]  # the max over layers



def test_example_job_model_reports_attention_through_the_hook_point():
    """The example job's model (launch/train.py's GPT) with the settings README's "The example
    job" gives for the logit precursors: every block's per-head maximum attention logit equals
    q.k/sqrt(d) recomputed in float64 from its qkv projection's output, causally masked, and
    the output head's max |logit| that of the returned logits' recomputation."""
    from tests.helpers import example_step, example_train

    train = example_train("example_train")
    torch.manual_seed(0)
    model = train.GPT(n_layer=2, d=32, n_head=4, block=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             logits={"attention": True, "attention_modules": r"^blocks\.\d+\.attn$",
                                     "output": True, "output_module": "head"})
    cap, handles = {}, []
    for i, b in enumerate(model.blocks):
        handles.append(b.attn.qkv.register_forward_hook(lambda m, x, y, i=i: cap.__setitem__(i, y.detach().double())))
    handles.append(model.head.register_forward_hook(lambda m, x, y: cap.__setitem__("head", y.detach().double())))
    rec = example_step(model, opt, dg, handles, batch=3)
    allowed = torch.ones(16, 16, dtype=torch.bool).tril()
    for i in range(2):
        q, k, _ = cap[i].split(32, dim=2)
        q, k = (t.view(3, 16, 4, 8).transpose(1, 2) for t in (q, k))
        s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~allowed, -math.inf)
        ref = s.transpose(0, 1).reshape(4, -1).amax(1)
        assert rec.logits.attention_head_max[str(i)] == pytest.approx(ref.tolist(), rel=1e-5, abs=1e-6)
    assert rec.logits.output_abs_max == pytest.approx(cap["head"].abs().max().item(), rel=1e-6)
    assert dg.counters["internal_errors"] == 0


def test_a_model_of_its_own_does_not_import_transformers():
    """logits.attention on a model that is not a Hugging Face one (in a fresh interpreter, as a
    training job starts): the attention maxima come through observe_attention, and transformers
    (and torchao, which it imports, with their start-up messages on every rank) is not imported
    by distgrad; the Hugging Face tests above import it first and are patched."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, torch, torch.nn.functional as F, distgrad\n"
        "from tests.logits_models import SDPAModel\n"
        "torch.manual_seed(0); m = SDPAModel(); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "dg = distgrad.instrument(m, optimizer=opt, exporter={'enabled': False}, statistics={'async_records': 'off'},"
        " logits={'attention': True, 'attention_modules': r'^blocks\\.\\d+$'})\n"
        "recs = []; dg.add_hook(recs.append); ids = torch.randint(0, 23, (2, 5))\n"
        "F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward(); opt.step(); dg.close()\n"
        "print(sorted(recs[0].logits.attention_max), 'transformers' in sys.modules, 'torchao' in sys.modules)\n")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['0',", "'1']", "False", "False"], out.stdout


def _rot_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _gpt2(impl: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=61, n_embd=32, n_layer=3, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0,
                     attn_implementation=impl)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    layers = [blk.attn for blk in model.transformer.h]

    def qk(i, cap, b, t):  # c_attn (Conv1D) output [b, t, 3 * 32] -> q, k [b, 4, t, 8]
        q, k, _ = cap[("qkv", i)].split(32, dim=2)
        return tuple(x.view(b, t, 4, 8).transpose(1, 2) for x in (q, k))
    return model, layers, "c_attn", qk


def _gpt_neox(impl: str):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=32, attn_implementation=impl)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg)
    layers = [blk.attention for blk in model.gpt_neox.layers]

    def qk(i, cap, b, t):  # fused query_key_value [b, t, 4 * 3 * 8] -> per head (q|k|v), partial rotary
        q, k, _ = cap[("qkv", i)].view(b, t, 4, 24).transpose(1, 2).chunk(3, dim=-1)
        cos, sin = (x.double()[:, None] for x in cap[("pe", i)])
        r = cos.shape[-1]
        assert 0 < r < 8  # GPT-NeoX's default rotary_pct 0.25: the rotary on 2 of the 8 head dims

        def rope(x):
            return torch.cat([x[..., :r] * cos + _rot_half(x[..., :r]) * sin, x[..., r:]], dim=-1)
        return rope(q), rope(k)
    return model, layers, "query_key_value", qk


@pytest.mark.parametrize("family,impl", [("gpt2", "eager"), ("gpt2", "sdpa"), ("gpt_neox", "sdpa")])
def test_attention_modules_without_q_proj_found_by_default_and_equal_float64_recomputation(family, impl):
    """Issue #25: GPT-2 (``c_attn``, a Conv1D with q|k|v side by side) and GPT-NeoX (fused
    ``query_key_value`` interleaved per head, rotary on a quarter of the head dims) have no
    ``q_proj`` / ``k_proj``; with ``logits.attention: true`` and no ``attention_modules`` their
    attention modules are found (exactly the model's layers: the modules calling transformers'
    attention interface, not the parents), and every layer's per-head maximum equals q.k/sqrt(d)
    recomputed in float64 from the fused projection's output (and the layer's rotary cos/sin),
    with the causal and padding masks, maxed over 2 micro-batches."""
    model, attn, proj, qk = (_gpt2 if family == "gpt2" else _gpt_neox)(impl)
    n = len(attn)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             logits={"attention": True})
    sig = next(s for s in dg.signals.signals if s.name == "logits")
    assert sig.layers == [str(i) for i in range(n)] and sig.heads == [4] * n
    assert {m for m, (s, _) in L._MODULES.items() if s is sig} == set(attn)  # the attention modules, no parent
    cap, handles = {}, []
    for i, a in enumerate(attn):
        handles.append(getattr(a, proj).register_forward_hook(
            lambda m, x, y, i=i: cap.__setitem__(("qkv", i), y.detach().double())))
        handles.append(a.register_forward_pre_hook(
            lambda m, args, kw, i=i: cap.__setitem__(("pe", i), kw.get("position_embeddings")), with_kwargs=True))
    recs, refs = [], []
    dg.add_hook(recs.append)
    g = torch.Generator().manual_seed(1)
    b, t = 2, 9
    for step in range(2):
        mb = []
        for j in range(2):
            ids = torch.randint(0, 61, (b, t), generator=g)
            mask = torch.ones(b, t, dtype=torch.long)
            if j == step:
                mask[1, :3] = 0  # left padding in one sequence of one micro-batch
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
            heads = {}
            for i in range(n):
                q, k = qk(i, cap, b, t)
                s = ((q @ k.transpose(-1, -2)) / math.sqrt(8)).masked_fill(~allowed, -math.inf)
                heads[str(i)] = s.transpose(0, 1).reshape(4, -1).amax(1)
            mb.append(heads)
        refs.append(mb)
        opt.step()
        opt.zero_grad()
    for h in handles:
        h.remove()
    dg.close()
    assert [r.step for r in recs] == [0, 1]
    for rec, mb in zip(recs, refs):
        assert sorted(rec.logits.attention_max) == [str(i) for i in range(n)]
        for layer in rec.logits.attention_max:
            ref = torch.stack([m[layer] for m in mb]).amax(0)
            assert rec.logits.attention_head_max[layer] == pytest.approx(ref.tolist(), rel=1e-5, abs=1e-6)
            assert rec.logits.attention_max[layer] == pytest.approx(ref.max().item(), rel=1e-5)
    assert dg.counters["internal_errors"] == 0 and not L._MODULES


def test_default_detection_is_the_interface_callers_not_their_parents():
    """``is_hf_attention`` against transformers' own code: in a BERT encoder the module calling the
    attention interface is ``BertSelfAttention`` (``query`` / ``key`` / ``value``), not the
    ``BertAttention`` around it (whose name ends in Attention too) nor the model, whose
    ``PreTrainedModel`` helpers name the interface outside ``forward``; a Falcon model (its own
    attention computation in transformers 5.24, no interface call) and a model of its own have none,
    so the refusal names logits.attention_modules."""
    import inspect

    from transformers import BertConfig, BertModel, FalconConfig, FalconForCausalLM

    bert = BertModel(BertConfig(vocab_size=31, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32))
    found = [n for n, m in bert.named_modules() if L.is_hf_attention(m)]
    assert found == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    for n, m in bert.named_modules():  # the reference: the class's forward source names the interface
        src = inspect.getsource(inspect.unwrap(type(m).forward)) if n else ""
        assert L.is_hf_attention(m) == (bool(n) and "ALL_ATTENTION_FUNCTIONS" in src), n
    falcon = FalconForCausalLM(FalconConfig(vocab_size=31, hidden_size=16, num_hidden_layers=2,
                                            num_attention_heads=2))
    assert not any(L.is_hf_attention(m) for m in falcon.modules())
    for model in (falcon, _SDPAModel()):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ConfigError, match="attention interface.*logits.attention_modules"):
            distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, logits={"attention": True})
    assert not L._MODULES
