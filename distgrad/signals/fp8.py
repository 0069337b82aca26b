"""FP8 scaling health (opt-in, ``fp8.enabled``): per float8 linear layer, on the sampled step's
micro-batches, the amax and scale of each tensor the layer casts to float8 (its input, its weight
and the gradient of its output), the fraction of elements that underflow to zero and that
saturate in the cast, and the amax disagreement across tensor-parallel shards.

Why: with dynamic float8 scaling an amax of zero gives a scale of ``fp8_max / eps`` (torchao) or
an infinite one (TransformerEngine PR #786) and a NaN downstream (pytorch/ao #3356); an amax
taken on a tensor-parallel shard gives every shard its own scale, and the grad norm jumps and
goes NaN (torchtitan #3109); an activation that jumps past a stale scale is clipped (TE #2801:
"serious clipping ... won't know with only max"). TransformerEngine's ``LogFp8TensorStats``
writes underflow / overflow percentages to files; this exports them and pages.

Layers: torchao's ``Float8Linear`` (``torchao.float8.convert_to_float8_training``; selected by
``fp8.modules``, default every one). Per layer and tensor ``t`` in ``(input, weight,
grad_output)`` whose cast config is not ``DISABLED``, the hooks see the tensor torchao casts
(``input``: the forward's input, cast to the autocast dtype as ``Float8Linear.forward`` does;
``weight``: ``module.weight``; ``grad_output``: the gradient of the layer's output, through a
tensor hook, as ``matmul_with_hp_or_float8_args.backward`` receives it) and compute, with
torchao's own functions and the layer's own cast config (``tensor_to_amax``, ``amax_to_scale``,
scaling granularity with the axis -1, ``round_scales_to_power_of_2``, target dtype):

* ``amax = max |x|`` (per row under axiswise scaling) and ``scale = fp8_max / max(amax, 1e-12)``
  (float64 then float32: torchao's ``amax_to_scale``);
* ``y = x.float() * scale`` (torchao's ``hp_tensor_and_scale_to_float8``) and the counts
  ``underflow = #{x != 0 and |y| <= tiny / 2}`` (``tiny``: the smallest subnormal of the fp8
  dtype; round-to-nearest-even casts exactly those to 0) and ``saturated = #{|y| > fp8_max +
  ulp(fp8_max) / 2}`` (the elements the cast clips by more than its rounding error: 464 for
  e4m3fn, 61440 for e5m2; with dynamic scaling the amax element maps to ``fp8_max`` exactly and
  is not counted, so a healthy layer reads 0);
* a micro-batch whose amax is NaN counts as non-finite (torchao's scale is then NaN).

Both counts are exact (float64 sums of integers) and equal to the elements that
``y.to(float8_dtype)`` turns into 0 / clips beyond its rounding interval
(tests/test_fp8.py recomputes them that way in float64).

FSDP2 with torchao's float8 all-gather (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``):
each rank casts its high-precision weight SHARD to float8 before the all-gather (torchao's
``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``), with the scale set by
``precompute_float8_dynamic_scale_for_fsdp`` when the user called it (``_precomputed_scale``,
kept until the next call) or else the mesh-reduced dynamic one, and the layer receives a
``Float8TrainingTensor``. The weight is then read from this rank's shard (the sharded parameter
found at :meth:`Fp8Signal.attach`) with the scale that ``Float8TrainingTensor`` carries, so the
counts over the ranks' shards are the whole weight's; its amax (both extremes) is the largest over
the shards, the whole weight's (the weight does not change within a step), and it takes no TP
slot. A precomputed scale that is not refreshed after every optimizer step (called once at
set-up, or before the step) is the realistic way a torchao run saturates: the weights grow past
the range the old scale was made for, and FSDP's cast clips them (tests/dist/fp8_fsdp_cases.py).

Tensor parallelism (``fp8.tp_size`` > 1: consecutive ranks ``r // tp_size`` form a TP group,
tp innermost as Megatron / torchtitan order them): each rank's largest amax over the step's
micro-batches, of each layer and tensor, rides in its TP group's slots of the MAX all-reduce as
``amax`` and ``-amax``; the disagreement is ``max / min`` of it over the group (1 when every
shard used the same amax on every micro-batch, as torchao's mesh-reduced amax of a DTensor;
above 1 when each shard scaled by its own, the torchtitan #3109 failure). DTensor tensors are
not read (each rank would count a replicated tensor once per shard): a float8 layer seeing one
raises in the hook (counted; the step's part dropped).

TransformerEngine: not installed on the test machine; its layers keep their own scaling state
(``fp8_meta``) and are not read yet (``fp8.enabled`` with no torchao float8 layer in the model
is refused at ``instrument()`` naming the key).

Sampling: the hooks compute only on the micro-batches of a step that will be sampled (armed
after the boundary of step ``s`` iff ``s + 1`` is sampled, as the logit precursors), only with
gradients enabled, and not in distgrad's own re-executions (the underflow recomputation, the
rerun attribution: :func:`distgrad.signals.underflow.in_replay`).

Packed parts: SUM ``5`` float64 per layer and tensor ``[observed, elements, underflow,
saturated, non-finite amax]``; MAX ``4 + 2 G`` per layer and tensor ``[scale, -scale, amax,
-amax, then per TP group the largest amax of its ranks and its negative]`` (G = world /
tp_size; 0 without TP). Cost per observed
micro-batch and tensor: one amax, one float32 product and two comparisons over the tensor (the
same passes torchao's cast makes), on the device, no host sync, no collective of its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from distgrad.config.errors import ConfigError
from distgrad.config.sections import Section
from distgrad.export.metrics import Metric, condition, label
from distgrad.naming.canonical import clean_name
from distgrad.naming.grouping import group_keys
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal
from distgrad.signals.underflow import in_replay

__all__ = ["Fp8Signal", "ROLES", "fp8_thresholds", "cast_stats"]

#: the tensors a float8 linear casts, in the order of the packed parts
ROLES = ("input", "weight", "grad_output")
#: SUM slots per layer and tensor
_NS = 5
#: MAX slots per layer and tensor before the TP groups' (scale, -scale, amax, -amax)
_NM = 4
#: series of the per-layer metrics (the layers of smallest amax / largest saturation)
LISTED = 8


def fp8_thresholds(dtype: torch.dtype) -> tuple[float, float, float]:
    """``(fp8_max, underflow bound, saturation bound)`` of a float8 dtype: a scaled value ``y``
    underflows to 0 iff ``|y| <= tiny / 2`` (``tiny = smallest_normal * eps``, the smallest
    subnormal; the tie rounds to the even 0) and saturates iff ``|y| > max + ulp(max) / 2``
    (``ulp(max) = 2**floor(log2(max)) * eps``: beyond it the unsaturated cast rounds past the
    largest finite value). Source: the IEEE-style layouts of OCP FP8 (e4m3fn: max 448, tiny
    2**-9; e5m2: max 57344, tiny 2**-16).

    Raises:
        TypeError: ``dtype`` not a floating type.
    """
    fi = torch.finfo(dtype)
    tiny = fi.smallest_normal * fi.eps
    ulp = 2.0 ** math.floor(math.log2(fi.max)) * fi.eps
    return float(fi.max), tiny / 2, float(fi.max) + ulp / 2


def cast_stats(x: torch.Tensor, dtype: torch.dtype, granularity: Any = None, round_pow2: bool = False,
               scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor's float8 cast statistics, with torchao's amax and scale.

    Args:
        x: the high-precision tensor torchao casts (any float dtype, any shape, not a DTensor).
        dtype: the float8 target dtype.
        granularity: torchao ``ScalingGranularity`` (None: tensorwise); axiswise uses the last
            dimension, as ``Float8Linear`` for its three tensors.
        round_pow2: torchao's ``round_scales_to_power_of_2``.
        scale: the scale the cast used when it is not the dynamic one (a delayed or static
            scale, float32, broadcastable to ``x``); None: torchao's dynamic scale from ``x``.

    Returns:
        ``(sums, maxes)`` float64 on ``x``'s device: ``[1, elements, underflow, saturated,
        non-finite amax]`` and ``[max scale, -min scale, max amax, -min amax]`` (over the rows
        under axiswise scaling; a NaN amax or scale enters the maxima as ``-inf`` and the
        non-finite count as 1).

    Raises:
        TypeError: a DTensor.
    """
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    if type(x).__name__ == "DTensor":
        raise TypeError("fp8: a DTensor reached a float8 layer; its statistics are not read (docs/signals.md)")
    x = x.detach()
    gran = ScalingGranularity.TENSORWISE if granularity is None else granularity
    axis = -1 if gran is ScalingGranularity.AXISWISE else None
    amax = tensor_to_amax(x, False, None, gran, axis)
    if scale is None:
        scale = amax_to_scale(amax, dtype, round_pow2)
    _, under, sat = fp8_thresholds(dtype)
    ay = (x.to(torch.float32) * scale).abs()
    f64: dict[str, Any] = dict(dtype=torch.float64, device=x.device)
    n_under = ((x != 0) & (ay <= under)).sum(dtype=torch.float64)
    n_sat = (ay > sat).sum(dtype=torch.float64)
    a, s = amax.to(torch.float64), scale.to(torch.float64)
    bad = (torch.isnan(a).any() | torch.isnan(s).any()).to(torch.float64)
    ninf = torch.full((), -math.inf, **f64)
    sums = torch.stack([torch.ones((), **f64), torch.full((), float(x.numel()), **f64), n_under, n_sat, bad])

    def hi(v: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isnan(v), ninf, v).amax()

    maxes = torch.stack([hi(s), hi(-s), hi(a), hi(-a)])
    return sums, maxes


def _role_config(module: Any, role: str) -> tuple[Any, torch.dtype] | None:
    """``(granularity, dtype)`` of the layer's cast config for ``role``, None when DISABLED."""
    from torchao.float8.config import ScalingType, e4m3_dtype

    cfg = module.config
    cc = {"input": cfg.cast_config_input, "weight": cfg.cast_config_weight,
          "grad_output": cfg.cast_config_grad_output}[role]
    if cc.scaling_type is ScalingType.DISABLED:
        return None
    return cc.scaling_granularity, (cc.target_dtype or e4m3_dtype)


def _fsdp_float8_weight(module: Any) -> Any:
    """The FSDP2-sharded weight of a float8 layer under torchao's float8 all-gather
    (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``): the ``nn.Parameter`` DTensor
    whose local shard is a ``WeightWithDynamicFloat8CastTensor`` (FSDP2 keeps this object across
    steps and swaps it back onto the module after each reshard); None otherwise."""
    w = getattr(module, "weight", None)
    if type(w).__name__ != "DTensor" or type(getattr(w, "_local_tensor", None)).__name__ != (
            "WeightWithDynamicFloat8CastTensor"):
        return None
    return w


def _already_float8(x: Any) -> bool:
    """``x`` is a torchao ``Float8TrainingTensor`` (cast before the layer: FSDP2's float8
    all-gather hands the layer its weight in float8)."""
    return type(x).__name__ == "Float8TrainingTensor"


def _float8_modules(module: Any) -> list[tuple[str, Any]]:
    try:
        from torchao.float8.float8_linear import Float8Linear
    except Exception:  # noqa: BLE001 - torchao absent or broken: no float8 layer to read
        return []
    return [(n, m) for n, m in module.named_modules() if isinstance(m, Float8Linear)]


class Fp8Signal(PackedSignal):
    """FP8 scaling health of the float8 linear layers (module docstring).

    Args:
        interval: ``sampling.interval``.
        modules_re: ``fp8.modules`` (None: every torchao ``Float8Linear``).
        tp_size: ``fp8.tp_size``; world: the instrument's world size; rank: this rank.
        naming_rules: ``naming.tuples`` (layer labels as the other per-layer metrics).
    """

    name = "fp8"

    class Config(Section):
        """FP8 scaling health (opt-in): amax, scale, underflow and saturation fractions of the
        tensors each torchao float8 linear layer casts, and their amax disagreement across
        tensor-parallel shards, on the sampled steps (docs/signals.md, "FP8 scaling health")."""

        section_key: ClassVar[str] = "fp8"
        enabled: bool = Field(False, description=(
            "Observe every torchao Float8Linear (torchao.float8.convert_to_float8_training) on the "
            "sampled steps' micro-batches: per layer and tensor (input, weight, grad_output) the amax "
            "and the scale torchao computes, the fraction of elements that underflow to zero and that "
            "saturate in the float8 cast. Costs one amax, a float32 product and two comparisons per "
            "tensor per sampled micro-batch, and 5 + 4 float64 per layer and tensor in the "
            "collectives (2 more per TP group). A model without a float8 layer is refused."))
        modules: str | None = Field(None, description=(
            "Regular expression on the module names (wrapper prefixes removed) selecting the float8 "
            "layers to observe; null: every Float8Linear."))
        tp_size: int = Field(1, ge=1, description=(
            "Tensor-parallel degree when each rank runs float8 layers on its local shard (ranks "
            "r // tp_size form a TP group, tp innermost): the amax of each layer and tensor is "
            "compared across the group (distgrad_fp8_amax_disagreement, max/min). 1: no "
            "tensor parallelism (the disagreement is not exported)."))

    @dataclass
    class Part(_Part):
        """FP8 scaling health of the sampled step (``StepRecord.fp8``).

        Attributes:
            tp_size: ``fp8.tp_size``.
            layers: per observed float8 module (its name), its layer label.
            stats: per module, per tensor (``input``, ``weight``, ``grad_output``) observed on the
                step: ``amax_min`` / ``amax_max`` (over micro-batches, rows and ranks),
                ``scale_min`` / ``scale_max`` (NaN when some observation's scale was NaN),
                ``elements``, ``underflow``, ``saturated`` (element counts summed over
                micro-batches and ranks), ``observed`` (micro-batches x ranks) and, with
                ``tp_size`` > 1, ``amax_disagreement`` (max over TP groups of max/min amax).
        """

        tp_size: int = 1
        layers: dict[str, str] = field(default_factory=dict)
        stats: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    _when = condition("fp8", "`fp8.enabled: true` with torchao float8 layers, after a sampled step",
                      enabled=lambda c: c.fp8.enabled)
    _tensor = label("tensor", "the tensor a float8 layer casts (`fp8.enabled`)", ROLES)
    # per layer only the few layers the alerts name (the series budget counts a per-layer series
    # on every run, whether fp8 is on or not): the LISTED (layer, tensor) pairs of smallest amax and
    # layers of largest saturation; every tensor over all layers; every module in the record
    _L = ("layer", _tensor)
    METRICS = (
        Metric("distgrad_fp8_amax_min", "gauge", _L, "1", f"Smallest amax max|x| torchao computed for the tensor's "
               f"float8 scale in the layer's float8 linears on the sampled step (micro-batches and ranks), for the "
               f"{LISTED} (layer, tensor) pairs of smallest amax; 0: an all-zero tensor.", _when, max_series=LISTED),
        Metric("distgrad_fp8_layer_saturation_ratio", "gauge", ("layer",), "ratio", "Largest over the tensors "
               "(input, weight, grad_output) of the fraction of elements the float8 cast clips beyond its rounding "
               f"error (|x*scale| > fp8_max + ulp/2), in the layer's float8 linears; the {LISTED} layers of "
               "largest fraction.", _when, max_series=LISTED,
               doc="per tensor: the fraction of its elements with `|x * scale| > fp8_max + ulp(fp8_max)/2` (464 for "
                   "e4m3fn), clipped to fp8_max by torchao's saturated cast; 0 under dynamic scaling of a finite "
                   f"tensor; the largest of the layer's three tensors, for the {LISTED} layers of largest value "
                   "(each module and tensor in the record)"),
        Metric("distgrad_fp8_scale_min", "gauge", (_tensor,), "1", "Smallest float8 scale fp8_max/amax of the tensor "
               "over every float8 linear on the sampled step (NaN: a NaN amax).", _when),
        Metric("distgrad_fp8_saturation_ratio", "gauge", (_tensor,), "ratio", "Fraction of the tensor's elements "
               "the float8 cast clips beyond its rounding error, over every float8 linear.", _when),
        Metric("distgrad_fp8_amax_max", "gauge", (_tensor,), "1", "Largest amax max|x| of the tensor over every "
               "float8 linear on the sampled step.", _when),
        Metric("distgrad_fp8_scale_max", "gauge", (_tensor,), "1", "Largest float8 scale fp8_max/amax of the tensor "
               "over every float8 linear on the sampled step (fp8_max/1e-12 for an amax of 0 under torchao; NaN: a "
               "NaN amax).", _when),
        Metric("distgrad_fp8_underflow_ratio", "gauge", (_tensor,), "ratio", "Fraction of the tensor's elements, "
               "nonzero in high precision, that the float8 cast turns into 0, over every float8 linear.", _when,
               doc="fraction of all the tensor's elements (float8 linears, sampled micro-batches, ranks) with `x != 0` "
                   "and `|x * scale| <= tiny/2` (tiny: the fp8 dtype's smallest subnormal): flushed to zero by the "
                   "cast (TransformerEngine's `underflows%`); per module in the record"),
        Metric("distgrad_fp8_amax_disagreement", "gauge", (_tensor,), "1", "Max over float8 linears and "
               "tensor-parallel groups of max/min of the tensor's amax across the group's shards (1: every shard "
               "scaled alike).", _when,
               doc="with `fp8.tp_size` > 1 only: `max max_{r in g} amax_r / min_{r in g} amax_r` over the float8 "
                   "linears and TP groups `g` (inf when a shard's amax is 0 and another's is not); per module in "
                   "the record"),
    )

    @staticmethod
    def samples(part: Fp8Signal.Part) -> dict[str, Any]:
        """Per ``(layer, tensor)`` (the modules of a layer aggregated) and per tensor (every
        module aggregated): minima / maxima of the extremes, counts summed before the ratios;
        a NaN scale makes the aggregate NaN."""
        def agg(key_of: Callable[[str, str], Any]) -> dict[Any, dict[str, float]]:
            out: dict[Any, dict[str, float]] = {}
            for mod, roles in part.stats.items():
                for role, st in roles.items():
                    a = out.setdefault(key_of(part.layers.get(mod, mod), role), {
                        "amax_min": math.inf, "amax_max": -math.inf, "scale_min": math.inf, "scale_max": -math.inf,
                        "elements": 0.0, "underflow": 0.0, "saturated": 0.0, "dis": -math.inf})
                    a["amax_min"] = min(a["amax_min"], st["amax_min"])
                    a["amax_max"] = max(a["amax_max"], st["amax_max"])
                    nan = math.isnan(st["scale_min"]) or math.isnan(a["scale_min"])
                    a["scale_min"] = math.nan if nan else min(a["scale_min"], st["scale_min"])
                    a["scale_max"] = math.nan if nan else max(a["scale_max"], st["scale_max"])
                    for k in ("elements", "underflow", "saturated"):
                        a[k] += st[k]
                    if "amax_disagreement" in st:
                        a["dis"] = max(a["dis"], st["amax_disagreement"])
            return out

        out: dict[str, Any] = {m.name: {} for m in Fp8Signal.METRICS}
        amin: dict[tuple[str, str], float] = {}
        sat: dict[str, float] = {}
        for (lay, role), a in agg(lambda lay, role: (lay, role)).items():
            if not math.isnan(a["amax_min"]):
                amin[(lay, role)] = a["amax_min"]
            if a["elements"] > 0:
                sat[lay] = max(sat.get(lay, 0.0), a["saturated"] / a["elements"])
        out["distgrad_fp8_amax_min"] = dict(sorted(amin.items(), key=lambda kv: kv[1])[:LISTED])
        out["distgrad_fp8_layer_saturation_ratio"] = dict(sorted(sat.items(), key=lambda kv: -kv[1])[:LISTED])
        for role, a in agg(lambda lay, role: role).items():
            out["distgrad_fp8_scale_min"][role] = a["scale_min"]
            out["distgrad_fp8_amax_max"][role] = a["amax_max"]
            out["distgrad_fp8_scale_max"][role] = a["scale_max"]
            if a["elements"] > 0:
                out["distgrad_fp8_saturation_ratio"][role] = a["saturated"] / a["elements"]
                out["distgrad_fp8_underflow_ratio"][role] = a["underflow"] / a["elements"]
            if part.tp_size > 1 and a["dis"] > -math.inf:
                out["distgrad_fp8_amax_disagreement"][role] = a["dis"]
        return out

    @classmethod
    def build(cls, inst: Any) -> Fp8Signal | None:
        """``fp8.enabled``: the signal (the layers are found at :meth:`attach`).

        Raises:
            ConfigError: ``fp8.modules`` not a regular expression; ``fp8.tp_size`` not dividing
                the world size; a pipeline / expert job view (the ranks do not hold the same
                layers)."""
        c = inst.config.fp8
        if not c.enabled:
            return None
        if getattr(inst, "job", None) is not None:
            raise ConfigError("distgrad config: 'fp8.enabled' is not supported with a pipeline / expert job view "
                              "(the ranks do not hold the same layers)")
        if c.modules:
            try:
                re.compile(c.modules)
            except re.error as e:
                raise ConfigError(f"distgrad config: 'fp8.modules' is not a regular expression: {e}") from e
        if inst.world_size % c.tp_size:
            raise ConfigError(f"distgrad config: 'fp8.tp_size' {c.tp_size} does not divide the world size "
                              f"{inst.world_size}")
        return cls(inst.config.sampling.interval, c.modules, c.tp_size, inst.world_size, inst.rank,
                   inst.config.naming.tuples)

    def __init__(self, interval: int, modules_re: str | None, tp_size: int, world: int, rank: int,
                 naming_rules: Any = None) -> None:
        self.interval, self.modules_re, self.tp = int(interval), modules_re, int(tp_size)
        self.groups = world // self.tp if self.tp > 1 else 0  # TP groups with slots (0: no TP)
        self.group = rank // self.tp if self.tp > 1 else 0
        self.naming_rules = naming_rules
        self.names: list[str] = []
        self.layer_of: list[str] = []
        self.roles: list[list[str]] = []  # per module, the roles it casts
        self._cfg: list[dict[str, tuple[Any, torch.dtype, bool]]] = []
        self._fsdp_w: list[Any] = []  # per module, its FSDP2 float8 all-gather sharded weight or None
        self.armed = True
        self._reset()

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def _nm(self) -> int:
        return _NM + 2 * self.groups

    @property
    def sum_size(self) -> int:
        return _NS * len(ROLES) * len(self.names)

    @property
    def max_size(self) -> int:
        return self._nm * len(ROLES) * len(self.names)

    @property
    def _local_size(self) -> int:  # this rank's running maxima, _NM per layer and tensor
        return _NM * len(ROLES) * len(self.names)

    # ---- set-up -------------------------------------------------------------------------------
    def attach(self, inst: Any, module: Any) -> Callable[[], None] | None:
        """Find the float8 layers and install the hooks. Raises ConfigError: none found."""
        pat = re.compile(self.modules_re) if self.modules_re else None
        chosen = []
        for name, m in _float8_modules(module):
            cname = clean_name(name) if name else name
            if pat is None or (cname and pat.search(cname)):
                chosen.append((cname, m))
        if not chosen:
            raise ConfigError("distgrad config: 'fp8.enabled' found no torchao float8 layer (Float8Linear, from "
                              "torchao.float8.convert_to_float8_training)"
                              + (f" matching fp8.modules {self.modules_re!r}" if self.modules_re else "")
                              + "; TransformerEngine layers are not read yet")
        self.names = [c for c, _ in chosen]
        self.layer_of = [group_keys([f"{c}.weight"], "layer", self.naming_rules)[0] for c in self.names]
        self._cfg, self.roles = [], []
        for _, m in chosen:
            per = {}
            for role in ROLES:
                rc = _role_config(m, role)
                if rc is not None:
                    per[role] = (rc[0], rc[1], bool(m.config.round_scales_to_power_of_2))
            self._cfg.append(per)
            self.roles.append(list(per))
        self._fsdp_w = [_fsdp_float8_weight(m) for _, m in chosen]
        handles = []
        for i, (_, m) in enumerate(chosen):
            handles.append(m.register_forward_pre_hook(lambda mod, args, i=i: self._pre(i, mod, args)))
            handles.append(m.register_forward_hook(lambda mod, args, out, i=i: self._post(i, out)))
        self._reset()

        def undo() -> None:
            for h in handles:
                h.remove()
        return undo

    # ---- observation --------------------------------------------------------------------------
    def _reset(self) -> None:
        self._sum: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._error: Exception | None = None

    def _active(self) -> bool:
        # not the underflow recomputation's nor the rerun attribution's forwards (in_replay)
        return self.armed and torch.is_grad_enabled() and not in_replay()

    def observe(self, i: int, role: str, x: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Add one cast of tensor ``role`` of layer ``i`` to this step's parts (``scale``: the
        scale the cast used when it is not the dynamic one of ``x``, see :func:`cast_stats`).
        Never raises (a failure is raised again in :meth:`local`: counted, the step's part
        dropped on every rank)."""
        try:
            cfg = self._cfg[i].get(role)
            if cfg is None:
                return
            if x.numel() == 0:  # an empty FSDP2 shard: nothing cast on this rank
                return
            s, m = cast_stats(x, cfg[1], cfg[0], cfg[2], scale=scale)
            dev = s.device
            if self._sum is None:
                self._sum = torch.zeros(self.sum_size, dtype=torch.float64, device=dev)
                self._max = torch.full((self._local_size,), -math.inf, dtype=torch.float64, device=dev)
            assert self._max is not None
            k = i * len(ROLES) + ROLES.index(role)
            self._sum[k * _NS:(k + 1) * _NS] += s.to(self._sum.device)
            self._max[k * _NM:(k + 1) * _NM] = torch.maximum(self._max[k * _NM:(k + 1) * _NM], m.to(self._max.device))
        except Exception as e:  # noqa: BLE001 - raised in local()
            self._error = self._error or e

    def _pre(self, i: int, mod: Any, args: Any) -> None:
        if not self._active() or not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0]
        if torch.is_autocast_enabled():  # as Float8Linear.forward
            x = x.to(torch.get_autocast_gpu_dtype())
        self.observe(i, "input", x)
        w = mod.weight
        if _already_float8(w):
            # FSDP2's float8 all-gather: each rank cast its high-precision shard with the scale the
            # Float8TrainingTensor carries (torchao's fsdp_pre_all_gather: the precomputed scale of
            # precompute_float8_dynamic_scale_for_fsdp when set, else the mesh-reduced dynamic one);
            # count this rank's shard against that scale (the shards sum to the whole weight)
            src = self._fsdp_w[i] if i < len(self._fsdp_w) else None
            if src is None:
                self._error = self._error or TypeError(
                    f"fp8: the weight of {self.names[i]} reached the layer already in float8 from an unknown "
                    "source (only FSDP2's float8 all-gather is read)")
                return
            self.observe(i, "weight", src._local_tensor._tensor, scale=w._scale)
        else:
            self.observe(i, "weight", w)

    def _post(self, i: int, out: Any) -> None:
        if not self._active() or "grad_output" not in self.roles[i]:
            return
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, i=i: self.observe(i, "grad_output", g))

    # ---- the boundary -------------------------------------------------------------------------
    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        s, m, err = self._sum, self._max, self._error
        self._reset()
        self.armed = self.interval == 1
        if err is not None:
            raise RuntimeError("fp8 statistics failed on a micro-batch of this step") from err
        f64: dict[str, Any] = dict(dtype=torch.float64, device=device)
        s = s.to(**f64) if s is not None else torch.zeros(self.sum_size, **f64)
        m = (m.to(**f64) if m is not None else torch.full((self._local_size,), -math.inf, **f64)).view(-1, _NM)
        if self.groups:
            # per TP group: this rank's largest amax over the step's micro-batches, and its negative
            hi = m[:, 2:3].clone()
            for i, src in enumerate(self._fsdp_w):  # an FSDP2 shard's amax is not a TP shard's
                if src is not None:
                    hi[i * len(ROLES) + ROLES.index("weight")] = -math.inf
            seen = hi > -math.inf
            grp = torch.full((m.shape[0], 2 * self.groups), -math.inf, **f64)
            grp[:, self.group:self.group + 1] = hi
            grp[:, self.groups + self.group:self.groups + self.group + 1] = torch.where(seen, -hi, hi)
            m = torch.cat([m, grp], dim=1)
        return s, m.reshape(-1)

    def skip(self, inst: Any, step: int) -> None:
        self._reset()
        self.armed = inst.is_sampled(step + 1)

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray,
               grad_scale: float) -> None:
        part = Fp8Signal.Part(tp_size=self.tp)
        gs = self.groups
        for i, name in enumerate(self.names):
            for r, role in enumerate(ROLES):
                k = i * len(ROLES) + r
                obs, n, under, sat, bad = (float(v) for v in sum_part[k * _NS:(k + 1) * _NS])
                if obs <= 0:
                    continue
                mx = max_part[k * self._nm:(k + 1) * self._nm]
                seen = mx[2] > -math.inf
                # the weight of an FSDP2 float8 all-gather layer: each rank saw its shard, the
                # whole weight's amax is the max over the ranks (constant within the step)
                whole = role == "weight" and i < len(self._fsdp_w) and self._fsdp_w[i] is not None
                st = {"observed": obs, "elements": n, "underflow": under, "saturated": sat,
                      "amax_min": (float(mx[2]) if whole else float(-mx[3])) if seen else math.nan,
                      "amax_max": float(mx[2]) if seen else math.nan,
                      "scale_min": math.nan if bad else float(-mx[1]),
                      "scale_max": math.nan if bad else float(mx[0])}
                if gs:
                    hi_g, lo_g = mx[_NM:_NM + gs], -mx[_NM + gs:_NM + 2 * gs]
                    ok = hi_g > -math.inf
                    ratios = [1.0 if h == lo else (math.inf if lo == 0 else float(h / lo))
                              for h, lo in zip(hi_g[ok], lo_g[ok])]
                    if ratios:
                        st["amax_disagreement"] = max(ratios)
                part.stats.setdefault(name, {})[role] = st
                part.layers[name] = self.layer_of[i]
        if part.stats:
            rec.fp8 = part
