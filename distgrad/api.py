"""``distgrad.instrument``: the one call users make."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from distgrad.config import ConfigError, DistgradConfig
from distgrad.core.instrument import Instrument

if TYPE_CHECKING:
    from distgrad.engines.torch_base import TorchSource

log = logging.getLogger("distgrad")


def instrument(engine: Any, config: DistgradConfig | Mapping[str, Any] | str | os.PathLike | None = None,
               *, optimizer: Any = None, scaler: Any = None, **overrides: Any) -> Instrument:
    """Attach distgrad to a training engine and return the :class:`Instrument`.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` (ZeRO stage 0-3; fp32, bf16, fp16), or a PyTorch
            model: ``DistributedDataParallel``, FSDP1 ``FullyShardedDataParallel``
            (``use_orig_params`` True or False), a module sharded with ``fully_shard`` (FSDP2),
            or a plain ``nn.Module`` on one process (see :mod:`distgrad.engines.torch_native`).
        config: a :class:`DistgradConfig`, a dict, a YAML file, a DeepSpeed JSON config whose
            ``"distgrad"`` section is used, or None. With None and a DeepSpeed engine whose
            config has a ``"distgrad"`` section, that section is used.
        optimizer: PyTorch models only, required: the ``torch.optim.Optimizer`` that steps the
            (wrapped) model's parameters. Its step pre-hook is the boundary at which the reduced,
            accumulated gradients are read, once per optimizer step.
        scaler: PyTorch models only, optional: the ``torch.amp.GradScaler`` (or FSDP1
            ``ShardedGradScaler``) whose ``scaler.step(optimizer)`` the loop calls; gives the loss
            scale and overflow (skipped) steps. Statistics are of the unscaled gradients.
            Without it, steps the scaler skips never reach ``optimizer.step`` and go unseen.
        **overrides: config settings applied on top: a section as a dict, merged key by key
            (``exporter={"port": 0}``) or a dotted key (``**{"exporter.port": 0}``); see
            ``docs/configuration.md``.

    Must be called on every rank (it makes one small collective to agree that set-up worked and
    that every rank has the same model and collective settings; with ``enabled: false`` too, so
    that one rank disabled alone raises on every rank instead of hanging the others).
    The engine keeps working as before; the statistics of every sampled optimizer step are read
    after the gradient reduction and before the optimizer consumes the gradients.

    Raises:
        TypeError: ``engine`` is of an unsupported type (the message lists supported ones), a
            PyTorch model without ``optimizer=``, or ``optimizer=``/``scaler=`` with DeepSpeed.
        ValueError: an unsupported PyTorch configuration (hybrid sharding, a plain module under
            torch.distributed with several ranks, an optimizer without the model's parameters).
        ConfigError: an unknown config key or a bad value (named), or an opt-in action
            (``action.*``) with ``sampling.interval`` > 1 or ``statistics.async_records: on``.
        OSError: rank 0 cannot bind the Prometheus port (the message says how to fix it).
        RuntimeError: set-up failed on another rank, or ranks disagree on the model or on a
            setting that decides the collectives (``enabled``, ``interval``, ``replica_check``,
            ``update_ratio``).
    """
    import torch

    from distgrad.diagnostics.replay import attach_replay
    from distgrad.diagnostics.rerun import attach_rerun
    from distgrad.engines.deepspeed import DeepSpeedSource, attach_deepspeed, is_deepspeed_engine
    from distgrad.engines.torch_native import attach_torch

    optimizer = unwrap_optimizer(optimizer)
    if isinstance(config, torch.optim.Optimizer):
        raise TypeError("distgrad.instrument(model, opt): the second argument is the config; pass the "
                        "optimizer by keyword: distgrad.instrument(model, optimizer=opt)")
    if getattr(engine, "_distgrad_instrument", None) is not None or \
            getattr(optimizer, "_distgrad_instrument", None) is not None:
        raise RuntimeError("this engine / optimizer is already instrumented by distgrad: call close() on "
                           "the existing Instrument first (two instruments would sample and serve twice)")
    if config is None and is_deepspeed_engine(engine):
        section = getattr(engine, "_config", None)
        raw = getattr(section, "_param_dict", None) if section is not None else None
        if isinstance(raw, Mapping) and "distgrad" in raw:
            config = raw["distgrad"]
    cfg = DistgradConfig.load(config).with_overrides(overrides)
    from distgrad.diagnostics.action import check_config

    check_config(cfg)

    deepspeed = is_deepspeed_engine(engine)
    source: DeepSpeedSource | TorchSource
    if deepspeed:
        if optimizer is not None or scaler is not None:
            raise TypeError("optimizer= and scaler= are for PyTorch models: a DeepSpeed engine owns its "
                            "optimizer and loss scaler; call distgrad.instrument(engine)")
        source = DeepSpeedSource(engine)
    else:
        source = _torch_source(engine, optimizer, scaler)
    inst = Instrument(source, cfg, group=source.group)
    if not cfg.enabled:  # the off switch: no exporter, no hooks, only the set-up agreement
        inst.agree()  # so that enabled: false on some ranks only raises on every rank
        if not deepspeed:
            _mark(inst, engine, optimizer)
        return inst
    # the one failure path: whatever fails after the exporter started closes the instrument
    # (port released, hooks removed, wrapped methods restored) before the error propagates
    try:
        inst.start()
        if isinstance(source, DeepSpeedSource):
            clip = float(engine.gradient_clipping() or 0.0)
            inst.attach_diagnostics(engine.module, clip if clip > 0 else None)
            attach_replay(inst, engine.module, source.engine_name, source.zero_stage)
            attach_rerun(inst)
            attach_deepspeed(inst, engine, source)
            if cfg.statistics.culprit_grad_check:
                inst.attach_local_grad_check(engine.module, "deepspeed")
            inst.attach_signals(engine.module)
            _mark(inst, engine)
        else:
            # torch loops clip in user code (clip_grad_norm_): the clip ratio uses config.clip.max_grad_norm
            inst.attach_diagnostics(source.user_module(engine), None)
            attach_replay(inst, source.user_module(engine), source.engine_name, source.zero_stage)
            attach_rerun(inst)
            inst.boundary = attach_torch(inst, source, engine, optimizer, scaler)
            if cfg.statistics.culprit_grad_check:
                inst.attach_local_grad_check(source.user_module(engine))
            inst.attach_signals(source.user_module(engine))
            _mark(inst, engine, optimizer)
    except BaseException:
        inst.close()
        raise
    return inst


def unwrap_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside a framework's wrapper, for ``optimizer=``.

    Unwraps Accelerate's ``AcceleratedOptimizer`` (``.optimizer``; it never ran
    ``Optimizer.__init__`` and has no step hooks of its own). Returns anything else unchanged.

    Raises:
        TypeError: a wrapper whose gradients distgrad cannot read through an optimizer hook:
            Accelerate's ``DeepSpeedOptimizerWrapper`` and DeepSpeed's ZeRO / fp16 / bf16
            optimizers (instrument the ``DeepSpeedEngine`` instead), PyTorch Lightning's
            ``LightningOptimizer`` (its ``step(closure)`` runs backward after the step pre-hook:
            use ``distgrad.integrations.lightning.DistgradCallback``).
    """
    if optimizer is None:
        return None
    name = type(optimizer).__name__
    mod = type(optimizer).__module__ or ""
    bases = {c.__name__ for c in type(optimizer).__mro__}  # LightningOptimizer renames its class
    if "DeepSpeedOptimizerWrapper" in bases or (mod.startswith("deepspeed.") and not isinstance(
            optimizer, __import__("torch").optim.Optimizer)) or mod.startswith("deepspeed.runtime"):
        raise TypeError(
            f"optimizer= got {mod}.{name}: under DeepSpeed the engine owns the optimizer and reduces "
            "the gradients; pass the engine instead: distgrad.instrument(engine) with the DeepSpeedEngine "
            "from deepspeed.initialize or accelerator.prepare (with the Hugging Face Trainer: "
            "distgrad.integrations.hf.attach(trainer))")
    if "LightningOptimizer" in bases:
        raise TypeError(
            "optimizer= got a lightning LightningOptimizer: Lightning runs forward and backward inside "
            "optimizer.step(closure), after an optimizer hook would read the gradients. Use the callback: "
            "Trainer(callbacks=[distgrad.integrations.lightning.DistgradCallback()])")
    if "AcceleratedOptimizer" in bases or (mod.startswith("accelerate.") and hasattr(optimizer, "optimizer")):
        return unwrap_optimizer(optimizer.optimizer)
    return optimizer


def _mark(inst: Instrument, *objs: Any) -> None:
    """Remember the instrument on the engine / optimizer until ``close()`` (double-instrumenting
    would sample and serve twice)."""
    for o in objs:
        try:
            o._distgrad_instrument = inst
            inst.on_close(functools.partial(setattr, o, "_distgrad_instrument", None))
        except (AttributeError, TypeError):
            pass


def _torch_source(model: Any, optimizer: Any, scaler: Any) -> TorchSource:
    """The adapter of a DDP / FSDP1 / FSDP2 / plain-module model after checking ``optimizer=`` and
    ``scaler=``; its boundary is the optimizer's step hooks (and ``scaler.step`` with a
    GradScaler), see :class:`distgrad.engines.optimizer_boundary.OptimizerBoundary`."""
    import torch

    from distgrad.engines.torch_native import SUPPORTED, check_boundary_args, torch_source

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"distgrad.instrument() got a {type(model).__module__}.{type(model).__name__}; supported: "
            f"deepspeed.DeepSpeedEngine (from deepspeed.initialize), {SUPPORTED}. Pass the engine "
            "returned by deepspeed.initialize, or the wrapped PyTorch model with optimizer=, not the "
            "optimizer or the loss.")
    if optimizer is None:
        raise TypeError(
            f"distgrad.instrument() needs the optimizer for a PyTorch model ({type(model).__name__}): "
            "call distgrad.instrument(model, optimizer=opt) (and scaler=scaler if you use "
            "torch.amp.GradScaler); distgrad reads the reduced gradients in the optimizer's step "
            "pre-hook, once per optimizer step. With DeepSpeed, pass the engine returned by "
            "deepspeed.initialize instead of engine.module")
    check_boundary_args(model, optimizer, scaler)
    source = torch_source(model)
    source.scaler = scaler  # before the sinks start: they export overflow series only with a scaler
    source.optimizer = optimizer  # its state (Adam moments) for the optimizer-aware signals
    return source


__all__ = ["instrument", "ConfigError", "DistgradConfig", "Instrument"]
