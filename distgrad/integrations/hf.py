"""Hugging Face ``Trainer`` (transformers >= 4.46, tested with 5.24 / accelerate 1.15 / peft 0.21)
and plain Accelerate loops.

One line with the Trainer (every rank, before ``trainer.train()``)::

    from distgrad.integrations.hf import attach
    attach(trainer)                      # or attach(trainer, exporter={"port": 9400}, sampling={"interval": 10})

One line in an Accelerate loop, after ``accelerator.prepare``::

    dg = distgrad.integrations.hf.instrument_accelerate(accelerator, model, optimizer)

What the Trainer does, and what the integration does about it (measured on transformers 5.24):

- DeepSpeed (ZeRO 0-3): the engine exists only once training starts, as
  ``trainer.model_wrapped``; the callback instruments it at ``on_train_begin``. DeepSpeed clips
  inside ``engine.step()`` after distgrad's boundary, so the gradient read is pre-clip; the clip
  threshold is the engine's ``gradient_clipping`` (the Trainer fills it from ``max_grad_norm``).
  The Trainer hands the loss to ``engine.backward(loss, scale_wrt_gas=False)`` already divided
  for accumulation (``1/GA``, or by ``num_items_in_batch`` and multiplied by the world size).
- FSDP2 / FSDP1 / DDP / one process: the optimizer the callbacks see is Accelerate's
  ``AcceleratedOptimizer``; the real ``torch.optim.Optimizer`` is unwrapped. The Trainer clips
  (``accelerator.clip_grad_norm_``) before ``optimizer.step()``, so the boundary reads the
  gradients at the first clipping call on the optimizer's parameters (``read_at =
  "before_clip"``), or in the step pre-hook when nothing clips. ``max_grad_norm`` becomes
  distgrad's ``clip.max_grad_norm`` (clip ratio and post-clip norm). The loss handed to
  ``accelerator.backward`` is captured.
- In both cases ``distgrad_loss`` is the sum over the step's micro-batches of the loss handed to
  backward, averaged over ranks (``Instrument.loss_reduction = "sum"``): exactly the loss whose
  gradient the reduced gradient is, i.e. the Trainer's own step loss (the mean per-token loss of
  the step with ``num_items_in_batch``, the mean of the micro-batch losses without it).
- Gradient noise scale (``noise_scale.enabled``, docs/signals.md): the small batch
  ``noise_scale.micro_batch_size``, when unset, is the Trainer's train batch size per process
  (``per_device_train_batch_size``); under DeepSpeed the Trainer fills
  ``train_micro_batch_size_per_gpu`` ("auto") from the same value and distgrad reads it from the
  engine. The Trainer's loss scaling (``1/GA``, or the sum over tokens divided by
  ``num_items_in_batch`` of the step) scales every micro-batch gradient and the reduced gradient
  alike, which the estimator allows; with ``num_items_in_batch`` each micro-batch's gradient is
  weighted by its share of the step's scored tokens, so micro-batches with different numbers of
  scored tokens (padding, variable lengths) bias the estimate (docs/signals.md); said once
  (rank 0) when the noise scale is on and the Trainer normalises so. A plain Accelerate loop
  (:func:`instrument_accelerate`) does not know its batch size: set
  ``noise_scale.micro_batch_size`` (DeepSpeed plugin: read from the engine).
- Lost to underflow (``underflow.enabled``, docs/signals.md "The loss factor"): the signal's
  recomputation scales the forward's loss as the Trainer does before backward (times
  ``num_processes`` with ``num_items_in_batch`` and ``average_tokens_across_devices``, else divided
  by ``current_gradient_accumulation_steps``; ``loss_is_scaled_for_ga`` honoured), read at each
  recomputation; in a plain Accelerate loop as ``accelerator.backward`` does (divided by its
  ``gradient_accumulation_steps``; DeepSpeed: by the engine's). Refused at ``on_train_begin``
  (``ConfigError``) with a ``compute_loss_func``, label smoothing or ``n_gpu > 1``: the loss
  differentiated is not the forward's.
- PEFT: frozen base weights have ``requires_grad=False`` and never appear as series.
- Opt-in action ``stop`` (docs/action.md): at ``on_step_end`` of the stopping step the Trainer is
  told to save a checkpoint (of the state before the skipped update) and to stop.
- Checkpoints (docs/checkpointing.md): distgrad's state (:meth:`distgrad.Instrument.state_dict`)
  is saved in every checkpoint's ``trainer_state.json`` under ``stateful_callbacks`` ->
  ``"DistgradState"`` (a :class:`DistgradState` callback, the Trainer's ``ExportableState``), and
  restored at ``on_train_begin`` of ``trainer.train(resume_from_checkpoint=...)`` on every rank
  (every rank reads that file), whatever ``restore_callback_states_from_checkpoint`` says.
  ``accelerator.save_state`` / ``load_state`` in a plain Accelerate loop carry it as a registered
  checkpointing object (:func:`instrument_accelerate`).

Settings: ``attach(trainer, config, **overrides)`` like :func:`distgrad.instrument`; with
``config=None`` under DeepSpeed, the DeepSpeed config's ``"distgrad"`` section. ``clip.max_grad_norm``
comes from ``TrainingArguments.max_grad_norm`` unless the config or an override sets it.
"""

from __future__ import annotations

import logging
from typing import Any

import distgrad
from distgrad.api import unwrap_optimizer
from distgrad.engines.deepspeed import is_deepspeed_engine
from distgrad.integrations import (
    checkpoint_state,
    restore_state,
    underflow_signal,
    with_clip_threshold,
    with_micro_batch_size,
)

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("distgrad.integrations.hf needs transformers: pip install 'distgrad[hf]'") from e

log = logging.getLogger("distgrad")

#: the key of distgrad's state in trainer_state.json's ``stateful_callbacks`` (the class name)
STATE_KEY = "DistgradState"


class DistgradState(TrainerCallback, ExportableState):
    """Carries distgrad's state in the Trainer's checkpoints: the Trainer saves every
    ``ExportableState`` callback's :meth:`state` in ``trainer_state.json`` (``stateful_callbacks``,
    keyed by the class name ``"DistgradState"``) when it writes a checkpoint, on the processes that
    write it. :func:`attach` adds one next to the :class:`DistgradCallback`, which restores the
    saved state when training resumes.

    A separate callback with an argument-free constructor, because with
    ``TrainingArguments.restore_callback_states_from_checkpoint=True`` the Trainer rebuilds each
    stored callback as ``type(cb)(**state["args"])`` and replaces it: this one is rebuilt harmlessly
    (the :class:`DistgradCallback` finds the new one at ``on_train_begin``), while the
    DistgradCallback, which needs the Trainer, could not be.

    Attributes:
        instrument: the instrument whose state is saved (None before training starts: the state
            is then None).
    """

    def __init__(self) -> None:
        self.instrument: distgrad.Instrument | None = None

    def state(self) -> dict:
        """``{"args": {}, "attributes": {}, "instrument": Instrument.state_dict() | None}``
        (JSON-serialisable; NaN is written as ``NaN``, which Python's json reads back). Called by
        the Trainer when it writes a checkpoint (on the writing processes only: no collective)."""
        inst = self.instrument
        return {"args": {}, "attributes": {},
                "instrument": checkpoint_state(inst, flush=False) if inst is not None else None}


class DistgradCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that instruments the Trainer's engine when training
    starts and closes the instrument when it ends. Build it with :func:`attach` (the callback
    needs the Trainer itself: callback events do not pass the DeepSpeed engine).

    Attributes:
        instrument: the :class:`distgrad.Instrument` once training has started, else None.
    """

    def __init__(self, trainer: Any, config: Any = None, **overrides: Any) -> None:
        self.trainer = trainer
        self.config = config
        self.overrides = overrides
        self.instrument: distgrad.Instrument | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Instrument the Trainer's engine, then, when the Trainer resumed from a checkpoint
        (``state`` is the ``TrainerState`` read from its ``trainer_state.json``), restore
        distgrad's state saved there (every rank; see :class:`DistgradState`)."""
        if self.instrument is not None:
            return
        self.instrument = instrument_trainer(self.trainer, self.config, kwargs.get("optimizer"),
                                             **self.overrides)
        holders = [cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, DistgradState)]
        for holder in holders:  # also the one the Trainer rebuilt from the checkpoint
            holder.instrument = self.instrument
        saved = getattr(state, "stateful_callbacks", None)
        if not isinstance(saved, dict) or not holders:
            return
        if STATE_KEY not in saved:
            # a checkpoint written without distgrad: the Trainer's next save looks the key up
            # (KeyError otherwise); and the detectors start from scratch
            saved[STATE_KEY] = holders[0].state()
            if state.global_step > 0:
                restore_state(self.instrument, None, f"the Trainer's checkpoint at step {state.global_step}")
            return
        mine = saved[STATE_KEY]
        if isinstance(mine, list):  # the Trainer's layout for several callbacks of one class
            mine = mine[-1] if mine else {}
        payload = mine.get("instrument") if isinstance(mine, dict) else None
        if payload is not None or state.global_step > 0:
            restore_state(self.instrument, payload, f"the Trainer's checkpoint at step {state.global_step}")

    def _flush_before_save(self, control: Any) -> None:
        """A checkpoint follows this event (``control.should_save``, the same on every rank):
        build the parked record of the last sampled step now (asynchronous records), so that the
        state the Trainer saves includes it; every rank is here, so the flush may make its
        collective."""
        if self.instrument is not None and control.should_save:
            try:
                self.instrument.flush()
            except Exception:  # noqa: BLE001 - never break training
                self.instrument.count_error("flushing the last record before a checkpoint")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The opt-in action's stop (config ``action.on_*: stop``, docs/action.md): the offending
        update was skipped and the ``on_stop`` callbacks ran; the Trainer saves a checkpoint of
        that state (``control.should_save``) and stops (``control.should_training_stop``), on
        every rank. Before a checkpoint: :meth:`_flush_before_save`."""
        if self.instrument is not None and self.instrument.should_stop:
            control.should_save = True
            control.should_training_stop = True
        self._flush_before_save(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush_before_save(control)  # save_strategy="epoch"

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.instrument is not None:
            self.instrument.close()


def attach(trainer: Any, config: Any = None, **overrides: Any) -> DistgradCallback:
    """Add a :class:`DistgradCallback` to ``trainer`` (a ``transformers.Trainer`` or subclass,
    e.g. TRL's ``SFTTrainer``), and a :class:`DistgradState` that saves distgrad's state in the
    Trainer's checkpoints; call on every rank before ``trainer.train()``.

    Args:
        trainer: the Trainer.
        config: as for :func:`distgrad.instrument` (a DistgradConfig, dict, YAML path or None).
        **overrides: config sections or dotted keys (``exporter={"port": 0}``,
            ``sampling={"interval": 10}``; see docs/configuration.md).

    Returns:
        The callback; ``callback.instrument`` is the Instrument once training has started.

    Raises:
        TypeError: ``trainer`` has no ``add_callback`` (not a transformers Trainer).
    """
    if not hasattr(trainer, "add_callback") or not hasattr(trainer, "accelerator"):
        raise TypeError(f"attach(trainer) needs a transformers.Trainer, got {type(trainer).__name__}")
    cb = DistgradCallback(trainer, config, **overrides)
    trainer.add_callback(cb)
    trainer.add_callback(DistgradState())
    return cb


def instrument_trainer(trainer: Any, config: Any = None, optimizer: Any = None,
                       **overrides: Any) -> distgrad.Instrument:
    """Instrument a Trainer whose training has started (``trainer.model_wrapped`` is the engine
    or wrapped model); what :class:`DistgradCallback` calls at ``on_train_begin``.

    Raises:
        TypeError / ValueError: from :func:`distgrad.instrument` (unsupported engine or settings).
        ConfigError: bad settings (e.g. ``noise_scale.enabled`` without a known micro-batch size;
            ``underflow.enabled`` where the Trainer's loss is not the forward's: see
            :func:`_trainer_underflow_scale`).
    """
    engine = trainer.model_wrapped
    accelerator = trainer.accelerator
    if is_deepspeed_engine(engine):
        inst = distgrad.instrument(engine, config, **overrides)
        inst.loss_reduction = "sum"
        _trainer_underflow_scale(trainer, inst, deepspeed=True)
        _warn_token_weighting(trainer, inst)
        return inst
    overrides = with_clip_threshold(config, overrides, getattr(trainer.args, "max_grad_norm", None))
    # the noise scale's small batch: the Trainer's micro-batch per process (under DeepSpeed the
    # Trainer fills train_micro_batch_size_per_gpu from the same value, which distgrad reads)
    batch = getattr(trainer, "_train_batch_size", None) or getattr(trainer.args, "train_batch_size", None)
    overrides = with_micro_batch_size(config, overrides, batch, "the Trainer's train batch size")
    # the Trainer writes its own checkpoints (not accelerator.save_state): DistgradState carries the state
    inst = instrument_accelerate(accelerator, engine, optimizer if optimizer is not None else trainer.optimizer,
                                 config, checkpointing=False, **overrides)
    _trainer_underflow_scale(trainer, inst, deepspeed=False)
    _warn_token_weighting(trainer, inst)
    return inst


def _trainer_underflow_scale(trainer: Any, inst: Any, deepspeed: bool) -> None:
    """``underflow.enabled``: tell the underflow signal how the Trainer scales the forward's loss
    before backward (transformers 5.24 ``Trainer.compute_loss`` / ``training_step``), per
    recomputed micro-batch:

    - with ``num_items_in_batch`` passed to the forward (a model that accepts loss kwargs: the
      forward's loss is already the micro-batch's share of the step's token mean) and
      ``average_tokens_across_devices``: times ``num_processes // tp_size`` (``compute_loss``);
    - unless the loss is scaled for accumulation (``Trainer.loss_is_scaled_for_ga``, else the
      rule above): divided by ``current_gradient_accumulation_steps`` (``training_step``; the
      last accumulation of an epoch may be shorter);
    - then ``accelerator.backward``'s division by its ``gradient_accumulation_steps`` (1 under the
      Trainer; not under DeepSpeed, which the Trainer calls with ``scale_wrt_gas=False``).

    Raises:
        ConfigError: (after closing ``inst``) the Trainer computes the loss outside the model's
            forward (``compute_loss_func``, label smoothing), or averages several GPUs' losses
            (``n_gpu > 1``, DataParallel): the recomputation cannot reproduce that loss.
    """
    from distgrad.config import ConfigError

    uf = underflow_signal(inst)
    if uf is None:
        return
    why = ("a compute_loss_func" if getattr(trainer, "compute_loss_func", None) is not None else
           "label smoothing (label_smoothing_factor)" if getattr(trainer, "label_smoother", None) is not None else
           f"n_gpu={trainer.args.n_gpu} (DataParallel)" if int(getattr(trainer.args, "n_gpu", 1) or 1) > 1 else "")
    if why:
        inst.close()
        raise ConfigError(
            f"distgrad config: 'underflow.enabled' under the Hugging Face Trainer with {why}: the loss the Trainer "
            "differentiates is not the loss the model's forward returns, so the recomputation cannot reproduce the "
            "training gradient; switch underflow.enabled off (docs/signals.md, 'Lost to underflow')")
    args, accelerator = trainer.args, trainer.accelerator

    def scale(_: tuple, kwargs: dict) -> tuple[float, tuple[float, ...]]:
        by_items = bool(getattr(trainer, "model_accepts_loss_kwargs", False)) and \
            kwargs.get("num_items_in_batch") is not None
        mul = 1.0
        if by_items and getattr(args, "average_tokens_across_devices", False):
            tp = trainer.get_tp_size() if hasattr(trainer, "get_tp_size") else 1
            mul = float(int(accelerator.num_processes) // int(tp))
        scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
        divs: list[float] = []
        if not (scaled if scaled is not None else by_items):
            divs.append(float(getattr(trainer, "current_gradient_accumulation_steps", None)
                              or args.gradient_accumulation_steps))
        if not deepspeed:
            divs.append(float(getattr(accelerator, "gradient_accumulation_steps", 1) or 1))
        return mul, tuple(divs)

    uf.framework_scale = scale


def _warn_token_weighting(trainer: Any, inst: Any) -> None:
    """The noise scale on and the Trainer normalising the loss by ``num_items_in_batch`` (a model
    that takes loss kwargs, or a ``compute_loss_func``): each micro-batch's gradient is weighted
    by its share of the step's scored tokens, which distgrad cannot see; say once (rank 0) that
    unequal counts bias the estimate (docs/signals.md, "Under the framework integrations")."""
    ns = getattr(getattr(inst, "config", None), "noise_scale", None)
    if ns is None or not ns.enabled or getattr(inst, "rank", 0) != 0:
        return
    if not (getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None)):
        return
    log.warning(
        "distgrad: gradient noise scale under the Trainer's num_items_in_batch loss: each micro-batch's gradient "
        "is its summed token loss over the step's scored tokens, so the estimate is exact only when every "
        "micro-batch has the same number of scored tokens (no -100 padding, packed full sequences); with unequal "
        "counts micro-batches with more tokens weigh more and the noise scale is biased (docs/signals.md, "
        "'Under the framework integrations')")


class AccelerateCheckpoint:
    """distgrad's state as an Accelerate checkpointing object: :func:`instrument_accelerate`
    passes one to ``accelerator.register_for_checkpointing``, so ``accelerator.save_state(dir)``
    writes ``custom_checkpoint_<i>.pkl`` (:meth:`state_dict`, ``torch.save`` on the main process)
    and ``accelerator.load_state(dir)`` reads it back into the instrument on every process
    (:meth:`load_state_dict`). ``<i>`` is the registration order: Accelerate requires the same
    registered objects, in the same order, at save and at load.

    Attributes:
        instrument: the :class:`distgrad.Instrument`.
    """

    def __init__(self, instrument: distgrad.Instrument) -> None:
        self.instrument = instrument

    def state_dict(self) -> dict[str, Any]:
        """:meth:`distgrad.Instrument.state_dict` (plain Python types), after building the parked
        record of the last sampled step (asynchronous records: Accelerate calls this on every
        process in ``save_state``); ``{}`` when it cannot be taken (counted, logged). Never raises."""
        return checkpoint_state(self.instrument, flush=True) or {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state`` into the instrument (every process, in ``load_state``); a state it
        cannot use leaves the detectors to start from scratch, said once on rank 0
        (:func:`distgrad.integrations.restore_state`). Never raises."""
        restore_state(self.instrument, state, "the Accelerate checkpoint")


def instrument_accelerate(accelerator: Any, model: Any, optimizer: Any = None, config: Any = None,
                          checkpointing: bool = True, **overrides: Any) -> distgrad.Instrument:
    """Instrument a model and optimizer returned by ``accelerator.prepare`` (any distributed type).

    DeepSpeed: ``model`` is the ``DeepSpeedEngine``; it is instrumented directly (``optimizer``
    is ignored) and ``distgrad_loss`` is the mean of the micro-batch losses handed to
    ``accelerator.backward`` over the step's micro-batches and ranks (DeepSpeed divides them by
    its accumulation steps itself). Otherwise the ``AcceleratedOptimizer`` is unwrapped, the gradients are read
    before the first ``accelerator.clip_grad_norm_`` of the step (else in ``optimizer.step()``),
    the loss handed to ``accelerator.backward`` is captured, and ``distgrad_loss`` is its sum
    over the step's micro-batches averaged over ranks (pass ``loss / gradient_accumulation_steps``
    to ``backward`` as Accelerate expects; ``accelerator.backward`` divides by
    ``accelerator.gradient_accumulation_steps`` itself when you use ``accelerator.accumulate``,
    which is accounted for). The underflow signal (``underflow.enabled``) repeats that division in
    its recomputation; ``underflow.loss_factor`` is only your own scaling before ``backward``.

    Checkpoints (``checkpointing=True``, the default): an :class:`AccelerateCheckpoint` is
    registered with ``accelerator.register_for_checkpointing``, so ``accelerator.save_state`` saves
    distgrad's state and ``accelerator.load_state`` restores it. Call ``instrument_accelerate``
    before ``load_state``, and at the same point relative to your own
    ``register_for_checkpointing`` calls in the saving and the resuming script (Accelerate matches
    ``custom_checkpoint_<i>.pkl`` files to objects by their order and refuses a different number of
    them: pass ``checkpointing=False`` to resume from checkpoints written without distgrad).

    Raises:
        TypeError: the optimizer wrapper cannot be unwrapped (see
            :func:`distgrad.api.unwrap_optimizer`), or from :func:`distgrad.instrument`.
    """
    if is_deepspeed_engine(model):
        # the loop hands the micro-batch loss to accelerator.backward -> engine.backward, which
        # divides by the accumulation steps itself: the default per-micro-batch mean is right
        inst = distgrad.instrument(model, config, **overrides)
        if checkpointing:
            accelerator.register_for_checkpointing(AccelerateCheckpoint(inst))
        return inst
    scaler = getattr(accelerator, "scaler", None)
    inst = distgrad.instrument(model, config, optimizer=unwrap_optimizer(optimizer), scaler=scaler, **overrides)
    if checkpointing:  # also when disabled: the saved objects' count must not depend on distgrad's config
        accelerator.register_for_checkpointing(AccelerateCheckpoint(inst))
    if inst.boundary is None:  # enabled: false
        return inst
    inst.loss_reduction = "sum"
    inst.boundary.read_at = "before_clip"
    uf = underflow_signal(inst)
    if uf is not None:  # accelerator.backward divides the loss by its accumulation steps (non-DeepSpeed)
        uf.framework_scale = lambda a, kw: (1.0, (float(getattr(accelerator, "gradient_accumulation_steps", 1)
                                                        or 1),))
    backward = accelerator.backward
    own = "backward" in vars(accelerator)

    def _backward(loss: Any, **kwargs: Any) -> Any:
        # Accelerate divides by its gradient_accumulation_steps inside backward (non-DeepSpeed)
        ga = max(1, int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1))
        try:
            inst.observe_loss(loss.detach() / ga)
        except Exception:  # noqa: BLE001 - never break training
            inst.count_error("capturing the loss")
        return backward(loss, **kwargs)

    accelerator.backward = _backward

    def restore() -> None:
        if own:
            accelerator.backward = backward
        else:
            vars(accelerator).pop("backward", None)

    inst.on_close(restore)
    return inst


__all__ = ["AccelerateCheckpoint", "DistgradCallback", "DistgradState", "attach", "instrument_accelerate",
           "instrument_trainer"]
