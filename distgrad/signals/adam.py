"""Optimizer-aware signals of Adam-family optimizers, from the optimizer state shards that sit
next to the gradient shards (:meth:`~distgrad.engines.base.GradSource.optimizer_slots`).

Definitions (per layer label and globally; sums over every element the job holds, each counted
once, so they are exact under any sharding):

- ``g``: the reduced gradient the optimizer is about to consume, read at the boundary, divided by
  the loss scale it still carries (DeepSpeed fp16), **before** any gradient clipping (DeepSpeed
  clips inside its step, after the boundary; PyTorch loops are read before ``clip_grad_norm_``
  or the step is refused). Global-norm clipping multiplies every element by the same
  ``c = min(1, max_norm / (|g| + 1e-6))``, known once the norm is reduced: the update RMS is
  reported for the gradient the optimizer applies, ``c * g`` (``c`` from the engine's clip
  threshold or ``clip.max_grad_norm``, 1 when none is known; recorded as ``clip_ratio``); the
  cosine does not depend on ``c``; the spike fraction is counted on the pre-clip ``g`` (a
  per-element test needs ``c`` on the device before the collective that gives it).
- ``m``, ``v``: ``exp_avg`` and ``exp_avg_sq`` **before this step's update** (the state the
  previous step left). ``t``: the optimizer's own count of applied updates (``state["step"]``,
  DeepSpeed FusedAdam: ``group["step"]``); ``beta2``, ``eps`` from the parameter's group.
  ``v_hat = v / (1 - beta2**t)`` (``v`` as is when the group sets ``bias_correction: False``);
  ``d = max(v_hat, eps**2)``.
- update RMS ``c * sqrt(sum(g**2 / d) / n)``: the RMS of the update Adam would make with ``v`` not
  yet refreshed (Wortsman et al. 2023, "Stable and low-precision training for large-scale
  vision-language models", arXiv 2304.13013, section 3.4: loss spikes follow 1-8 steps after it
  exceeds ~1 in a layer).
- spike fraction ``#(g**2 > theta * d) / n`` (SPAM, Huang et al., ICLR 2025: gradient spikes
  relative to the second moment; ``theta = optimizer_signals.spike_threshold``).
- moment norms ``|m|``, ``|v|`` (raw state), the diagonal Fisher estimate ``v_hat`` (trace
  ``sum(v_hat)``; an empirical Fisher of the mini-batch gradient), and the cosine
  ``g . m / (|g| |m|)`` (``maximize=True``: m tracks ``-g``, the sign is flipped back).

Which optimizers: ``torch.optim.Adam`` / ``AdamW`` (not ``amsgrad``, whose denominator is
``max_exp_avg_sq``; not Adam with coupled L2 ``weight_decay > 0``, whose moments track
``g + wd * w``), DeepSpeed ``FusedAdam`` and ``DeepSpeedCPUAdam`` (in AdamW mode, or without
weight decay). Anything else: off with one warning (``enabled: auto``) or a ConfigError naming
``optimizer_signals.enabled`` (``on``). A torch ``GradScaler`` is refused the same way (the
scale the gradients carry at the read is not known on the device without a sync).

Not computed on the first optimizer step (no moment exists before it: the record part is None)
nor on fp16 overflow steps, nor on the sampled steps ``optimizer_signals.every`` leaves out (one
sampled step in ``every``, default 8, computes them, decided from the step counter; the others carry
None in the record, and the Prometheus sink serves the last computed values with
``distgrad_optimizer_signals_step`` naming their step).
Cost: one read of ``g``, ``m`` and ``v`` per sampled step (about ten elementwise operations,
float32, float64 sums; on the CPU one fused pass of the native kernel
:mod:`distgrad.signals.adam_native`, the torch path when it is unavailable), ``8 L + 1`` float64 in
the SUM collective (L layer labels), nothing kept between steps.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import BeforeValidator, Field

from distgrad.config.errors import ConfigError
from distgrad.config.sections import Section, _on_off
from distgrad.export.metrics import condition, gauge, label
from distgrad.naming.grouping import group_keys
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal, adam_native

log = logging.getLogger("distgrad")

#: optimizer class names whose state is Adam's (exp_avg, exp_avg_sq, step)
ADAM_FAMILY = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam")
#: per-layer SUM columns
COLS = ("n", "ratio", "spikes", "gm", "gg", "mm", "vv", "vhat")
#: smallest clip coefficient at which the spike fraction is exported: the pre-clip count then
#: equals the applied update's at a threshold within 2% of theta (1 / 0.99**2)
SPIKE_CLIP_MIN = 0.99
#: elements per chunk of the CPU computation (temporaries stay in cache: ~10x faster than whole
#: pieces on a loaded CPU, measured; accelerators process whole pieces)
CHUNK = 1 << 16
#: ``"auto"``: pieces whose gradient and moments are CPU tensors the native kernel takes
#: (:mod:`distgrad.signals.adam_native`, one pass per piece) go through it when it loaded;
#: ``"torch"``: always the torch path (tests compare both)
KERNEL = "auto"


def _inner_optimizer(inst: Any) -> Any:
    """The torch optimizer whose state is read: the one given to ``instrument()``, or the one
    inside DeepSpeed's ZeRO / mixed-precision wrapper (``engine.optimizer.optimizer``)."""
    src = inst.source
    opt = getattr(src, "optimizer", None)
    if opt is None and getattr(src, "engine", None) is not None:
        opt = src.engine.optimizer
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            opt = inner
    return opt


def refusal(inst: Any) -> str | None:
    """Why the signals cannot be computed for this instrument (None: they can)."""
    opt = _inner_optimizer(inst)
    if opt is None:
        return "no optimizer is known to distgrad"
    name = type(opt).__name__
    if name not in ADAM_FAMILY:
        return f"the optimizer is {name}, not one of the Adam family {ADAM_FAMILY}"
    for g in opt.param_groups:
        bad = group_problem(name, g, opt)
        if bad:
            return bad
    if getattr(inst.source, "scaler", None) is not None and inst.source.has_loss_scaler():
        return "a torch GradScaler is in use (the loss scale at the read is not known without a host sync)"
    try:
        slots = inst.source.optimizer_slots()
    except Exception as e:  # noqa: BLE001 - a layout the adapter cannot read
        return f"the optimizer state could not be located next to the gradient shards ({e})"
    if slots is None:
        return (f"the {inst.source.engine_name} adapter cannot locate the optimizer state next to the gradient "
                "shards in this configuration")
    return None


def group_problem(name: str, g: dict, opt: Any = None) -> str | None:
    """Why a param group's Adam variant is not the one the definitions assume, or None
    (DeepSpeed's FusedAdam / DeepSpeedCPUAdam keep their Adam/AdamW mode on the optimizer,
    ``adam_w_mode``)."""
    if g.get("amsgrad"):
        return "amsgrad=True (the update divides by max_exp_avg_sq, not exp_avg_sq)"
    wd = float(g.get("weight_decay", 0.0) or 0.0)
    coupled = (name == "Adam" and not g.get("decoupled_weight_decay", False)) or \
        (name in ("FusedAdam", "DeepSpeedCPUAdam") and not getattr(opt, "adam_w_mode", True))
    if coupled and wd > 0:
        return (f"{name} with coupled L2 weight_decay={wd} (its moments track g + weight_decay * w, not the "
                "gradient): use AdamW or weight_decay 0")
    return None


class AdamSignal(PackedSignal):
    """Update RMS, spike fraction, moment norms, Fisher trace and gradient-momentum cosine per
    layer label and globally (definitions: module docstring).

    SUM part (float64): ``[L, 8]`` per layer ``(n, sum g^2/d, #spikes, sum g.m, sum g^2,
    sum m^2, sum v^2, sum v_hat)`` then the gradient elements without optimizer state. No MAX
    part.
    """

    name = "optimizer_signals"
    hold = True  # served between computing steps (optimizer_signals.every), named by their step

    class Config(Section):
        """Optimizer-aware signals of Adam-family optimizers (distgrad.signals.adam): update RMS,
        second-moment spike fraction, moment norms, diagonal Fisher trace, gradient-momentum cosine."""

        section_key: ClassVar[str] = "optimizer_signals"
        enabled: Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)] = Field("auto", description=(
            "auto: on when the optimizer is Adam or AdamW (torch.optim, DeepSpeed FusedAdam / DeepSpeedCPUAdam) "
            "and its state can be located next to the gradient shards, else off with one warning naming why. "
            "on: the same, but a configuration it cannot serve raises at instrument(). off: not computed. "
            "Costs one read of exp_avg and exp_avg_sq per sampled step (docs/signals.md)."))
        spike_threshold: float = Field(50.0, gt=0, description=(
            "theta: an element is a second-moment spike when g^2 > theta * max(v_hat, eps^2), v_hat being "
            "Adam's bias-corrected second moment before this step (its gradient is theta**0.5 standard "
            "deviations beyond what the optimizer expects; Wortsman et al. 2023, SPAM 2025)."))
        top_layers: int = Field(5, ge=1, description=(
            "Layers named in the record's fisher_top_layers (largest diagonal Fisher trace first)."))
        every: int = Field(8, ge=1, description=(
            "Compute the signals on one sampled step in this many (sampled steps counted from the optimizer step "
            "counter, step // sampling.interval, so every rank agrees); the sampled steps in between read no "
            "optimizer state and their record part is None, while the Prometheus sink keeps serving the last "
            "computed values with distgrad_optimizer_signals_step naming their step. 1: every sampled step. The "
            "signals read g, exp_avg and exp_avg_sq (3x the bytes of the statistics pass): measured at 113.9M "
            "parameters on CPU, every: 1 puts the default sampled step at 4-6x the floor, every: 8 (the default) "
            "at a mean of 1.1-2.0x (docs/performance.md)."))

    @dataclass
    class Part(_Part):
        """Adam-family signals of one sampled step, exact over all ranks' shards (see
        :mod:`distgrad.signals.adam` for the definitions). ``g`` is the reduced, unscaled, pre-clip
        gradient read at the boundary; ``m``, ``v`` Adam's ``exp_avg`` / ``exp_avg_sq`` before this
        step's update; ``v_hat = v / (1 - beta2**t)`` with the optimizer's own step count ``t`` (the
        updates already applied) and ``beta2``; ``d = max(v_hat, eps**2)``.

        Attributes:
            optimizer: the optimizer's class name (``"AdamW"``, ``"FusedAdam"``, ...).
            spike_threshold: theta of the spike fraction (``optimizer_signals.spike_threshold``).
            clip_ratio: ``c = min(1, max_norm / (|g| + 1e-6))`` of global-norm clipping (the engine's
                threshold or ``clip.max_grad_norm``; 1.0 when none is known), applied to the update RMS.
            elements: gradient elements with optimizer state (over all ranks, each counted once).
            elements_without_state: gradient elements the optimizer holds no moment for (not in
                the optimizer, or never stepped); left out of every value below.
            update_rms: ``clip_ratio * sqrt(mean(g**2 / d))``: the RMS of the update of the clipped
                gradient the optimizer applies (dimensionless; ~1 when the second moment tracks the
                gradient, >> 1 when the gradient outgrows it: Wortsman et al. 2023).
            spike_fraction: fraction of elements with ``g**2 > spike_threshold * d`` (pre-clip ``g``);
                NaN on a step the clip scales by ``clip_ratio < 0.99``: ``v`` tracks the *clipped*
                gradient, so every pre-clip ratio ``g**2 / d`` is inflated by about ``1 / clip_ratio**2``
                and the count would read as spikes on a healthy, steadily clipped run (not exported to
                Prometheus then; the raw count is kept in ``spike_fraction_preclip``).
            spike_fraction_preclip: the same fraction on every step, clipped or not (JSONL only).
            grad_momentum_cosine: ``g . m / (|g| |m|)`` (NaN when a norm is 0).
            exp_avg_norm, exp_avg_sq_norm: L2 norms of the raw states ``m`` (gradient unit) and ``v``
                (gradient unit squared).
            fisher_trace: ``sum(v_hat)``: trace of the empirical diagonal Fisher estimate Adam keeps
                (gradient unit squared; of the mini-batch gradient, Kunstner et al. 2019's caveats).
            layer_*: the same per layer label (``{layer: value}``; ``layer_spike_fraction`` is empty
                on a step the clip scales, like ``spike_fraction``).
            fisher_top_layers: the ``optimizer_signals.top_layers`` layers of largest Fisher trace,
                largest first.
        """

        optimizer: str = ""
        spike_threshold: float = float("nan")
        clip_ratio: float = 1.0
        elements: float = 0.0
        elements_without_state: float = 0.0
        update_rms: float = float("nan")
        spike_fraction: float = float("nan")
        spike_fraction_preclip: float = float("nan")
        grad_momentum_cosine: float = float("nan")
        exp_avg_norm: float = float("nan")
        exp_avg_sq_norm: float = float("nan")
        fisher_trace: float = float("nan")
        layer_update_rms: dict[str, float] = field(default_factory=dict)
        layer_spike_fraction: dict[str, float] = field(default_factory=dict)
        layer_grad_momentum_cosine: dict[str, float] = field(default_factory=dict)
        layer_exp_avg_norm: dict[str, float] = field(default_factory=dict)
        layer_exp_avg_sq_norm: dict[str, float] = field(default_factory=dict)
        layer_fisher_trace: dict[str, float] = field(default_factory=dict)
        fisher_top_layers: list[str] = field(default_factory=list)

    _moment = label("moment", "Adam optimizer state", ("exp_avg", "exp_avg_sq"))
    _when = condition("adam", "an Adam-family optimizer (`optimizer_signals.enabled: auto`, the default), after a "
                      "sampled step from the second optimizer step on (no moment exists before the first)",
                      enabled=lambda c: c.optimizer_signals.enabled != "off")
    METRICS = (
        gauge("distgrad_update_rms", "1", "sqrt(mean(g^2 / max(v_hat, eps^2))) over the model: the RMS of Adam's "
              "update with the second moment before this step.", _when,
              doc="`sqrt(mean(g^2 / max(v_hat, eps^2)))` over every element: `g` the reduced, unscaled, pre-clip "
                  "gradient, `v_hat` Adam's bias-corrected `exp_avg_sq` before this step's update (~1 when the second "
                  "moment tracks the gradient, well above 1 when the gradient outgrows it: an early warning of loss "
                  "spikes, Wortsman et al. 2023; see docs/signals.md)"),
        gauge("distgrad_adam_spike_fraction", "ratio", "Fraction of gradient elements with g^2 > theta * "
              "max(v_hat, eps^2) (theta: optimizer_signals.spike_threshold); no sample on a step the gradient clip "
              "scales (c < 0.99).", _when),
        gauge("distgrad_grad_momentum_cosine", "1", "Cosine between the gradient and Adam's first moment (exp_avg) "
              "before the step.", _when),
        gauge("distgrad_optimizer_moment_norm", "grad", "L2 norm of an Adam state over the model (exp_avg in the "
              "gradient's unit, exp_avg_sq in its square).", _when, (_moment,)),
        gauge("distgrad_fisher_trace", "grad^2", "sum(v_hat): trace of the diagonal empirical Fisher estimate Adam "
              "keeps (gradient unit squared).", _when,
              doc="`sum(v_hat)` over the model: trace of the diagonal empirical Fisher estimate of the mini-batch "
                  "gradient that Adam's second moment is (gradient unit squared); the top layers are in the JSONL "
                  "record"),
        gauge("distgrad_layer_update_rms", "1", "distgrad_update_rms over the layer's elements.", _when, ("layer",)),
        gauge("distgrad_layer_adam_spike_fraction", "ratio", "distgrad_adam_spike_fraction over the layer's "
              "elements.", _when, ("layer",)),
        gauge("distgrad_optimizer_signals_step", "steps", "Optimizer step at which the served Adam signals were "
              "computed: they are computed on one sampled step in optimizer_signals.every and served until the "
              "next computing step.", _when),
    )

    @staticmethod
    def samples(part: AdamSignal.Part) -> dict[str, Any]:
        """The model's and each layer's values; the spike fraction is absent (no sample) on a step
        the clip scales by less than :data:`SPIKE_CLIP_MIN` (the pre-clip count is not the
        applied update's; ``layer_spike_fraction`` is then empty)."""
        return {
            "distgrad_update_rms": part.update_rms,
            "distgrad_adam_spike_fraction": part.spike_fraction if part.clip_ratio >= SPIKE_CLIP_MIN else None,
            "distgrad_grad_momentum_cosine": part.grad_momentum_cosine,
            "distgrad_optimizer_moment_norm": {"exp_avg": part.exp_avg_norm, "exp_avg_sq": part.exp_avg_sq_norm},
            "distgrad_fisher_trace": part.fisher_trace,
            "distgrad_layer_update_rms": part.layer_update_rms,
            "distgrad_layer_adam_spike_fraction": part.layer_spike_fraction,
        }

    @classmethod
    def build(cls, inst: Any) -> AdamSignal | None:
        """On for Adam-family optimizers whose state the adapter locates (``enabled: auto``, with
        one warning on rank 0 naming why when it cannot); None when ``off``.

        Raises:
            ConfigError: ``enabled: on`` and the optimizer or its state cannot be served (names
                ``optimizer_signals.enabled`` and why).
        """
        mode = inst.config.optimizer_signals.enabled
        if mode == "off":
            return None
        why = refusal(inst)
        if why is not None:
            if mode == "on":
                raise ConfigError(f"distgrad config: 'optimizer_signals.enabled' is on but {why}; set "
                                  "optimizer_signals.enabled: auto (or off) to train without these signals")
            if inst.global_rank == 0:
                log.warning("distgrad: optimizer-aware signals (update RMS, spike fraction, Fisher, momentum cosine) "
                            "are off: %s", why)
            return None
        return cls(inst, group_keys(inst.names, "layer", inst.config.naming.tuples))

    def __init__(self, inst: Any, layer_keys: list[str]) -> None:
        cfg = inst.config.optimizer_signals
        self.theta = float(cfg.spike_threshold)
        self.top = int(cfg.top_layers)
        self.every = int(cfg.every)
        self.interval = int(inst.config.sampling.interval)
        index: dict[str, int] = {}
        self.inv = [index.setdefault(k, len(index)) for k in layer_keys]
        self.layers = list(index)
        self.opt_name = type(_inner_optimizer(inst)).__name__
        try:  # on CPU, build and self-check the native kernel now, not inside a sampled step
            cpu = torch.device(inst.source.device()).type == "cpu"
        except Exception:  # noqa: BLE001 - device not known yet: built on first use
            cpu = False
        if KERNEL == "auto" and cpu:
            adam_native.native()

    @property
    def sum_size(self) -> int:
        return len(self.layers) * len(COLS) + 1

    def computes(self, step: int | None) -> bool:
        """Whether the sampled optimizer step ``step`` computes the signals: one sampled step in
        ``optimizer_signals.every``, by the sampled-step index ``step // sampling.interval`` (a pure
        function of the step counter, the same on every rank); True when the step is not known."""
        return step is None or self.every <= 1 or (int(step) // max(1, self.interval)) % self.every == 0

    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.computes(getattr(inst, "sampled_step", None)):
            # not this sampled step: no read of the optimizer state; all-zero sums (no element with
            # state) make finish() leave the record part None on every rank
            return torch.zeros(self.sum_size, dtype=torch.float64, device=device), None
        slots = inst.pieces(inst.source.optimizer_slots())
        ms = inst.own.take(inst.pieces([None if s is None else s.piece("exp_avg") for s in slots]))
        vs = inst.own.take(inst.pieces([None if s is None else s.piece("exp_avg_sq") for s in slots]))
        scale = float(inst.source.grad_scale()) if inst.source.has_loss_scaler() else 1.0
        f64 = torch.float64
        fn = adam_native.native() if KERNEL == "auto" and device.type == "cpu" else None
        sums: list[list[torch.Tensor]] = [[] for _ in self.layers]
        todo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        prms, where, counts = [], [], []
        missing = 0
        for i, g in enumerate(pieces):
            if g is None or g.numel() == 0:
                continue
            slot, m, v = slots[i], ms[i], vs[i]
            t = slot.step_count() if slot is not None else None
            if m is None or v is None or t is None or (not isinstance(t, torch.Tensor) and t == 0):
                missing += g.numel()  # never stepped (first step) or not stepped by this optimizer
                continue
            bad = group_problem(self.opt_name, slot.group, slot.optimizer)
            if bad:  # a param group changed after instrument(): this step's signal is dropped
                raise ValueError(f"optimizer_signals: {bad}")
            if fn is not None and adam_native.eligible(g, m, v) and (
                    not isinstance(t, torch.Tensor) or t.device.type == "cpu"):
                todo.append((g, m, v))
                prms.append((t, slot.group))
                where.append(self.inv[i])
                counts.append(float(g.numel()))
                continue
            sums[self.inv[i]].append(self._sums(g, m, v, t, slot.group, scale).to(device))
        zero = torch.zeros(len(COLS), dtype=f64, device=device)
        body = torch.stack([torch.stack(r).sum(0) if r else zero for r in sums])  # [L, 8]
        if todo and fn is not None:  # fn is not None: todo holds the kernel's pieces
            rows = torch.cat([torch.tensor(counts, dtype=f64)[:, None],
                              adam_native.run(fn, todo, self._params(prms, scale))], 1)
            body = body.index_add(0, torch.tensor(where, dtype=torch.int64, device=device), rows.to(device))
        tail = torch.full((1,), float(missing), dtype=f64, device=device)  # a fill, no host copy
        return torch.cat([body.reshape(-1), tail]), None

    def _params(self, steps: list[tuple[Any, dict]], scale: float) -> torch.Tensor:
        """float32 ``[P, 5]`` ``(scale, bc, eps^2, theta, sign)`` of the native kernel for pieces
        with step counts (numbers or CPU tensors) and param groups ``steps``; ``bc`` computed as
        the torch path does (float64 ``1 - beta2**t``, then float32), with torch operations on the
        CPU (no Python read of a step tensor)."""
        f64 = torch.float64
        t = torch.stack([x.detach().to(f64).reshape(()) if isinstance(x, torch.Tensor)
                         else torch.tensor(float(x), dtype=f64) for x, _ in steps])
        beta2 = torch.tensor([float(g["betas"][1]) for _, g in steps], dtype=f64)
        corrected = torch.tensor([bool(g.get("bias_correction", True)) for _, g in steps])
        bc = torch.where(corrected, 1.0 - torch.pow(beta2, t), torch.ones_like(t)).float()
        rest = torch.tensor([[scale, float(g["eps"]) ** 2, self.theta, -1.0 if g.get("maximize", False) else 1.0]
                             for _, g in steps], dtype=torch.float32)
        return torch.cat([rest[:, :1], bc[:, None], rest[:, 1:]], 1).contiguous()

    def _sums(self, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: Any, group: dict,
              scale: float) -> torch.Tensor:
        """The 8 sums ``(n, sum g^2/d, #spikes, g.m, g.g, m.m, v.v, sum v_hat)`` of one piece,
        float64 ``[8]`` on the gradient's device: elementwise float32 over chunks of
        :data:`CHUNK` elements on the CPU (whole pieces on accelerators, whose caching
        allocator reuses the temporaries), each chunk summed in float32 (pairwise / tree
        reduction), the chunks' sums added in float64."""
        f64 = torch.float64
        beta2 = float(group["betas"][1])
        eps2 = float(group["eps"]) ** 2
        bc: Any = 1.0
        if group.get("bias_correction", True):
            if isinstance(t, torch.Tensor):  # no host read: a CPU scalar, or on the gradient's device
                t = t.to(dtype=f64) if t.device.type == "cpu" else t.to(g.device, f64)
                bc = (1.0 - torch.pow(beta2, t)).float()
            else:
                bc = 1.0 - beta2 ** float(t)
        sign = -1.0 if group.get("maximize", False) else 1.0
        step = CHUNK if g.device.type == "cpu" else max(1, g.numel())
        parts = []
        for s in range(0, g.numel(), step):
            gc = g[s:s + step].float()
            if scale != 1.0:
                gc = gc / scale
            mc, vc = m[s:s + step].float(), v[s:s + step].float()
            den = vc / bc
            vhat = den.sum()
            den.clamp_min_(eps2)
            r = gc * gc
            gg = r.sum()
            r.div_(den)
            parts.append(torch.stack([r.sum(), (r > self.theta).sum().float(), torch.dot(gc, mc) * sign, gg,
                                      torch.dot(mc, mc), torch.dot(vc, vc), vhat.float()]))
        body = torch.stack(parts).to(f64).sum(0)
        return torch.cat([torch.full((1,), float(g.numel()), dtype=f64, device=g.device), body])

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray, grad_scale: float) -> None:
        L = len(self.layers)
        cols = sum_part[: L * len(COLS)].reshape(L, len(COLS))
        missing = float(sum_part[-1])
        if rec.overflow or cols[:, 0].sum() == 0:
            return  # first step (no moment yet), or an fp16 overflow the optimizer skips
        c = self._clip_ratio(inst, rec)
        # the count is of the pre-clip gradient against a second moment of clipped gradients:
        # inflated by ~1/c^2 on a clipped step, where it is not the applied update's (NaN, not exported)
        spikes_vouched = c >= SPIKE_CLIP_MIN
        tot = cols.sum(0)
        vals = [_values(r, c) for r in cols]
        g = _values(tot, c)
        keep = [k for k, r in zip(self.layers, cols) if r[0] > 0]
        per = {k: v for k, v, r in zip(self.layers, vals, cols) if r[0] > 0}
        fisher = {k: per[k]["fisher"] for k in keep}
        top = sorted(keep, key=lambda k: -fisher[k] if math.isfinite(fisher[k]) else math.inf)[: self.top]
        rec.optimizer_signals = AdamSignal.Part(
            optimizer=self.opt_name, spike_threshold=self.theta, clip_ratio=c, elements=float(tot[0]),
            elements_without_state=missing, update_rms=g["rms"],
            spike_fraction=g["spikes"] if spikes_vouched else math.nan, spike_fraction_preclip=g["spikes"],
            grad_momentum_cosine=g["cos"], exp_avg_norm=g["m"], exp_avg_sq_norm=g["v"], fisher_trace=g["fisher"],
            layer_update_rms={k: per[k]["rms"] for k in keep},
            layer_spike_fraction={k: per[k]["spikes"] for k in keep} if spikes_vouched else {},
            layer_grad_momentum_cosine={k: per[k]["cos"] for k in keep},
            layer_exp_avg_norm={k: per[k]["m"] for k in keep},
            layer_exp_avg_sq_norm={k: per[k]["v"] for k in keep},
            layer_fisher_trace=fisher, fisher_top_layers=top)


    @staticmethod
    def _clip_ratio(inst: Any, rec: Any) -> float:
        """``min(1, max_norm / (grad_norm + 1e-6))`` for the clip threshold the diagnostics know
        (the engine's, or ``clip.max_grad_norm``), as torch / DeepSpeed compute it; 1.0 without
        one or with a non-finite norm."""
        from distgrad.diagnostics.health import clip_ratio

        diag = getattr(inst, "diagnostics", None)
        m = getattr(diag, "max_norm", None) if diag is not None else None
        if not m or not math.isfinite(rec.grad_norm):
            return 1.0
        return float(clip_ratio(rec.grad_norm, float(m), eps=1e-6))


def _values(r: np.ndarray, clip: float = 1.0) -> dict[str, float]:
    """The signals of one row of sums ``(n, ratio, spikes, gm, gg, mm, vv, vhat)``; ``clip``:
    the global clip coefficient the update applies to the gradient (scales the update RMS)."""
    n, ratio, spikes, gm, gg, mm, vv, vhat = (float(x) for x in r)
    if n <= 0:
        return {k: math.nan for k in ("rms", "spikes", "cos", "m", "v", "fisher")}
    denom = math.sqrt(gg) * math.sqrt(mm)
    # a NaN element is in no count (NaN > theta is False): with a non-finite gradient element
    # (sum g^2/d NaN or Inf) the fraction is not known, NaN like the update RMS, never a low count
    return {"rms": clip * math.sqrt(ratio / n), "spikes": spikes / n if math.isfinite(ratio) else math.nan,
            "cos": gm / denom if denom > 0 else math.nan,
            "m": math.sqrt(mm), "v": math.sqrt(vv), "fisher": vhat}



#: the record part (``StepRecord.optimizer_signals``), by its earlier name
OptimizerSignals = AdamSignal.Part
