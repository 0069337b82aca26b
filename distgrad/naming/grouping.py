"""Exact re-aggregation of per-parameter gradient statistics, and the Prometheus series budget.

Pure numpy on :class:`~distgrad.record.ParamStats`; no torch, no distributed calls.

Re-aggregation
--------------
The per-parameter statistics are sufficient statistics, so a group of parameters is summarised
exactly from them (as if its gradients were concatenated into one tensor): ``numel``, ``sum``,
``sumsq``, ``nan``, ``inf``, ``zeros`` add; ``min`` is the min of the mins and ``max`` the max of
the maxes. A group norm is therefore ``sqrt(sum sumsq)`` (root-sum-square of the member norms),
its mean ``sum / numel``, its zero ratio ``zeros / numel``. NaN propagates as in ``torch``: a
group with a NaN element has NaN ``min``/``max`` (``torch.amin``/``amax``) and NaN ``sum``; a
group with both ``+Inf`` and ``-Inf`` elements has NaN ``sum``, as the concatenated tensor would.

Grouping keys (:func:`group_keys`), from :func:`distgrad.naming.classify.classify`:

* ``"param"``: the parameter name itself (identity grouping);
* ``"module"``: the canonical module path (``model.layers.3.self_attn.q_proj``; weight, bias
  and PEFT ``base_layer`` merge);
* ``"layer"``: the layer label (``"3"``, ``"enc.3"``, ``embed``, ``head``, ``norm``, ``other``);
* ``"module_kind"``: the kind (``attn_q``, ``mlp_up``, ...).

LoRA / DoRA parameters get groups of their own, side by side with the frozen or trained base
weights: the key is the base key followed by ``"/lora_<role>"``, e.g. at layer granularity
``"3/lora_A"``, ``"3/lora_B"``, ``"3/lora_magnitude"``, ``"embed/lora_embedding_A"``; at module
granularity ``"model.layers.3.self_attn.q_proj/lora_A"``. Adapter gradients are orders of
magnitude apart from base gradients (and the base is usually frozen), so mixing them would hide
both.

Series budget
-------------
Prometheus cost grows with the number of time series, so per-parameter series are exported only
for a selection of parameters (:func:`select_series`). The series of one scrape
(:func:`series_count`) are::

    series = PARAM_SERIES * k  +  LAYER_SERIES * L  +  KIND_SERIES * K  +  GLOBAL_SERIES

Every term is counted from the metric catalogue (:mod:`distgrad.export.metrics`, one declaration per
metric; ``Metric.series()`` is the series of one metric per value of its scope label):

* ``k``: parameters selected for per-parameter series; ``PARAM_SERIES = 10`` per selected
  parameter: the catalogue's ``param``-scoped metrics, i.e. ``distgrad_param_grad_{norm, mean,
  std, min, max, abs_max, zero_ratio, headroom_ratio}`` (8) plus
  ``distgrad_param_grad_nonfinite{kind=nan|inf}`` (2); ``+UPDATE_RATIO_SERIES`` (1,
  ``distgrad_param_update_ratio``) when the update-ratio option is on;
* ``L``: layer groups (layer-granularity keys, LoRA groups included);
  ``LAYER_SERIES = 8``: the catalogue's ``layer``-scoped metrics, today
  ``distgrad_layer_grad_{norm, nonfinite, zero_ratio, headroom_ratio, underflow_ratio}``,
  ``distgrad_layer_{update_rms, adam_spike_fraction}`` and the per-layer metrics the packed
  signals declare (:mod:`distgrad.signals`; the curvature's ``distgrad_layer_curvature``);
  given a configuration (``config=``), only the families it switches on are counted (below);
* ``K``: module-kind groups (kind-granularity keys); ``KIND_SERIES = 1``
  (``distgrad_module_kind_grad_norm``);
* ``GLOBAL_SERIES`` (about 180; the exact value is counted from the catalogue, the packed
  signals' metrics included, when first read): the
  catalogue's metrics of a fixed or capped series count (
  unlabelled ones, the three-valued ``detector`` families, ``distgrad_sink_errors_total{sink}``
  for its 4 sinks, ``distgrad_refused_steps_total{reason}`` for its 3 reasons,
  ``distgrad_nonfinite_params`` capped at 20, ``distgrad_nonfinite_culprit`` capped at 8, the loss
  components (3 x 8, and 8 x 2 spike counters), the token-loss bins (15), data sources (2 x 9),
  the gradient noise scale (5), the packed signals' own (the curvature: 1), the opt-in action's
  counter (2 causes) and stop gauge, and the optimizer signals (4 + 2 moment norms)) plus
  :data:`GLOBAL_RESERVE` (5) for exporter-side extras and metrics still to come.
  (prometheus_client's ``*_created`` samples and process collectors are not served by distgrad's
  exporter.)

Families switched by the configuration (each condition of
:data:`distgrad.export.metrics.SWITCHES`: ``router.enabled``, ``fp8.enabled``, ``logits.*``, ...,
and the default-on ones such as ``incidents.enabled`` or ``optimizer_signals.enabled``) are
counted only when the configuration passed as ``config`` switches them on (:func:`series_terms`);
without ``config`` every declared family is counted (the module constants: the most any
configuration serves). The opt-in families a configuration switches on (off by default) are
reported apart (:func:`opt_in_series`, logged at ``instrument()``), and
:func:`check_budget` fails ``instrument()`` with a ConfigError naming them, the count and what
to change when the layer, kind and global series alone exceed the budget.

The default budget is :data:`DEFAULT_SERIES_BUDGET` ``= 2500`` and the default ``top_k`` is
:data:`DEFAULT_TOP_K` ``= 100``. Example, LLaMA-70B (723 tensors, 80 blocks): L = 83 (80 blocks +
embed, norm, head), K = 10. With the default configuration (2026-12-02: LAYER_SERIES = 6 and
GLOBAL_SERIES = 192 for its families) the fixed part is 6*83 + 10 + 192 = 700, so at most
floor((2500 - 700) / 10) = 180 parameters can have per-parameter series; with the default top-k,
10*100 + 700 = 1700 series (1800 with the update ratio). With every family on (LAYER_SERIES = 14,
GLOBAL_SERIES = 273 on that date; both grow as metrics are declared) the fixed part is
14*83 + 10 + 273 = 1445 and the update-ratio case keeps floor((2500 - 1445) / 11) = 95
parameters (the router's per-layer dead-expert count, 2026-12-02, took it below the top-k); a step with many
non-finite parameters is capped below the budget (:func:`select_series`). The budget was 2000
until the opt-in families of 2026-12 (per-layer attention logits, incidents, replica checks),
then counted whether on or not, pushed the update-ratio case to 2066.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from distgrad.export import metrics as _metrics
from distgrad.naming import classify as naming
from distgrad.record import STAT_FIELDS, ParamStats

__all__ = [
    "GRANULARITIES",
    "DEFAULT_SERIES_BUDGET",
    "DEFAULT_TOP_K",
    "PARAM_SERIES",  # noqa: F822 - module __getattr__
    "LAYER_SERIES",  # noqa: F822 - module __getattr__
    "KIND_SERIES",  # noqa: F822 - module __getattr__
    "GLOBAL_SERIES",  # noqa: F822 - module __getattr__
    "GLOBAL_RESERVE",
    "UPDATE_RATIO_SERIES",  # noqa: F822 - module __getattr__
    "aggregate",
    "group_keys",
    "series_count",
    "series_capacity",
    "series_terms",
    "opt_in_series",
    "check_budget",
    "select_series",
]

GRANULARITIES = ("param", "module", "layer", "module_kind")

#: Default maximum number of Prometheus series exported by distgrad.
DEFAULT_SERIES_BUDGET = 2500
#: Default number of largest-norm parameters that get per-parameter series.
DEFAULT_TOP_K = 100
#: Series kept free in the global part for exporter extras and future metrics.
GLOBAL_RESERVE = 5


def _series_constants(config: Any = None) -> dict[str, int]:
    """The series per scope, counted from the catalogue when first asked for (module
    ``__getattr__``), so that the metrics of plug-ins (:mod:`distgrad.signals`), registered after
    this module is imported, are counted: ``PARAM_SERIES`` (per selected parameter),
    ``UPDATE_RATIO_SERIES`` (extra per parameter with the update-ratio option), ``LAYER_SERIES``
    (per layer group), ``KIND_SERIES`` (per module-kind group) and ``GLOBAL_SERIES`` (not
    proportional to parameters, layers or kinds, including :data:`GLOBAL_RESERVE`).

    ``config``: a ``DistgradConfig``; the families it switches off
    (:data:`distgrad.export.metrics.SWITCHES`) are not counted. None: every declared family (the
    module constants: the most any configuration can serve). ``UPDATE_RATIO_SERIES`` is always
    the option's own count (the ``update_ratio`` argument of :func:`series_count` decides)."""
    return {
        "PARAM_SERIES": _metrics.series_per("param", exclude=["update_ratio"], config=config),
        "UPDATE_RATIO_SERIES": _metrics.series_per("param", when=["update_ratio"]),
        "LAYER_SERIES": _metrics.series_per("layer", config=config),
        "KIND_SERIES": _metrics.series_per("module_kind", config=config),
        "GLOBAL_SERIES": _metrics.series_per(None, config=config) + GLOBAL_RESERVE,
    }


def series_terms(config: Any = None) -> dict[str, int]:
    """``{"PARAM_SERIES", "UPDATE_RATIO_SERIES", "LAYER_SERIES", "KIND_SERIES", "GLOBAL_SERIES":
    series}`` for the families ``config`` (a ``DistgradConfig``; None: all declared) enables:
    the terms of :func:`series_count` (module docstring)."""
    return _series_constants(config)


def opt_in_series(config: Any, n_layers: int, n_kinds: int) -> dict[str, int]:
    """The series of the opt-in families ``config`` switches on, reported apart:
    ``{condition: series on this layout}`` for each condition of
    :data:`distgrad.export.metrics.SWITCHES` that ``config`` enables and the default
    configuration (``type(config)()``) leaves off (e.g. ``{"router": 83 + 4}``: its per-layer
    series on ``n_layers`` layer groups plus its fixed ones). Empty with the defaults.

    Args:
        config: a ``DistgradConfig``.
        n_layers: layer groups; n_kinds: module-kind groups (as for :func:`series_count`).
    """
    off_now, off_default = _metrics.switched_off(config), _metrics.switched_off(type(config)())
    out: dict[str, int] = {}
    for key in _metrics.SWITCHES:
        if key in off_now or key not in off_default:
            continue
        n = 0
        for m in _metrics.CATALOGUE:
            if m.when != key or m.scope == "param":  # the update ratio: the update_ratio argument
                continue
            n += m.series() * {"layer": n_layers, "module_kind": n_kinds}.get(m.scope or "", 1)
        if n:
            out[key] = n
    return out


def check_budget(config: Any, names: Sequence[str], rules: Sequence[tuple[str, str, str]] | None = None) -> int:
    """Check at set-up that the series ``config`` enables fit its budget
    (``statistics.max_param_series``) on the parameters ``names`` without any per-parameter series.

    Returns:
        how many parameters can have per-parameter series (:func:`series_capacity`, >= 0).

    Raises:
        ValueError: the layer, kind and global series of the enabled families exceed the budget;
            the message gives the count, the opt-in families' share (:func:`opt_in_series`) and
            what to change (raise the budget to the count, switch a family off, or group the
            parameters into fewer layers with ``naming`` rules).
    """
    st = config.statistics
    n_layers = len(set(group_keys(names, "layer", rules)))
    n_kinds = len(set(group_keys(names, "module_kind", rules)))
    update_ratio = bool(st.per_param and st.update_ratio)
    cap = series_capacity(st.max_param_series, n_layers, n_kinds, update_ratio=update_ratio, config=config)
    if cap >= 0:
        return cap
    fixed = series_count(len(names), n_layers, n_kinds, 0, update_ratio=update_ratio, config=config)
    extra = opt_in_series(config, n_layers, n_kinds)
    fams = ", ".join(f"{k}: {v}" for k, v in sorted(extra.items(), key=lambda kv: -kv[1])) or "none"
    raise ValueError(
        f"distgrad config: 'statistics.max_param_series' {st.max_param_series} is below the {fixed} Prometheus "
        f"series this configuration serves without any per-parameter series ({n_layers} layer groups x "
        f"{_series_constants(config)['LAYER_SERIES']} per-layer series, {n_kinds} module kinds, the global ones; "
        f"opt-in families switched on: {fams}). Raise statistics.max_param_series to at least {fixed}, switch "
        "an opt-in family off, or group the parameters into fewer layers (naming rules)")


def __getattr__(name: str) -> int:
    """``PARAM_SERIES``, ``UPDATE_RATIO_SERIES``, ``LAYER_SERIES``, ``KIND_SERIES``,
    ``GLOBAL_SERIES``: see :func:`_series_constants`."""
    consts = _series_constants()
    if name in consts:
        return consts[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_SUMMED = ("numel", "sum", "sumsq", "nan", "inf", "zeros")


def aggregate(stats: ParamStats, keys: Sequence[str]) -> ParamStats:
    """Re-aggregate per-parameter sufficient statistics over groups of parameters.

    Args:
        stats: per-parameter statistics, every field a float64 array of shape ``[P]``.
        keys: group key of each parameter, ``len(keys) == P`` (e.g. from :func:`group_keys`).

    Returns:
        A :class:`ParamStats` with one entry per distinct key, ``names`` = the keys in order of
        first appearance, float64 arrays of shape ``[G]``. ``numel``, ``sum``, ``sumsq``,
        ``nan``, ``inf``, ``zeros`` are summed over the members; ``min`` is the minimum of the
        members' ``min`` and ``max`` the maximum of their ``max``, NaN if any member's is NaN
        (torch ``amin``/``amax`` semantics on the concatenated gradient). Members with
        ``numel == 0`` do not take part in ``min``/``max``; a group without elements has NaN
        ``min``/``max``. Counts stay exact (integers below 2**53); sums are float64 sums of the
        members' float64 sums (the formula of the textbook pooled moments:
        S1 = sum_i S1_i, S2 = sum_i S2_i).

    Raises:
        ValueError: ``len(keys) != P``.
    """
    n = len(stats.names)
    if len(keys) != n:
        raise ValueError(f"aggregate: {len(keys)} keys for {n} parameters")
    index: dict[str, int] = {}
    inv = np.empty(n, dtype=np.intp)
    for i, k in enumerate(keys):
        inv[i] = index.setdefault(k, len(index))
    g = len(index)

    out: dict[str, np.ndarray] = {}
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf -> NaN, as torch
        for f in _SUMMED:
            out[f] = group_sums(inv, getattr(stats, f), g)

        present = stats.numel > 0
        gmin = np.full(g, np.inf)
        gmax = np.full(g, -np.inf)
        np.minimum.at(gmin, inv[present], stats.min[present])  # np.minimum propagates NaN
        np.maximum.at(gmax, inv[present], stats.max[present])
        empty = out["numel"] == 0
        gmin[empty] = np.nan
        gmax[empty] = np.nan
    out["min"], out["max"] = gmin, gmax
    return ParamStats(names=list(index), **{f: out[f] for f in STAT_FIELDS})


def group_sums(inv: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Per-group sums of per-parameter values: the one summation behind every layer, module and
    kind aggregate (:func:`aggregate`, and the report's and TensorBoard sink's per-layer norms,
    :meth:`distgrad.naming.layers.LayerIndex.norms_and_nonfinite`).

    Args:
        inv: integer array ``[P]``, the group of each parameter, each in ``[0, n_groups)``.
        values: float64 array ``[P]``.
        n_groups: G.

    Returns:
        float64 array ``[G]``; each group's members added one by one in parameter order (the
        same float64 result as ``np.add.at``), NaN/Inf propagating; 0 for a group without members.
    """
    return np.bincount(inv, weights=values, minlength=n_groups).astype(np.float64, copy=False)


def group_keys(
    names: Sequence[str],
    granularity: str,
    rules: Sequence[tuple[str, str, str]] | None = None,
) -> list[str]:
    """Group key of each parameter name at a granularity.

    Args:
        names: parameter names, length P.
        granularity: ``"param"`` (the name), ``"module"`` (canonical module path), ``"layer"``
            (layer label) or ``"module_kind"`` (kind); see the module docstring.
        rules: user naming rules passed to :func:`distgrad.naming.classify.classify`.

    Returns:
        list of P strings. LoRA/DoRA parameters get ``"<key>/lora_<role>"``, e.g. layer ``"3"``
        and role ``A`` -> ``"3/lora_A"``; DoRA magnitude -> ``"3/lora_magnitude"``.

    Raises:
        ValueError: unknown granularity, or invalid rules (from ``classify``).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "param":
        return list(names)
    out = []
    for name in names:
        pg = naming.classify(name, rules)
        key = pg.module if granularity == "module" else pg.layer if granularity == "layer" else pg.module_kind
        if pg.lora is not None:
            key = f"{key}/lora_{pg.lora}"
        out.append(key)
    return out


def series_count(
    n_params: int,
    n_layers: int,
    n_kinds: int,
    selected: int | Sequence[int],
    *,
    update_ratio: bool = False,
    global_series: int | None = None,
    config: Any = None,
) -> int:
    """Number of Prometheus series distgrad exports (formula in the module docstring).

    ``PARAM_SERIES(+1) * k + LAYER_SERIES * n_layers + KIND_SERIES * n_kinds + global_series``.

    Args:
        n_params: number of tracked parameter tensors P (bounds ``k``).
        n_layers: number of layer groups (``len(set(group_keys(names, "layer")))``).
        n_kinds: number of module-kind groups.
        selected: k, or the selected parameter indices (from :func:`select_series`).
        update_ratio: the ``distgrad_param_update_ratio`` option is on (+1 series per param).
        global_series: series independent of P, layers and kinds.
        config: a ``DistgradConfig``: count only the families it enables (:func:`series_terms`);
            None: every declared family.

    Returns:
        the series count (int).

    Raises:
        ValueError: a negative argument or ``k > n_params``.
    """
    c = _series_constants(config)
    global_series = c["GLOBAL_SERIES"] if global_series is None else global_series
    k = selected if isinstance(selected, (int, np.integer)) else len(selected)
    if min(n_params, n_layers, n_kinds, k, global_series) < 0:
        raise ValueError("series_count: arguments must be >= 0")
    if k > n_params:
        raise ValueError(f"series_count: {k} selected of {n_params} parameters")
    per_param = c["PARAM_SERIES"] + (c["UPDATE_RATIO_SERIES"] if update_ratio else 0)
    return int(per_param * k + c["LAYER_SERIES"] * n_layers + c["KIND_SERIES"] * n_kinds + global_series)


def series_capacity(
    budget: int,
    n_layers: int,
    n_kinds: int,
    *,
    update_ratio: bool = False,
    global_series: int | None = None,
    config: Any = None,
) -> int:
    """Largest k with ``series_count(., n_layers, n_kinds, k) <= budget`` (same arguments, ``config``
    included); negative if even k = 0 exceeds the budget."""
    c = _series_constants(config)
    global_series = c["GLOBAL_SERIES"] if global_series is None else global_series
    per_param = c["PARAM_SERIES"] + (c["UPDATE_RATIO_SERIES"] if update_ratio else 0)
    fixed = c["LAYER_SERIES"] * n_layers + c["KIND_SERIES"] * n_kinds + global_series
    return (budget - fixed) // per_param


def select_series(
    stats: ParamStats,
    budget: int = DEFAULT_SERIES_BUDGET,
    top_k: int = DEFAULT_TOP_K,
    *,
    rules: Sequence[tuple[str, str, str]] | None = None,
    update_ratio: bool = False,
    global_series: int | None = None,
    config: Any = None,
) -> list[int]:
    """Choose the parameters that get per-parameter series this step.

    Rule: every parameter with a non-finite element (``nan + inf > 0``) or a non-finite norm is
    kept, those with the most non-finite elements first (ties: parameter order); then the
    ``top_k`` largest finite norms among the others (ties: parameter order). The total is capped
    at the budget's capacity ``floor((budget - 8 L - K - G) / 10)`` (module docstring), with L and
    K the layer and module-kind groups of ``stats.names``, so that
    ``series_count(P, L, K, result) <= budget`` always holds.

    Args:
        stats: per-parameter statistics (float64 arrays of shape ``[P]``).
        budget: maximum number of exported series (default 2500).
        top_k: number of largest-norm parameters kept besides the non-finite ones (>= 0).
        rules: user naming rules, as for :func:`distgrad.naming.classify.classify`.
        update_ratio: count the optional ``distgrad_param_update_ratio`` family.
        global_series: series independent of P, layers and kinds.
        config: a ``DistgradConfig``: count only the families it enables (None: all declared).

    Returns:
        sorted list of selected parameter indices (positions in ``stats.names``).

    Raises:
        ValueError: ``top_k < 0``, or ``budget`` below the series needed with no per-parameter
            series at all (layer, kind and global series).
    """
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    n_layers = len(set(group_keys(stats.names, "layer", rules)))
    n_kinds = len(set(group_keys(stats.names, "module_kind", rules)))
    cap = series_capacity(budget, n_layers, n_kinds, update_ratio=update_ratio, global_series=global_series,
                          config=config)
    if cap < 0:
        fixed = series_count(len(stats.names), n_layers, n_kinds, 0, update_ratio=update_ratio,
                             global_series=global_series, config=config)
        raise ValueError(f"series budget {budget} < {fixed} series needed without per-parameter series")
    norm = stats.norm
    bad = (stats.nonfinite > 0) | ~np.isfinite(norm)
    idx = np.arange(len(stats.names))
    bad_idx = idx[bad]
    # most non-finite elements first; stable sort keeps parameter order among ties
    bad_idx = bad_idx[np.argsort(-np.nan_to_num(stats.nonfinite[bad_idx], nan=0.0), kind="stable")]
    good_idx = idx[~bad]
    good_idx = good_idx[np.argsort(-norm[good_idx], kind="stable")][:top_k]
    chosen = np.concatenate([bad_idx, good_idx])[:cap]
    return sorted(int(i) for i in chosen)
