"""distgrad configuration: one pydantic model with a section per component, loadable from a dict,
a YAML file, or the ``"distgrad"`` section of a DeepSpeed config JSON.

Each setting is declared once, with its one default, its range and its description, in
:mod:`distgrad.config.sections`; validation happens once, when the configuration is built (at
``instrument()`` time), and a bad value raises :class:`ConfigError` naming the key
(``distgrad config: 'spikes.window' must be >= 2 (got 1)``). Components take their section
(``cfg.spikes``, ``cfg.sinks.jsonl``) and do not re-check it.

The documented defaults, ``configs/distgrad.yaml`` and ``docs/configuration.md``, are generated
from the model: ``python -m distgrad.config --write`` (``--yaml`` / ``--markdown`` print them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from distgrad.config.errors import ConfigError, describe
from distgrad.config.sections import (
    _LISTENERS,
    PLUGIN_SECTIONS,
    SECTIONS,
    ActionConfig,
    ClipConfig,
    ExporterConfig,
    FlightRecorderConfig,
    HealthConfig,
    IncidentsConfig,
    JsonlConfig,
    LossConfig,
    LossScaleConfig,
    NamingConfig,
    NamingRule,
    SamplingConfig,
    Section,
    SinksConfig,
    SpikesConfig,
    StatisticsConfig,
    TensorBoardConfig,
    TracerConfig,
)

#: top-level keys that mark a DeepSpeed config (whose "distgrad" section holds distgrad's settings)
_DEEPSPEED_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "zero_optimization", "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping",
    "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "amp",
    "activation_checkpointing", "data_types", "communication_data_type", "prescale_gradients",
})

def _put(out: dict[str, Any], path: str, value: Any, given: dict[str, str], as_key: str) -> None:
    """Set ``out[a][b][c] = value`` for ``path`` "a.b.c"; two keys for one place is an error."""
    parts = path.split(".")
    node = out
    for i, p in enumerate(parts[:-1]):
        sub = node.setdefault(p, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"distgrad config: {'.'.join(parts[:i + 1])!r} must be a mapping of keys "
                              f"to values (got {sub!r})")
        node = sub
    if path in given:
        raise ConfigError(f"distgrad config: {path!r} is given twice (as {given[path]!r} and as "
                          f"{as_key!r}); keep one")
    given[path] = as_key
    node[parts[-1]] = value


def _leaves(prefix: str, m: Any) -> list[tuple[str, Any]]:
    """``{"jsonl": {"path": p}}`` under ``"sinks"`` -> ``[("sinks.jsonl.path", p)]``. Section
    objects count as the keys they were built with; lists and scalars are leaves."""
    if isinstance(m, Section):
        m = m.model_dump(exclude_unset=True)
    items: list[tuple[str, Any]] = []
    for k, v in m.items():
        if isinstance(v, (Mapping, Section)):
            items.extend(_leaves(f"{prefix}.{k}", v))
        else:
            items.append((f"{prefix}.{k}", v))
    return items


def _normalise(data: Mapping[str, Any]) -> dict[str, Any]:
    """Sectioned form of ``data``: dotted keys (``"exporter.port"``) moved to their section.

    Raises:
        ConfigError: one setting given twice (e.g. ``port`` and ``exporter.port``).
    """
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in data.items():
        key = str(key)
        if key in SECTIONS and isinstance(value, (Mapping, Section)):
            out.setdefault(key, {})
            for sub, v in _leaves(key, value):
                _put(out, sub, v, given, sub)
        else:
            _put(out, key, value, given, key)
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


class DistgradConfig(BaseModel):
    """All distgrad settings, one section per component (see :mod:`distgrad.config.sections`).

    Build it with keyword arguments (sections as dicts or section objects), :meth:`from_dict` or
    :meth:`load`. Immutable once built.

    Raises:
        ConfigError: an unknown key or a bad value (the message names the key).
    """

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(True, description=(
        "Master switch: false makes instrument() return an inert Instrument (no exporter, hooks "
        "or collectives)."))
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description=SamplingConfig.__doc__)
    exporter: ExporterConfig = Field(default_factory=ExporterConfig, description=ExporterConfig.__doc__)
    statistics: StatisticsConfig = Field(default_factory=StatisticsConfig, description=StatisticsConfig.__doc__)
    spikes: SpikesConfig = Field(default_factory=SpikesConfig, description=SpikesConfig.__doc__)
    incidents: IncidentsConfig = Field(default_factory=IncidentsConfig, description=IncidentsConfig.__doc__)
    health: HealthConfig = Field(default_factory=HealthConfig, description=HealthConfig.__doc__)
    loss_scale: LossScaleConfig = Field(default_factory=LossScaleConfig, description=LossScaleConfig.__doc__)
    clip: ClipConfig = Field(default_factory=ClipConfig, description=ClipConfig.__doc__)
    flight_recorder: FlightRecorderConfig = Field(default_factory=FlightRecorderConfig,
                                                  description=FlightRecorderConfig.__doc__)
    tracer: TracerConfig = Field(default_factory=TracerConfig, description=TracerConfig.__doc__)
    sinks: SinksConfig = Field(default_factory=SinksConfig, description=SinksConfig.__doc__)
    naming: NamingConfig = Field(default_factory=NamingConfig, description=NamingConfig.__doc__)
    loss: LossConfig = Field(default_factory=LossConfig, description=LossConfig.__doc__)
    action: ActionConfig = Field(default_factory=ActionConfig, description=ActionConfig.__doc__)

    def __init__(self, **data: Any) -> None:
        self._validate_into(_normalise(data) if data else {})

    def _validate_into(self, nested: Mapping[str, Any]) -> None:
        try:
            super().__init__(**nested)
        except ValidationError as e:
            raise ConfigError(describe(e, root=type(self))) from None

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DistgradConfig:
        """Build from a mapping (sections as nested mappings, dotted keys such as
        ``"exporter.port"``). A whole DeepSpeed config dict is accepted: its
        ``"distgrad"`` section is used.

        Raises:
            ConfigError: not a mapping, a DeepSpeed config without a ``"distgrad"`` section, an
                unknown key (with the known ones) or a bad value.
        """
        if isinstance(d, Mapping) and "distgrad" in d and (set(d) & _DEEPSPEED_KEYS or set(d) == {"distgrad"}):
            d = d["distgrad"]
        if not isinstance(d, Mapping):
            raise ConfigError(f"distgrad config must be a mapping of keys to values, got {type(d).__name__}")
        if set(d) & _DEEPSPEED_KEYS:
            raise ConfigError(
                "distgrad config: this looks like a DeepSpeed config (keys "
                f"{sorted(set(d) & _DEEPSPEED_KEYS)[:4]}) without a 'distgrad' section: add "
                "\"distgrad\": {...} to it, or pass distgrad's own settings")
        return cls(**{str(k): v for k, v in d.items()})

    @classmethod
    def load(cls, source: DistgradConfig | Mapping[str, Any] | str | os.PathLike | None) -> DistgradConfig:
        """Accepts a DistgradConfig, a dict, a path to a YAML file, a path to a DeepSpeed JSON
        config (its ``"distgrad"`` section is used), or None (defaults).

        Raises:
            ConfigError: unknown key, bad value, unreadable or malformed file.
        """
        if source is None:
            return cls()
        if isinstance(source, cls):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            if not path.is_file():
                raise ConfigError(f"distgrad config file {str(path)!r} does not exist")
            text = path.read_text()
            try:
                if path.suffix == ".json":
                    data = json.loads(text)  # a DeepSpeed config: from_dict takes its section
                else:
                    import yaml

                    data = yaml.safe_load(text) or {}
            except Exception as e:  # noqa: BLE001 - ValueError, yaml.YAMLError
                raise ConfigError(f"distgrad config file {str(path)!r} cannot be parsed: {e}") from e
            try:
                return cls.from_dict(data)
            except ConfigError as e:
                raise ConfigError(f"{str(path)!r}: {e}") from None
        raise ConfigError(
            f"distgrad config must be a DistgradConfig, a dict or a file path, got {type(source).__name__}")

    def with_overrides(self, overrides: Mapping[str, Any]) -> DistgradConfig:
        """A copy with ``overrides`` applied on top: sections given as mappings are merged key by
        key into this configuration's (``exporter={"port": 0}`` keeps the exporter's host); dotted
        keys are accepted as in :meth:`from_dict`.

        Raises:
            ConfigError: as :meth:`from_dict`.
        """
        if not overrides:
            return self
        out = type(self).__new__(type(self))
        out._validate_into(_merge(self.model_dump(), _normalise(overrides)))
        return out

    def to_dict(self) -> dict[str, Any]:
        """All settings as a plain nested dict (YAML/JSON-serialisable)."""
        return self.model_dump()


def _add_section(cls: type[Section]) -> None:
    """Add the plug-in section ``cls`` (see :func:`distgrad.config.sections.register_section`) as
    the field ``cls.section_key`` of :class:`DistgradConfig`, after the built-in sections, with
    its default and its docstring as description (pydantic rebuilds the model's validator)."""
    from pydantic.fields import FieldInfo

    key = cls.section_key
    DistgradConfig.__annotations__[key] = cls
    DistgradConfig.__pydantic_fields__[key] = FieldInfo.from_annotated_attribute(
        cls, Field(default_factory=cls, description=cls.__doc__))
    DistgradConfig.model_rebuild(force=True)


__all__ = [
    "ConfigError", "DistgradConfig", "SECTIONS", "Section", "SamplingConfig",
    "ExporterConfig", "StatisticsConfig", "SpikesConfig", "HealthConfig", "ClipConfig", "FlightRecorderConfig",
    "TracerConfig",
    "SinksConfig", "JsonlConfig", "TensorBoardConfig", "NamingConfig", "NamingRule", "LossConfig",
    "ActionConfig",
    "IncidentsConfig",
]

# plug-in sections (a signal's nested Config): those registered so far, and every later one
for _cls in PLUGIN_SECTIONS:
    _add_section(_cls)
_LISTENERS.append(_add_section)
# the built-in signals and diagnostics: defining their classes registers their sections (and
# record parts and metrics, distgrad.config.contract), so a DistgradConfig built after
# ``import distgrad.config`` has every section
import distgrad.diagnostics  # noqa: E402,F401
import distgrad.signals.builtin  # noqa: E402,F401
