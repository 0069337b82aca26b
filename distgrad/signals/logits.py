"""Logit precursors (opt-in, ``logits.attention`` / ``logits.output``): the maximum pre-softmax
attention logit per layer and head, and the output head's max |logit| and log-sum-exp (z)
statistics, observed on the forward passes of the sampled step's micro-batches.

Why: a growing maximum attention logit precedes attention-entropy collapse and loss spikes
(Kimi K2 bounds it per head with QK-Clip at 100, arXiv 2507.20534; Megatron-Core exports
``max_attention_logit``); a growing output log-sum-exp is what PaLM's z-loss holds down
(arXiv 2204.02311 sec. 5).

Quantities (per micro-batch, then max / sum over micro-batches and ranks):

* attention, per layer and head ``h``: ``max_{b,i,j allowed} (q_{b,h,i} . k_{b,h,j}) * scale``
  with ``q``, ``k`` as the attention kernel receives them (after the rotary embedding; grouped
  key heads repeated to the query heads as Hugging Face's ``repeat_kv`` does), ``scale`` the
  kernel's (default ``1/sqrt(head_dim)``) and the allowed positions those of the mask (a boolean
  mask: True; a float mask: finite and above half its dtype's lowest value, i.e. not the
  ``finfo.min`` Hugging Face writes for masked positions) and of ``is_causal`` (SDPA's top-left
  lower triangle); computed in float32 from the kernel's inputs, autocast off;
* output: ``max |logit|`` and ``z = logsumexp_v logit_v`` per position (float32, autocast off),
  summed in float64 (``sum z``, ``sum z^2``, positions) and maxed.

Hook points (installed at ``instrument()``, undone at ``close()``):

* Hugging Face attention modules (the selected modules: ``logits.attention_modules``, default
  :func:`is_hf_attention`: every module whose class's code calls transformers' attention interface
  ``ALL_ATTENTION_FUNCTIONS``, i.e. the module that hands itself to the kernel (GPT-2's
  ``c_attn``, GPT-NeoX's ``query_key_value``, BERT's self-attention, LLaMA...; not the parent
  that contains it), and every module with a ``q_proj`` and a ``k_proj`` child as before):
  transformers' global attention
  interface ``ALL_ATTENTION_FUNCTIONS.get_interface`` is wrapped so that the function it returns
  (eager, sdpa, flash...) first reports ``(query, key, mask, scaling)`` when its module argument
  is a selected module; every other call passes through untouched;
* any other attention code: :func:`observe_attention` (``observe_attention(self, q, k,
  attn_mask=..., is_causal=..., scale=...)`` next to its ``scaled_dot_product_attention`` call;
  ``self`` must be a module selected by ``logits.attention_modules``); it does nothing unless a
  signal is watching that module on a sampled step;
* the output head (``logits.output_module``, default the Hugging Face model's
  ``get_output_embeddings()``, else the module named ``lm_head``): a forward hook on its output.

Sampling: the hooks compute only on the micro-batches of a step that will be sampled, decided
from the step counters every rank shares (armed after the boundary of step ``s`` iff ``s + 1``
is sampled; armed before the first boundary), and only with gradients enabled (training
forwards; evaluation under ``torch.no_grad`` is not counted).

Cost: per observed micro-batch and layer, one ``q k^T`` (the eager attention score matrix, in
row chunks of at most 2**24 elements) and an amax; for the head, one logsumexp over the logits
(row chunks of at most 2**24 elements); all on the device, no host sync. Collectives: ``2 + 3 +
L`` float64 in the SUM part (per rank: attention and output observed, ``sum z``, ``sum z^2``,
positions; per layer: observed) and ``2 + S`` in the MAX part (``max |logit|``, ``max z``; S =
sum over layers of the head count, 1 for a layer whose head count is unknown). A layer not
observed on every rank, or an output head not observed on every rank, is left out of the record.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from distgrad.config.errors import ConfigError
from distgrad.config.sections import Section
from distgrad.export.metrics import condition, gauge
from distgrad.naming.canonical import clean_name
from distgrad.naming.grouping import group_keys
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal

__all__ = ["LogitSignal", "observe_attention", "attention_head_max", "output_logit_stats", "is_hf_attention"]

#: elements of one chunk of the score matrix / the logits
CHUNK = 1 << 24

_LOCK = threading.Lock()
#: module -> (signal, layer index): the modules selected by a live signal
_MODULES: dict[Any, tuple[LogitSignal, int]] = {}
_HF_PATCH: dict[str, Any] = {"count": 0, "orig": None}
#: the name by which transformers' attention modules fetch their kernel (modeling_utils)
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
#: class -> whether its code (or a base class's, not torch's) names _INTERFACE
_CALLS_INTERFACE: dict[type, bool] = {}

log = logging.getLogger("distgrad")


def attention_head_max(q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
                       attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """Per-head maximum attention logit of one attention call.

    Args:
        q: queries ``[..., H, T, D]`` (any float dtype).
        k: keys ``[..., Hk, S, D]`` with ``H % Hk == 0`` (grouped keys are repeated per query
            head: query head ``h`` uses key head ``h // (H // Hk)``, as ``repeat_kv``).
        scale: the factor on ``q . k``; None: ``1 / sqrt(D)`` (SDPA's default).
        attn_mask: broadcastable to ``[..., H, T, S]``: boolean (True: allowed) or additive float
            (allowed where finite and above ``finfo(dtype).min / 2``); None: all allowed.
        is_causal: also only ``j <= i`` (SDPA's top-left triangle of ``[T, S]``).

    Returns:
        float32 ``[H]`` on ``q``'s device: per head the max over batch, queries and allowed keys
        of ``(q . k) * scale`` computed in float32 (``-inf`` for a head with nothing allowed).
    Raises:
        ValueError: shapes that do not fit.
    """
    q, k = q.detach(), k.detach()
    if q.dim() < 3 or k.dim() != q.dim():
        raise ValueError(f"attention logits: q {tuple(q.shape)} and k {tuple(k.shape)} must be [..., H, T, D]")
    h, t, d = q.shape[-3:]
    hk, s = k.shape[-3], k.shape[-2]
    if hk != h:
        if h % hk:
            raise ValueError(f"attention logits: {h} query heads, {hk} key heads")
        k = k.repeat_interleave(h // hk, dim=-3)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    allowed = None
    if is_causal:
        allowed = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        m = attn_mask.detach()
        if m.dtype != torch.bool:
            m = torch.isfinite(m) & (m > torch.finfo(m.dtype).min / 2)
        allowed = m if allowed is None else (m & allowed)
    lead = max(1, math.prod(q.shape[:-2]))
    rows = max(1, CHUNK // max(1, lead * s))
    out = torch.full((h,), -math.inf, dtype=torch.float32, device=q.device)
    with torch.autocast(q.device.type, enabled=False):
        kt = k.float().transpose(-1, -2)
        for t0 in range(0, t, rows):
            sc = torch.matmul(q[..., t0:t0 + rows, :].float(), kt) * scale
            if allowed is not None:
                a = allowed if allowed.dim() < 2 or allowed.shape[-2] == 1 else allowed[..., t0:t0 + rows, :]
                sc = sc.masked_fill(~a, -math.inf)
            out = torch.maximum(out, sc.movedim(-3, 0).reshape(h, -1).amax(dim=1))
    return out


def output_logit_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Statistics of one output-logits tensor ``[..., V]`` (any float dtype).

    Returns:
        ``(sums, maxes)`` on the logits' device: float64 ``[sum z, sum z^2, positions]`` and
        float64 ``[max |logit|, max z]``, with ``z = logsumexp`` over the last dimension computed
        in float32 per position (autocast off), the sums accumulated in float64.
    """
    x = logits.detach()
    v = x.shape[-1]
    x = x.reshape(-1, v)
    n = x.shape[0]
    rows = max(1, CHUNK // max(1, v))
    dev = x.device
    sums = torch.zeros(3, dtype=torch.float64, device=dev)
    maxes = torch.full((2,), -math.inf, dtype=torch.float64, device=dev)
    with torch.autocast(dev.type, enabled=False):
        for r0 in range(0, n, rows):
            xf = x[r0:r0 + rows].float()
            z = torch.logsumexp(xf, dim=-1).double()
            sums = sums + torch.stack([z.sum(), (z * z).sum(), torch.tensor(float(z.numel()), dtype=torch.float64,
                                                                            device=dev)])
            maxes = torch.maximum(maxes, torch.stack([xf.abs().amax().double(), z.amax()]))
    return sums, maxes


def _code_names(code: Any, seen: set[int] | None = None) -> set[str]:
    """The global and attribute names a code object and the code nested in it (closures,
    comprehensions) refer to."""
    seen = set() if seen is None else seen
    if id(code) in seen:
        return set()
    seen.add(id(code))
    names = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            names |= _code_names(c, seen)
    return names


def is_hf_attention(module: Any) -> bool:
    """Whether ``module`` is an attention module that calls transformers' attention interface.

    True when the ``forward`` its class runs (decorators unwrapped through ``__wrapped__``, code
    nested in it included) names ``ALL_ATTENTION_FUNCTIONS``: the registry through which every
    transformers attention module fetches its kernel and hands itself to it as the module
    argument (``modeling_*.py`` in 5.x: ``attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
    self.config._attn_implementation, eager_attention_forward)``, then ``attention_interface(self,
    query, key, value, attention_mask, scaling=...)``; in transformers 5.24, 462 classes, all from
    their ``forward``). Read from the byte code's names (no source file, no import of
    transformers); cached per class. The module that contains one (BERT's ``BertAttention``
    around ``BertSelfAttention``, a decoder layer, the model, whose ``PreTrainedModel`` helpers
    name the registry outside ``forward``) is not one, nor a class named ``...Attention`` that
    computes attention its own way (BLOOM, Falcon, MPT, GPT-Neo, linear attention): it could not
    be observed through the interface.

    Args:
        module: any object (usually a ``torch.nn.Module``).
    Returns:
        bool.
    """
    cls = type(module)
    hit = _CALLS_INTERFACE.get(cls)
    if hit is None:
        fn = getattr(cls, "forward", None)
        try:
            fn = inspect.unwrap(fn) if callable(fn) else fn
        except ValueError:  # a __wrapped__ cycle
            pass
        code = getattr(fn, "__code__", None)
        hit = code is not None and _INTERFACE in _code_names(code)
        _CALLS_INTERFACE[cls] = hit
    return hit


def observe_attention(module: Any, q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None,
                      is_causal: bool = False, scale: float | None = None) -> None:
    """The documented hook point for attention code distgrad does not patch: report one
    attention call's ``q`` ``[..., H, T, D]`` and ``k`` ``[..., Hk, S, D]`` (as handed to
    ``F.scaled_dot_product_attention``, with the same ``attn_mask``, ``is_causal`` and
    ``scale``) from the forward of ``module``, a module selected by ``logits.attention_modules``.
    Does nothing (no computation) unless a live signal watches ``module`` and the current step
    is sampled, or with gradients disabled. Never raises (a failure is counted and the step's
    logit statistics dropped on every rank)."""
    entry = _MODULES.get(module)
    if entry is not None:
        entry[0].observe_attention(entry[1], q, k, attn_mask, is_causal, scale)


def _wrap_interface(fn: Callable) -> Callable:
    if getattr(fn, "_distgrad_logits", False):
        return fn
    eager = getattr(fn, "__name__", "") == "eager_attention_forward"

    def wrapped(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        entry = _MODULES.get(module)
        if entry is not None:
            causal = (attention_mask is None and not eager and query.shape[-2] > 1
                      and bool(kwargs.get("is_causal") if kwargs.get("is_causal") is not None
                               else getattr(module, "is_causal", True)))
            entry[0].observe_attention(entry[1], query, key, attention_mask, causal, kwargs.get("scaling"))
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    wrapped._distgrad_logits = True  # type: ignore[attr-defined]
    return wrapped


def _install_hf() -> Callable[[], None] | None:
    """Wrap transformers' ``ALL_ATTENTION_FUNCTIONS.get_interface`` (once for all signals).
    Only when transformers is already imported (a Hugging Face model's classes import it): a
    model of its own is not made to import transformers, and torchao through it, with their
    start-up time and messages on every rank."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except Exception:  # noqa: BLE001 - no transformers: only observe_attention
        return None
    with _LOCK:
        if _HF_PATCH["count"] == 0:
            orig = ALL_ATTENTION_FUNCTIONS.get_interface

            def get_interface(attn_implementation: Any, default: Callable) -> Callable:
                return _wrap_interface(orig(attn_implementation, default))

            # an instance attribute over the class's method, deleted again by undo()
            ALL_ATTENTION_FUNCTIONS.get_interface = get_interface  # type: ignore[method-assign]
            _HF_PATCH["orig"] = orig
        _HF_PATCH["count"] += 1

    def undo() -> None:
        with _LOCK:
            _HF_PATCH["count"] -= 1
            if _HF_PATCH["count"] == 0:
                try:
                    del ALL_ATTENTION_FUNCTIONS.get_interface  # the instance attribute: the class's method again
                except AttributeError:
                    pass
                _HF_PATCH["orig"] = None
    return undo


def _head_count(module: Any) -> int:
    for obj, attr in ((module, "num_heads"), (module, "num_attention_heads"), (module, "n_heads"),
                      (module, "n_head"), (getattr(module, "config", None), "num_attention_heads")):
        v = getattr(obj, attr, None) if obj is not None else None
        if isinstance(v, int) and v > 0:
            return v
    return 0


class LogitSignal(PackedSignal):
    """The logit precursors (see the module docstring).

    Args:
        attention: observe attention logits.
        output: observe the output head.
        interval: ``sampling.interval`` (which steps are sampled).
        attention_modules: regex selecting the attention modules (None: the modules calling
            transformers' attention interface, :func:`is_hf_attention`, and those with q_proj +
            k_proj children).
        output_module: the output head's module name (None: automatic).
        naming_rules: ``naming.tuples`` (layer labels as the other per-layer metrics).

    SUM part (float64 ``[5 + L]``): ``[attention observed, output observed, sum z, sum z^2,
    positions, per layer observed]``; MAX part (float64 ``[2 + S]``): ``[max |logit|, max z,
    per layer its per-head maxima]``. Record part: :class:`LogitSignal.Part`
    (``StepRecord.logits``); its configuration section (``logits``), metrics and factory are
    declared on this class too (the contract of :mod:`distgrad.signals`).
    """

    name = "logits"

    class Config(Section):
        """Logit precursors at sampled steps: the maximum pre-softmax attention logit per layer (and
        head) and the output head's max |logit| and log-sum-exp (z) statistics (see docs/signals.md,
        "Logit precursors")."""

        section_key: ClassVar[str] = "logits"
        attention: bool = Field(False, description=(
            "Observe the maximum attention logit q.k*scale per layer and head on the sampled step's "
            "micro-batches: Hugging Face attention modules (through the attention interface, after "
            "the rotary embedding) automatically, other attention code where it calls "
            "distgrad.signals.logits.observe_attention. Recomputes q.k^T once per layer on the "
            "sampled step's micro-batches (the cost of one eager attention score matrix)."))
        attention_modules: str | None = Field(None, description=(
            "Regular expression (re.search) on module names selecting the attention modules (one "
            "layer each, named by the layer of the module name); default: every Hugging Face attention "
            "module that calls transformers' attention interface (GPT-2, GPT-NeoX, GPT-J, OPT, Phi, BERT, "
            "T5, LLaMA, Mistral, Qwen...: the module handing itself to the kernel, not its parent) and "
            "every module with both a q_proj and a k_proj child. Models whose attention does not go "
            "through that interface (in transformers 5.24: BLOOM, Falcon, MPT, GPT-Neo) need this "
            "expression, and their attention code must call observe_attention(self, q, k, ...)."))
        output: bool = Field(False, description=(
            "Observe the output head's logits on the sampled step's micro-batches: max |logit| and "
            "the log-sum-exp z per position (mean, mean of z^2, max)."))
        output_module: str | None = Field(None, description=(
            "Name of the module whose output are the logits (e.g. lm_head); default: the model's "
            "get_output_embeddings() (Hugging Face), else a module named lm_head."))

    @dataclass
    class Part(_Part):
        """Attention and output logit statistics of a sampled step, over the training forward
        passes of the step's micro-batches on every rank (max over ranks; sums over ranks).

        Attributes:
            attention_max: ``{layer: max over heads, batch, query and allowed key positions of
                q . k * scale}`` (the pre-softmax attention logit, dimensionless; masked positions
                left out); layers whose attention was not observed on some rank are left out.
            attention_head_max: ``{layer: [per-head max]}`` (heads in the module's order), for the
                layers whose head count distgrad knows.
            output_abs_max: ``max |logit|`` of the output head's logits (dimensionless), or None when
                the output head is not observed.
            z_mean, z_sq_mean, z_max: over every position the head computed (padding included),
                ``z = log sum_v exp(logit_v)`` (nats): mean, mean of ``z^2`` (PaLM's z-loss
                quantity, arXiv 2204.02311 sec. 5) and max; None when not observed.
            positions: the number of positions the z statistics are over (all ranks).
        """

        attention_max: dict[str, float] = field(default_factory=dict)
        attention_head_max: dict[str, list[float]] = field(default_factory=dict)
        output_abs_max: float | None = None
        z_mean: float | None = None
        z_sq_mean: float | None = None
        z_max: float | None = None
        positions: int = 0

    _when = condition("logits", "`logits.attention: true` (attention series) / `logits.output: true` (output "
                      "series), after a sampled step whose forward passes were observed on every rank (see "
                      "docs/signals.md)",
                      enabled=lambda c: c.logits.attention or c.logits.output)
    METRICS = (
        gauge("distgrad_layer_attention_logit_max", "1", "Maximum pre-softmax attention logit q.k*scale of the "
              "layer over heads and the sampled step's micro-batches of all ranks (masked positions left out).",
              _when, ("layer",),
              doc="max over heads, batch, query and allowed key positions of `q . k * scale` (after the rotary "
                  "embedding) on the sampled step's training forwards, all ranks; per-head values in the JSONL "
                  "record (`logits.attention_head_max`)"),
        gauge("distgrad_output_logit_abs_max", "1", "Maximum |logit| of the output head on the sampled step's "
              "micro-batches of all ranks.", _when),
        gauge("distgrad_output_logsumexp_mean", "nats", "Mean over positions of z = logsumexp(output logits) on "
              "the sampled step's micro-batches of all ranks.", _when,
              doc="mean over every position the head computed (padding included) of `z = log sum_v exp(logit_v)`"),
        gauge("distgrad_output_logsumexp_sq_mean", "nats^2", "Mean over positions of z^2 (PaLM's z-loss quantity).",
              _when, doc="mean of `z^2`: the z-loss of PaLM (arXiv 2204.02311 sec. 5) without its coefficient"),
        gauge("distgrad_output_logsumexp_max", "nats", "Maximum over positions of z = logsumexp(output logits).",
              _when),
    )

    @staticmethod
    def samples(part: LogitSignal.Part) -> dict[str, Any]:
        """The per-layer attention maxima (no series for a layer not observed on every rank) and
        the output head's statistics (absent when the head was not observed)."""
        return {"distgrad_layer_attention_logit_max": part.attention_max,
                "distgrad_output_logit_abs_max": part.output_abs_max,
                "distgrad_output_logsumexp_mean": part.z_mean,
                "distgrad_output_logsumexp_sq_mean": part.z_sq_mean,
                "distgrad_output_logsumexp_max": part.z_max}

    @classmethod
    def build(cls, inst: Any) -> LogitSignal | None:
        """``logits.attention`` / ``logits.output``: the signal, or None when both are off.

        Raises:
            ConfigError: under a pipeline / expert job view (the ranks do not hold the same
                layers), or ``logits.attention_modules`` not a regular expression.
        """
        cfg = inst.config
        lc = cfg.logits
        if not (lc.attention or lc.output):
            return None
        if getattr(inst, "job", None) is not None:
            raise ConfigError("distgrad config: 'logits' is not supported with a pipeline / expert job view "
                              "(the ranks do not hold the same layers)")
        if lc.attention_modules:
            try:
                re.compile(lc.attention_modules)
            except re.error as e:
                raise ConfigError(f"distgrad config: 'logits.attention_modules' is not a regular expression: "
                                  f"{e}") from e
        return cls(lc.attention, lc.output, cfg.sampling.interval, lc.attention_modules, lc.output_module,
                   cfg.naming.tuples)

    def __init__(self, attention: bool, output: bool, interval: int, attention_modules: str | None = None,
                 output_module: str | None = None, naming_rules: Any = None) -> None:
        self.attention, self.output, self.interval = attention, output, int(interval)
        self.attention_modules, self.output_module = attention_modules, output_module
        self.naming_rules = naming_rules
        self._warned_unobserved = False
        self._unobserved = 0  # sampled steps on which no rank observed any watched attention module
        self._observed = False  # some sampled step had an observation
        self.layers: list[str] = []
        self.heads: list[int] = []  # per layer, 0: unknown
        self._offsets: list[int] = []
        self._slots = 0
        self.armed = True  # before the first boundary the first step is assumed sampled
        self._reset()

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def sum_size(self) -> int:
        return 5 + len(self.layers)

    @property
    def max_size(self) -> int:
        return 2 + self._slots

    # ---- set-up -------------------------------------------------------------------------------
    def attach(self, inst: Any, module: Any) -> Callable[[], None] | None:
        undo: list[Callable[[], None]] = []
        named = list(module.named_modules())
        if self.attention:
            pat = re.compile(self.attention_modules) if self.attention_modules else None
            chosen: list[tuple[str, Any]] = []
            for name, m in named:
                cname = clean_name(name) if name else name
                if pat is not None:
                    ok = bool(name) and bool(pat.search(cname))
                else:
                    ok = (hasattr(m, "q_proj") and hasattr(m, "k_proj")) or is_hf_attention(m)
                if ok and not any(m is c for _, c in chosen):
                    chosen.append((cname, m))
            if not chosen:
                raise ConfigError("distgrad config: 'logits.attention' found no attention module"
                                  + (f" matching logits.attention_modules {self.attention_modules!r}"
                                     if self.attention_modules else " (no module calling transformers' attention "
                                     "interface and none with q_proj and k_proj children; set "
                                     "logits.attention_modules)"))
            labels = []
            for cname, m in chosen:
                first = next((n for n, _ in m.named_parameters()), None)
                key = group_keys([f"{cname}.{first}" if first else cname], "layer", self.naming_rules)[0]
                labels.append(key if key not in labels else cname)
            self.layers = labels
            self.heads = [_head_count(m) for _, m in chosen]
            self._offsets, off = [], 0
            for h in self.heads:
                self._offsets.append(off)
                off += max(h, 1)
            self._slots = off
            with _LOCK:
                for i, (_, m) in enumerate(chosen):
                    if m in _MODULES:
                        raise ConfigError("distgrad config: 'logits.attention': a module is already watched by "
                                          "another instrument")
                    _MODULES[m] = (self, i)
            mods = [m for _, m in chosen]

            def forget() -> None:
                with _LOCK:
                    for m in mods:
                        if _MODULES.get(m, (None,))[0] is self:
                            del _MODULES[m]
            undo.append(forget)
            hf = _install_hf()
            if hf is not None:
                undo.append(hf)
        if self.output:
            head = None
            if self.output_module:
                head = dict(named).get(self.output_module)
                if head is None:
                    head = next((m for n, m in named if clean_name(n) == self.output_module), None)
            else:
                get = getattr(module, "get_output_embeddings", None)
                head = get() if callable(get) else None
                if head is None:
                    head = next((m for n, m in named if n.split(".")[-1] == "lm_head"), None)
            if head is None:
                raise ConfigError("distgrad config: 'logits.output' found no output head"
                                  + (f" named {self.output_module!r}" if self.output_module
                                     else " (no get_output_embeddings() nor lm_head; set logits.output_module)"))
            handle = head.register_forward_hook(self._output_hook)
            undo.append(handle.remove)

        self._reset()  # sized for the layers found

        def undo_all() -> None:
            for u in reversed(undo):
                u()
        return undo_all

    # ---- observation (forward) ----------------------------------------------------------------
    def _reset(self) -> None:
        self._att: torch.Tensor | None = None  # float64 [slots]
        self._layer_seen = [False] * len(self.layers)
        self._out_sums: torch.Tensor | None = None
        self._out_max: torch.Tensor | None = None
        self._error: Exception | bool = False  # the first failure of a hook this step

    def _active(self) -> bool:
        from distgrad.signals.underflow import in_replay  # not the underflow recomputation's forwards

        return self.armed and torch.is_grad_enabled() and not in_replay()

    def observe_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                          is_causal: bool, scale: float | None) -> None:
        """One attention call of layer ``layer`` (index into :attr:`layers`); see the module
        docstring. Never raises: a failure marks the step's statistics failed."""
        if not self._active():
            return
        try:
            hm = attention_head_max(q, k, scale, mask, is_causal).double()
            h = self.heads[layer]
            if h and hm.numel() != h:
                raise ValueError(f"layer {self.layers[layer]}: {hm.numel()} heads, expected {h}")
            if not h:
                hm = hm.amax().reshape(1)
            if self._att is None:
                self._att = torch.full((self._slots,), -math.inf, dtype=torch.float64, device=hm.device)
            o = self._offsets[layer]
            self._att[o:o + hm.numel()] = torch.maximum(self._att[o:o + hm.numel()], hm.to(self._att.device))
            self._layer_seen[layer] = True
        except Exception as e:  # noqa: BLE001 - raised in local(): counted, the step's signal dropped
            self._error = self._error or e

    def _output_hook(self, module: Any, args: Any, output: Any) -> None:
        if not self._active():
            return
        try:
            x = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
            if x is None and isinstance(output, (tuple, list)) and output:
                x = output[0]
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"output head returned {type(output).__name__}, not logits")
            s, m = output_logit_stats(x)
            if self._out_sums is None or self._out_max is None:  # both None or both set
                self._out_sums, self._out_max = s, m
            else:
                self._out_sums = self._out_sums + s.to(self._out_sums.device)
                self._out_max = torch.maximum(self._out_max, m.to(self._out_max.device))
        except Exception as e:  # noqa: BLE001 - raised in local()
            self._error = self._error or e

    # ---- the boundary -------------------------------------------------------------------------
    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        att, seen, out_sums, out_max, error = self._att, self._layer_seen, self._out_sums, self._out_max, self._error
        self._reset()
        self.armed = self.interval == 1  # this step s is sampled: s + 1 is sampled iff interval 1
        if error:
            raise RuntimeError("logit statistics failed on a micro-batch of this step") from (
                error if isinstance(error, Exception) else None)
        f64, dev = torch.float64, device
        head = torch.tensor([float(any(seen)), float(out_sums is not None)], dtype=f64, device=dev)
        z = out_sums.to(dtype=f64, device=dev) if out_sums is not None else torch.zeros(3, dtype=f64, device=dev)
        layer_seen = torch.tensor([float(v) for v in seen], dtype=f64, device=dev)
        mx = (out_max.to(dtype=f64, device=dev) if out_max is not None
              else torch.full((2,), -math.inf, dtype=f64, device=dev))
        am = (att.to(dtype=f64, device=dev) if att is not None
              else torch.full((self._slots,), -math.inf, dtype=f64, device=dev))
        return torch.cat([head, z, layer_seen]), torch.cat([mx, am])

    def skip(self, inst: Any, step: int) -> None:
        self._reset()
        self.armed = inst.is_sampled(step + 1)

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray,
               grad_scale: float) -> None:
        w = inst.world_size
        part = LogitSignal.Part()
        if self.attention and self.layers:
            # every rank decides alike from the reduced count; a log line, no collective. Two
            # sampled steps without any observation from the start (the first may have had its
            # forwards before instrument()): the watched modules do not report
            self._observed = self._observed or sum_part[0] > 0
            self._unobserved += int(sum_part[0] == 0)
        if (self.attention and self.layers and not self._observed and self._unobserved >= 2
                and not self._warned_unobserved):
            self._warned_unobserved = True
            if getattr(inst, "rank", 0) == 0:
                log.warning("distgrad: logits.attention: none of the watched attention modules (%s) reported its "
                            "logits on any sampled step up to step %d on any rank, so no attention logit is "
                            "exported. A module "
                            "that is not a Hugging Face attention module must call "
                            "distgrad.signals.logits.observe_attention(self, q, k, ...) next to its attention "
                            "kernel (docs/signals.md, \"Logit precursors\").", ", ".join(self.layers[:4])
                            + (", ..." if len(self.layers) > 4 else ""), rec.step)
        if self.output and sum_part[1] >= w and sum_part[4] > 0:
            n = float(sum_part[4])
            part.z_mean = float(sum_part[2] / n)
            part.z_sq_mean = float(sum_part[3] / n)
            part.positions = int(round(n))
            part.output_abs_max = float(max_part[0])
            part.z_max = float(max_part[1])
        for i, label in enumerate(self.layers):
            if sum_part[5 + i] < w:
                continue
            o, h = self._offsets[i], self.heads[i]
            vals = max_part[2 + o:2 + o + max(h, 1)]
            part.attention_max[label] = float(np.max(vals))
            if h:
                part.attention_head_max[label] = [float(v) for v in vals]
        if part.attention_max or part.z_mean is not None:
            rec.logits = part



#: the record part (``StepRecord.logits``), by its earlier name
LogitStats = LogitSignal.Part
