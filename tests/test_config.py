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
    ({"sampling": {"interval": 0}}, "sampling.interval"),
    ({"sampling": {"interval": "5"}}, "sampling.interval"),
    ({"exporter": {"port": 70000}}, "exporter.port"),
    ({"spikes": {"ema_alpha": 1.5}}, "spikes.ema_alpha"),
    ({"clip": {"max_grad_norm": -1}}, "clip.max_grad_norm"),
    ({"exporter": {"enabled": "yes"}}, "exporter.enabled"),
    ({"statistics": {"replica_check_rtol": float("nan")}}, "statistics.replica_check_rtol"),
    # the flat keys of a pre-release version are unknown keys, named
    ({"port": 0}, "unknown key 'port'"),
])
def test_bad_values_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key):
        DistgradConfig.from_dict(bad)


def test_deepspeed_json_section(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_batch_size": 8, "distgrad": {"sampling": {"interval": 5}, "exporter": {"port": 0}}}))
    cfg = DistgradConfig.load(p)
    assert (cfg.sampling.interval, cfg.exporter.port) == (5, 0)


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
    from distgrad.core.instrument import Instrument

    class NoGrads(GradSource):
        names, numels = [], []

        def local_pieces(self):
            return []

    path = tmp_path / "targets" / "run1.json"
    cfg = DistgradConfig(exporter={"port": 0, "file_sd_path": str(path), "advertise_host": "node17", "run_name": "run1"})
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
    p.write_text(json.dumps({"distgrad": {"sampling": {"interval": 4}}}))
    assert DistgradConfig.load(p).sampling.interval == 4
    y = tmp_path / "c.yaml"
    y.write_text("distgrad:\n  sampling: {interval: 6}\n")
    assert DistgradConfig.load(y).sampling.interval == 6


@pytest.mark.parametrize("host", ["", "  "])
def test_empty_host_names_the_host_key(host):
    with pytest.raises(ConfigError, match=r"'exporter.host'.* must be an address of this machine.*127\.0\.0\.1"):
        DistgradConfig(exporter={"host": host})


# --- sectioned configuration -------------------------------------------------------------------

def test_committed_yaml_and_docs_are_generated_from_the_model():
    """configs/distgrad.yaml and docs/configuration.md are rendered from the model's declarations;
    a changed default or description without `python -m distgrad.config --write` fails here."""
    from distgrad.config.generate import DOC_PATH, YAML_PATH, render_markdown, render_yaml

    assert YAML_PATH.read_text() == render_yaml()
    assert DOC_PATH.read_text() == render_markdown()
    import yaml

    # the YAML's values are the model's defaults, read back through YAML (not through the model)
    assert yaml.safe_load(YAML_PATH.read_text()) == DistgradConfig().to_dict()


def test_sections_and_dotted_keys_are_the_same_configuration():
    b = DistgradConfig.from_dict({"exporter": {"port": 0}, "spikes": {"window": 64},
                                  "sinks": {"jsonl": {"path": "x.jsonl"}}})
    c = DistgradConfig.from_dict({"exporter.port": 0, "spikes.window": 64, "sinks.jsonl.path": "x.jsonl"})
    assert b == c
    assert (b.exporter.port, b.spikes.window, b.sinks.jsonl.path) == (0, 64, "x.jsonl")
    assert b.exporter.host == "127.0.0.1" and b.spikes.ema_alpha == 0.97  # the rest stays default
    with pytest.raises(ConfigError, match=r"'exporter.port' is given twice"):
        DistgradConfig.from_dict({"exporter.port": 0, "exporter": {"port": 1}})


@pytest.mark.parametrize("bad,msg", [
    ({"spikes": {"window": 1}}, r"^distgrad config: 'spikes.window' must be >= 2 \(got 1\)$"),
    ({"exporter": {"port": 70000}}, r"'exporter.port' must be in 0..65535 \(got 70000\)"),
    ({"spikes": {"ema_alpha": 1.0}}, r"'spikes.ema_alpha' must be in \(0, 1\) \(got 1.0\)"),
    ({"exporter": {"host": ""}}, r"'exporter.host' must be an address of this machine"),
    ({"sinks": {"jsonl": {"path": ""}}}, r"'sinks.jsonl.path' must not be empty"),
    ({"sinks": {"jsonl": {"max_bytes": -1}}}, r"'sinks.jsonl.max_bytes' must be >= 0 \(got -1\)"),
    ({"sampling": {"interval": True}}, r"'sampling.interval' must be an integer \(got True\)"),
    ({"health": {"vanish_threshold": 1.0, "explode_threshold": 0.5}},
     r"'health.vanish_threshold' must be below health.explode_threshold \(0.5\) \(got 1.0\)"),
    ({"spikes": {"windw": 3}}, r"unknown key 'spikes.windw'; did you mean 'window'\?"),
    ({"spikes": 3}, r"'spikes' must be a mapping"),
    ({"naming": {"rules": [["(x", "1", "k"]]}}, r"'naming.rules\[0\].pattern' is not a valid regular expression"),
    ({"naming": {"rules": [["x", r"\1", "k"]]}}, r"'naming.rules\[0\].layer' refers to a group"),
    ({"naming": {"rules": [{"pattern": "x", "layer": "1"}]}}, r"'naming.rules\[0\].module_kind' is required"),
])
def test_errors_name_the_dotted_key(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        DistgradConfig.from_dict(bad)


def test_overrides_merge_into_sections(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("exporter:\n  host: 0.0.0.0\n  port: 9500\nspikes: {window: 32}\n")
    base = DistgradConfig.load(p)
    cfg = base.with_overrides({"exporter": {"port": 0}, "sampling.interval": 4})
    assert (cfg.exporter.host, cfg.exporter.port, cfg.spikes.window, cfg.sampling.interval) == ("0.0.0.0", 0, 32, 4)
    assert base.exporter.port == 9500  # the loaded config is not modified
    with pytest.raises(ConfigError, match=r"'exporter.port' must be in 0..65535"):
        base.with_overrides({"exporter": {"port": -1}})
    # a DeepSpeed JSON's section in the new form
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "distgrad": {"sampling": {"interval": 5}}}))
    assert DistgradConfig.load(ds).sampling.interval == 5


def test_generator_cli_check(tmp_path, monkeypatch, capsys):
    from distgrad.config import generate

    assert generate.main(["--check"]) == 0
    monkeypatch.setattr(generate, "YAML_PATH", tmp_path / "stale.yaml")
    (tmp_path / "stale.yaml").write_text("enabled: true\n")
    assert generate.main(["--check"]) == 1
    assert "stale.yaml" in capsys.readouterr().out
    generate.main(["--yaml"])
    assert capsys.readouterr().out == generate.render_yaml()


def test_unknown_attributes_and_immutability():
    cfg = DistgradConfig()
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        cfg.nothing  # noqa: B018
    with pytest.raises(Exception, match="frozen"):  # immutable once validated
        cfg.enabled = False
