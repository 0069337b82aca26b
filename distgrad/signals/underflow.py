"""Gradient elements lost to underflow, told from genuinely zero ones (opt-in,
``underflow.enabled``), per layer.

Why a recomputation. Under fp16 autocast without loss scaling a layer's weight gradient is
computed in fp16 and cast to the parameter's dtype: every element whose true value is below
fp16's smallest subnormal (2^-24) arrives as an exact 0. From the gradient alone nothing tells
such a zero from a genuinely zero element (an embedding row not in the batch, a dead unit, a
masked branch), and the histogram's underflow ratio (:mod:`distgrad.signals.histogram`) counts
only the *non-zero* elements below the smallest normal: on a tiny decoder whose layers lose most
of their elements to exact zeros it names the final norm (whose gradient is summed in fp32 from
fp16 inputs: subnormal, not lost) as the worst layer. The zero fraction's jump when a dynamic
loss scale halves would tell the two apart only on runs with a scaler, only at a scale change,
and only as a difference of two steps' batches; the recomputation answers on any run.

Method. Every ``underflow.interval``-th sampled step each rank recomputes *one* micro-batch of
that step (the first one of the step with gradients enabled; its inputs kept by reference, with
the CPU/CUDA RNG state and the autocast state its forward ran under) twice, at the step's
boundary, before the optimizer consumes the gradients (the weights are those of the forward):

1. *low precision*: the model's forward under the kept autocast state, with the parameters in
   their own dtype, the loss (the forward's returned loss, times ``underflow.loss_factor``, then
   scaled as the framework scales it before backward: :meth:`Underflow._scaled`)
   multiplied by the loss scale in force (``GradScaler`` / DeepSpeed fp16; 1 without one), then
   the backward into the parameter copies: the gradient the training backward produced
   for that micro-batch, element for element;
2. *reference*: the same forward with autocast off and float32 copies of the parameters,
   buffers and floating inputs, its gradient w.r.t. the float32 parameters.

Per parameter element: **lost to underflow** = non-zero in the reference, exactly zero in the
low-precision gradient; **genuinely zero** = zero in the reference. Per layer the counts (lost,
low-precision zeros, reference zeros, elements, low-precision non-finite) are summed over the
layer's parameters and ride in the step's SUM all-reduce (``2 + 5 L`` float64: a per-rank
"recomputed" count and the loss scale used first), so the job's ratio is over the W recomputed
micro-batches. No extra collective (but FSDP2's / ZeRO-3's parameter all-gather on a
recomputation step, below) and no host synchronisation (counts stay on the device until the step's one copy);
the loss scale of a ``GradScaler`` is its device tensor.

The replay runs through ``functional_call``'s parameter swap on the user's module (DDP: the
inner module, so no DDP hook or collective), with detached parameter copies swapped in through
the forward and the backward (the model's ``.grad`` is not written, no parameter hook fires;
activation checkpointing recomputes with the copies) and every module forward/backward hook of
the model set aside for its duration (distgrad's own loss, logit, tracer and replay hooks do not
see it; :func:`in_replay` tells the attention hook point). Dropout masks are the training
forward's (its RNG state restored inside ``torch.random.fork_rng``); floating buffers are passed
as copies (BatchNorm statistics are not updated).

FSDP2 (``fully_shard``, dim-0 shards over a 1-D mesh). No rank holds the parameters, so on a
recomputation step (decided from the step number: every rank alike, whether or not it measures,
a refused step included: :meth:`Underflow.exchange`, called by the signal pack before the packed
parts) every rank makes ONE extra collective: an all-gather over the mesh's group of every
parameter's local float32 chunk, padded to ``ceil(d0 / W)`` rows and packed in one flat buffer,
unpacked into a full float32 copy of each parameter. The replay then runs on the FSDP2 root with
FSDP2's own hooks set aside (no unshard, no reduce-scatter) and the gathered copies swapped in:
the training-precision pass casts them to the dtype the training forward used, the
``MixedPrecisionPolicy.param_dtype`` of the ``fully_shard`` unit holding each parameter (its own
dtype without one), and makes FSDP2's forward casts (``cast_forward_inputs`` to ``param_dtype``
before each unit, ``output_dtype`` after it) through temporary hooks; autocast, when the
training forward ran under it, is replayed as on DDP. So what is compared under FSDP2 is the
same as on DDP: the gradient one micro-batch produces on one rank *before* the reduce-scatter
(FSDP2 computes it in ``param_dtype`` and only then casts it to ``reduce_dtype``), against its
float32 recomputation. Steps that do not recompute keep their 2 collectives and 1 host copy.
The full float32 model (4 bytes per parameter) must fit ``underflow.max_gather_bytes`` (default
4 GiB), checked at ``instrument()`` with a ``ConfigError`` otherwise; HSDP, tensor parallelism
or a ``shard_placement_fn`` (other placements) are refused there too.

DeepSpeed ZeRO-3 the same way: the one all-gather packs each parameter's flat partition
(``p.ds_tensor``, already padded by DeepSpeed, in the parameter's fp16/bf16/fp32 dtype, exact in
float32) over ``p.ds_process_group``; the replay runs on ``engine.module`` with ZeRO-3's
fetch/release hooks set aside, the training-precision pass with the gathered values in the
parameter's own dtype (as on ZeRO-0/1/2, where the module's parameters are the 16-bit copies the
forward used), the reference in float32. Partitions over more than one group (MiCS) are refused.

FSDP1 and model-parallel layouts (pipeline stages, experts elsewhere) are refused at
``instrument()``: no rank holds the parameters the forward needs and no gather of them is
implemented.

Cost, paid only on a recomputation step: two forward + backward passes of one micro-batch on
each rank (the reference in float32), a float32 copy of the parameters when they are held in
16 bits, one bool mask per parameter (1 byte per element) and per-layer sums. On FSDP2 / ZeRO-3 on top:
the all-gather (each rank receives the float32 model, ``4 x`` the parameter count bytes, padding
included), the gathered buffer and its unpacked copy (twice the float32 model for the length of
the unpacking, then once for the two passes), and the training-precision copy in
``param_dtype``; all freed at the end of the step's ``local``. Every step: a reference to the
first micro-batch's inputs and a copy of the CPU RNG state (~5 KB).

Needs the loss: the forward of the module must return it (a scalar tensor, a dict with
``"loss"``, or an object with ``.loss``, as Hugging Face models with labels). A loop that
scales the loss outside the forward (gradient accumulation) says so with
``underflow.loss_factor``; the framework's own scaling is applied automatically on top: DeepSpeed's
division by the accumulation steps, and through :attr:`Underflow.framework_scale`, set by
:mod:`distgrad.integrations`, that of Accelerate's ``backward``, the Hugging Face Trainer and
Lightning (docs/signals.md, "The loss factor"). When the forward returns no loss (logits only)
the first recomputation step's measurement is dropped, counted once as an internal error and
logged once with the fix; from then on nothing is kept or recomputed (no repeated error, no
cost) and nothing is exported. A parameter the reference backward does not reach (unused by that
micro-batch) is left out of the counts, not claimed zero. The model's own parameters are out of
autograd (``requires_grad`` False) while the passes run, so nothing can accumulate into their
``.grad``.

Everything the signal adds lives in this module (the contract of :mod:`distgrad.signals`): its
configuration section ``underflow`` (:class:`Underflow.Config`), its record part
``StepRecord.underflow`` (:class:`Underflow.Part`), its metrics (:attr:`Underflow.METRICS`,
:meth:`Underflow.samples`) and its factory (:meth:`Underflow.build`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from distgrad.config.errors import ConfigError
from distgrad.config.sections import Section
from distgrad.export.metrics import Metric, condition
from distgrad.naming.canonical import clean_name
from distgrad.naming.grouping import group_keys
from distgrad.record.base import _Part
from distgrad.signals import PackedSignal

log = logging.getLogger("distgrad")

__all__ = ["Underflow", "NoLossError", "in_replay", "loss_of"]

#: columns per layer in the SUM part
COLS = ("lost", "zero_low", "zero_ref", "numel", "nonfinite_low")

_DEPTH = [0]
#: the module hook dictionaries set aside during a recomputation (torch 2.13 ``nn.Module``)
_HOOK_ATTRS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks")


def in_replay() -> bool:
    """True while an underflow recomputation runs its forward passes (observers of the
    training forward, e.g. :func:`distgrad.signals.logits.observe_attention`, ignore them)."""
    return _DEPTH[0] > 0


@contextlib.contextmanager
def _replaying(root: torch.nn.Module) -> Iterator[None]:
    saved = []
    _DEPTH[0] += 1
    try:
        for m in root.modules():
            for a in _HOOK_ATTRS:
                d = getattr(m, a, None)
                if isinstance(d, dict) and d:
                    saved.append((m, a, d))
                    setattr(m, a, OrderedDict())
        yield
    finally:
        for m, a, d in saved:
            setattr(m, a, d)
        _DEPTH[0] -= 1


class NoLossError(TypeError):
    """The model's forward returned no scalar loss (see :func:`loss_of`)."""


def loss_of(output: Any) -> torch.Tensor:
    """The loss a forward returned: a 0-d floating tensor, ``output["loss"]`` or ``output.loss``.

    Raises:
        NoLossError: no such loss (the forward returns logits only)."""
    loss = output
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif not isinstance(output, torch.Tensor):
        loss = getattr(output, "loss", None)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        raise NoLossError("underflow: the model's forward returns no scalar loss (a tensor, a dict with 'loss' "
                        "or an object with .loss); the recomputation needs it")
    return loss


@dataclass
class _Kept:
    args: tuple
    kwargs: dict
    versions: list[tuple[torch.Tensor, int]]
    cpu_rng: torch.Tensor
    cuda_rng: tuple[int, torch.Tensor] | None
    autocast: list[tuple[str, torch.dtype]]


def _tensors(obj: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _caster(dt: torch.dtype) -> Any:
    """A floating tensor to ``dt`` (FSDP2's ``_cast_fp_tensor``); anything else as is."""
    return lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _to_fp32(obj: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point()
                    and t.dtype in (torch.float16, torch.bfloat16) else t, obj)


class Underflow(PackedSignal):
    """Lost-to-underflow vs genuinely zero gradient elements per layer (see the module docstring).

    Args:
        layers: the layer labels (``naming.tuples`` applied to the module's parameter names).
        param_layer: per trainable parameter of the module (``named_parameters`` order), its
            index into ``layers``.
        interval: recompute every ``interval``-th sampled step.
        loss_factor: multiplies the forward's loss in both passes (the user's own scaling; the
            framework's is applied on top, :meth:`_scaled`).

    SUM part (float64 ``[2 + 5 L]``): ``[ranks that recomputed, sum of their loss scales, then per
    layer lost, zero_low, zero_ref, numel, nonfinite_low]``. Record part: :class:`Underflow.Part`
    (``StepRecord.underflow``).
    """

    name = "underflow"

    class Config(Section):
        """Gradient elements lost to underflow (non-zero in a float32 recomputation, exactly zero
        in the training precision), told from genuinely zero ones, per layer (see docs/signals.md,
        "Lost to underflow")."""

        section_key: ClassVar[str] = "underflow"
        enabled: bool = Field(False, description=(
            "Every underflow.interval-th sampled step, recompute one micro-batch per rank in the training "
            "precision and in float32 and count, per layer, the gradient elements that are non-zero in float32 "
            "but exactly zero in the training precision (lost to underflow). Costs two forward+backward passes of "
            "one micro-batch on that step (on FSDP2 and DeepSpeed ZeRO-3 also one all-gather of the parameters, see "
            "underflow.max_gather_bytes). Needs the model's forward to return the loss; not on FSDP1 or "
            "model-parallel layouts."))
        interval: int = Field(10, ge=1, description=(
            "Recompute on every interval-th sampled step: those whose index step / sampling.interval is a multiple "
            "of interval (step 0 included; every rank decides from the step number). The last measurement is served "
            "until the next one (distgrad_underflow_measured_step says which step)."))
        loss_factor: float = Field(1.0, gt=0.0, description=(
            "Factor your own code applies to the forward's loss before handing it to backward (a raw loop's "
            "(loss / GA).backward(): 1/GA); underflow depends on it. The framework's own scaling is applied "
            "automatically on top, read at each recomputation: DeepSpeed's engine.backward division by its "
            "accumulation steps, accelerator.backward's (instrument_accelerate), the Hugging Face Trainer's (1/GA, or "
            "none with num_items_in_batch), Lightning's automatic optimization's (1/accumulate_grad_batches); so "
            "leave 1.0 under those unless your code scales the loss further (docs/signals.md, 'The loss factor')."))
        worst: int = Field(3, ge=1, le=20, description="Layers named in the record's worst list (most lost first).")
        max_gather_bytes: int = Field(4 * 2**30, ge=0, description=(
            "FSDP2 and DeepSpeed ZeRO-3 only: the largest full float32 model (4 bytes times the parameter "
            "count) whose parameters a recomputation step all-gathers onto every rank; a larger model is refused at "
            "instrument() (no rank could hold the copy). A recomputation step there costs one extra all-gather of "
            "the float32 shards and a full float32 copy of the parameters on each rank for its duration (twice while "
            "it is unpacked; plus the training-precision copy and the two passes' gradients); other steps are "
            "unchanged."))

    @dataclass
    class Part(_Part):
        """One recomputation's result (served until the next one).

        Attributes:
            step: the sampled step whose micro-batches were recomputed.
            lost: ``{layer: lost / elements}``: the fraction of the layer's gradient elements non-zero
                in the float32 recomputation and exactly zero in the training precision, over the W
                recomputed micro-batches (ratio, 0-1).
            zero: ``{layer: reference zeros / elements}``: the genuinely zero fraction.
            total_lost: lost / elements over the whole model (ratio).
            total_zero_low: exact zeros of the training-precision gradient / elements (ratio).
            total_zero_ref: exact zeros of the float32 gradient / elements (ratio).
            nonfinite_low: non-finite elements of the training-precision gradients (count).
            worst: up to ``underflow.worst`` layers with lost > 0, most lost first.
            loss_scale: the loss scale the training-precision pass used (1.0 without a scaler).
        """

        step: int = 0
        lost: dict[str, float] = field(default_factory=dict)
        zero: dict[str, float] = field(default_factory=dict)
        total_lost: float = 0.0
        total_zero_low: float = 0.0
        total_zero_ref: float = 0.0
        nonfinite_low: float = 0.0
        worst: list[str] = field(default_factory=list)
        loss_scale: float = 1.0

    _when = condition("underflow", "`underflow.enabled: true`, from the first recomputation on (every "
                                   "`underflow.interval`-th sampled step; see docs/signals.md)",
                      enabled=lambda c: c.underflow.enabled)
    METRICS = (
        Metric("distgrad_grad_lost_to_underflow_ratio", "gauge", (), "ratio",
               "Fraction of the gradient elements lost to underflow: non-zero in a float32 recomputation of a "
               "sampled micro-batch, exactly zero in the training precision.", _when,
               doc="fraction of all gradient elements (of one recomputed micro-batch per rank) that are non-zero in "
                   "float32 and exactly zero in the training precision: lost to underflow, not genuinely zero. "
                   "Measured every `underflow.interval`-th sampled step, served until the next measurement"),
        Metric("distgrad_layer_grad_lost_to_underflow_ratio", "gauge", ("layer",), "ratio",
               "Fraction of the layer's gradient elements lost to underflow (see "
               "distgrad_grad_lost_to_underflow_ratio).", _when,
               doc="`distgrad_grad_lost_to_underflow_ratio` over the layer's parameters"),
        Metric("distgrad_grad_genuine_zero_ratio", "gauge", (), "ratio",
               "Fraction of the gradient elements exactly zero in the float32 recomputation (genuinely zero).", _when,
               doc="fraction of all gradient elements of the recomputed micro-batches that are zero in float32 as "
                   "well (unused embedding rows, dead units): zeros that are no precision loss"),
        Metric("distgrad_underflow_measured_step", "gauge", (), "steps",
               "The sampled step of the last underflow recomputation (the underflow ratios are its).", _when),
    )

    @staticmethod
    def samples(part: Underflow.Part) -> dict[str, Any]:
        """The whole-model and per-layer lost ratios, the genuine zero ratio, the measured step."""
        return {"distgrad_grad_lost_to_underflow_ratio": part.total_lost,
                "distgrad_layer_grad_lost_to_underflow_ratio": part.lost,
                "distgrad_grad_genuine_zero_ratio": part.total_zero_ref,
                "distgrad_underflow_measured_step": float(part.step)}

    @classmethod
    def build(cls, inst: Any) -> Underflow | None:
        """``underflow.enabled``: the signal (its layers are found at :meth:`attach`), or None.

        On FSDP2 and DeepSpeed ZeRO-3 the signal all-gathers the parameters on its
        recomputation steps (``sharded``: ``"fsdp2"`` / ``"zero3"``, else ``""``; the layout and
        the size bound are checked at :meth:`attach`).

        Raises:
            ConfigError: FSDP1 or a model-parallel layout (pipeline stages, experts elsewhere):
                no rank holds the whole model's parameters and no gather of them is implemented.
        """
        cfg = inst.config.underflow
        if not cfg.enabled:
            return None
        engine = getattr(inst.source, "engine_name", "")
        stage = getattr(inst.source, "zero_stage", None)
        if engine == "fsdp1" or getattr(inst, "job", None) is not None:
            raise ConfigError(f"distgrad config: 'underflow.enabled' is not supported on engine {engine!r}"
                              " or with pipeline/expert parallelism: the recomputation needs every parameter of the "
                              "model on each rank (FSDP2 and DeepSpeed ZeRO-3 are supported: their parameters are "
                              "all-gathered on a recomputation step)")
        sharded = "fsdp2" if engine == "fsdp2" else "zero3" if stage == 3 else ""
        return cls(int(cfg.interval), float(cfg.loss_factor), int(cfg.worst), inst.config.naming.tuples,
                   int(inst.config.sampling.interval), sharded=sharded, max_gather_bytes=int(cfg.max_gather_bytes))

    def __init__(self, interval: int, loss_factor: float = 1.0, worst: int = 3, naming_rules: Any = None,
                 sampling_interval: int = 1, *, sharded: str = "", max_gather_bytes: int = 4 * 2**30) -> None:
        self.interval, self.loss_factor, self.n_worst = int(interval), float(loss_factor), int(worst)
        self.sampling_interval = max(1, int(sampling_interval))
        self.naming_rules = naming_rules
        if sharded not in ("", "fsdp2", "zero3"):
            raise ValueError(f"sharded: {sharded!r}")
        self.sharded, self.max_gather_bytes = sharded, int(max_gather_bytes)
        self._shards: list[tuple[int, int, tuple[int, ...]]] = []  # per parameter (padded chunk, numel, shape)
        self._group: Any = None
        self._world = 1
        self._low_dtypes: list[torch.dtype] = []
        self._units: list[tuple[torch.nn.Module, Any]] = []  # (fully_shard module, its MixedPrecisionPolicy)
        self._full: dict[str, torch.Tensor] | None = None
        self.root: torch.nn.Module | None = None
        self.params: list[tuple[str, torch.nn.Parameter]] = []
        self.layers: list[str] = []
        self.param_layer: list[int] = []
        self._next = 0  # the optimizer step the next forwards belong to (the last boundary's + 1)
        self._kept: _Kept | None = None
        self._last: Underflow.Part | None = None
        #: the forward returned no loss once (flagged then): nothing more is kept or recomputed
        self._no_loss = False
        #: DeepSpeed's ``engine.backward`` division (its accumulation steps; found at :meth:`attach`)
        self._ds_divisor = 1.0
        #: set by a framework integration (:mod:`distgrad.integrations`): given the kept forward's
        #: ``(args, kwargs)``, ``(multiplier, divisors)``: the framework's own scaling of the forward's loss
        #: before backward, the loss multiplied by ``multiplier`` then divided by each divisor in turn;
        #: replaces DeepSpeed's division above (the integration accounts for it). None: that division only.
        self.framework_scale: Callable[[tuple, dict], tuple[float, Sequence[float]]] | None = None
        #: set by a framework integration: True for a call of the module that is not to be kept (its
        #: ``forward`` redirected elsewhere for that call, e.g. Lightning's ``training_step``
        #: redirection through a DDP / DeepSpeed wrapper); the next call is considered instead
        self.skip_call: Callable[[torch.nn.Module], bool] | None = None
        #: set by a framework integration whose framework scales the loss with a ``GradScaler`` that
        #: distgrad's engine does not hold (Lightning's precision plugin): its scale multiplies the
        #: training-precision pass's loss, as ``scaler.scale(loss)`` did before the training backward
        self.loss_scaler: Any = None

    @property
    def sum_size(self) -> int:
        return 2 + len(COLS) * len(self.layers)

    def recomputes(self, step: int) -> bool:
        """Whether optimizer step ``step`` recomputes: a sampled step (``step % sampling.interval
        == 0``) whose index among the sampled steps is a multiple of ``underflow.interval``; from the
        step number alone, so every rank decides alike (whatever steps a rank refused)."""
        m = self.sampling_interval
        return step % m == 0 and (step // m) % self.interval == 0

    @property
    def armed(self) -> bool:
        """The step whose forwards run now recomputes (its first micro-batch is kept)."""
        return self.recomputes(self._next)

    def attach(self, inst: Any, module: Any) -> Any:
        """Find the layers of ``module``'s trainable parameters and keep the first micro-batch of
        each step (a forward pre-hook on ``module``).

        On FSDP2 / ZeRO-3 (``sharded``) also: the all-gather's layout (per parameter its padded
        chunk), its process group, and per parameter the dtype its training forward runs in
        (FSDP2: the ``MixedPrecisionPolicy.param_dtype`` of the ``fully_shard`` unit holding it,
        else its own dtype; ZeRO-3: its own dtype, fp16/bf16 under DeepSpeed's mixed precision).

        Raises:
            ConfigError: ``module`` is not a module, or has no trainable parameter; on FSDP2 a
                parameter not sharded on dim 0 over a 1-D mesh (HSDP, tensor parallelism, a
                ``shard_placement_fn``); on ZeRO-3 a parameter without its partition or
                partitions over more than one group (MiCS); a full float32 model larger than
                ``underflow.max_gather_bytes``."""
        if not isinstance(module, torch.nn.Module):
            raise ConfigError("distgrad config: 'underflow.enabled' needs the model as a torch.nn.Module")
        self.root = module
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("distgrad config: 'underflow.enabled': the model has no trainable parameter")
        keys = group_keys([clean_name(n) for n, _ in self.params], "layer", self.naming_rules)
        self.layers = sorted(set(keys))
        self.param_layer = [self.layers.index(k) for k in keys]
        if self.sharded:
            self._plan_gather(module)
        ds = getattr(inst.source, "engine", None)
        gas = getattr(ds, "gradient_accumulation_steps", None)
        if callable(gas):  # DeepSpeed divides the loss by the accumulation steps in engine.backward
            self._ds_divisor = float(gas())
        handle = module.register_forward_pre_hook(self._pre, with_kwargs=True)
        return handle.remove

    def _pre(self, module: Any, args: Any, kwargs: Any) -> None:
        if in_replay() or not torch.is_grad_enabled() or self._kept is not None or not self.armed or self._no_loss:
            return None
        try:
            if self.skip_call is not None and self.skip_call(module):
                return None
            cuda = None
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                dev = torch.cuda.current_device()
                cuda = (dev, torch.cuda.get_rng_state(dev))
            ac = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
            self._kept = _Kept(tuple(args), dict(kwargs or {}), [(t, t._version) for t in _tensors((args, kwargs))],
                               torch.get_rng_state(), cuda, ac)
        except Exception:  # noqa: BLE001 - never break the forward pass; local() then finds nothing kept
            self._kept = None
        return None

    def skip(self, inst: Any, step: int) -> None:
        self._kept = None  # an unsampled step's micro-batch
        self._full = None
        self._next = int(step) + 1

    # ---- FSDP2 / ZeRO-3: the parameters gathered on a recomputation step ---------------------
    def _plan_gather(self, module: torch.nn.Module) -> None:
        label = "FSDP2" if self.sharded == "fsdp2" else "DeepSpeed ZeRO-3"
        self._shards, self._low_dtypes = [], []
        if self.sharded == "fsdp2":
            self._group, self._world = self._plan_fsdp2(module)
        else:
            self._group, self._world = self._plan_zero3()
        full = 4 * sum(numel for _, numel, _ in self._shards)
        if full > self.max_gather_bytes:
            raise ConfigError(f"distgrad config: 'underflow.enabled' on {label}: the full float32 model is {full} "
                              f"bytes, above 'underflow.max_gather_bytes' ({self.max_gather_bytes}); a recomputation "
                              "step would all-gather it onto every rank. Raise the bound if each rank can hold it "
                              "(twice, while it is unpacked), or switch underflow off")

    def _plan_zero3(self) -> tuple[Any, int]:
        """ZeRO-3: each parameter flattened and cut in W equal partitions (the last padded), this
        rank's in ``p.ds_tensor`` (``ds_tensor.ds_numel`` elements), over ``p.ds_process_group``."""
        import torch.distributed as dist

        group: Any = None
        for i, (n, p) in enumerate(self.params):
            t = getattr(p, "ds_tensor", None)
            if t is None or not hasattr(p, "ds_numel"):
                raise ConfigError(f"distgrad config: 'underflow.enabled' on DeepSpeed ZeRO-3: parameter {n!r} is not "
                                  "partitioned by ZeRO-3 (no ds_tensor)")
            g = getattr(p, "ds_process_group", None)
            if i and g is not group:
                raise ConfigError("distgrad config: 'underflow.enabled' on DeepSpeed ZeRO-3: the parameters are "
                                  "partitioned over more than one process group (MiCS?); the recomputation gathers "
                                  "over one")
            group = g
            part = int(getattr(t, "ds_numel", t.numel()))
            zp: Any = p  # DeepSpeed's attributes on the parameter
            self._shards.append((part, int(zp.ds_numel), tuple(zp.ds_shape)))
            self._low_dtypes.append(p.dtype)
        world = int(dist.get_world_size(group))
        for (n, _), (part, numel, _) in zip(self.params, self._shards):
            if part * world < numel:
                raise ConfigError(f"distgrad config: 'underflow.enabled' on DeepSpeed ZeRO-3: parameter {n!r}'s "
                                  f"partitions ({world} x {part}) do not cover its {numel} elements")
        return group, world

    def _plan_fsdp2(self, module: torch.nn.Module) -> tuple[Any, int]:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor, Shard

        mesh = None
        for n, p in self.params:
            if not isinstance(p, DTensor):
                raise ConfigError(f"distgrad config: 'underflow.enabled' on FSDP2: parameter {n!r} is not sharded by "
                                  "fully_shard (apply fully_shard to the root module)")
            if p.device_mesh.ndim != 1 or len(p.placements) != 1 or p.placements[0] != Shard(0):
                raise ConfigError(f"distgrad config: 'underflow.enabled' on FSDP2: parameter {n!r} has placements "
                                  f"{tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh; the recomputation gathers "
                                  "only dim-0 shards over a 1-D mesh (no HSDP, tensor parallelism or "
                                  "shard_placement_fn)")
            if mesh is None:
                mesh = p.device_mesh
            elif p.device_mesh != mesh:
                raise ConfigError("distgrad config: 'underflow.enabled' on FSDP2: the parameters are on more than one "
                                  "mesh; the recomputation gathers over one")
            d0 = p.shape[0] if p.dim() else 1
            row = p.numel() // d0 if d0 else 0
            self._shards.append((-(-d0 // mesh.size()) * row, p.numel(), tuple(p.shape)))
        assert mesh is not None  # attach() refused a model without trainable parameters
        units: list[tuple[str, Any]] = sorted(((name, m) for name, m in module.named_modules()
                                               if isinstance(m, FSDPModule)),
                       key=lambda u: -len(u[0]))  # the innermost unit first
        self._units = []
        try:
            for _, m in units:
                self._units.append((m, m._get_fsdp_state()._mp_policy))  # private: torch 2.13's FSDPState
        except AttributeError as e:
            raise ConfigError("distgrad config: 'underflow.enabled' on FSDP2: cannot read a fully_shard unit's "
                              f"MixedPrecisionPolicy ({e}); the training precision cannot be reproduced") from None
        policy = {id(m): pol for m, pol in self._units}
        for n, p in self.params:
            pol = next((policy[id(m)] for name, m in units if not name or n.startswith(name + ".")), None)
            dt = getattr(pol, "param_dtype", None)
            self._low_dtypes.append(dt if dt is not None and p.dtype.is_floating_point else p.dtype)
        return mesh.get_group(), int(mesh.size())

    def exchange(self, inst: Any, device: torch.device) -> None:
        """FSDP2 / ZeRO-3, on a recomputation step (from the step number: every rank alike),
        whether or not this rank measures: ONE all-gather over the parameters' group of every
        parameter's local chunk in float32, packed in one flat buffer, unpacked into a full
        float32 copy per parameter kept for :meth:`local`. FSDP2: the dim-0 chunk
        (``DTensor.to_local()``) padded to ``ceil(d0 / W)`` rows (``torch.chunk``'s split, as
        FSDP2's ``FSDPParam``); ZeRO-3: the flat partition ``ds_tensor`` (already padded, in the
        parameter's dtype: the float32 values are exact). Nothing on other steps or engines. No
        host sync.

        Raises:
            ValueError: a local chunk larger than the planned one (the layout changed)."""
        self._full = None
        if not self.sharded or not self.recomputes(int(inst.sampled_step)):
            return
        import torch.distributed as dist

        flats = []
        for (_, p), (size, _, _) in zip(self.params, self._shards):
            dt_param: Any = p  # a DTensor / a ZeRO-3 parameter (checked at attach)
            chunk = dt_param.to_local() if self.sharded == "fsdp2" else dt_param.ds_tensor
            loc = chunk.detach().reshape(-1).to(torch.float32)
            if self.sharded == "zero3":
                loc = loc[:size]  # the partition proper (DeepSpeed may allocate more)
            if loc.numel() > size:
                raise ValueError(f"underflow: a local shard of {loc.numel()} elements, expected at most {size}")
            flats += [loc, loc.new_zeros(size - loc.numel())]
        local = torch.cat(flats)
        out = local.new_empty(self._world * local.numel())
        # all_gather_single replaces the deprecated all_gather_into_tensor in torch >= 2.13
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local, group=self._group)
        per = out.view(self._world, -1)
        full, o = {}, 0
        for (n, _), (size, numel, shape) in zip(self.params, self._shards):
            full[n] = per[:, o:o + size].reshape(-1)[:numel].reshape(shape)  # rank-major rows, padding cut
            o += size
        self._full = full

    def after_step(self, inst: Any, step_applied: bool) -> None:
        """Drop the gathered copy if :meth:`local` did not consume it (a step refused or failed
        on this rank: the copy is not held until the next recomputation)."""
        self._full = None

    @contextlib.contextmanager
    def _mixed_precision(self) -> Iterator[None]:
        """FSDP2's forward casts (``MixedPrecisionPolicy.cast_forward_inputs`` to ``param_dtype``
        before each unit's forward, ``output_dtype`` after it), while FSDP2's own hooks are set
        aside by the replay: the same casts the training forward made."""
        from torch.distributed.utils import _apply_to_tensors

        def cast_inputs(dt: torch.dtype) -> Any:
            f = _caster(dt)
            return lambda mod, a, kw: (_apply_to_tensors(f, a), _apply_to_tensors(f, kw))

        def cast_output(dt: torch.dtype) -> Any:
            f = _caster(dt)
            return lambda mod, a, out: _apply_to_tensors(f, out)

        handles = []
        try:
            for m, pol in self._units:
                if getattr(pol, "cast_forward_inputs", False) and pol.param_dtype is not None:
                    handles.append(m.register_forward_pre_hook(cast_inputs(pol.param_dtype), with_kwargs=True))
                if getattr(pol, "output_dtype", None) is not None:
                    handles.append(m.register_forward_hook(cast_output(pol.output_dtype)))
            yield
        finally:
            for h in handles:
                h.remove()

    # ---- the recomputation --------------------------------------------------------------------
    def _scale(self, inst: Any, device: torch.device) -> torch.Tensor:
        t = getattr(self.loss_scaler, "_scale", None)  # an integration's GradScaler (device tensor: no sync)
        if isinstance(t, torch.Tensor) and self.loss_scaler.is_enabled():
            return t.detach().reshape(()).float()
        src = inst.source
        if not src.has_loss_scaler():
            return torch.ones((), dtype=torch.float32, device=device)
        t = getattr(getattr(src, "scaler", None), "_scale", None)  # GradScaler's device tensor: no sync
        if isinstance(t, torch.Tensor):
            return t.detach().reshape(()).float()
        return torch.tensor(float(src.loss_scale()), dtype=torch.float32, device=device)

    def _pass(self, k: _Kept, reference: bool, scale: torch.Tensor | None,
              full: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        assert self.root is not None
        root = self.root
        # the values swapped in: FSDP2's / ZeRO-3's gathered float32 copies, else the model's own parameters
        src = full if full is not None else {n: p for n, p in self.params}
        if reference:
            params = {n: src[n].detach().float().requires_grad_() for n, _ in self.params}
            bufs = {n: (b.float() if b.is_floating_point() else b.clone()) for n, b in root.named_buffers()}
            args, kwargs = _to_fp32(k.args), _to_fp32(k.kwargs)
            ctx: Any = [torch.autocast(d, enabled=False) for d in ("cpu", "cuda")
                        if d == "cpu" or torch.cuda.is_available()]
        else:
            if full is not None:  # in the dtype the forward used (FSDP2: MixedPrecisionPolicy.param_dtype)
                params = {n: full[n].detach().to(dt).requires_grad_()
                          for (n, _), dt in zip(self.params, self._low_dtypes)}
            else:
                params = {n: p.detach().requires_grad_() for n, p in self.params}
            bufs = {n: b.clone() for n, b in root.named_buffers()}
            args, kwargs = k.args, k.kwargs
            ctx = [torch.autocast(d, dtype=dt) for d, dt in k.autocast]
        from torch.nn.utils.stateless import _reparametrize_module  # functional_call's own swap

        devices = [k.cuda_rng[0]] if k.cuda_rng is not None else []
        # the copies stay swapped in through the backward too: code that re-runs the module there
        # (activation checkpointing, reentrant or not) recomputes with them, not with the real weights
        # FSDP2's casts stay through the backward too (an activation checkpoint's recomputation)
        mp = self._mixed_precision() if full is not None and not reference else contextlib.nullcontext()
        with torch.random.fork_rng(devices=devices, device_type="cuda"), \
                _reparametrize_module(root, {**params, **bufs}, tie_weights=True), mp:
            torch.set_rng_state(k.cpu_rng)
            if k.cuda_rng is not None:
                torch.cuda.set_rng_state(k.cuda_rng[1], k.cuda_rng[0])
            with contextlib.ExitStack() as stack:
                for c in ctx:
                    stack.enter_context(c)
                loss = self._scaled(loss_of(root(*args, **kwargs)), k)
            if scale is not None:
                loss = loss * scale.to(loss.device)
            loss.backward()  # into the copies' .grad only: the model's parameters are not in the graph
        return [t.grad for t in params.values()]

    def _scaled(self, loss: torch.Tensor, k: _Kept) -> torch.Tensor:
        """The forward's ``loss`` scaled as the training loop scaled it before backward (before the
        loss scale): times ``underflow.loss_factor`` (the user's code), then the framework's
        scaling (:attr:`framework_scale`, else DeepSpeed's division by its accumulation steps), each
        step the same operation as the framework's (a division stays a division: ``loss / 3`` and
        ``loss * (1/3)`` may differ in the last bit, and so would every gradient element)."""
        if self.loss_factor != 1.0:
            loss = loss * self.loss_factor
        if self.framework_scale is not None:
            mul, divs = self.framework_scale(k.args, k.kwargs)
        else:
            mul, divs = 1.0, (self._ds_divisor,)
        if mul != 1:
            loss = loss * mul
        for d in divs:
            if d != 1:
                loss = loss / d
        return loss

    def local(self, inst: Any, pieces: Sequence[torch.Tensor | None],
              device: torch.device) -> tuple[torch.Tensor, None]:
        k, self._kept = self._kept, None
        full, self._full = self._full, None
        step = int(inst.sampled_step)
        run = self.recomputes(step)
        self._next = step + 1
        out = torch.zeros(self.sum_size, dtype=torch.float64, device=device)
        if not run or k is None or self.root is None or (self.sharded and full is None) or self._no_loss:
            return out, None
        if any(t._version != v for t, v in k.versions):
            return out, None  # an input modified in place since its forward: cannot be vouched for
        scale = self._scale(inst, device)
        frozen = [p for _, p in self.params if p.requires_grad]
        with _replaying(self.root), torch.enable_grad():
            try:
                # the model's own parameters out of any graph while the passes run (belt and braces:
                # the passes differentiate detached copies swapped in for them)
                for p in frozen:
                    p.requires_grad_(False)
                low = self._pass(k, False, scale, full)
                zero_low = [None if g is None else (g == 0) for g in low]
                bad = [None if g is None else (~torch.isfinite(g)).sum() for g in low]
                del low
                ref = self._pass(k, True, None, full)
                del full
            except NoLossError:
                # a property of the model, the same at every step: flagged once (this step's error,
                # counted once, and the log line), then nothing more is kept or recomputed
                self._no_loss = True
                log.error("distgrad: underflow.enabled: the model's forward returns no loss (logits only), so "
                          "the recomputation cannot differentiate it: nothing is measured for the rest of the "
                          "run. Return the loss from the forward (Hugging Face: pass labels) or switch "
                          "underflow.enabled off (see docs/signals.md, 'Lost to underflow')")
                raise
            finally:
                for p in frozen:
                    p.requires_grad_(True)
        f64: dict[str, Any] = dict(dtype=torch.float64, device=device)
        rows = torch.zeros(len(self.layers), len(COLS), **f64)
        for zl, nb, g, li in zip(zero_low, bad, ref, self.param_layer):
            if g is None:  # not reached by the reference backward: not measured (not claimed zero)
                continue
            n = g.numel()
            nz = g != 0
            lost = (nz.sum() if zl is None else (zl & nz).sum()).to(**f64)  # no training-precision grad: all 0
            z_low = torch.tensor(float(n), **f64) if zl is None else zl.sum().to(**f64)
            z_ref = (n - nz.sum()).to(**f64)
            nbad = torch.zeros((), **f64) if nb is None else nb.to(**f64)
            rows[li] += torch.stack([lost, z_low, z_ref, torch.tensor(float(n), **f64), nbad])
        out[0] = 1.0
        out[1] = scale.to(**f64)
        out[2:] = rows.reshape(-1)
        return out, None

    def finish(self, inst: Any, rec: Any, sum_part: np.ndarray, max_part: np.ndarray,
               grad_scale: float) -> None:
        if sum_part[0] >= inst.world_size:
            rows = np.asarray(sum_part[2:], dtype=np.float64).reshape(len(self.layers), len(COLS))
            lost, zl, zr, n, bad = rows.T
            tot = float(n.sum())
            ratio = {k: float(a / b) for k, a, b in zip(self.layers, lost, n) if b > 0}
            order = sorted((k for k in ratio if ratio[k] > 0), key=lambda k: -ratio[k])
            self._last = Underflow.Part(
                step=int(rec.step), lost=ratio,
                zero={k: float(a / b) for k, a, b in zip(self.layers, zr, n) if b > 0},
                total_lost=float(lost.sum() / tot) if tot else math.nan,
                total_zero_low=float(zl.sum() / tot) if tot else math.nan,
                total_zero_ref=float(zr.sum() / tot) if tot else math.nan,
                nonfinite_low=float(bad.sum()), worst=order[:self.n_worst],
                loss_scale=float(sum_part[1] / sum_part[0]))
        if self._last is not None:
            rec.underflow = self._last

