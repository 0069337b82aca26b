"""One-line integrations with training frameworks that build the engine for the user.

- :mod:`distgrad.integrations.hf`: the Hugging Face ``Trainer`` (and trainers built on it, such as
  TRL's) and plain Accelerate loops; ``pip install distgrad[hf]``.
- :mod:`distgrad.integrations.lightning`: PyTorch Lightning; ``pip install distgrad[lightning]``.

Each reads the step's reduced gradient before the framework clips it, and reports
``distgrad_loss`` as the mean training loss of the optimizer step over all micro-batches and
ranks, whatever scaling the framework applies before backward (see docs/metrics.md). The core
package never imports these frameworks; each module imports its framework when imported.

Each also saves distgrad's state (:meth:`distgrad.Instrument.state_dict`: detector windows, health
streaks, counters, signal states, the optimizer boundary's step) in the framework's own checkpoint
and restores it on resume, with :func:`checkpoint_state` and :func:`restore_state`
(docs/checkpointing.md, "Framework integrations").
"""

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("distgrad")


def _sets_clip(d: Any) -> bool:
    """Whether the mapping ``d`` (overrides or a config dict) sets the clip threshold, in any of
    its spellings: ``"clip.max_grad_norm"`` or ``clip={"max_grad_norm": ...}``."""
    if not isinstance(d, Mapping):
        return False
    clip = d.get("clip")
    return ("clip.max_grad_norm" in d
            or (isinstance(clip, Mapping) and "max_grad_norm" in clip)
            or getattr(clip, "max_grad_norm", None) is not None)


def with_clip_threshold(config: Any, overrides: dict[str, Any], threshold: Any) -> dict[str, Any]:
    """``overrides`` plus the framework's clip threshold ``threshold`` (the Trainer's
    ``max_grad_norm``, Lightning's ``gradient_clip_val``) as ``clip.max_grad_norm``, unless it is
    not a positive number or the user set the threshold already (in ``overrides`` or in
    ``config``: a dict or a DistgradConfig). Returns a new dict."""
    out = dict(overrides)
    try:
        value = float(threshold) if threshold is not None else 0.0
    except (TypeError, ValueError):
        return out
    in_config = getattr(getattr(config, "clip", None), "max_grad_norm", None) is not None  # DistgradConfig
    if value > 0 and not (_sets_clip(out) or _sets_clip(config) or in_config):
        out["clip.max_grad_norm"] = value
    return out


def with_micro_batch_size(config: Any, overrides: dict[str, Any], batch_size: Any, source: str) -> dict[str, Any]:
    """``overrides`` plus the framework's samples per micro-batch per rank ``batch_size`` as
    ``noise_scale.micro_batch_size`` when the resolved settings (``config`` with ``overrides``)
    enable the gradient noise scale (``noise_scale.enabled``) and leave that key unset; else
    ``overrides`` unchanged. ``source`` names where ``batch_size`` came from, for the error.
    Returns a new dict.

    Raises:
        ConfigError: the noise scale is enabled, ``noise_scale.micro_batch_size`` is unset and
            ``batch_size`` is not a positive int (the framework does not know it); or a bad
            config (as :func:`distgrad.instrument` would raise it).
    """
    from distgrad.config import ConfigError, DistgradConfig

    out = dict(overrides)
    # noise_scale is a plug-in section (a field added at import, distgrad.config.contract): not
    # on DistgradConfig's static type
    cfg: Any = DistgradConfig.load(config).with_overrides(out)
    ns = cfg.noise_scale
    if not ns.enabled or ns.micro_batch_size is not None:
        return out
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(
            f"distgrad config: 'noise_scale.micro_batch_size' is required with noise_scale.enabled here: {source} "
            f"does not give the samples per micro-batch on each rank (got {batch_size!r}); set "
            "noise_scale.micro_batch_size (the noise scale is in that unit)")
    out["noise_scale.micro_batch_size"] = int(batch_size)
    return out


def underflow_signal(inst: Any) -> Any:
    """The instrument's underflow signal (:class:`distgrad.signals.underflow.Underflow`, built when
    ``underflow.enabled``), or None. The integrations set its ``framework_scale``: the scaling
    their framework applies to the forward's loss before backward, which the signal's
    training-precision recomputation must repeat."""
    for s in getattr(getattr(inst, "signals", None), "signals", ()) or ():
        if getattr(s, "name", "") == "underflow":
            return s
    return None


def checkpoint_state(inst: Any, flush: bool) -> dict[str, Any] | None:
    """``inst.state_dict()`` for a framework's checkpoint hook (plain Python types, see
    :func:`distgrad.core.checkpoint.instrument_state`), or None when it cannot be taken: the failure
    is counted in ``distgrad_internal_errors_total`` and logged, and the checkpoint is written
    without it (a checkpoint must never fail for distgrad).

    Args:
        inst: the :class:`distgrad.Instrument`.
        flush: first build the parked record of the last sampled step (asynchronous records,
            :meth:`distgrad.Instrument.flush`), so that the state includes it. That may make a
            collective (the provenance all-gather of a non-finite step): pass True only where
            every rank calls this at the same point, False where only the writing rank does.
    """
    try:
        if flush:
            inst.flush()
        return dict(inst.state_dict())
    except Exception:  # noqa: BLE001 - never fail the framework's checkpoint
        inst.count_error("saving distgrad's state in the checkpoint")
        return None


def restore_state(inst: Any, state: Any, where: str) -> bool:
    """``inst.load_state_dict(state)`` from a framework's checkpoint (every rank, before the
    resumed run's first step). A state the instrument cannot use (another distgrad version,
    another model: :func:`distgrad.core.checkpoint.load_instrument_state`'s ValueError) or an empty
    one is not an error of the training run: the detectors then start from scratch and rank 0
    says so once with the reason. Never raises.

    Args:
        inst: the :class:`distgrad.Instrument`.
        state: the dict saved by :func:`checkpoint_state` (None or ``{}``: nothing to restore,
            said on rank 0).
        where: names the checkpoint for the log line.

    Returns:
        True when the state was restored.
    """
    try:
        if not state:
            raise ValueError("the checkpoint holds no distgrad state")
        inst.load_state_dict(state)
        return True
    except Exception as e:  # noqa: BLE001 - resume without the state rather than fail the run
        if getattr(inst, "global_rank", 0) == 0:
            log.warning("distgrad: not restoring its state from %s (%s): the detectors start from scratch "
                        "(a new warm-up) and the counters from 0", where, e)
        return False
