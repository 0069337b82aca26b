"""Configuration: defaults, YAML / DeepSpeed-JSON loading, and errors that name the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distgrad.config import ConfigError, DistgradConfig

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_default_yaml_equals_the_dataclass_defaults():
    assert DistgradConfig.load(ROOT / "configs" / "distgrad.yaml") == DistgradConfig()


@pytest.mark.parametrize("bad,key", [
    ({"intervall": 2}, "intervall"),
    ({"interval": 0}, "interval"),
    ({"interval": "5"}, "interval"),
    ({"port": 70000}, "port"),
    ({"spike_ema_alpha": 1.5}, "spike_ema_alpha"),
    ({"max_grad_norm": -1}, "max_grad_norm"),
    ({"prometheus": "yes"}, "prometheus"),
    ({"replica_check_rtol": float("nan")}, "replica_check_rtol"),
])
def test_bad_values_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key):
        DistgradConfig.from_dict(bad)


def test_deepspeed_json_section(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_batch_size": 8, "distgrad": {"interval": 5, "port": 0}}))
    cfg = DistgradConfig.load(p)
    assert (cfg.interval, cfg.port) == (5, 0)


def test_yaml_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("interval: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot be parsed"):
        DistgradConfig.load(p)
    with pytest.raises(ConfigError, match="does not exist"):
        DistgradConfig.load(tmp_path / "missing.yaml")


def test_file_sd_target_written_by_rank0_and_removed_at_close(tmp_path):
    """Rank 0's exporter advertises itself for Prometheus file_sd (multi-node jobs)."""
    import json

    from distgrad.engines.base import GradSource
    from distgrad.instrument import Instrument

    class NoGrads(GradSource):
        names, numels = [], []

        def local_pieces(self):
            return []

    path = tmp_path / "targets" / "run1.json"
    cfg = DistgradConfig(port=0, file_sd_path=str(path), advertise_host="node17", run_name="run1")
    inst = Instrument(NoGrads(), cfg)
    inst.start()
    try:
        assert json.loads(path.read_text()) == [{"targets": [f"node17:{inst.port}"], "labels": {"run": "run1"}}]
    finally:
        inst.close()
    assert not path.exists()


def test_deepspeed_json_file_without_section_is_refused_like_the_same_dict(tmp_path):
    ds = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match="'distgrad' section") as from_dict:
        DistgradConfig.from_dict(ds)
    with pytest.raises(ConfigError, match="'distgrad' section") as from_file:
        DistgradConfig.load(p)
    assert str(p) in str(from_file.value) and str(from_dict.value) in str(from_file.value)
    # a file holding only the section, as JSON or YAML, is that section
    p.write_text(json.dumps({"distgrad": {"interval": 4}}))
    assert DistgradConfig.load(p).interval == 4
    y = tmp_path / "c.yaml"
    y.write_text("distgrad:\n  interval: 6\n")
    assert DistgradConfig.load(y).interval == 6


@pytest.mark.parametrize("host", ["", "  "])
def test_empty_host_names_the_host_key(host):
    with pytest.raises(ConfigError, match=r"'host' must be an address of this machine.*127\.0\.0\.1"):
        DistgradConfig(host=host)
