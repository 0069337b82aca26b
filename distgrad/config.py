"""distgrad configuration: one dataclass, loadable from YAML, a dict, or the ``"distgrad"``
section of a DeepSpeed config JSON. Unknown keys and bad values raise :class:`ConfigError`
naming the key, at ``instrument()`` time.

The documented default lives in ``configs/distgrad.yaml``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


#: top-level keys that mark a DeepSpeed config (whose "distgrad" section holds distgrad's settings)
_DEEPSPEED_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "zero_optimization", "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping",
    "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "amp",
    "activation_checkpointing", "data_types", "communication_data_type", "prescale_gradients",
})


class ConfigError(ValueError):
    """A distgrad configuration key is unknown or has a bad value. The message names the key
    and says what would be accepted."""


@dataclass
class DistgradConfig:
    """All distgrad settings (thresholds, sampling, exporter, sinks) in one place."""

    enabled: bool = True
    """Master switch: False makes ``instrument()`` return a no-op instrument."""

    interval: int = 1
    """Sample every ``interval`` optimizer steps (steps ``s`` with ``s % interval == 0``,
    counted by the engine's step counter, identical on every rank)."""

    # --- Prometheus exporter (global rank 0 only) -------------------------------------------
    prometheus: bool = True
    """Serve metrics over HTTP from global rank 0."""
    host: str = "127.0.0.1"
    """Address the exporter binds to. Use 0.0.0.0 to be scraped from another host."""
    port: int = 9400
    """Exporter TCP port; 0 picks a free port (logged, and available as ``Instrument.port``)."""

    file_sd_path: str | None = None
    """Rank 0 writes its exporter address here as a Prometheus ``file_sd_configs`` target file
    (``[{"targets": ["<host>:<port>"], "labels": {"run": run_name}}]``) and removes it at close:
    multi-node jobs get scraped wherever rank 0 lands (see configs/prometheus.yml)."""
    advertise_host: str | None = None
    """Host name written to ``file_sd_path`` (default: this machine's FQDN, or ``host`` when the
    exporter is bound to a specific address)."""
    run_name: str | None = None
    """Value of the ``run`` label in ``file_sd_path`` (default: none)."""

    # --- statistics -------------------------------------------------------------------------
    per_param: bool = True
    """Export per-parameter series (``distgrad_param_*{param}``); layer-level series and the
    global statistics are always exported."""
    max_param_series: int = 2000
    """Upper bound on exported Prometheus series; per-parameter detail is reduced to the top-k
    parameters by norm (non-finite ones always kept) when the bound would be exceeded."""
    replica_check: bool = True
    """On engines whose reduced gradients are replicated on every rank (DDP, ZeRO-0), compare
    a per-rank fingerprint (the sum of squares of the rank's whole copy, carried in the same SUM
    collective) and count mismatches. Costs one extra read of the local gradient per sampled
    step, since each rank otherwise reads only its 1/W slice."""
    replica_check_rtol: float = 1e-6
    """Relative tolerance of the replica fingerprint comparison."""
    async_records: str | bool = "auto"
    """``"on"`` (or true): the training thread never waits for the device for distgrad: a sampled step's
    reduced statistics go to pinned host memory with a non-blocking copy and a CUDA event, and
    its record is built and published at the next optimizer-step boundary (one step late; the
    last one at ``close()``). ``"off"``: the record is built at its own boundary after one
    blocking device-to-host copy (or false). ``"auto"`` (default): on for CUDA gradients, off on CPU.
    Must be the same on every rank (it decides where the provenance all-gather happens)."""

    # --- diagnostics --------------------------------------------------------------------------
    spike_ema_alpha: float = 0.97
    spike_ema_z: float = 2.5
    spike_ema_warmup: int = 25
    spike_window: int = 128
    spike_window_sigma: float = 6.0
    vanish_threshold: float = 1e-10
    explode_threshold: float = 1e3
    health_patience: int = 3
    update_ratio: bool = False
    """Compute the update-to-weight ratio (keeps one copy of the local parameter shard)."""
    max_grad_norm: float | None = None
    """Clip threshold used for the clip ratio when the engine does not clip itself."""
    flight_recorder_steps: int = 64
    flight_recorder_dir: str | None = None
    """Directory for flight-recorder reports; None disables writing them."""
    trace_micro_batches: int = 0
    """After the first non-finite step, trace the forward pass of this many micro-batches."""

    # --- sinks ---------------------------------------------------------------------------------
    jsonl_path: str | None = None
    """One JSON line per sampled step (rank 0), flushed each step."""
    jsonl_max_bytes: int = 128 << 20
    """Rotate the JSONL file at this size (bytes; 0 = never). About 190 bytes per parameter per
    line: size it (with ``jsonl_backups``) for the steps you want to keep."""
    jsonl_backups: int = 8
    """Rotated JSONL files kept (``run.jsonl.1`` ...)."""
    tensorboard_dir: str | None = None

    # ----------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"distgrad config: '{key}' {why} (got {getattr(self, key)!r})")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            want = f.type if isinstance(f.type, str) else f.type.__name__
            if want == "bool" and not isinstance(v, bool):
                raise bad(f.name, "must be true or false")
            if want == "int" and (isinstance(v, bool) or not isinstance(v, int)):
                raise bad(f.name, "must be an integer")
            if want == "float":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise bad(f.name, "must be a finite number")
                setattr(self, f.name, float(v))
            if want == "str" and not isinstance(v, str):
                raise bad(f.name, "must be a string")
            if want.startswith("str | None") and v is not None and not isinstance(v, (str, os.PathLike)):
                raise bad(f.name, "must be a path string or null")
        if isinstance(self.async_records, bool):  # YAML reads on/off as booleans
            self.async_records = "on" if self.async_records else "off"
        if self.async_records not in ("auto", "on", "off"):
            raise bad("async_records", "must be 'auto', 'on' or 'off'")
        if self.interval < 1:
            raise bad("interval", "must be >= 1 (sample every N optimizer steps)")
        if not self.host.strip():
            raise bad("host", "must be an address of this machine to bind the exporter to: '127.0.0.1' "
                              "(scrapes from this machine only) or '0.0.0.0' (all interfaces)")
        if not 0 <= self.port <= 65535:
            raise bad("port", "must be in 0..65535 (0 picks a free port)")
        if self.max_param_series < 50:
            raise bad("max_param_series", "must be >= 50")
        if not 0.0 < self.spike_ema_alpha < 1.0:
            raise bad("spike_ema_alpha", "must be in (0, 1)")
        for k in ("spike_ema_z", "spike_window_sigma", "explode_threshold", "replica_check_rtol"):
            if getattr(self, k) <= 0:
                raise bad(k, "must be > 0")
        if self.vanish_threshold < 0:
            raise bad("vanish_threshold", "must be >= 0")
        if self.vanish_threshold >= self.explode_threshold:
            raise bad("vanish_threshold", f"must be below explode_threshold ({self.explode_threshold})")
        for k in ("jsonl_max_bytes", "jsonl_backups"):
            if getattr(self, k) < 0:
                raise bad(k, "must be >= 0")
        for k in ("spike_ema_warmup", "flight_recorder_steps", "trace_micro_batches"):
            if getattr(self, k) < 0:
                raise bad(k, "must be >= 0")
        for k in ("spike_window", "health_patience"):
            if getattr(self, k) < 1:
                raise bad(k, "must be >= 1")
        if self.max_grad_norm is not None:
            if isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float)) \
                    or not self.max_grad_norm > 0:
                raise bad("max_grad_norm", "must be a positive number or null")
            self.max_grad_norm = float(self.max_grad_norm)

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DistgradConfig":
        """Build from a mapping; raises ConfigError on unknown keys (with the known ones). A whole
        DeepSpeed config dict is accepted: its ``"distgrad"`` section is used (one without that
        section raises, naming the fix), as is ``{"distgrad": {...}}``."""
        if isinstance(d, Mapping) and "distgrad" in d and (set(d) & _DEEPSPEED_KEYS or set(d) == {"distgrad"}):
            d = d["distgrad"]
        if not isinstance(d, Mapping):
            raise ConfigError(f"distgrad config must be a mapping of keys to values, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown and set(d) & _DEEPSPEED_KEYS:
            raise ConfigError(
                "distgrad config: this looks like a DeepSpeed config (keys "
                f"{sorted(set(d) & _DEEPSPEED_KEYS)[:4]}) without a 'distgrad' section: add "
                "\"distgrad\": {...} to it, or pass distgrad's own settings")
        if unknown:
            raise ConfigError(
                f"distgrad config: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**dict(d))

    @classmethod
    def load(cls, source: "DistgradConfig | Mapping[str, Any] | str | os.PathLike | None") -> "DistgradConfig":
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
            except (ValueError, ImportError) as e:  # yaml.YAMLError subclasses Exception
                raise ConfigError(f"distgrad config file {str(path)!r} cannot be parsed: {e}") from e
            except Exception as e:  # noqa: BLE001 - yaml.YAMLError
                raise ConfigError(f"distgrad config file {str(path)!r} cannot be parsed: {e}") from e
            try:
                return cls.from_dict(data)
            except ConfigError as e:
                raise ConfigError(f"{str(path)!r}: {e}") from None
        raise ConfigError(
            f"distgrad config must be a DistgradConfig, a dict or a file path, got {type(source).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """All settings as a plain dict (YAML/JSON-serialisable)."""
        return dataclasses.asdict(self)
