"""MoE router health (distgrad/signals/router.py) on one process, against float64 recomputations
made another way: for tiny Hugging Face Mixtral and Qwen2-MoE models (2 layers, 4 experts, top-2,
hidden 16) the router inputs are captured by the test's own hooks, the router logits recomputed
in float64 from the router weight, the top-k assignment counted with ``bincount`` and the
softmax entropy taken in float64; the auxiliary loss is the model's own ``aux_loss`` output.
Also: only sampled steps are computed, the record's JSON round trip, the served metrics, and the
realistic collapse case (a DeepSeek-V3 style router whose load-balancing bias is updated with
the wrong sign collapses onto one expert; the collapse threshold and the dead-expert count name
that layer, and a run with the right sign stays silent)."""

from __future__ import annotations

import math

import pytest
import torch

import distgrad
from distgrad.config import ConfigError
from distgrad.record import StepRecord
from distgrad.signals.router import RouterHealth, expert_counts, router_entropy_sum


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=32, output_router_logits=True)
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=37, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                         shared_expert_intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                         output_router_logits=True)
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(cfg)


def _reference(model, ids):
    """Per layer: float64 tokens per expert of the top-k of softmax(x W^T) and the summed softmax
    entropy, from the router inputs captured by the test's own pre-hooks; the model's aux_loss."""
    cap, hs = {}, []
    for i, layer in enumerate(model.model.layers):
        g = layer.mlp.gate
        hs.append(g.register_forward_pre_hook(lambda m, a, i=i: cap.__setitem__(i, (a[0].detach(), m))))
    with torch.no_grad():
        out = model(input_ids=ids)
    for h in hs:
        h.remove()
    ref = {}
    for i, (x, m) in cap.items():
        x = x.reshape(-1, x.shape[-1]).double()
        logits = x @ m.weight.detach().double().T
        p = torch.softmax(logits, -1)
        idx = torch.topk(p, m.top_k, dim=-1).indices
        counts = torch.bincount(idx.reshape(-1), minlength=p.shape[-1]).double()
        ent = -(p * torch.log(p)).sum()
        ref[str(i)] = (counts, ent, x.shape[0])
    return ref, float(out.aux_loss)


@pytest.mark.parametrize("make", [_mixtral, _qwen2_moe], ids=["mixtral", "qwen2_moe"])
def test_hf_router_counts_entropy_and_aux_loss_equal_float64_recomputation(make):
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             router={"enabled": True})
    sig = next(s for s in dg.signals.signals if s.name == "router")
    assert sig.layers == ["0", "1"] and sig.experts == [4, 4]
    recs, refs = [], []
    dg.add_hook(recs.append)
    g = torch.Generator().manual_seed(1)
    for _step in range(2):
        mb = []
        for _j in range(2):  # 2 micro-batches of 3 sequences
            ids = torch.randint(0, 37, (3, 7), generator=g)
            mb.append(_reference(model, ids))
            model(input_ids=ids, labels=ids).loss.backward()
        refs.append(mb)
        opt.step()
        opt.zero_grad()
    dg.close()
    assert [r.step for r in recs] == [0, 1]
    for rec, mb in zip(recs, refs):
        r = rec.router
        for layer in ("0", "1"):
            counts = sum(m[0][layer][0] for m in mb)
            ent = sum(m[0][layer][1] for m in mb)
            n = sum(m[0][layer][2] for m in mb)
            assert r.tokens[layer] == counts.tolist()  # exact integers
            assert sum(r.tokens[layer]) == 2 * n and r.routed[layer] == n == 2 * 3 * 7
            assert r.entropy[layer] == pytest.approx(ent.item() / n, rel=1e-6)
            assert r.imbalance[layer] == pytest.approx((counts.max() / counts.mean()).item(), rel=1e-12)
            assert r.cv[layer] == pytest.approx((counts.std(unbiased=False) / counts.mean()).item(), rel=1e-12)
            assert r.dead[layer] == []
        assert r.aux_loss == pytest.approx(sum(m[1] for m in mb) / 2, rel=1e-6)  # the model's own value
        assert r.layer_aux_loss == {}
        assert StepRecord.from_dict(rec.to_dict()).router == r
        served = RouterHealth.samples(r)
        assert served["distgrad_router_load_imbalance"] == r.imbalance
        assert served["distgrad_router_dead_experts"] == 0.0
        assert served["distgrad_router_entropy_min_nats"] == min(r.entropy.values())
    assert dg.counters["internal_errors"] == 0


def test_only_sampled_steps_are_computed_and_helpers():
    model = _mixtral()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             sampling={"interval": 2}, router={"enabled": True})
    from distgrad.signals import router as R
    calls, orig = [], R.router_entropy_sum
    R.router_entropy_sum = lambda x: (calls.append(1), orig(x))[1]
    recs = []
    dg.add_hook(recs.append)
    try:
        for step in range(4):
            ids = torch.randint(0, 37, (2, 5))
            n0 = len(calls)
            model(input_ids=ids, labels=ids).loss.backward()
            assert len(calls) - n0 == (2 if step % 2 == 0 else 0)  # two routers, sampled steps only
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # evaluation forwards are not counted
                model(input_ids=ids)
    finally:
        R.router_entropy_sum = orig
    dg.close()
    assert [r.step for r in recs] == [0, 2] and all(sum(r.router.tokens["0"]) == 2 * 10 for r in recs)
    # the helpers against closed forms
    assert expert_counts(torch.tensor([[0, 2], [2, 3]]), 5).tolist() == [1, 0, 2, 1, 0]
    assert router_entropy_sum(torch.zeros(3, 8)).item() == pytest.approx(3 * math.log(8), rel=1e-15)
    assert router_entropy_sum(torch.tensor([[0.0, -1e4]])).item() == pytest.approx(0.0, abs=1e-300)


def test_router_off_by_default_and_clear_errors():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False})
    assert "router" not in {s.name for s in dg.signals.signals}
    dg.close()
    with pytest.raises(ConfigError, match="router.enabled"):
        distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, router={"enabled": True})
    with pytest.raises(ConfigError, match="router.modules"):
        distgrad.instrument(model, optimizer=opt, exporter={"enabled": False},
                            router={"enabled": True, "modules": "("})


#: the balancing bias step (DeepSeek-V3 uses 0.001) and the steps of the collapse case
GAMMA = 0.002
COLLAPSE_STEPS = 25


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=37, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                           num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=0,
                           n_shared_experts=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                           qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=32)
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(cfg)


def _balancing_run(flipped_layer: int | None, steps: int = COLLAPSE_STEPS, jsonl: str | None = None,
                   init_bias: dict[int, dict[int, float]] | None = None, reference: list | None = None):
    """DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437 sec. 2.1.2): after each step
    the loop moves each expert's bias ``e_score_correction_bias`` by ``gamma`` against its load
    (down when above the mean). ``flipped_layer``: that layer's update has the wrong sign (a bug),
    so the busiest expert's bias keeps rising until every token goes to it. ``jsonl``: a path for
    distgrad's JSONL sink (tests/monitoring/test_precursor_paging.py replays it through the rules).
    ``init_bias``: ``{layer: {expert: bias}}`` set before the first step (a restored balancing
    bias). ``reference``: a list that gets, per step, ``{layer: float64 tokens per expert}``
    recomputed from each router's own input, weight and bias (captured by a pre-hook): the
    top-k of ``sigmoid(x W^T) + bias`` in float64, counted with ``bincount``."""
    model = _deepseek_v3()
    with torch.no_grad():
        for i, experts in (init_bias or {}).items():
            for e, b in experts.items():
                model.model.layers[i].mlp.gate.e_score_correction_bias[e] = b
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dg = distgrad.instrument(model, optimizer=opt, exporter={"enabled": False}, statistics={"async_records": "off"},
                             router={"enabled": True, "dead_after": 5},
                             sinks={"jsonl": {"path": jsonl}})
    loads: dict[int, torch.Tensor] = {}
    gates = [layer.mlp.gate for layer in model.model.layers]
    hs = [g.register_forward_hook(lambda m, a, o, i=i: loads.__setitem__(i, torch.bincount(
        o[-1].reshape(-1), minlength=4).float())) for i, g in enumerate(gates)]
    seen: dict[int, tuple] = {}
    if reference is not None:
        hs += [g.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, (
            a[0].detach().reshape(-1, a[0].shape[-1]).double(), m.weight.detach().double(),
            m.e_score_correction_bias.detach().double(), m.top_k))) for i, g in enumerate(gates)]
    g = torch.Generator().manual_seed(1)
    recs = []
    for _s in range(steps):
        ids = torch.randint(0, 37, (4, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        recs.append(dg.last_record.router)
        if reference is not None:  # n_group = topk_group = 1: no group masking
            reference.append({str(i): torch.bincount(torch.topk(torch.sigmoid(x @ w.T) + b, k, dim=-1).indices.reshape(-1),
                                                     minlength=w.shape[0]).double() for i, (x, w, b, k) in seen.items()})
        with torch.no_grad():
            for i, gate in enumerate(gates):
                sign = 1.0 if i == flipped_layer else -1.0
                gate.e_score_correction_bias += sign * GAMMA * torch.sign(loads[i] - loads[i].mean())
    for h in hs:
        h.remove()
    dg.close()
    assert dg.counters["internal_errors"] == 0
    return recs



def test_router_collapse_pages_naming_its_layer_and_a_balanced_run_stays_silent():
    """The realistic case (issue 25, item 6): layer 1's balancing bias update has the wrong sign;
    its load collapses onto one expert: the imbalance crosses DistgradRouterCollapse's threshold
    and the other three experts become dead (DistgradRouterDeadExperts), in layer 1 only. With the
    right sign on both layers neither fires on any step."""
    from grafana import config as gconfig

    threshold = gconfig.ALERTS["DistgradRouterCollapse"]["threshold"]
    bad = _balancing_run(flipped_layer=1)
    over = [s for s, r in enumerate(bad) if r.imbalance["1"] > threshold]
    dead = [s for s, r in enumerate(bad) if r.dead["1"]]
    assert over and dead, ([r.imbalance["1"] for r in bad], [r.dead["1"] for r in bad])
    assert bad[-1].imbalance["1"] == 4.0 and len(bad[-1].dead["1"]) == 3  # every token on one expert: E / k
    assert all(r.imbalance["0"] <= threshold and not r.dead["0"] for r in bad)  # the healthy layer is not named
    served = RouterHealth.samples(bad[-1])
    assert max(served["distgrad_router_load_imbalance"], key=served["distgrad_router_load_imbalance"].get) == "1"
    assert served["distgrad_router_dead_experts"] == 3.0 and bad[-1].dead["1"] and not bad[-1].dead["0"]
    print(f"router collapse: imbalance above {threshold} from step {over[0]}, dead experts from step {dead[0]}")
    good = _balancing_run(flipped_layer=None)
    worst = max(v for r in good for v in r.imbalance.values())
    assert worst <= threshold and not any(v for r in good for v in r.dead.values()), worst


def test_report_router_series_and_collapse_finding():
    """The offline report (distgrad/report/signals.py): the imbalance series is the max over layers
    and the router_collapse finding names the first step and the layer above the threshold
    (ROUTER_COLLAPSE, DistgradRouterCollapse's default), linking its runbook section."""
    import re
    from pathlib import Path
    from types import SimpleNamespace

    from distgrad.report import signals as sig

    acc = sig.SignalsAccumulator(max_points=64)
    for s in range(12):
        bad = 1.0 + 0.5 * s  # layer 1 rises past 3 at step 5 (3.5)
        acc.add(SimpleNamespace(step=s, router=RouterHealth.Part(
            imbalance={"0": 1.2, "1": bad}, entropy={"0": 1.3, "1": 1.0}, dead={"0": [], "1": []}, aux_loss=1.5)))
    res = acc.result()
    (f,) = [x for x in res.findings if x.kind == "router_collapse"]
    assert (f.step, f.layer) == (5, "1") and sig.ROUTER_COLLAPSE < 3.5
    anchors = {m.group(1) for m in re.finditer(r"^#+ (\S+)\s*$", (Path(__file__).resolve().parents[1] / "docs" /
                                                                  "runbook.md").read_text(), re.M)}
    assert f"signal-{f.kind.replace('_', '-')}" in anchors and "#signal-router-collapse" in f.detail
    s = next(s for s in res.series if s.signal == "router" and s.metric == "imbalance")
    assert s.glob.last[-1, 0] == 1.0 + 0.5 * 11 and s.layers == ["0", "1"]
    quiet = sig.SignalsAccumulator(max_points=64)
    for s in range(12):
        quiet.add(SimpleNamespace(step=s, router=RouterHealth.Part(imbalance={"0": 1.9}, dead={"0": []})))
    assert not quiet.result().findings


def test_finish_dead_streak_checkpointed_and_layers_not_seen_everywhere_left_out():
    """RouterHealth.finish on hand-built reduced parts (2 ranks): imbalance / CV / entropy / l_aux
    against closed forms, an expert dead after ``dead_after`` sampled steps without a token, the
    streak carried through state_dict / load_state_dict, and a layer observed on 1 of 2 ranks left
    out of the record."""
    from types import SimpleNamespace

    import numpy as np

    def make():
        s = RouterHealth(1, dead_after=2)
        s.set_layers(["0", "1"], [3, 2])
        return s

    def step(sig, seen0, counts0, counts1):
        s = np.zeros(sig.sum_size)
        o0, o1 = sig._offsets
        s[o0:o0 + 5] = [seen0, 2, 6, 6 * 0.5, 0.0]
        s[o0 + 5:o0 + 8] = counts0
        s[o1:o1 + 5] = [2, 2, 6, 3.0, 0.4]
        s[o1 + 5:o1 + 7] = counts1
        rec = SimpleNamespace(router=None)
        sig.finish(SimpleNamespace(world_size=2), rec, s, np.zeros(0), 1.0)
        return rec.router

    sig = make()
    r = step(sig, 2, [6, 0, 6], [12, 0])
    assert r.dead == {"0": [], "1": []} and r.routed == {"0": 6, "1": 6}
    assert r.imbalance["0"] == 6 / 4 and r.cv["0"] == pytest.approx(math.sqrt(8) / 4, rel=1e-15)
    assert r.entropy["0"] == 0.5 and r.layer_aux_loss == {"1": 0.2} and r.aux_loss == 0.2
    r = step(sig, 2, [6, 0, 6], [12, 0])
    assert r.dead == {"0": [1], "1": [1]}
    restored = make()
    restored.load_state_dict(sig.state_dict())
    r = step(restored, 1, [6, 0, 6], [12, 0])  # layer 0 seen on one rank only
    assert "0" not in r.tokens and "0" not in r.imbalance and "0" not in r.dead
    assert r.dead == {"1": [1]}  # the restored streak: a fresh signal would not call it dead yet
    assert step(make(), 2, [6, 0, 6], [12, 0]).dead == {"0": [], "1": []}


#: the starved-experts case: layer 1's balancing bias restored with experts 2 and 3 at -0.5
STARVED = {1: {2: -0.5, 3: -0.5}}
#: router.dead_after of _balancing_run
DEAD_AFTER = 5
#: steps of the starved case (dead from step DEAD_AFTER - 1 on; a short test)
STARVED_STEPS = 12


def dead_from_counts(reference: list[dict[str, torch.Tensor]], dead_after: int = DEAD_AFTER) -> list[dict]:
    """Per step ``{layer: [experts with no token on each of the last dead_after steps]}`` from
    float64 tokens per expert (``_balancing_run``'s ``reference``), counted over windows of steps
    (not as a running streak, as distgrad's host state does)."""
    out = []
    for s in range(len(reference)):
        win = reference[max(0, s - dead_after + 1):s + 1]
        out.append({lay: ([e for e in range(len(c)) if all(w[lay][e] == 0 for w in win)] if len(win) == dead_after
                          else []) for lay, c in reference[s].items()})
    return out


def test_starved_experts_dead_per_layer_equal_float64_recomputation():
    """The realistic dead-expert case: DeepSeek-V3's balancing bias is restored (a checkpoint taken
    under another data mix, or resharded with another expert order) with experts 2 and 3 of layer
    1 at -0.5. Its sigmoid scores lie in (0, 1) and stay near 0.5 for a young router, so their
    biased scores stay below the others' and they get no token; the bias update (gamma per step)
    needs ~0.5 / (2 gamma) = 125 steps to close the gap. Layer 1's dead experts
    (distgrad_router_layer_dead_experts{layer="1"}) equal those recomputed from the routers' own
    inputs in float64; layer 0 keeps all its experts; the load of layer 1 stays spread over two
    experts (imbalance about 2; above DistgradRouterCollapse's threshold of 3 on single steps, never
    for as long as its for:): only the dead-expert alert can name this layer."""
    from grafana import config as gconfig

    ref: list = []
    recs = _balancing_run(flipped_layer=None, steps=STARVED_STEPS, init_bias=STARVED, reference=ref)
    dead = dead_from_counts(ref)
    for r, counts, d in zip(recs, ref, dead):
        assert {k: v for k, v in r.tokens.items()} == {k: c.tolist() for k, c in counts.items()}  # exact integers
        assert r.dead == d
        served = RouterHealth.samples(r)
        assert served["distgrad_router_layer_dead_experts"] == {k: float(len(v)) for k, v in d.items()}
        assert served["distgrad_router_dead_experts"] == float(sum(len(v) for v in d.values()))
    assert all(d == {"0": [], "1": []} for d in dead[:DEAD_AFTER - 1])
    assert all(d == {"0": [], "1": [2, 3]} for d in dead[DEAD_AFTER - 1:]), dead
    threshold = gconfig.ALERTS["DistgradRouterCollapse"]["threshold"]
    print("starved layer 1: imbalance", [round(r.imbalance["1"], 2) for r in recs])
    # at one sampled step per 30 s (tests/monitoring/test_precursor_paging.py), the collapse alert's
    # for: needs more consecutive steps above its threshold than this case ever has
    from grafana.rule_replay import parse_duration

    longest, run = 0, 0
    for r in recs:
        run = run + 1 if r.imbalance["1"] > threshold else 0
        longest = max(longest, run)
    assert longest < parse_duration(gconfig.ALERTS["DistgradRouterCollapse"]["for"]) / 30.0, longest
