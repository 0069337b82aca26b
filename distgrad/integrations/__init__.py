"""One-line integrations with training frameworks that build the engine for the user.

- :mod:`distgrad.integrations.hf`: the Hugging Face ``Trainer`` (and trainers built on it, such as
  TRL's) and plain Accelerate loops; ``pip install distgrad[hf]``.
- :mod:`distgrad.integrations.lightning`: PyTorch Lightning; ``pip install distgrad[lightning]``.

Each reads the step's reduced gradient before the framework clips it, and reports
``distgrad_loss`` as the mean training loss of the optimizer step over all micro-batches and
ranks, whatever scaling the framework applies before backward (see docs/metrics.md). The core
package never imports these frameworks; each module imports its framework when imported.
"""

from typing import Any, Mapping


def _sets_clip(d: Any) -> bool:
    """Whether the mapping ``d`` (overrides or a config dict) sets the clip threshold, in any of
    its spellings: ``max_grad_norm`` (flat, deprecated), ``"clip.max_grad_norm"``, or
    ``clip={"max_grad_norm": ...}``."""
    if not isinstance(d, Mapping):
        return False
    clip = d.get("clip")
    return ("max_grad_norm" in d or "clip.max_grad_norm" in d
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
