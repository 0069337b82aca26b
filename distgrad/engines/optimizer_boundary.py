"""The optimizer-step boundary of the PyTorch-native engines: the optimizer's step hooks and, with
a ``GradScaler``, ``scaler.step`` (facts: :mod:`distgrad.engines.torch_native`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from distgrad.core.step import StepOutcome, StepToken
from distgrad.engines.torch_base import TorchSource, _unwrap_compiled

if TYPE_CHECKING:
    from distgrad.engines.guards import GradSignature

log = logging.getLogger("distgrad")


class OptimizerBoundary:
    """The optimizer-step boundary for PyTorch-native engines.

    Installs on ``optimizer``: a step pre-hook that opens the step (``Instrument.begin_step``:
    on sampled steps local statistics + 2 collectives + 1 host copy) and a step post-hook that
    closes it (``Instrument.end_step``: publishes a sampled step, accounts any step);
    on ``model``: a forward hook counting micro-batches (forward passes with grad enabled) and
    capturing the loss when the forward returns one (a 0-d floating tensor, or an object /
    dict with a 0-d ``loss``, as Hugging Face models return; ``observe_loss(loss,
    automatic=True)``). The first explicit ``inst.observe_loss(...)`` call switches the
    automatic capture off. With a
    ``GradScaler``, ``scaler.step`` is wrapped on the instance (see the module docstring):

    - non-fused optimizers: gradients are unscaled when the pre-hook runs (``scaler.step``
      calls ``unscale_`` first, or the user did); an overflow step never reaches
      ``optimizer.step``, so its statistics are read after ``scaler.step`` returns (Inf/NaN
      gradients, already unscaled) and the step is recorded with ``overflow=True``,
      ``step_applied=False``.
    - ``_step_supports_amp_scaling`` optimizers (``fused=True``): the pre-hook sees gradients
      still multiplied by ``optimizer.grad_scale`` (None when the user already unscaled); the
      statistics are divided by it (exact for power-of-two scales), and ``optimizer.found_inf``
      gives the overflow.

    ``step`` counts optimizer steps since ``instrument()``, skipped ones included: every
    ``optimizer.step()`` outside ``scaler.step`` plus every ``scaler.step(optimizer)``. It is
    the same on all ranks because every rank calls them, and it decides sampling, so all ranks
    make the same collectives. ``loss_scale`` is ``scaler.get_scale()`` just before
    ``scaler.step``: the scale this step's backward used (read on sampled steps only).

    Not seen: steps a GradScaler skips when ``scaler=`` was not passed (``optimizer.step`` is
    never called, so neither hook fires and the step is not counted).

    Opt-in action (:mod:`distgrad.diagnostics.action`): when the decision made at the read says skip, every
    gradient the optimizer would consume is set to None from the step pre-hook (or from the read,
    when that happens inside ``optimizer.step``) until the step ends, then put back:
    ``optimizer.step()`` runs and changes nothing (see :meth:`_hold_back`); the step is recorded
    with ``step_applied=False``. A clipping call between the read and ``optimizer.step`` still
    sees the gradients. The loop's LR scheduler steps as the loop calls it.
    """

    def __init__(self, inst: Any, source: TorchSource, optimizer: torch.optim.Optimizer,
                 model: nn.Module, scaler: Any = None) -> None:
        from distgrad.engines.guards import ClipWatch, Refusals

        self.inst, self.source, self.optimizer, self.scaler = inst, source, optimizer, scaler
        self.step = 0
        self.micro = 0
        #: where the gradients are read (set by distgrad.integrations): "pre_hook" (the optimizer's
        #: step pre-hook), "before_clip" (the first clipping call on the optimizer's parameters,
        #: else the pre-hook: the Hugging Face Trainer / Accelerate clip before optimizer.step),
        #: "external" (only :meth:`read_now`, called by an integration after the closure ran)
        self.read_at = "pre_hook"
        self.refusals = Refusals()
        self._opt_ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._clipped = False
        self._last_sig: GradSignature | None = None
        self._pending: tuple[StepToken, float, bool | None] | None = None  # (StepToken, grad_scale, fused_overflow)
        self._in_scaler = False
        self._fired = False
        self._in_step = False  # the step pre-hook of the current optimizer step has run
        self._skip = False  # the opt-in action skips this step's update (distgrad.diagnostics.action)
        self._stashed: list[tuple[Any, Any]] | None = None  # gradients held back from the optimizer
        self._handles = [optimizer.register_step_pre_hook(self._pre),
                         optimizer.register_step_post_hook(self._post),
                         model.register_forward_pre_hook(self._forward_pre),
                         model.register_forward_hook(self._forward)]
        self._scaler_step: Callable[..., Any] | None = None
        self._scaler_own_step = scaler is not None and "step" in vars(scaler)
        if scaler is not None:
            self._scaler_step = scaler.step
            scaler.step = self._wrapped_scaler_step  # on this instance only
        ClipWatch.register(self)
        inst.on_close(self.remove)

    def remove(self) -> None:
        """Remove the hooks and restore ``scaler.step`` (called by ``Instrument.close``)."""
        from distgrad.engines.guards import ClipWatch

        ClipWatch.unregister(self)
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._scaler_step is not None:
            if self._scaler_own_step:
                self.scaler.step = self._scaler_step
            else:
                vars(self.scaler).pop("step", None)
            self._scaler_step = None

    # -- hooks ------------------------------------------------------------------------------
    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self.inst.forward_started()  # the step's first forward ends its data time

    def _forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self.micro += 1
        loss = output
        if isinstance(output, dict):
            loss = output.get("loss")
        elif not isinstance(output, torch.Tensor):
            loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
            self.inst.observe_loss(loss, automatic=True)  # ignored once the user observes losses
        self.inst.after_micro_batch()  # writes the forward tracer's report once it has run

    def on_clip(self, param_ids: set) -> None:
        """Called by :class:`~distgrad.engines.guards.ClipWatch` before a clipping call."""
        if self._pending is not None or not (param_ids & self._opt_ids):
            return  # read already (clipping after distgrad's read is fine), or not our parameters
        if self.read_at == "before_clip":
            self.read_now()
        else:
            self._clipped = True

    def read_now(self) -> None:
        """Read this step's reduced gradients now (once per optimizer step; later calls and the
        step pre-hook do nothing until the step completes). For integrations and loops that
        modify the gradients (clipping) between the last backward and ``optimizer.step()``."""
        if self._pending is None:
            self._begin()

    def _begin(self, refuse: str | None = None, decide: bool = True) -> None:
        """Open the step; on sampled steps read the gradients (all ranks reach this at the same
        step). ``refuse``: why the gradients cannot be this step's (see
        :mod:`distgrad.engines.guards`); the checks here may add a reason. ``decide``: the
        optimizer update is still ahead, so the opt-in action may skip it."""
        from distgrad.engines.guards import GradSignature

        self.inst.after_micro_batch()  # the tracer report of the last micro-batch, if it ran
        if self._pending is not None:  # the previous optimizer.step raised after its pre-hook
            log.warning("distgrad: optimizer.step() at step %d did not complete; recorded as not applied",
                        self._pending[0].step)
            in_step = self._in_step
            self._end(None, False, None)
            self._in_step = in_step
        try:
            sig = GradSignature(p for g in self.optimizer.param_groups for p in g["params"])
            if refuse is None and self._clipped:
                refuse = "clipped"
            if refuse is None and (sig.empty or sig.same_as(self._last_sig)):
                refuse = "no_backward"
            self._last_sig = sig
        except Exception:  # noqa: BLE001 - a check must never break training
            self.inst.count_error("checking the gradients' provenance")
        if refuse is not None:
            self.refusals.refuse(refuse, self.step)
        gscale, fused_overflow = 1.0, None
        if self._in_scaler:
            try:
                found = getattr(self.optimizer, "found_inf", None)
                if found is not None:  # fused path: grads still scaled by optimizer.grad_scale
                    fused_overflow = bool(float(found) > 0)
                    gs = getattr(self.optimizer, "grad_scale", None)
                    gscale = float(gs) if gs is not None else 1.0
            except Exception:  # noqa: BLE001
                self.inst.count_error("reading the GradScaler state")
        elif self.scaler is not None and self.inst.is_sampled(self.step):
            gscale = self._scale_still_applied()
        self._pending = (self.inst.begin_step(self.step, refuse), gscale, fused_overflow)
        if decide and not fused_overflow and self.inst.decide_action(self._pending[0], gscale) is not None:
            self._skip = True
            if self._in_step:  # read inside optimizer.step (pre-hook, or a closure): hold them back now
                self._hold_back()
        elif decide and not fused_overflow:
            self._clip(self.inst.action.take_clip())

    def _clip(self, factors: Any) -> None:
        """Adaptive clipping (:mod:`distgrad.diagnostics.adaptive_clip`): scale each gradient by its
        factor, right after distgrad's read (the exported statistics are the pre-clip ones) and
        before the optimizer consumes them; a clipping call after the read then sees the clipped
        gradients. Never raises (a failure is counted)."""
        if factors is None:
            return
        try:
            self.source.scale_grads(factors)
        except Exception:  # noqa: BLE001 - never break training
            self.inst.count_error("applying adaptive clipping")

    def _hold_back(self) -> None:
        """Skip this step's update (the opt-in action, :mod:`distgrad.diagnostics.action`): set every
        gradient the optimizer would consume to None until the step ends. ``torch.optim``
        optimizers leave a parameter whose ``.grad`` is None untouched, state included (its moments
        and step count), so neither the parameters nor the optimizer state change; the gradients
        are put back when the step ends (:meth:`_end`). Called in the step pre-hook, after any
        clipping, or at a read inside ``optimizer.step`` (Lightning's closure)."""
        if self._stashed is not None:
            return
        self._stashed = []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self._stashed.append((p, p.grad))
                    p.grad = None

    def _give_back(self) -> None:
        for p, grad in self._stashed or ():
            p.grad = grad
        self._stashed = None

    def _scale_still_applied(self) -> float:
        """The loss scale the gradients still carry when they are read outside ``scaler.step``
        (``read_gradients_now()`` or a read at a clipping call): the scaler's scale while
        ``scaler.unscale_(optimizer)`` has not run for this step (the scaler's per-optimizer
        stage is READY), else 1.0. Without this a read before ``unscale_`` would export the
        gradients multiplied by the loss scale. ``get_scale()`` syncs: sampled steps only."""
        try:
            if not self.scaler.is_enabled():
                return 1.0
            state = getattr(self.scaler, "_per_optimizer_states", {}).get(id(self.optimizer))
            stage = state.get("stage") if isinstance(state, dict) else None
            if stage is not None and getattr(stage, "name", "READY") != "READY":
                return 1.0  # UNSCALED (unscale_ ran) or STEPPED (scaler.step unscaled and skipped)
            return float(self.scaler.get_scale())
        except Exception:  # noqa: BLE001 - a check must never break training
            self.inst.count_error("reading the GradScaler state")
            return 1.0

    def _end(self, overflow: bool | None, applied: bool, loss_scale: float | None) -> None:
        pending = self._pending
        if pending is None:  # nothing read this step ("external" and the integration did not read): count it
            pending = (StepToken(self.step, False, None), 1.0, None)
        token, gscale, _ = pending
        self._pending = None
        self._clipped = False
        if self._skip:
            applied = False
            self._give_back()
        self._skip = self._in_step = False
        self.step += 1
        self.inst.end_step(token, StepOutcome(overflow=overflow, step_applied=applied, loss_scale=loss_scale,
                                              grad_scale=gscale, micro_step=self.micro))

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._fired = self._in_step = True
        if self.read_at == "external" or self._pending is not None:
            if self._skip:  # decided at an earlier read (before clipping, read_gradients_now)
                self._hold_back()
            return  # read by the integration after the closure / already read before clipping
        rest = args[1:] if args and args[0] is optimizer else args  # the hook's args include self
        closure = kwargs.get("closure", rest[0] if rest else None)
        self._begin("closure" if closure is not None else None)

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._in_scaler:
            return
        self._end(None, True, None)  # "external" and the integration did not read: counted by _end

    def _wrapped_scaler_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        step_fn = self._scaler_step
        if step_fn is None:  # remove() restored scaler.step: only a reference taken before it gets here
            raise RuntimeError("distgrad: the GradScaler.step wrapper was called after the instrument was closed; "
                               "call scaler.step")
        if optimizer is not self.optimizer or not self.scaler.is_enabled() or self._in_scaler:
            return step_fn(optimizer, *args, **kwargs)
        loss_scale = None
        if self.inst.is_sampled(self.step):  # get_scale() syncs with the device: sampled steps only
            try:
                loss_scale = float(self.scaler.get_scale())
            except Exception:  # noqa: BLE001
                self.inst.count_error("reading the loss scale")
        self._in_scaler, self._fired = True, False
        try:
            out = step_fn(optimizer, *args, **kwargs)
        finally:
            self._in_scaler = False
        if self._fired:
            fused_overflow = self._pending[2] if self._pending is not None else None
            overflow = bool(fused_overflow)
        else:  # GradScaler found Inf/NaN and skipped optimizer.step(): read the unscaled grads now
            overflow = True
            if self._pending is None:  # not read before clipping already
                self._begin(decide=False)  # the scaler skipped the update already
        self._end(overflow, not overflow, loss_scale)
        return out


def check_boundary_args(model: Any, optimizer: Any, scaler: Any) -> None:
    """Validate ``optimizer=`` / ``scaler=`` before anything is installed.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` or ``scaler`` has no
            ``step``/``get_scale``/``is_enabled`` (not a ``torch.amp.GradScaler``).
        ValueError: the optimizer holds none of the model's trainable parameters (typically:
            created before wrapping with FSDP ``use_orig_params=False`` or ``fully_shard``).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if scaler is not None and not all(hasattr(scaler, a) for a in ("step", "get_scale", "is_enabled")):
        raise TypeError(f"scaler= must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    mine = [p for p in _unwrap_compiled(model).parameters() if p.requires_grad]
    if mine and not any(id(p) in held for p in mine):
        raise ValueError("the optimizer holds none of the model's trainable parameters: create the "
                         "optimizer from the wrapped model's parameters (after DDP / FSDP wrapping) and "
                         "pass that optimizer")


def attach_torch(inst: Any, source: TorchSource, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: Any = None) -> OptimizerBoundary:
    """Install the :class:`OptimizerBoundary` (``Instrument.close`` removes it). Arguments are
    checked by :func:`check_boundary_args` first."""
    source.scaler = scaler
    return OptimizerBoundary(inst, source, optimizer, model, scaler)
