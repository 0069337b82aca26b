"""MoE router health (opt-in, ``router.enabled``): tokens per expert per MoE layer, summed over
the sampled step's micro-batches of every rank (so across the expert-parallel and the
data-parallel ranks: the job's global count), the load imbalance (max / mean), its coefficient
of variation, dead experts (no token for ``router.dead_after`` sampled steps), the router
entropy, and the auxiliary load-balancing loss where the model computes one.

Why: a router that sends every token to a few experts wastes the other experts' parameters and
compute (the model trains as a smaller dense one), and one that collapses never recovers without
intervention (Switch Transformer, arXiv 2101.03961 sec. 2.2; GShard's auxiliary loss, arXiv
2006.16668); users ask for per-layer expert load (Megatron-LM issue #2398), the overload factor
(Megatron-LM PR #4110) and dead experts, which DeepSpeed MoE and Hugging Face MoE models compute
inside the forward and never expose.

Router modules (``router.modules``: a regular expression on module names, wrapper prefixes
removed; default automatic):

* DeepSpeed MoE (``deepspeed.moe.sharded_moe.TopKGate``, the gate of ``deepspeed.moe.layer.MoE``):
  a forward hook reads the gate's own ``exp_counts`` (the last element of its output: tokens per
  expert of the top-k assignment, before capacity drops) and ``l_aux`` (the first), and
  recomputes the router logits ``x.float() @ wg.weight.float().T`` from the gate's input (what
  ``TopKGate.forward`` computes; with ``noisy_gate_policy='Jitter'`` the entropy is the one of
  the un-jittered input);
* Hugging Face MoE routers (Mixtral, Qwen2-MoE, ...: a module whose class name ends in
  ``Router`` with a ``weight`` and a ``top_k``, returning ``(router_logits, scores,
  indices)``): a forward hook counts ``indices`` (the top-k assignment) and takes the entropy of
  ``softmax(router_logits)``; a module returning only the logits tensor is counted by its own
  ``top_k`` attribute (``topk`` of the logits). The model's ``aux_loss`` output
  (``output_router_logits=True``) is read by a forward hook on the root module.

Quantities (per MoE layer, layer label as the other per-layer metrics):

* ``tokens[e]``: token-to-expert assignments of expert ``e`` (a token routed to k experts counts
  once for each), summed over micro-batches and ranks; exact integers in float64;
* imbalance ``max_e tokens[e] / mean_e tokens[e]`` (1 = balanced; ``E / k`` when every token
  goes to the same k experts: Megatron's overload factor of the busiest expert);
* coefficient of variation ``std_e tokens[e] / mean_e tokens[e]`` (population std);
* entropy: mean over tokens of ``-sum_e p_e log p_e``, ``p = softmax(router logits)`` (nats;
  ``log E`` for a uniform router, 0 for a one-hot one), computed in float64 from the logits;
* dead experts: experts with no token on each of the last ``router.dead_after`` sampled steps
  (host state, checkpointed);
* auxiliary loss: DeepSpeed: per layer the mean over its forward calls of the gate's ``l_aux``,
  and their sum over layers (what a DeepSpeed loop adds to its loss); Hugging Face: the mean
  over forward calls of the model's ``aux_loss`` (before ``router_aux_loss_coef``).

Sampling and cost: the hooks compute only on the forwards of a step that will be sampled
(decided from the step counters every rank shares, as :mod:`distgrad.signals.logits`) with
gradients enabled; per call one ``[tokens, E]`` log-softmax in float64 and a scatter-add of the
assignments (DeepSpeed: plus the ``[tokens, d] x [d, E]`` logits product), all on the device,
no host sync. Collectives: ``2 + sum_l (5 + E_l)`` float64 in the SUM part (per layer: observed
on this rank, forward calls, tokens, entropy sum, aux-loss sum, the E_l counts; globally the
model's aux-loss sum and calls), nothing in the MAX part. A layer not observed on every rank is
left out of the step's record.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from distgrad.config.errors import ConfigError
from distgrad.config.sections import Section
from distgrad.export.metrics import condition, gauge, label
from distgrad.naming.canonical import clean_name
from distgrad.naming.grouping import group_keys
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal

__all__ = ["RouterHealth", "router_entropy_sum", "expert_counts", "load_stats"]

#: per-layer slots before the expert counts: observed, calls, tokens, entropy sum, aux sum
_HEAD = 5
#: rows of the [tokens, E] logits per chunk of the entropy computation
CHUNK_ROWS = 1 << 16
#: MoE layers served per step with their imbalance (the most unbalanced; the record has every layer)
MAX_LAYER_SERIES = 8
_MOE_LAYER = label("moe_layer", "a MoE layer, named as the `layer` label of its router's parameters; at most "
                   f"{MAX_LAYER_SERIES} series, the most unbalanced layers of the sampled step (`router.enabled`)")


def router_entropy_sum(logits: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the softmax entropy of router logits.

    Args:
        logits: ``[..., E]`` router logits (any float dtype, any device).

    Returns:
        0-d float64 tensor on the logits' device: ``sum_t -sum_e p_te log p_te`` with
        ``p_t = softmax(logits_t)`` computed in float64 (nats; autocast off), in row chunks.
    """
    x = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.zeros((), dtype=torch.float64, device=x.device)
    with torch.autocast(x.device.type, enabled=False):
        for r0 in range(0, x.shape[0], CHUNK_ROWS):
            lp = torch.log_softmax(x[r0:r0 + CHUNK_ROWS].double(), dim=-1)
            out = out - (lp.exp() * lp).nan_to_num(0.0).sum()  # 0 log 0 = 0
    return out


def expert_counts(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens per expert of a top-k assignment without a host sync (no ``bincount``).

    Args:
        indices: integer tensor of expert indices in ``[0, n_experts)``, any shape (``[T, k]``).
        n_experts: E.

    Returns:
        float64 ``[E]`` on the indices' device: how many entries of ``indices`` equal each ``e``.
    """
    idx = indices.detach().reshape(-1).long()
    return torch.zeros(n_experts, dtype=torch.float64, device=idx.device).scatter_add_(
        0, idx, torch.ones(idx.numel(), dtype=torch.float64, device=idx.device))


def load_stats(tokens: Sequence[float]) -> tuple[float, float]:
    """``(max / mean, std / mean)`` of tokens per expert (population std), float64 on the host;
    ``(nan, nan)`` when no token was routed."""
    t = np.asarray(tokens, dtype=np.float64)
    mean = t.mean() if t.size else 0.0
    if not mean > 0:
        return math.nan, math.nan
    return float(t.max() / mean), float(t.std() / mean)


def _deepspeed_gate_type() -> type | None:
    mod = sys.modules.get("deepspeed.moe.sharded_moe")
    return getattr(mod, "TopKGate", None) if mod is not None else None


def _is_hf_router(m: Any) -> bool:
    return (type(m).__name__.endswith("Router") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and isinstance(getattr(m, "top_k", None), int))


def _n_experts(m: Any) -> int:
    wg = getattr(m, "wg", None)
    if wg is not None and hasattr(wg, "out_features"):
        return int(wg.out_features)
    for attr in ("num_experts", "n_routed_experts", "num_local_experts"):
        v = getattr(m, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[0])
    raise ConfigError(f"distgrad config: 'router.modules': cannot tell the expert count of {type(m).__name__}")


class RouterHealth(PackedSignal):
    """MoE router health (see the module docstring).

    Args:
        interval: ``sampling.interval`` (which steps are sampled).
        modules: regex selecting the router modules (None: automatic).
        dead_after: sampled steps without a token before an expert counts as dead.
        naming_rules: ``naming.tuples`` (layer labels as the other per-layer metrics).

    SUM part (float64 ``[2 + sum_l (5 + E_l)]``): ``[model aux sum, model aux calls]`` then per
    layer ``[observed, calls, tokens, entropy sum, l_aux sum, tokens per expert (E_l)]``.
    Record part: :class:`RouterHealth.Part` (``StepRecord.router``).
    """

    name = "router"

    class Config(Section):
        """MoE router health (DeepSpeed MoE, Hugging Face Mixtral / Qwen-MoE style routers): tokens
        per expert per MoE layer summed over every rank, imbalance, dead experts, router entropy,
        auxiliary loss (see docs/signals.md, "MoE router health")."""

        section_key: ClassVar[str] = "router"
        enabled: bool = Field(False, description=(
            "Watch the MoE routers: on the forwards of sampled steps a hook on each router counts "
            "the tokens sent to each expert and the softmax entropy of its logits (device work, no "
            "host sync); 2 + sum over MoE layers of (5 + experts) float64 ride in the step's SUM "
            "collective."))
        modules: str | None = Field(None, description=(
            "Regular expression on module names (wrapper prefixes removed) selecting the router "
            "modules; unset: every DeepSpeed TopKGate and every Hugging Face module whose class name "
            "ends in Router (with weight and top_k)."))
        dead_after: int = Field(20, ge=1, description=(
            "An expert is dead after this many consecutive sampled steps in which the whole job "
            "routed no token to it (distgrad_router_dead_experts)."))

    @dataclass
    class Part(_Part):
        """MoE router health of one sampled step, over the training forwards of the step's
        micro-batches on every rank (sums over ranks).

        Attributes:
            tokens: ``{layer: [token assignments per expert]}`` (a token routed to k experts is
                counted for each of them; exact integers).
            imbalance: ``{layer: max / mean of tokens}`` (1: balanced; E/k: collapsed onto k
                experts); absent for a layer that routed no token.
            cv: ``{layer: std / mean of tokens}`` (population std).
            entropy: ``{layer: mean over tokens of the router softmax entropy}`` (nats).
            routed: ``{layer: tokens the router saw}`` (each token once).
            dead: ``{layer: [experts without a token on each of the last dead_after sampled
                steps]}``.
            layer_aux_loss: ``{layer: mean over forward calls of DeepSpeed's l_aux}``.
            aux_loss: the auxiliary load-balancing loss: DeepSpeed the sum over layers of
                ``layer_aux_loss``; Hugging Face the mean over forward calls of the model's
                ``aux_loss``; None when the model computes none.
        """

        tokens: dict[str, list[float]] = field(default_factory=dict)
        imbalance: dict[str, float] = field(default_factory=dict)
        cv: dict[str, float] = field(default_factory=dict)
        entropy: dict[str, float] = field(default_factory=dict)
        routed: dict[str, int] = field(default_factory=dict)
        dead: dict[str, list[int]] = field(default_factory=dict)
        layer_aux_loss: dict[str, float] = field(default_factory=dict)
        aux_loss: float | None = None

    _when = condition("router", "`router.enabled: true`, after a sampled step whose MoE routers were observed on "
                      "every rank (see docs/signals.md)",
                      enabled=lambda c: c.router.enabled)
    METRICS = (
        gauge("distgrad_router_load_imbalance", "1", "Max over experts / mean over experts of the tokens routed "
              "to each expert in the sampled step (all ranks), per MoE layer (the most unbalanced ones).", _when,
              (_MOE_LAYER,), max_series=MAX_LAYER_SERIES,
              doc=f"1 when balanced, E/k when every token goes to the same k experts (the overload factor of the "
                  f"busiest expert), for the {MAX_LAYER_SERIES} most unbalanced MoE layers of the step (a bounded "
                  "label: a layer-scoped metric would be counted for every layer of every model by the series "
                  "budget); DistgradRouterCollapse pages above its threshold; every layer's value, counts per "
                  "expert, coefficient of variation and entropy are in the JSONL record (`router.*`)"),
        gauge("distgrad_router_dead_experts", "experts", "Experts that got no token on each of the last "
              "router.dead_after sampled steps (all ranks), summed over MoE layers.", _when,
              doc="the sum over layers of `distgrad_router_layer_dead_experts`; the expert indices are in the JSONL "
                  "record (`router.dead`)"),
        gauge("distgrad_router_layer_dead_experts", "experts", "Experts of a MoE layer that got no token on each of "
              "the last router.dead_after sampled steps (all ranks).", _when, ("layer",),
              doc="one series per MoE layer observed on every rank (0 while its experts all get tokens), `layer` as "
                  "the other per-layer metrics (the layer of the router's parameters), so the series budget counts "
                  "it once per layer group when `router.enabled` (a layer with two routers: the second router's "
                  "module name); DistgradRouterDeadExperts fires on it and names the layers; the expert indices are "
                  "in the JSONL record (`router.dead`)"),
        gauge("distgrad_router_entropy_min_nats", "nats", "Lowest over MoE layers of the mean over tokens of the "
              "entropy of the router's softmax.", _when, doc="`log E` for a uniform router, 0 for a one-hot one"),
        gauge("distgrad_router_aux_loss", "1", "Auxiliary load-balancing loss of the MoE layers (DeepSpeed: sum "
              "over layers of l_aux; Hugging Face: the model's aux_loss), mean over the sampled step's forwards.",
              _when, doc="absent when the model computes none"),
    )

    @staticmethod
    def samples(part: RouterHealth.Part) -> dict[str, Any]:
        """The imbalance of the :data:`MAX_LAYER_SERIES` most unbalanced layers; the dead experts
        of each layer (``{layer: count}``, every layer of the part) and their sum, the lowest
        entropy, the auxiliary loss (the other per-layer values are in the JSONL record)."""
        top = sorted(part.imbalance.items(), key=lambda kv: -kv[1])[:MAX_LAYER_SERIES]
        return {"distgrad_router_load_imbalance": dict(top),
                "distgrad_router_dead_experts": float(sum(len(v) for v in part.dead.values())),
                "distgrad_router_layer_dead_experts": {lab: float(len(v)) for lab, v in part.dead.items()},
                "distgrad_router_entropy_min_nats": min(part.entropy.values()) if part.entropy else None,
                "distgrad_router_aux_loss": part.aux_loss}

    @classmethod
    def build(cls, inst: Any) -> RouterHealth | None:
        """``router.enabled``: the signal, or a ConfigError for a layout whose ranks do not all
        hold every router (pipeline stages) or an invalid ``router.modules``."""
        cfg = inst.config
        rc = cfg.router
        if not rc.enabled:
            return None
        job = getattr(inst, "job", None)
        if job is not None:
            local = set(inst.source.names)
            missing = [n for n in job.names if n not in local and ".deepspeed_experts." not in n]
            if missing:
                raise ConfigError("distgrad config: 'router.enabled' is not supported when ranks hold different "
                                  f"layers (pipeline stages: {missing[0]!r} is not on every rank); expert "
                                  "parallelism is supported")
        if rc.modules:
            try:
                re.compile(rc.modules)
            except re.error as e:
                raise ConfigError(f"distgrad config: 'router.modules' is not a regular expression: {e}") from e
        return cls(cfg.sampling.interval, rc.modules, rc.dead_after, cfg.naming.tuples)

    def __init__(self, interval: int, modules: str | None = None, dead_after: int = 20,
                 naming_rules: Any = None) -> None:
        self.interval, self.modules, self.dead_after = int(interval), modules, int(dead_after)
        self.naming_rules = naming_rules
        self.layers: list[str] = []
        self.experts: list[int] = []
        self._offsets: list[int] = []
        self._zero_streak: dict[str, list[int]] = {}
        self.armed = True  # before the first boundary the first step is assumed sampled
        self._reset()

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def sum_size(self) -> int:
        return 2 + sum(_HEAD + e for e in self.experts)

    # ---- set-up -------------------------------------------------------------------------------
    def set_layers(self, labels: Sequence[str], experts: Sequence[int]) -> None:
        """Size the packed part for MoE layers ``labels`` with ``experts[i]`` experts each (what
        :meth:`attach` finds; set before the first sampled step, identically on every rank)."""
        self.layers, self.experts = list(labels), [int(e) for e in experts]
        self._offsets, off = [], 2
        for e in self.experts:
            self._offsets.append(off)
            off += _HEAD + e
        self._zero_streak = {lab: [0] * e for lab, e in zip(self.layers, self.experts)}
        self._reset()

    def attach(self, inst: Any, module: Any) -> Callable[[], None] | None:
        ds_gate = _deepspeed_gate_type()
        pat = re.compile(self.modules) if self.modules else None
        chosen: list[tuple[str, Any]] = []
        for name, m in module.named_modules():
            cname = clean_name(name) if name else name
            if pat is not None:
                ok = bool(name) and bool(pat.search(cname))
            else:
                ok = (ds_gate is not None and isinstance(m, ds_gate)) or _is_hf_router(m)
            if ok and not any(m is c for _, c in chosen):
                chosen.append((cname, m))
        if not chosen:
            raise ConfigError("distgrad config: 'router.enabled' found no MoE router"
                              + (f" matching router.modules {self.modules!r}" if self.modules else
                                 " (no DeepSpeed TopKGate, no Hugging Face *Router module; set router.modules)"))
        labels: list[str] = []
        for cname, m in chosen:
            first = next((n for n, _ in m.named_parameters()), None)
            key = group_keys([f"{cname}.{first}" if first else cname], "layer", self.naming_rules)[0]
            labels.append(key if key not in labels else cname)
        self.set_layers(labels, [_n_experts(m) for _, m in chosen])
        handles = []
        for i, (_, m) in enumerate(chosen):
            ds = ds_gate is not None and isinstance(m, ds_gate)
            handles.append(m.register_forward_hook(self._ds_hook(i) if ds else self._hf_hook(i, m)))
        handles.append(module.register_forward_hook(self._model_hook))
        self._reset()

        def undo() -> None:
            for h in handles:
                h.remove()
        return undo

    # ---- observation (forward) ----------------------------------------------------------------
    def _reset(self) -> None:
        self._acc: torch.Tensor | None = None  # float64 [sum_size]
        self._error: Exception | None = None

    def _active(self) -> bool:
        return self.armed and torch.is_grad_enabled()

    def _add(self, layer: int, calls_tokens_ent_aux: torch.Tensor, counts: torch.Tensor) -> None:
        dev = counts.device
        if self._acc is None:
            self._acc = torch.zeros(self.sum_size, dtype=torch.float64, device=dev)
        o = self._offsets[layer]
        e = self.experts[layer]
        if counts.numel() != e:
            raise ValueError(f"router of layer {self.layers[layer]}: {counts.numel()} experts, expected {e}")
        self._acc[o] = 1.0
        self._acc[o + 1:o + _HEAD] += calls_tokens_ent_aux.to(self._acc.device)
        self._acc[o + _HEAD:o + _HEAD + e] += counts.to(self._acc.device)

    def _ds_hook(self, layer: int) -> Callable:
        def hook(mod: Any, args: Any, output: Any) -> None:
            if not self._active():
                return
            try:
                x = args[0].detach()
                with torch.autocast(x.device.type, enabled=False):
                    logits = F.linear(x.float(), mod.wg.weight.detach().float())
                counts = output[-1].detach().to(torch.float64).reshape(-1)
                l_aux = output[0].detach().to(torch.float64).reshape(())
                ent = router_entropy_sum(logits)
                one = torch.ones((), dtype=torch.float64, device=ent.device)
                self._add(layer, torch.stack([one, one * logits.shape[0], ent, l_aux.to(ent.device)]), counts)
            except Exception as e:  # noqa: BLE001 - raised in local(): counted, the step's signal dropped
                self._error = self._error or e
        return hook

    def _hf_hook(self, layer: int, mod: Any) -> Callable:
        e = self.experts[layer]

        def hook(m: Any, args: Any, output: Any) -> None:
            if not self._active():
                return
            try:
                if isinstance(output, torch.Tensor):
                    logits = output
                    k = getattr(m, "top_k", None)
                    if not isinstance(k, int):
                        raise TypeError(f"router {type(m).__name__} returns logits and has no top_k")
                    with torch.autocast(logits.device.type, enabled=False):
                        idx = torch.topk(logits.detach().float(), k, dim=-1).indices
                else:
                    logits, idx = output[0], output[-1]
                logits = logits.detach().reshape(-1, logits.shape[-1])
                counts = expert_counts(idx, e)
                ent = router_entropy_sum(logits)
                one = torch.ones((), dtype=torch.float64, device=ent.device)
                zero = torch.zeros((), dtype=torch.float64, device=ent.device)
                self._add(layer, torch.stack([one, one * logits.shape[0], ent, zero]), counts)
            except Exception as ex:  # noqa: BLE001 - raised in local()
                self._error = self._error or ex
        return hook

    def _model_hook(self, module: Any, args: Any, output: Any) -> None:
        if not self._active():
            return
        try:
            aux = output.get("aux_loss") if hasattr(output, "get") else getattr(output, "aux_loss", None)
            if isinstance(aux, torch.Tensor) and aux.numel() == 1:
                a = aux.detach().to(torch.float64).reshape(())
                if self._acc is None:
                    self._acc = torch.zeros(self.sum_size, dtype=torch.float64, device=a.device)
                self._acc[0] += a.to(self._acc.device)
                self._acc[1] += 1.0
        except Exception as e:  # noqa: BLE001 - raised in local()
            self._error = self._error or e

    # ---- the boundary -------------------------------------------------------------------------
    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, None]:
        acc, error = self._acc, self._error
        self._reset()
        self.armed = self.interval == 1  # this step s is sampled: s + 1 is sampled iff interval 1
        if error is not None:
            raise RuntimeError("router statistics failed on a micro-batch of this step") from error
        if acc is None:
            return torch.zeros(self.sum_size, dtype=torch.float64, device=device), None
        return acc.to(device=device, dtype=torch.float64), None

    def skip(self, inst: Any, step: int) -> None:
        self._reset()
        self.armed = inst.is_sampled(step + 1)

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray,
               grad_scale: float) -> None:
        w = inst.world_size
        part = RouterHealth.Part()
        ds_aux = []
        for i, lab in enumerate(self.layers):
            o, e = self._offsets[i], self.experts[i]
            if sum_part[o] < w:
                continue
            calls, routed, ent, aux = (float(v) for v in sum_part[o + 1:o + _HEAD])
            tokens = [float(v) for v in sum_part[o + _HEAD:o + _HEAD + e]]
            part.tokens[lab] = tokens
            part.routed[lab] = int(round(routed))
            if routed > 0:
                part.entropy[lab] = ent / routed
            imb, cv = load_stats(tokens)
            if not math.isnan(imb):
                part.imbalance[lab], part.cv[lab] = imb, cv
            streak = self._zero_streak.setdefault(lab, [0] * e)
            for j, t in enumerate(tokens):
                streak[j] = streak[j] + 1 if t == 0 else 0
            part.dead[lab] = [j for j, s in enumerate(streak) if s >= self.dead_after]
            if aux != 0.0 and calls > 0:
                part.layer_aux_loss[lab] = aux / calls
                ds_aux.append(aux / calls)
        if sum_part[1] > 0:
            part.aux_loss = float(sum_part[0] / sum_part[1])
        elif ds_aux:
            part.aux_loss = float(sum(ds_aux))
        if part.tokens:
            rec.router = part

    # ---- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict | None:
        """The per-expert streaks of sampled steps without a token."""
        return {"zero_streak": {k: list(v) for k, v in self._zero_streak.items()}}

    def load_state_dict(self, state: dict) -> None:
        for k, v in (state.get("zero_streak") or {}).items():
            if k in self._zero_streak and len(v) == len(self._zero_streak[k]):
                self._zero_streak[k] = [int(x) for x in v]
