"""distgrad.naming.grouping: exact re-aggregation against statistics computed directly (torch float64) on
the concatenated gradients of each group, the series budget, parameter selection.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from distgrad.config import ConfigError, DistgradConfig
from distgrad.config.sections import StatisticsConfig
from distgrad.export import metrics
from distgrad.naming.grouping import (
    DEFAULT_SERIES_BUDGET,
    DEFAULT_TOP_K,
    GLOBAL_RESERVE,
    GLOBAL_SERIES,
    KIND_SERIES,
    LAYER_SERIES,
    PARAM_SERIES,
    UPDATE_RATIO_SERIES,
    aggregate,
    check_budget,
    group_keys,
    opt_in_series,
    select_series,
    series_capacity,
    series_count,
    series_terms,
)
from distgrad.diagnostics import Diagnostics
from distgrad.record import STAT_FIELDS, ParamStats
from tests.synthetic import llama70b_layout

FIXTURES = Path(__file__).parent / "fixtures" / "param_names"
RTOL = 1e-12


# ---------------------------------------------------------------- reference (torch, float64)


def torch_stats(g: torch.Tensor) -> dict[str, float]:
    """Statistics of one tensor computed directly by torch in float64."""
    g = g.reshape(-1).to(torch.float64)
    return {
        "numel": float(g.numel()),
        "sum": g.sum().item(),
        "sumsq": (g * g).sum().item(),
        "nan": torch.isnan(g).sum().item(),
        "inf": torch.isinf(g).sum().item(),
        "zeros": (g == 0).sum().item(),
        "min": torch.amin(g).item(),
        "max": torch.amax(g).item(),
    }


def per_param_stats(names: list[str], grads: list[torch.Tensor]) -> ParamStats:
    rows = [torch_stats(g) for g in grads]
    return ParamStats(names=list(names), **{f: np.array([r[f] for r in rows]) for f in STAT_FIELDS})


def reference_groups(keys: list[str], grads: list[torch.Tensor]) -> ParamStats:
    """Group statistics computed on the concatenation of each group's gradients."""
    order: list[str] = []
    members: dict[str, list[torch.Tensor]] = {}
    for k, g in zip(keys, grads):
        if k not in members:
            order.append(k)
            members[k] = []
        members[k].append(g.reshape(-1))
    rows = [torch_stats(torch.cat(members[k])) for k in order]
    return ParamStats(names=order, **{f: np.array([r[f] for r in rows]) for f in STAT_FIELDS})


def assert_stats_equal(got: ParamStats, want: ParamStats) -> None:
    assert got.names == want.names
    for f in STAT_FIELDS:
        np.testing.assert_allclose(getattr(got, f), getattr(want, f), rtol=RTOL, atol=0, equal_nan=True, err_msg=f)


def random_grads(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(shapes):
        scale = 10.0 ** float(torch.randint(-6, 2, (1,), generator=gen))
        # non-zero mean keeps group sums away from cancellation, so 1e-12 relative is meaningful
        g = (torch.randn(s, generator=gen, dtype=torch.float64) + 0.5) * scale
        if i % 3 == 0:  # exact zeros (ReLU-dead units, masked rows)
            g.view(-1)[:: 4] = 0.0
        out.append(g)
    return out


# ---------------------------------------------------------------- small fake model


def example_model(n_blocks: int = 3, d: int = 6, vocab: int = 11, ctx: int = 5):
    names, shapes = ["tok_emb.weight", "pos_emb.weight"], [(vocab, d), (ctx, d)]
    for i in range(n_blocks):
        for m, s in [
            ("ln1.weight", (d,)), ("ln1.bias", (d,)),
            ("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
            ("attn.proj.weight", (d, d)), ("attn.proj.bias", (d,)),
            ("ln2.weight", (d,)), ("ln2.bias", (d,)),
            ("mlp.fc.weight", (4 * d, d)), ("mlp.fc.bias", (4 * d,)),
            ("mlp.proj.weight", (d, 4 * d)), ("mlp.proj.bias", (d,)),
        ]:
            names.append(f"blocks.{i}.{m}")
            shapes.append(s)
    names += ["ln_f.weight", "ln_f.bias", "head.weight"]
    shapes += [(d,), (d,), (vocab, d)]
    return names, shapes


@pytest.fixture
def fake_model():
    names, shapes = example_model()
    grads = random_grads(shapes, seed=1)
    i = names.index
    grads[i("blocks.1.attn.qkv.weight")].view(-1)[7] = float("nan")
    grads[i("blocks.1.mlp.fc.weight")].view(-1)[3] = float("inf")  # layer 1: NaN and +inf
    grads[i("blocks.2.mlp.proj.weight")].view(-1)[0] = float("inf")
    grads[i("blocks.2.attn.proj.weight")].view(-1)[1] = float("-inf")  # layer 2: +inf and -inf -> sum NaN
    grads[i("ln_f.bias")].zero_()  # all-zero parameter
    grads[i("head.weight")].view(-1)[5] = float("-inf")
    return names, grads


@pytest.mark.parametrize("granularity", ["param", "module", "layer", "module_kind"])
def test_aggregate_matches_concatenated_reference(fake_model, granularity):
    names, grads = fake_model
    stats = per_param_stats(names, grads)
    keys = group_keys(names, granularity)
    got = aggregate(stats, keys)
    assert_stats_equal(got, reference_groups(keys, grads))


def test_aggregate_nan_inf_semantics(fake_model):
    names, grads = fake_model
    got = aggregate(per_param_stats(names, grads), group_keys(names, "layer"))
    row = {n: i for i, n in enumerate(got.names)}
    assert got.names == ["embed", "0", "1", "2", "norm", "head"]
    l1, l2 = row["1"], row["2"]
    assert np.isnan(got.min[l1]) and np.isnan(got.max[l1]) and np.isnan(got.sum[l1])  # NaN element
    assert got.nan[l1] == 1 and got.inf[l1] == 1
    assert np.isnan(got.sum[l2]) and got.sumsq[l2] == np.inf  # +inf and -inf
    assert got.min[l2] == -np.inf and got.max[l2] == np.inf and got.nan[l2] == 0 and got.inf[l2] == 2
    assert got.min[row["head"]] == -np.inf and got.sum[row["head"]] == -np.inf
    assert np.isfinite(got.norm[row["0"]]) and got.nonfinite[row["0"]] == 0
    # group norm = root-sum-square of member norms
    stats = per_param_stats(names, grads)
    members = [i for i, n in enumerate(names) if n.startswith("blocks.0.")]
    np.testing.assert_allclose(got.norm[row["0"]], np.sqrt(np.sum(stats.norm[members] ** 2)), rtol=RTOL)


def test_aggregate_first_appearance_order_and_identity():
    names, shapes = example_model(n_blocks=2)
    grads = random_grads(shapes, seed=3)
    stats = per_param_stats(names, grads)
    same = aggregate(stats, names)
    assert same.names == names
    for f in STAT_FIELDS:
        np.testing.assert_array_equal(getattr(same, f), getattr(stats, f))
    keys = ["b", "a", "b", "c"] + ["a"] * (len(names) - 4)
    assert aggregate(stats, keys).names == ["b", "a", "c"]


def test_aggregate_empty_members_and_errors():
    stats = ParamStats(
        names=["e", "x", "e2"],
        numel=[0, 3, 0], sum=[0, 3, 0], sumsq=[0, 5, 0], nan=[0, 0, 0], inf=[0, 0, 0], zeros=[0, 1, 0],
        min=[np.nan, -1.0, np.inf], max=[np.nan, 2.0, -np.inf],
    )
    got = aggregate(stats, ["g", "g", "h"])
    assert got.names == ["g", "h"]
    assert (got.min[0], got.max[0]) == (-1.0, 2.0)  # the empty member is ignored
    assert np.isnan(got.min[1]) and np.isnan(got.max[1]) and got.numel[1] == 0
    with pytest.raises(ValueError):
        aggregate(stats, ["g"])
    with pytest.raises(ValueError):
        group_keys(stats.names, "block")


# ---------------------------------------------------------------- LoRA


def _fixture_names(arch: str) -> list[str]:
    text = (FIXTURES / f"{arch}.txt").read_text().splitlines()
    return [ln for ln in text if ln.strip() and not ln.startswith("#")]


def _lora_shape(name: str, d: int = 8, r: int = 2, vocab: int = 16, ffn: int = 12) -> tuple[int, ...]:
    if "lora_embedding_A" in name:
        return (r, vocab)
    if "lora_embedding_B" in name:
        return (d, r)
    if "embed_tokens" in name or "lm_head" in name:
        return (vocab, d)
    out_dim = ffn if ("gate_proj" in name or "up_proj" in name) else d
    in_dim = ffn if "down_proj" in name else d
    if ".lora_A." in name:
        return (r, in_dim)
    if ".lora_B." in name:
        return (out_dim, r)
    if "lora_magnitude_vector" in name:
        return (out_dim,)
    if "norm" in name:
        return (d,)
    return (out_dim, in_dim)


@pytest.mark.parametrize(
    "arch,expected",
    [
        ("peft_lora_llama",
         ["embed", "embed/lora_embedding_A", "embed/lora_embedding_B", "0", "0/lora_A", "0/lora_B",
          "1", "1/lora_A", "1/lora_B", "norm", "head"]),
        ("peft_dora_llama",
         ["embed", "0", "0/lora_A", "0/lora_B", "0/lora_magnitude", "1", "1/lora_A", "1/lora_B",
          "1/lora_magnitude", "norm", "head"]),
    ],
)
def test_lora_groups_side_by_side(arch, expected):
    names = _fixture_names(arch)
    grads = random_grads([_lora_shape(n) for n in names], seed=4)
    lora_b = names.index("base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight")
    grads[lora_b].view(-1)[2] = float("nan")
    keys = group_keys(names, "layer")
    got = aggregate(per_param_stats(names, grads), keys)
    assert got.names == expected
    assert_stats_equal(got, reference_groups(keys, grads))
    assert got.nan[got.names.index("1/lora_B")] == 1 and got.nan[got.names.index("1")] == 0
    kinds = aggregate(per_param_stats(names, grads), group_keys(names, "module_kind"))
    assert "attn_q/lora_A" in kinds.names and "attn_q" in kinds.names
    mods = group_keys(names, "module")
    assert "model.layers.0.self_attn.q_proj" in mods and "model.layers.0.self_attn.q_proj/lora_B" in mods


# ---------------------------------------------------------------- 70B layout


@pytest.fixture(scope="module")
def llama70b():
    names, shapes = llama70b_layout()
    assert len(names) == 723
    grads = random_grads(shapes, seed=70)
    return names, grads, per_param_stats(names, grads)


def test_llama70b_series_within_default_budget(llama70b):
    names, _, stats = llama70b
    n_layers = len(set(group_keys(names, "layer")))
    n_kinds = len(set(group_keys(names, "module_kind")))
    assert (n_layers, n_kinds) == (83, 10)
    cfg = DistgradConfig()  # the default configuration: the families it enables are counted
    sel = select_series(stats, config=cfg)  # defaults: budget 2500, top_k 100
    assert len(sel) == DEFAULT_TOP_K
    count = series_count(len(names), n_layers, n_kinds, sel, config=cfg)
    t = series_terms(cfg)
    assert count == t["PARAM_SERIES"] * 100 + t["LAYER_SERIES"] * 83 + t["KIND_SERIES"] * 10 + t["GLOBAL_SERIES"]
    assert count <= DEFAULT_SERIES_BUDGET
    assert series_count(len(names), n_layers, n_kinds, sel, update_ratio=True, config=cfg) <= DEFAULT_SERIES_BUDGET
    # without a configuration every declared family is counted (the module constants)
    assert series_count(len(names), n_layers, n_kinds, sel) == (
        PARAM_SERIES * 100 + LAYER_SERIES * 83 + KIND_SERIES * 10 + GLOBAL_SERIES) >= count
    # the selection is the top-k by norm
    norms = stats.norm
    assert min(norms[sel]) >= max(np.delete(norms, sel))


#: every family the configuration switches on or off, switched on (the update ratio included)
ALL_ON = {"router.enabled": True, "fp8.enabled": True, "curvature.enabled": True, "histogram.enabled": True,
          "noise_scale.enabled": True, "underflow.enabled": True, "rerun.enabled": True, "logits.attention": True,
          "logits.output": True, "update_geometry.enabled": True, "update_geometry.spectral": True,
          "replica_weights.hash_interval": 10, "adaptive_clip.mode": "zclip", "action.on_nonfinite": "skip",
          "statistics.update_ratio": True}


def _by_hand(cfg, n_layers, n_kinds, k, update_ratio):
    """The series count written out from the catalogue entries and the configuration's own keys
    (each family's switch read here from its section, not through metrics.SWITCHES)."""
    on = {"router": cfg.router.enabled, "fp8": cfg.fp8.enabled, "curvature": cfg.curvature.enabled,
          "histogram": cfg.histogram.enabled, "noise_scale": cfg.noise_scale.enabled,
          "underflow": cfg.underflow.enabled, "rerun": cfg.rerun.enabled,
          "logits": cfg.logits.attention or cfg.logits.output,
          "update_geometry": cfg.update_geometry.enabled, "update_geometry_muon": cfg.update_geometry.enabled,
          "update_geometry_adafactor": cfg.update_geometry.enabled,
          "update_geometry_spectral": cfg.update_geometry.enabled and cfg.update_geometry.spectral,
          "replica_weights": cfg.replica_weights.hash_interval > 0, "adaptive_clip": cfg.adaptive_clip.mode != "off",
          "action": cfg.action.on_nonfinite != "none" or cfg.action.on_spike != "none",
          "incident": cfg.incidents.enabled, "replicated": cfg.statistics.replica_check,
          "adam": cfg.optimizer_signals.enabled != "off", "duplicate_data": cfg.duplicate_data.steps > 0}
    assert set(on) == set(metrics.SWITCHES) - {"update_ratio"}  # a new switch: add it here
    n = GLOBAL_RESERVE
    for m in metrics.CATALOGUE:
        if m.when == "update_ratio":
            n += m.series() * k if update_ratio else 0
        elif on.get(m.when, True):
            n += m.series() * {"param": k, "layer": n_layers, "module_kind": n_kinds}.get(m.scope or "", 1)
    return n


def test_llama70b_budget_counts_the_enabled_families_and_reports_the_opt_in_ones(llama70b):
    names, _, stats = llama70b
    default, all_on = DistgradConfig(), DistgradConfig.from_dict(ALL_ON)
    assert metrics.switched_off(all_on) == set()
    assert opt_in_series(default, 83, 10) == {}  # nothing opt-in is on by default
    for cfg, ratio in ((default, False), (default, True), (all_on, True)):
        for k in (0, 100):
            assert series_count(len(names), 83, 10, k, update_ratio=ratio, config=cfg) == _by_hand(cfg, 83, 10, k, ratio)
    # all on = everything declared; the difference to the defaults is what opt_in_series reports
    assert series_terms(all_on) == series_terms()
    extra = opt_in_series(all_on, 83, 10)
    assert set(extra) == metrics.switched_off(default) - {"update_ratio"} - {
        k for k in metrics.SWITCHES if not any(m.when == k for m in metrics.CATALOGUE)}
    assert (series_count(len(names), 83, 10, 100, config=all_on)
            == series_count(len(names), 83, 10, 100, config=default) + sum(extra.values()))
    router = DistgradConfig(router={"enabled": True})
    assert set(opt_in_series(router, 83, 10)) == {"router"}
    assert opt_in_series(router, 83, 10)["router"] == extra["router"] > 0
    # with everything on, the selection still keeps the scrape within the budget (fewer parameters)
    sel = select_series(stats, update_ratio=True, config=all_on)
    assert series_count(len(names), 83, 10, sel, update_ratio=True, config=all_on) <= DEFAULT_SERIES_BUDGET
    cap = series_capacity(DEFAULT_SERIES_BUDGET, 83, 10, update_ratio=True, config=all_on)
    assert cap == (DEFAULT_SERIES_BUDGET - _by_hand(all_on, 83, 10, 0, True)) // (PARAM_SERIES + 1)
    assert len(sel) == min(DEFAULT_TOP_K, cap)


def test_llama70b_opt_in_families_over_the_budget_give_a_clear_error(llama70b):
    names, _, _ = llama70b
    fixed_default = _by_hand(DistgradConfig(), 83, 10, 0, False)
    fixed_all = _by_hand(DistgradConfig.from_dict(ALL_ON), 83, 10, 0, True)
    assert fixed_default < fixed_all
    budget = max(50, fixed_default + 50)  # the defaults fit (50 / 10 = 5 parameters), everything on does not
    assert budget < fixed_all
    small = DistgradConfig(statistics={"max_param_series": budget})
    assert check_budget(small, names) == (budget - fixed_default) // PARAM_SERIES == 5
    Diagnostics(small, names)  # instrument()'s diagnostics accept it
    over = DistgradConfig.from_dict({**ALL_ON, "statistics.max_param_series": budget})
    with pytest.raises(ValueError) as e:
        check_budget(over, names)
    msg = str(e.value)
    assert f"'statistics.max_param_series' {budget} is below the {fixed_all} Prometheus series" in msg, msg
    assert "83 layer groups" in msg and f"at least {fixed_all}" in msg and "naming rules" in msg, msg
    extra = opt_in_series(over, 83, 10)
    assert f"router: {extra['router']}" in msg and f"update_geometry: {extra['update_geometry']}" in msg, msg
    with pytest.raises(ConfigError, match="statistics.max_param_series"):
        Diagnostics(over, names)  # at instrument() time, before any step
    # one more series of budget than the fixed part: no error, no per-parameter series
    assert check_budget(DistgradConfig.from_dict({**ALL_ON, "statistics.max_param_series": fixed_all}), names) == 0
    # through instrument(): a budget below the global series alone fails before any step
    import distgrad

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="Raise statistics.max_param_series to at least"):
        distgrad.instrument(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), exporter={"enabled": False},
                            statistics={"max_param_series": 50})


def test_opt_in_families_logged_with_their_series_at_set_up(llama70b, caplog):
    names, _, _ = llama70b
    router = DistgradConfig(router={"enabled": True})
    n = opt_in_series(router, 83, 10)["router"]
    # the router's per-layer dead-expert count on every layer group plus its fixed-count metrics
    per_layer = sum(m.series() for m in metrics.CATALOGUE if m.when == "router" and m.scope == "layer")
    fixed = sum(m.series() for m in metrics.CATALOGUE if m.when == "router" and m.scope is None)
    assert per_layer >= 1 and n == per_layer * 83 + fixed
    with caplog.at_level("INFO", logger="distgrad"):
        Diagnostics(router, names)
        Diagnostics(router, names, global_rank=1)  # one line for the job, from rank 0
        Diagnostics(DistgradConfig(), names)  # nothing opt-in: no line
    lines = [r.getMessage() for r in caplog.records if "opt-in metric families" in r.getMessage()]
    assert lines == [f"distgrad: opt-in metric families switched on serve {n} Prometheus series (router: {n}) of "
                     "the budget statistics.max_param_series = 2500"], lines


def test_llama70b_nonfinite_params_kept_and_budget_holds(llama70b):
    names, _, stats = llama70b
    bad = [5, 100, 700]  # small-norm tensors somewhere in the model
    nan = stats.nan.copy()
    nan[bad] = [1, 3, 2]
    sumsq = stats.sumsq.copy()
    sumsq[bad] = np.nan
    s2 = ParamStats(**{**{f: getattr(stats, f) for f in STAT_FIELDS}, "nan": nan, "sumsq": sumsq, "names": names})
    sel = select_series(s2)
    assert set(bad) <= set(sel) and len(sel) == DEFAULT_TOP_K + 3
    # every parameter non-finite: capped at the budget's capacity, most non-finite first
    nan_all = np.arange(len(names), dtype=np.float64) % 7 + 1
    s3 = ParamStats(**{**{f: getattr(stats, f) for f in STAT_FIELDS}, "nan": nan_all, "names": names})
    fixed = LAYER_SERIES * 83 + KIND_SERIES * 10 + GLOBAL_SERIES  # layers, kinds and the global part
    for budget in (2000, (fixed + 2000) // 2, fixed, fixed + 1, fixed + 10):  # one between fixed and 2000
        sel = select_series(s3, budget=budget, top_k=10)
        assert series_count(len(names), 83, 10, sel) <= budget
        assert len(sel) == series_capacity(budget, 83, 10) == max(0, (budget - fixed) // 10)
        if sel:
            assert min(nan_all[sel]) >= max(np.delete(nan_all, sel))
    with pytest.raises(ValueError):
        select_series(s3, budget=405)
    with pytest.raises(ValueError):
        select_series(s3, top_k=-1)


def test_llama70b_layer_reaggregation_exact(llama70b):
    names, grads, stats = llama70b
    grads = [g.clone() for g in grads]
    grads[names.index("model.layers.41.mlp.down_proj.weight")].view(-1)[9] = float("nan")
    grads[names.index("model.layers.63.self_attn.k_proj.weight")].view(-1)[0] = float("inf")
    stats = per_param_stats(names, grads)
    keys = group_keys(names, "layer")
    got = aggregate(stats, keys)
    assert got.names == ["embed"] + [str(i) for i in range(80)] + ["norm", "head"]
    assert_stats_equal(got, reference_groups(keys, grads))
    # global norm from the layer groups equals the global norm over all elements
    finite = np.isfinite(got.sumsq)
    flat = torch.cat([g.reshape(-1) for g, k in zip(grads, keys) if k not in ("41", "63")])
    np.testing.assert_allclose(np.sqrt(got.sumsq[finite].sum()), torch.linalg.vector_norm(flat).item(), rtol=RTOL)


def test_series_count_arithmetic():
    # the terms are counted from the catalogue (they grow as metrics are added); the arithmetic
    # is checked against the formula written out, and the LLaMA-70B capacity stays >= the top-k
    fixed = LAYER_SERIES * 83 + KIND_SERIES * 10 + GLOBAL_SERIES
    assert series_count(723, 83, 10, 0) == fixed
    assert series_count(723, 83, 10, [1, 2, 3]) == fixed + 3 * PARAM_SERIES
    assert series_count(723, 83, 10, 3, update_ratio=True) == fixed + 3 * (PARAM_SERIES + UPDATE_RATIO_SERIES)
    budget = StatisticsConfig().max_param_series  # the default budget (2,500)
    cap = series_capacity(budget, 83, 10)
    assert cap == (budget - fixed) // PARAM_SERIES >= DEFAULT_TOP_K
    assert series_count(723, 83, 10, cap) <= budget < series_count(723, 83, 10, cap + 1)
    with pytest.raises(ValueError):
        series_count(3, 1, 1, 4)
    with pytest.raises(ValueError):
        series_count(3, -1, 1, 0)


def test_select_series_small_model_tie_and_order():
    names, shapes = example_model(n_blocks=2)
    stats = per_param_stats(names, random_grads(shapes, seed=9))
    sel = select_series(stats, top_k=len(names) + 5)
    assert sel == list(range(len(names)))  # small model: everything fits
    assert select_series(stats, top_k=0) == []
    top3 = select_series(stats, top_k=3)
    assert top3 == sorted(np.argsort(-stats.norm, kind="stable")[:3].tolist())
