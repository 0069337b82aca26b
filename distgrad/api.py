"""``distgrad.instrument``: the one call users make."""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from distgrad.config import ConfigError, DistgradConfig
from distgrad.instrument import Instrument

log = logging.getLogger("distgrad")


def instrument(engine: Any, config: "DistgradConfig | Mapping[str, Any] | str | os.PathLike | None" = None,
               **overrides: Any) -> Instrument:
    """Attach distgrad to a training engine and return the :class:`Instrument`.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` (ZeRO stage 0-3; fp32, bf16, fp16).
        config: a :class:`DistgradConfig`, a dict, a YAML file, a DeepSpeed JSON config whose
            ``"distgrad"`` section is used, or None. With None and a DeepSpeed engine whose
            config has a ``"distgrad"`` section, that section is used.
        **overrides: individual config keys, applied on top (e.g. ``port=0``, ``interval=10``).

    Must be called on every rank (it makes one small collective to agree that set-up worked).
    The engine keeps working as before; the statistics of every sampled optimizer step are read
    after the gradient reduction and before the optimizer consumes the gradients.

    Raises:
        TypeError: ``engine`` is of an unsupported type (the message lists supported ones).
        ConfigError: an unknown config key or a bad value (named).
        OSError: rank 0 cannot bind the Prometheus port (the message says how to fix it).
        RuntimeError: set-up failed on another rank, or ranks disagree on the model.
    """
    from distgrad.engines.deepspeed import DeepSpeedSource, is_deepspeed_engine

    if config is None and is_deepspeed_engine(engine):
        section = getattr(engine, "_config", None)
        raw = getattr(section, "_param_dict", None) if section is not None else None
        if isinstance(raw, Mapping) and "distgrad" in raw:
            config = raw["distgrad"]
    cfg = DistgradConfig.load(config)
    if overrides:
        cfg = DistgradConfig.from_dict({**cfg.to_dict(), **overrides})

    if is_deepspeed_engine(engine):
        source = DeepSpeedSource(engine)
        inst = Instrument(source, cfg)
        inst._start_sinks()
        _attach_deepspeed(inst, engine, source)
        return inst
    raise TypeError(
        f"distgrad.instrument() got a {type(engine).__module__}.{type(engine).__name__}; supported: "
        "deepspeed.DeepSpeedEngine (from deepspeed.initialize). Pass the engine returned by "
        "deepspeed.initialize, not the model or the optimizer.")


def _attach_deepspeed(inst: Instrument, engine: Any, source: Any) -> None:
    """Wrap ``engine._take_model_step`` (the boundary) and ``engine.backward`` (loss capture)
    on this engine instance only; :meth:`Instrument.close` restores them."""
    take = engine._take_model_step
    backward = engine.backward

    def _take_model_step(*args: Any, **kwargs: Any) -> Any:
        step, micro = int(engine.global_steps), int(engine.micro_steps)
        sampled = inst.is_sampled(step)
        host, gscale = None, 1.0
        if sampled:
            try:
                gscale = source.grad_scale()
            except Exception:  # noqa: BLE001
                inst._internal_error("reading the loss scale")
            host = inst.collect(step)
        out = take(*args, **kwargs)
        try:
            overflow, applied = source.overflow(), bool(engine.was_step_applied())
            loss_scale, samples = source.loss_scale(), source.samples()
        except Exception:  # noqa: BLE001
            inst._internal_error("reading the optimizer state")
            overflow, applied, loss_scale, samples = None, True, None, None
        if sampled:
            inst.finish(step, micro, host, gscale, loss_scale, overflow, applied, samples)
        else:
            inst.skip(overflow, applied, samples)
        return out

    def _backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
        inst.observe_loss(loss)
        return backward(loss, *args, **kwargs)

    engine._take_model_step = _take_model_step
    engine.backward = _backward

    def restore() -> None:
        engine._take_model_step = take
        engine.backward = backward

    inst._restore.append(restore)


__all__ = ["instrument", "ConfigError", "DistgradConfig", "Instrument"]
