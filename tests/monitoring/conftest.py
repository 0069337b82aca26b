"""Registers the ``monitoring`` marker for the tests in this directory (they start Prometheus
and Alertmanager subprocesses; deselect with ``-m "not monitoring"``)."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "monitoring: starts Prometheus/Alertmanager subprocesses on 127.0.0.1")
