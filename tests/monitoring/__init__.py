"""Monitoring tests: Prometheus, Alertmanager and the distgrad rules against live processes."""
